"""A run's bookkeeping around its steps, over scripted services and a policy that trains nothing: the step numbers
its warnings name, policy versions across `--resume`, what a checkpoint records and how many stay on disk.

The services answer from a script (a sample is right or wrong by its text) and the policy keeps its "checkpoints"
in memory beside marker files, so the trainer's own logic runs as in a real run (tests/integration/
test_learner_loop.py runs the same with DeepSpeed, vLLM, the verifier and Redis).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from rlep.common.dataset import Question
from rlep.common.policy_info import POLICY_FILE, policy_version_of
from rlep.common.tiny_model import ModelSpec, cached_model
from rlep.common.types import FinishReason, Verdict
from rlep.replay.v1 import replay_pb2
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.records import read_step_log
from rlep.services.learner.step_inputs import ServiceClients
from rlep.services.learner.tokens import PolicyTokenizer
from rlep.services.learner.trainer import Trainer
from rlep.services.rollout.client import PushResult, ReplicaTarget
from rlep.services.rollout.types import Completion, SampleOut

SMALL = ModelSpec(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64)
QUESTIONS = [Question(f"q{i}", (("user", f"{i}+1=?"),), str(i + 1)) for i in range(4)]


class ScriptedRollout:
    """One replica: half of a question's samples say "right", stamped with the version it serves (the last push)."""

    failovers = 0

    def __init__(self, served: int = 0):
        self.served, self.pushed = served, []
        self.frozen: int | None = None  # set: samples say this version, as from a replica stuck on it

    def generate(self, prompts, sampling):
        texts = ["right" if i % 2 == 0 else "wrong" for i in range(sampling.n)]
        version = self.served if self.frozen is None else self.frozen
        samples = [SampleOut([3, 4], t, [-0.1, -0.2], FinishReason.STOP, version) for t in texts]
        return [Completion(list(ids), list(samples)) for ids in prompts]

    def versions(self) -> list[int]:
        return [self.served]

    def max_model_len(self) -> int:
        return 256

    def target(self, replicas=None):
        return ReplicaTarget(("scripted",), None, 1.0)

    def take_push_result(self, result) -> None:
        assert result.version > self.served, "a replica refuses a version that is not newer"
        self.served = result.version
        self.pushed.append(result.version)

    def refresh(self) -> None: ...

    def check(self) -> list:
        return []

    def set_serving(self, replicas) -> None: ...

    def serving(self) -> list:
        return ["scripted"]


class Outcome:
    def __init__(self, correct: bool):
        self.verdict = Verdict.CORRECT if correct else Verdict.WRONG
        self.reward = 1.0 if correct else -1.0


class ScriptedVerifier:
    def verify(self, items):
        return [Outcome(text == "right") for text, _ in items]


class EmptyReplay:
    """A pool without the step's questions: every step gets no replayed answer (and warns); its per-question
    history records every report."""

    def __init__(self):
        self.reports: list[tuple[int, list]] = []
        self.report_runs: set[str] = set()

    def sample(self, pool, question_ids, m, strategy, seed):
        return {}

    def report_outcomes(self, pool, run_id, step, policy_version, outcomes):
        self.reports.append((step, list(outcomes)))
        self.report_runs.add(run_id)
        return replay_pb2.ReportOutcomesResponse(recorded=len(outcomes), last_step=step)


