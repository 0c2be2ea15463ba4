"""Collection's keep/drop rule and its resume state, with stand-in services (real ones: test_learner_loop.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from rlep.common.dataset import Question
from rlep.common.types import FinishReason, Source, Verdict
from rlep.services.cli.app import app
from rlep.services.learner.collect import (
    CollectConfig,
    StateMismatch,
    collect,
    default_state_file,
    fingerprint,
    load_state,
    run_settings,
)
from rlep.services.learner.cursor import load_questions
from rlep.services.learner.step_inputs import ServiceClients
from rlep.services.rollout.types import Completion, SampleOut


class Rollout:
    def __init__(self, texts: dict[str, list[str]]):
        self.texts = texts
        self.prompts = 0

    def generate(self, prompts, sampling):
        self.prompts += len(prompts)
        return [
            Completion(
                [1, 2], [SampleOut([3, 4], t, [-0.1, -0.2], FinishReason.STOP, 7) for t in self.texts[p[0]["content"]]]
            )
            for p in prompts
        ]


class Verifier:
    def verify(self, items):
        return [
            SimpleNamespace(reward=1.0 if "ok" in r else -1.0, verdict=Verdict.CORRECT if "ok" in r else Verdict.WRONG)
            for r, _ in items
        ]


class Replay:
    def __init__(self):
        self.added = []

    def add(self, pool, trajectories):
        self.added.extend(trajectories)
        return SimpleNamespace(added=len(trajectories))


def test_questions_need_k_distinct_successes():
    texts = {"q1": ["ok a", "ok b", "no"], "q2": ["ok a", "ok a", "no"], "q3": ["no", "no", "no"]}
    questions = [Question(q, (("user", q),), "1") for q in texts]
    replay = Replay()
    services = ServiceClients(rollout=Rollout(texts), verifier=Verifier(), replay=replay)
    stats = collect(
        services, questions, "p", CollectConfig(samples_per_question=3, min_successes=2), show_progress=False
    )
    assert (stats.questions, stats.questions_kept, stats.samples, stats.successes) == (3, 1, 9, 4)
    assert [t.response_text for t in replay.added] == ["ok a", "ok b"]  # q2's two successes are one answer
    assert all(t.prompt_token_ids == (1, 2) and t.policy_version == 7 for t in replay.added)
    assert all(t.source == Source.REPLAY and t.verdict == Verdict.CORRECT for t in replay.added)


def test_the_papers_rule_counts_every_correct_sample_and_only_it_changes_the_settings():
    texts = {"q1": ["ok a", "ok b", "no"], "q2": ["ok a", "ok a", "no"], "q3": ["no", "no", "no"]}
    questions = [Question(q, (("user", q),), "1") for q in texts]
    replay = Replay()
    services = ServiceClients(rollout=Rollout(texts), verifier=Verifier(), replay=replay)
    config = CollectConfig(samples_per_question=3, min_successes=2, keep_rule="correct")
    stats = collect(services, questions, "p", config, show_progress=False)
    assert stats.questions_kept == 2  # q2's two identical successes count twice under the paper's rule
    assert sorted(t.question_id for t in replay.added) == ["q1", "q1", "q2", "q2"]
    # The default rule leaves the settings (and so older resume states' fingerprints) as they were.
    assert "keep_rule" not in run_settings(CollectConfig(), questions, "p")
    assert run_settings(config, questions, "p")["keep_rule"] == "correct"


TEXTS = {"q1": ["ok a", "ok b"], "q2": ["ok a", "no"], "q3": ["no", "no"]}
QUESTIONS = [Question(q, (("user", q),), "1") for q in TEXTS]
CONFIG = CollectConfig(samples_per_question=2, min_successes=1, questions_per_chunk=2)


def run(state_file, config=CONFIG, questions=QUESTIONS, checkpoint=None):
    services = ServiceClients(rollout=Rollout(TEXTS), verifier=Verifier(), replay=Replay())
    stats = collect(services, questions, "p", config, state_file, show_progress=False, checkpoint=checkpoint)
    return stats, services.rollout.prompts


def checkpoint_dir(path, weights=b"w" * 8):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")  # the CLI checks a model has a tokenizer before it starts
    return path


def test_rerun_with_the_same_settings_resumes(tmp_path):
    ckpt = checkpoint_dir(tmp_path / "ckpt")
    first, sampled = run(tmp_path / "state.json", checkpoint=ckpt)
    assert (first.questions, first.chunks_done, sampled) == (3, 2, 3)
    again, sampled_again = run(tmp_path / "state.json", checkpoint=ckpt)
    assert again == first and sampled_again == 0  # nothing sampled twice


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"config": CONFIG.model_copy(update={"temperature": 1.0})}, "temperature 0.7 -> 1.0"),
        ({"config": CONFIG.model_copy(update={"seed": 3})}, "seed 0 -> 3"),
        ({"questions": QUESTIONS[:2]}, "questions"),
        ({"checkpoint": "other"}, "checkpoint"),
    ],
)
def test_a_state_of_other_settings_is_refused_naming_the_difference(tmp_path, change, named):
    state = tmp_path / "state.json"
    run(state, checkpoint=checkpoint_dir(tmp_path / "ckpt"))
    saved = state.read_text()
    kwargs = {"checkpoint": tmp_path / "ckpt", **change}
    with pytest.raises(StateMismatch, match="other settings") as err:
        run(state, **kwargs)
    assert named in str(err.value)
    assert state.read_text() == saved  # the other run's progress is kept


def test_every_setting_and_the_checkpoint_change_the_fingerprint(tmp_path):
    ckpt = checkpoint_dir(tmp_path / "ckpt")
    base = fingerprint(run_settings(CONFIG, QUESTIONS, "p", ckpt))
    changed = {"samples_per_question": 3, "temperature": 0.5, "top_p": 0.5, "max_response_tokens": 7}
    changed |= {"min_successes": 2, "keep_rule": "correct", "questions_per_chunk": 1, "seed": 1, "run_id": "x"}
    assert changed.keys() == CollectConfig.model_fields.keys()  # a new field needs a line here
    for field, value in changed.items():
        config = CONFIG.model_copy(update={field: value})
        assert fingerprint(run_settings(config, QUESTIONS, "p", ckpt)) != base, field
    assert fingerprint(run_settings(CONFIG, QUESTIONS, "p2", ckpt)) != base
    assert fingerprint(run_settings(CONFIG, QUESTIONS[::-1], "p", ckpt)) != base  # the order of questions too
    assert fingerprint(run_settings(CONFIG, QUESTIONS, "p", ckpt)) == base
    checkpoint_dir(ckpt, weights=b"w" * 9)  # the checkpoint was overwritten by another save
    assert fingerprint(run_settings(CONFIG, QUESTIONS, "p", ckpt)) != base


def test_default_state_files_are_per_settings(tmp_path):
    settings = run_settings(CONFIG, QUESTIONS, "p", "ckpt")
    other = run_settings(CONFIG.model_copy(update={"top_p": 0.5}), QUESTIONS, "p", "ckpt")
    assert default_state_file("p", settings) == default_state_file("p", dict(settings))
    assert default_state_file("p", settings) != default_state_file("p", other)
    assert default_state_file("p", settings).name.startswith("p-")


def test_a_state_without_settings_is_refused(tmp_path):
    state = tmp_path / "old.json"
    state.write_text(json.dumps({"questions": 3, "chunks_done": 2}))  # written before states had settings
    with pytest.raises(StateMismatch, match="records no settings"):
        load_state(state, run_settings(CONFIG, QUESTIONS, "p"))


class ServicesStarted(Exception):
    pass


def test_cli_resumes_its_own_state_file_and_refuses_another_runs(tmp_path, monkeypatch):
    from rlep.services.demo.task import make_problems, write_parquet
    from rlep.services.learner.config import TrainConfig

    data = write_parquet(make_problems(4, 0, "train"), tmp_path / "train.parquet")
    ckpt = checkpoint_dir(tmp_path / "ckpt")
    settings = run_settings(TrainConfig().collect, load_questions([data]), "p", ckpt)  # an earlier run's, defaults
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"chunks_done": 1, "fingerprint": fingerprint(settings), "settings": settings}))

    def init_ray(*args):
        raise ServicesStarted

    monkeypatch.setattr("rlep.services.launch.collection.init_ray", init_ray)
    args = ["collect", "--model", str(ckpt), "--data", str(data), "--pool", "p", "--state-file", str(state)]
    same = CliRunner().invoke(app, args)
    assert isinstance(same.exception, ServicesStarted) and "1 chunks done: resuming" in same.output
    other = CliRunner().invoke(app, [*args, "--temperature", "0.9"])
    assert other.exit_code == 2, other.output
    assert "temperature 0.7 -> 0.9" in " ".join(other.output.replace("│", " ").split())