class MemoryPolicy:
    """Trains nothing; `save_checkpoint` keeps the client state in memory and writes the files DeepSpeed would
    (`latest`, a file in the tag directory), `save_hf` a weights file, so retention and resume see a real layout."""

    def __init__(self):
        self.saved: dict[str, dict] = {}

    def logprobs(self, batch):
        return torch.zeros(batch.loss_mask.shape)

    def update(self, batch, rows_per_mini_batch):
        stats = dict.fromkeys(("clip_fraction", "approx_kl", "entropy", "loss"), 0.0)
        return {**stats, "lr": 1e-3, "optimizer_steps": 1.0}

    def push_weights(self, target, version, sync):
        return PushResult(version, target.addresses)

    def rng_state(self):
        return {}

    def save_checkpoint(self, directory: Path, tag: str, client_state: dict) -> None:
        (directory / tag).mkdir(parents=True, exist_ok=True)  # the trainer wrote rlep-checkpoint.json there first
        (directory / tag / "mp_rank_00_model_states.pt").write_bytes(b"0" * 64)
        (directory / "latest").write_text(tag)
        self.saved[tag] = client_state

    def save_hf(self, out_dir: Path, tokenizer_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(b"0" * 32)

    def load_checkpoint(self, directory: Path, tag: str | None = None) -> dict:
        return self.saved[tag or (directory / "latest").read_text()]


@pytest.fixture(scope="module")
def tokenizer():
    model = cached_model(SMALL)  # built once, then read from ~/.cache/rlep/models
    return PolicyTokenizer.load(model, max_prompt_tokens=64, max_response_tokens=16)


def make_trainer(
    tokenizer, policy, rollout, tmp_path: Path, steps: int, algorithm=None, lora=None, **checkpoint
) -> Trainer:
    config = TrainConfig.model_validate(
        {
            "run_id": "bookkeeping",
            "seed": 2,
            "steps": steps,
            "replay_pool": "empty",
            "algorithm": {
                "questions_per_step": 2,
                "fresh_per_question": 2,
                "replayed_per_question": 1,
                "mini_batch_questions": 2,
                "max_response_tokens": 16,
                "overlong_buffer_tokens": 0,
                **(algorithm or {}),
            },
            "checkpoint": {"dir": str(tmp_path / "ckpt"), **checkpoint},
            "lora": lora or {},
        }
    )
    services = ServiceClients(rollout=rollout, verifier=ScriptedVerifier(), replay=EmptyReplay())
    return Trainer(config, Path(tokenizer.tokenizer.name_or_path), QUESTIONS, policy, services, tokenizer)


def test_a_warning_names_the_step_its_record_names(tokenizer, tmp_path, caplog):
    """One numbering: the first step's record says step 1, and so does its warning (it said step 0)."""
    trainer = make_trainer(tokenizer, MemoryPolicy(), ScriptedRollout(), tmp_path, steps=2, every_steps=10)
    trainer.start()
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlep.services.learner"):
            record = trainer.train_step()
        (message,) = [r.getMessage() for r in caplog.records if "got no replayed answer" in r.getMessage()]
        assert f"but step {record.step} got no replayed answer" in message


def test_staleness_messages_name_the_step_being_trained(tokenizer, tmp_path, caplog):
    """max_staleness=1 and a replica stuck on version 1: the third step drops its samples and then refuses to
    train; both say step 3, the number its record would have had."""
    rollout = ScriptedRollout()
    overlap = {"max_staleness": 1, "replayed_per_question": 0}
    trainer = make_trainer(tokenizer, MemoryPolicy(), rollout, tmp_path, steps=4, algorithm=overlap, every_steps=10)
    trainer.start()
    rollout.frozen = 1  # from the start: step 2 gathers while step 1 trains, so a later freeze would race it
    try:
        trainer.train_step()
        assert trainer.train_step().step == 2  # samples of version 1 train version 2: one stale, allowed
        refused = pytest.raises(RuntimeError, match=r"^step 3: every fresh sample is staler than max_staleness=1")
        with caplog.at_level(logging.WARNING, logger="rlep.services.learner"), refused:
            trainer.train_step()
    finally:
        trainer.close()
    dropped = [r.getMessage() for r in caplog.records if "staler than max_staleness" in r.getMessage()]
    assert dropped and all(m.startswith("step 3: ") for m in dropped)


def test_policy_versions_keep_growing_across_a_resume(tokenizer, tmp_path):
    """A run checkpoints after step 2 and dies after step 3; resumed on freshly started replicas (which serve version
    0), its next step is numbered above every version logged before, and every checkpoint records its version."""
    policy = MemoryPolicy()
    first = make_trainer(tokenizer, policy, ScriptedRollout(), tmp_path, steps=4, every_steps=2)
    first.start()
    before = [first.train_step() for _ in range(3)]
    assert [r.policy_version for r in before] == [2, 3, 4]  # 1 is the start's push
    assert policy.saved["step_2"]["policy_version"] == 3
    hf = tmp_path / "ckpt" / "step_2" / "hf"
    assert json.loads((hf / POLICY_FILE).read_text()) == {"run_id": "bookkeeping", "step": 2, "policy_version": 3}
    assert policy_version_of(hf) == 3

    rollout = ScriptedRollout(served=0)  # the stack was restarted too
    resumed = make_trainer(tokenizer, policy, rollout, tmp_path, steps=4, every_steps=2)
    resumed.start(resume=True)
    after = [resumed.train_step() for _ in range(2)]

    assert [r.step for r in after] == [3, 4]
    logged = [r.policy_version for r in read_step_log(tmp_path / "ckpt" / "log.jsonl")]
    assert logged == [2, 3, 4, 6, 7]  # 5: the resumed run's first push, above the lost step 3's 4
    assert rollout.pushed == [5, 6, 7]
    assert policy.saved["step_4"]["policy_version"] == 7 == policy_version_of(tmp_path / "ckpt" / "step_4" / "hf")
    # The history hears the resumed steps under the first run's name (steps it reported before would be retries),
    # and another run with the same run_id under a name of its own.
    assert first.services.replay.report_runs == resumed.services.replay.report_runs == {first.history_run}
    assert first.history_run.startswith("bookkeeping:")
    other = make_trainer(tokenizer, MemoryPolicy(), ScriptedRollout(), tmp_path / "other", steps=1, every_steps=2)
    assert other.history_run != first.history_run


def test_a_resume_with_another_lora_shape_is_refused_before_the_policy_loads(tokenizer, tmp_path):
    """The checkpoint's info says full fine-tuning; a LoRA run resuming it (through the Python API, where `rlep
    train`'s own check is not in the way) is refused naming both shapes, and the policy never reads the files."""
    policy = MemoryPolicy()
    first = make_trainer(tokenizer, policy, ScriptedRollout(), tmp_path, steps=2, every_steps=2)
    first.start()
    for _ in range(2):
        first.train_step()
    first.close()
    loads = []
    policy.load_checkpoint = lambda *args, **kwargs: loads.append(args)  # counts any read of the files
    lora = make_trainer(tokenizer, policy, ScriptedRollout(), tmp_path, steps=4, lora={"rank": 4}, every_steps=2)
    with pytest.raises(
        ValueError, match=r"was trained with full fine-tuning \(lora.rank=0\), this config asks for LoRA"
    ):
        lora.start(resume=True)
    assert loads == []


class CountingRollout(ScriptedRollout):
    """`ScriptedRollout` that counts its generations (each follows one gather's draw from the data cursor)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.called = threading.Condition()

    def generate(self, prompts, sampling):
        with self.called:
            self.calls += 1
            self.called.notify_all()
        return super().generate(prompts, sampling)


class AheadPolicy(MemoryPolicy):
    """Its update returns only once the next step's gather has drawn its questions (the rollout was asked for them),
    as on a real stack, where an update takes longer than a draw: the checkpoint after it is taken while generation
    runs a step ahead of training."""

    def __init__(self):
        super().__init__()
        self.rollout: CountingRollout | None = None
        self.steps_left = 0  # the trainer's steps still to run when it starts: no gather follows its last one
        self.updates = 0

    def run_with(self, rollout: CountingRollout, steps_left: int) -> None:
        self.rollout, self.steps_left, self.updates = rollout, steps_left, 0

    def update(self, batch, rows_per_mini_batch):
        self.updates += 1
        if self.updates < self.steps_left:
            with self.rollout.called:
                assert self.rollout.called.wait_for(lambda: self.rollout.calls > self.updates, timeout=30)
        return super().update(batch, rows_per_mini_batch)


def test_a_resume_while_generation_runs_ahead_trains_the_questions_of_an_uninterrupted_run(tokenizer, tmp_path):
    """max_staleness=1: step 3's questions are drawn while step 2 trains, before step 2's checkpoint. The checkpoint
    must hold the cursor after step 2's draws (the trained one), not after step 3's, or the resumed run skips step 3's
    questions. Resumed after step 2, steps 3-4 train the questions of the fixed schedule, as an uninterrupted run does.
    """
    from rlep.services.learner.cursor import DataCursor

    overlap = {"max_staleness": 1, "replayed_per_question": 0}
    policy, rollout = AheadPolicy(), CountingRollout()
    first = make_trainer(tokenizer, policy, rollout, tmp_path / "run", steps=4, algorithm=overlap, every_steps=2)
    policy.run_with(rollout, steps_left=4)
    first.start()
    try:
        before = [first.train_step() for _ in range(2)]  # then the run dies, step 3's questions already drawn
        assert rollout.calls == 3
    finally:
        first.close()
    rollout = CountingRollout()
    resumed = make_trainer(tokenizer, policy, rollout, tmp_path / "run", steps=4, algorithm=overlap, every_steps=2)
    policy.run_with(rollout, steps_left=2)
    resumed.start(resume=True)
    try:
        after = [resumed.train_step() for _ in range(2)]
    finally:
        resumed.close()

    reference, rollout = AheadPolicy(), CountingRollout()
    whole = make_trainer(tokenizer, reference, rollout, tmp_path / "ref", steps=4, algorithm=overlap, every_steps=2)
    reference.run_with(rollout, steps_left=4)
    whole.start()
    try:
        uninterrupted = [whole.train_step() for _ in range(4)]
    finally:
        whole.close()

    # The schedule: the seeded cursor's draws of 2 questions per step (config seed 2, shuffled, 4 questions).
    cursor = DataCursor(len(QUESTIONS), seed=2, shuffle=True)
    schedule = [[QUESTIONS[i].question_id for i in cursor.next_indices(2)] for _ in range(4)]
    assert [r.step for r in before + after] == [1, 2, 3, 4]
    assert [r.question_ids for r in uninterrupted] == schedule
    assert [r.question_ids for r in before + after] == schedule
    assert policy.saved["step_2"]["cursor"] == {"epoch": 1, "position": 0, "count": 4, "seed": 2}


def test_resume_starts_above_the_checkpoint_without_a_step_log(tokenizer, tmp_path):
    """Only the checkpoint knows the version (the log went elsewhere): still above it."""
    policy = MemoryPolicy()
    first = make_trainer(tokenizer, policy, ScriptedRollout(), tmp_path, steps=2, every_steps=2)
    first.start()
    first.train_step(), first.train_step()
    (tmp_path / "ckpt" / "log.jsonl").unlink()
    resumed = make_trainer(tokenizer, policy, ScriptedRollout(served=0), tmp_path, steps=3, every_steps=2)
    resumed.start(resume=True)
    assert resumed.version == 3 + 1 and resumed.train_step().policy_version == 5


def test_keep_last_bounds_the_checkpoints_on_disk(tokenizer, tmp_path):
    """Every step checkpoints; keep_last=2 leaves the two newest step directories, HF exports included."""
    trainer = make_trainer(tokenizer, MemoryPolicy(), ScriptedRollout(), tmp_path, steps=5, every_steps=1, keep_last=2)
    trainer.start()
    ckpt = tmp_path / "ckpt"
    for step in range(1, 6):
        trainer.train_step()
        kept = sorted(p.name for p in ckpt.glob("step_*"))
        assert kept == [f"step_{s}" for s in range(max(1, step - 1), step + 1)]
    assert all((ckpt / tag / "hf" / "model.safetensors").exists() for tag in ("step_4", "step_5"))
    assert sorted(p.name for p in ckpt.iterdir()) == ["generations.jsonl", "latest", "log.jsonl", "step_4", "step_5"]


class SamplerViewPolicy(MemoryPolicy):
    """Its processed view of the sampler's distribution agrees with the sampler to the last bit; its raw view
    (`logprobs`, zeros) does not: which one a step compares shows in the record."""

    def __init__(self):
        super().__init__()
        self.asked: list[tuple[float, float]] = []
        self.trained = None

    def logprobs_with_processed(self, batch, temperature, top_p):
        self.asked.append((temperature, top_p))
        sampled = ~torch.isnan(batch.behavior_logprobs)
        return self.logprobs(batch), torch.where(sampled, batch.behavior_logprobs, 0.0)

    def update(self, batch, rows_per_mini_batch):
        self.trained = batch
        return super().update(batch, rows_per_mini_batch)


@pytest.mark.parametrize(("sampling", "processed"), [({"temperature": 0.7, "top_p": 0.95}, True), ({}, False)])
def test_a_tempered_correction_compares_the_processed_view(tokenizer, tmp_path, sampling, processed):
    policy = SamplerViewPolicy()
    algorithm = {"behavior_correction": "masked_is", **sampling}
    trainer = make_trainer(tokenizer, policy, ScriptedRollout(), tmp_path, steps=1, algorithm=algorithm)
    trainer.start()
    record = trainer.train_step()
    if processed:  # the learner's processed view, at the sampler's settings, is what the figures and weights use
        assert policy.asked == [(0.7, 0.95)]
        assert policy.trained.old_processed_logprobs is not None
        assert record.rollout_mismatch_kl == 0.0 and record.rollout_correction_weight_mean == 1.0
    else:  # untempered: the raw view, no extra forward pass
        assert policy.asked == [] and policy.trained.old_processed_logprobs is None
        assert record.rollout_mismatch_kl > 0.0


def test_every_step_reports_its_groups_to_the_replay_history_numbered_as_its_record(tokenizer, tmp_path):
    """Issue 48: each step tells the replay service every generated group's fresh outcome (attempts G, successes,
    rows replayed) under the step number its record carries, and the record says what the report did."""
    trainer = make_trainer(tokenizer, MemoryPolicy(), ScriptedRollout(), tmp_path, steps=2, every_steps=10)
    trainer.start()
    records = [trainer.train_step() for _ in range(2)]
    reports = trainer.services.replay.reports
    assert [step for step, _ in reports] == [r.step for r in records] == [1, 2]
    for (_, outcomes), record in zip(reports, records, strict=True):
        assert sorted(o.question_id for o in outcomes) == sorted(record.question_ids)
        assert {(o.attempts, o.replayed, o.rescued) for o in outcomes} == {(2, 0, False)}  # the pool gave nothing
        assert all(0 <= o.successes <= o.attempts for o in outcomes)
        assert (record.history_status, record.history_recorded) == ("recorded", len(outcomes))
        assert (record.replay_offered, record.replay_skipped) == (2, {})  # `always`: every group offered


def test_with_report_outcomes_off_nothing_is_reported_and_the_record_says_nothing(tokenizer, tmp_path):
    off = {"replay_rule": {"report_outcomes": False}}
    trainer = make_trainer(tokenizer, MemoryPolicy(), ScriptedRollout(), tmp_path, steps=1, algorithm=off)
    trainer.start()
    record = trainer.train_step()
    assert trainer.services.replay.reports == []
    assert (record.history_status, record.history_recorded) == (None, None)
    assert "history_status" not in record.to_json()


def test_a_baseline_without_replay_reports_nothing(tokenizer, tmp_path):
    """M = 0: no pool to tell (phase 1 has not collected one yet), so no report and no warning each step."""
    trainer = make_trainer(
        tokenizer, MemoryPolicy(), ScriptedRollout(), tmp_path, steps=1, algorithm={"replayed_per_question": 0}
    )
    trainer.start()
    assert trainer.train_step().history_status is None and trainer.services.replay.reports == []


def test_with_tools_the_held_out_evaluation_runs_tool_episodes(tokenizer):
    """A policy trained with the tool is evaluated with it, on its own tokens: the scripted policy answers only
    after its call (the tool prints 42), so a single-turn evaluation would score it 0 of 4."""
    from rlep.services.sandbox.types import ToolResult
    from tests.unit.test_step_inputs import BoxedVerifier, ToolRollout

    class Rollout(ScriptedRollout):
        def generate(self, prompts, sampling):
            return ToolRollout(tokenizer).generate(prompts, sampling)

    calls = []

    def run_code(code, caller):
        calls.append(code)
        return ToolResult("ok", 0, None, "42\n", "", False, 0.01, "bubblewrap")

    config = TrainConfig.model_validate(
        {"algorithm": {"max_response_tokens": 64, "overlong_buffer_tokens": 0, "replayed_per_question": 0},
         "eval": {"samples_per_question": 2},
         "tools": {"loop": {"max_output_tokens": 64}}}
    )  # fmt: skip
    verifier = BoxedVerifier()
    services = ServiceClients(rollout=Rollout(), verifier=verifier, replay=None, run_code=run_code)
    model = Path(tokenizer.tokenizer.name_or_path)
    trainer = Trainer(config, model, QUESTIONS, MemoryPolicy(), services, tokenizer, eval_questions=QUESTIONS[:2])
    assert trainer.evaluate() == (1.0, [2, 2])
    assert calls == ["print(6*7)"] * 4 and set(verifier.texts) == {"<code>print(6*7)</code>\\boxed{42}"}
