"""What one `Trainer.train_step` hands to the policy: mixed groups, their shaped rewards and advantages.

Real verifier (math-verify workers over gRPC) and real replay (Redis); the policy is a recording
stand-in (the assertions are about the batch the trainer builds, not about DeepSpeed), and the
rollout answers from a script: the untrained tiny model never writes a correct answer, and exact
response lengths are what overlong shaping is about. Every expected reward and advantage below is
computed by hand from the script.

Settings: B=2 questions, G=4 fresh answers, max_response_tokens=16 with a 4-token overlong buffer
(penalty 1.0): a response of L tokens loses min(1, max(0, (L - 12) / 4)).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from rlep.common.dataset import Question
from rlep.common.tiny_model import ModelSpec, cached_model
from rlep.common.types import FinishReason, Source, Trajectory, Verdict, trajectory_id
from rlep.replay.v1 import replay_pb2
from rlep.services.learner.config import TrainConfig
from rlep.services.learner.step_inputs import ServiceClients
from rlep.services.learner.tokens import PolicyTokenizer
from rlep.services.learner.trainer import Trainer
from rlep.services.rollout.client import PushResult, ReplicaTarget
from rlep.services.rollout.types import Completion, SampleOut

pytestmark = [pytest.mark.integration]

SMALL = ModelSpec(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64)
MAX_RESPONSE, BUFFER = 16, 4
QUESTIONS = [Question("q-sum-7", (("user", "3+4=?"),), "7"), Question("q-sum-42", (("user", "12+30=?"),), "42")]
TRUTH = {"3+4": "7", "12+30": "42"}


def fresh_script(truth: str) -> list[tuple[str, float]]:
    """G=4 fresh answers (text, shaped reward by hand); the tiny tokenizer spends a token per character,
    `\\boxed{` is one token, and every answer ends with EOS unless cut at 16 tokens."""
    return [
        (f"\\boxed{{{truth}}}", 1.0),  # correct, short: no penalty
        (f"{'x' * (11 - len(truth))}\\boxed{{{truth}}}", 0.5),  # correct, 13 tokens + EOS: 1.0 - (14 - 12) / 4
        (f"\\boxed{{{int(truth) + 1}}}", -1.0),  # wrong (a real WRONG verdict), short
        ("x" * MAX_RESPONSE, -2.0),  # cut at 16 tokens: unparseable (-1) and the full penalty (-1)
    ]


class ScriptedRollout:
    """Answers every question with `fresh_script`, stamped with the last pushed version (the one it serves),
    and records the weight pushes (versions only)."""

    def __init__(self, tokenizer: PolicyTokenizer):
        self.tokenizer, self.pushed, self.calls = tokenizer, [], 0
        self.frozen_version: int | None = None  # set: answers as a replica stuck on that version would
        self.sampler_logprob = 0.0  # the logprob the "sampler" reports for every token

    def generate(self, prompts, sampling):
        self.calls += 1
        served = self.frozen_version if self.frozen_version is not None else self.versions()[0]
        completions = []
        for ids in prompts:
            question = self.tokenizer.decode(ids).split("Q: ")[-1].split("=?")[0]
            script = fresh_script(TRUTH[question])
            assert sampling.n == len(script) and sampling.max_tokens == MAX_RESPONSE
            samples = []
            for text, _ in script:
                encoded = self.tokenizer.encode_response(text)
                finish = FinishReason.LENGTH if encoded.truncated else FinishReason.STOP
                body = self.tokenizer.decode(encoded.token_ids)
                logprobs = [self.sampler_logprob] * len(encoded.token_ids)
                samples.append(SampleOut(list(encoded.token_ids), body, logprobs, finish, served))
            completions.append(Completion(list(ids), samples))
        return completions

    def versions(self) -> list[int]:
        return [self.pushed[-1] if self.pushed else 0]

    def max_model_len(self) -> int:
        return 256

    def target(self, replicas=None):
        return ReplicaTarget(("scripted",), None, 1.0)

    def take_push_result(self, result) -> None:
        self.pushed.append(result.version)

    def refresh(self) -> None: ...

    def check(self) -> list:
        return []

    def set_serving(self, replicas) -> None: ...

    def serving(self) -> list:
        return ["scripted"]

    failovers = 0


class RecordingPolicy:
    """Stands in for DeepSpeed: old logprobs are zeros, `update` records the batch it is given."""

    def __init__(self):
        self.updates = []

    def logprobs(self, batch):
        return torch.zeros(batch.loss_mask.shape)

    def update(self, batch, rows_per_mini_batch):
        self.updates.append((batch, rows_per_mini_batch))
        stats = dict.fromkeys(("clip_fraction", "approx_kl", "entropy", "loss"), 0.0)
        return {**stats, "lr": 1e-3, "optimizer_steps": float(len(self.updates))}

    def push_weights(self, target, version, sync):
        return PushResult(version, target.addresses)

    def rng_state(self):
        return {}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model = cached_model(SMALL, cache_dir=tmp_path_factory.mktemp("models"))
    return PolicyTokenizer.load(model, max_prompt_tokens=64, max_response_tokens=MAX_RESPONSE)


def make_trainer(tokenizer, verifier_client, replay_client, pool, **algorithm):
    config = TrainConfig.model_validate(
        {
            "seed": 5,
            "replay_pool": pool,
            "algorithm": {
                "questions_per_step": 2,
                "fresh_per_question": 4,
                "mini_batch_questions": 1,
                "max_response_tokens": MAX_RESPONSE,
                "overlong_buffer_tokens": BUFFER,
                "overlong_penalty": 1.0,
                **algorithm,
            },
            "data": {"shuffle": False},
        }
    )
    policy, rollout = RecordingPolicy(), ScriptedRollout(tokenizer)
    services = ServiceClients(rollout=rollout, verifier=verifier_client, replay=replay_client)
    trainer = Trainer(config, tokenizer.tokenizer.name_or_path, QUESTIONS, policy, services, tokenizer)
    trainer.start()
    return trainer, policy, rollout


def stored(tokenizer, question: Question, text: str) -> Trajectory:
    """A verified success as phase-1 collection stores it (this policy's tokenizer, so its ids are used as is)."""
    prompt = tokenizer.encode_prompt(question.chat()).token_ids
    ids = tokenizer.encode_response(text).token_ids
    fingerprint = tokenizer.fingerprint
    return Trajectory(
        question.question_id, text, 1.0, Source.REPLAY, Verdict.CORRECT, 0, FinishReason.STOP, prompt, ids,
        tokenizer_fingerprint=fingerprint,
    )  # fmt: skip


def advantages_by_hand(rewards: list[float]) -> list[float]:
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)  # unbiased, as verl
    return [(r - mean) / (std + 1e-6) for r in rewards]


def rows_of_group(batch, group: int) -> list[tuple[bool, int, float, float]]:
    """(replayed, response tokens, reward, advantage) of one group's rows, in batch order."""
    rows = (batch.group_index == group).nonzero().flatten().tolist()
    return [
        (bool(batch.replayed[i]), int(batch.loss_mask[i].sum()), float(batch.rewards[i]), float(batch.advantages[i]))
        for i in rows
    ]


def test_fresh_and_replayed_answers_form_one_shaped_mixed_group(tokenizer, verifier_client, replay_client, pool_name):
    """G=4 fresh + M=2 replayed per question: one group, re-verified and overlong-shaped alike, one baseline."""
    replayed_texts = {
        q.question_id: [
            f"so \\boxed{{{q.ground_truth}}}",
            f"{'y' * (12 - len(q.ground_truth))}\\boxed{{{q.ground_truth}}}",
        ]
        for q in QUESTIONS
    }  # 7 tokens (reward 1.0) and 15 tokens (1.0 - 0.75 = 0.25)
    replay_client.add(pool_name, [stored(tokenizer, q, t) for q in QUESTIONS for t in replayed_texts[q.question_id]])
    trainer, policy, rollout = make_trainer(
        tokenizer, verifier_client, replay_client, pool_name, replayed_per_question=2
    )

    record = trainer.train_step()

    ((batch, rows_per_mini_batch),) = policy.updates
    assert rows_per_mini_batch == 1 * 4  # mini_batch_questions x G: replayed rows add updates
    assert batch.size == 2 * (4 + 2) and batch.old_logprobs is not None
    for group, question in enumerate(QUESTIONS):
        truth = question.ground_truth
        fresh = [
            (False, 4 if len(truth) == 1 else 5, 1.0),
            (False, 14, 0.5),
            (False, 4 if len(truth) == 1 else 5, -1.0),
        ]
        fresh += [(False, 16, -2.0)]
        replayed = sorted([(True, 7 if len(truth) == 1 else 8, 1.0), (True, 15, 0.25)], key=lambda r: r[2])
        rows = rows_of_group(batch, group)
        got_fresh, got_replayed = rows[:4], sorted(rows[4:], key=lambda r: r[2])  # replay's order is the sampler's
        expected = fresh + replayed
        advantages = advantages_by_hand([r[2] for r in expected])
        for got, want, advantage in zip(got_fresh + got_replayed, expected, advantages, strict=True):
            assert got[:3] == pytest.approx(want), (question.question_id, got, want)
            assert got[3] == pytest.approx(advantage, abs=1e-5)
    assert record.replayed_fraction == pytest.approx(2 / 6)
    assert (record.replay_requested, record.replay_used, record.replay_failed_verification) == (4, 4, 0)
    assert record.reward_mean == pytest.approx((1.0 + 0.5 - 1.0 - 2.0) / 4)
    assert record.fresh_accuracy == pytest.approx(0.5)
    # What replay could teach: its rows' share of |A| x tokens, no group rescued (fresh rewards differ already),
    # and the policy's own chance of each replayed answer, all from the batch the policy trained on.
    tokens = batch.loss_mask.sum(dim=1)
    mass = batch.advantages.abs() * tokens
    assert record.replay_advantage_share == pytest.approx(float(mass[batch.replayed].sum() / mass.sum()), rel=1e-5)
    assert 0 < record.replay_advantage_share < 1 and record.replay_signal_groups == 0
    sums = (batch.old_logprobs * batch.loss_mask)[batch.replayed].sum(dim=1)
    assert record.replay_sequence_prob_mean == pytest.approx(float(sums.exp().mean()), rel=1e-5)
    assert record.replay_logprob_mean == pytest.approx(float(sums.sum() / tokens[batch.replayed].sum()), rel=1e-5)
    assert rollout.pushed == [1, 2]  # the start's push, then one per step


def test_max_replayed_fraction_caps_replayed_rows_per_group(tokenizer, verifier_client, replay_client, pool_name):
    """M=4 with a cap of 0.34 of a group: replayed <= 0.34 x 4 / 0.66, i.e. 2 of 6 rows."""
    answers = [stored(tokenizer, q, f"{tag} \\boxed{{{q.ground_truth}}}") for q in QUESTIONS for tag in "abcd"]
    replay_client.add(pool_name, answers)
    trainer, policy, _ = make_trainer(
        tokenizer, verifier_client, replay_client, pool_name, replayed_per_question=4, max_replayed_fraction=0.34
    )

    record = trainer.train_step()

    ((batch, _),) = policy.updates
    for group in range(len(QUESTIONS)):
        assert [r[0] for r in rows_of_group(batch, group)] == [False] * 4 + [True] * 2
    assert record.replayed_fraction == pytest.approx(2 / 6)
    assert (record.replay_requested, record.replay_used) == (2 * 2, 2 * 2)


@pytest.mark.parametrize("online", [True, False], ids=["online-replay", "off"])
def test_online_replay_stores_this_steps_fresh_successes_only(
    tokenizer, verifier_client, replay_client, pool_name, online
):
    """The verifier's CORRECT fresh answers reach the pool (both lengths); WRONG and cut ones never do."""
    trainer, _, _ = make_trainer(
        tokenizer, verifier_client, replay_client, pool_name, replayed_per_question=0, online_replay=online
    )

    trainer.train_step()

    if not online:
        assert pool_name not in replay_client.list_pools()
        return
    expected = {q.question_id: {text for text, reward in fresh_script(q.ground_truth) if reward > 0} for q in QUESTIONS}
    assert replay_client.stats(pool_name).trajectories == 2 * len(QUESTIONS)
    found = replay_client.sample(pool_name, [q.question_id for q in QUESTIONS], m=8, seed=1)
    assert {qid: {t.response_text for t in ts} for qid, ts in found.items()} == expected
    assert all(t.id == trajectory_id(t.question_id, t.response_text) for ts in found.values() for t in ts)


def seed_two_successes_each(tokenizer, replay_client, pool_name) -> None:
    replay_client.add(
        pool_name,
        [stored(tokenizer, q, f"{prefix}\\boxed{{{q.ground_truth}}}") for q in QUESTIONS for prefix in ("so ", "")],
    )


@pytest.mark.parametrize(
    ("rule", "offered", "skipped"),
    [
        ({"when": "rescue"}, 0, {"fresh_succeeded": 2}),  # the script gives each group 2 fresh successes of 4
        ({"when": "rescue", "rescue_max_fresh_successes": 2}, 2, {}),
        ({"when": "band", "band_low": 0.4, "band_high": 0.6}, 2, {}),  # 2/4 = 0.5, no history yet
        ({"when": "band", "band_low": 0.6, "band_high": 1.0}, 0, {"out_of_band": 2}),
    ],
)
def test_a_replay_rule_decides_which_groups_get_replay_and_the_history_records_the_step(
    tokenizer, verifier_client, replay_client, pool_name, rule, offered, skipped
):
    """Issue 48 part 2 against the real replay service: the rule's groups get M=2 replayed rows, the others none;
    the step record says how many were offered and why the rest were not, and the service's history then holds
    the step's fresh outcome (4 attempts, 2 successes) and the rows replayed into each group."""
    seed_two_successes_each(tokenizer, replay_client, pool_name)
    trainer, policy, _ = make_trainer(
        tokenizer, verifier_client, replay_client, pool_name, replayed_per_question=2, replay_rule=rule
    )
    record = trainer.train_step()
    ((batch, _),) = policy.updates
    assert int(batch.replayed.sum()) == record.replay_used == 2 * offered
    assert (record.replay_offered, record.replay_skipped, record.replay_requested) == (offered, skipped, 2 * offered)
    assert (record.history_status, record.history_recorded) == ("recorded", 2)
    ids = [q.question_id for q in QUESTIONS]
    histories = replay_client.question_stats(pool_name, question_ids=ids).questions
    assert sorted(h.question_id for h in histories) == sorted(ids)
    for h in histories:
        assert (h.visits, h.attempts, h.successes, h.last_step) == (1, 4, 2, 1)
        assert (h.times_replayed, h.replayed_rows, h.times_rescued) == (int(offered > 0), 2 if offered else 0, 0)


def test_retirement_reads_the_history_an_earlier_run_reported(tokenizer, verifier_client, replay_client, pool_name):
    """Three earlier visits at 8/8 and this step's 2/4 make 26/28 = 0.93 over 4 visits: retired at 0.9, so no
    replayed row, and the step says why. A retried report of the same step changes nothing."""
    seed_two_successes_each(tokenizer, replay_client, pool_name)
    for step in (1, 2, 3):
        earlier = [replay_pb2.QuestionOutcome(question_id=q.question_id, attempts=8, successes=8) for q in QUESTIONS]
        replay_client.report_outcomes(pool_name, "earlier-run", step, 0, earlier)
    retire = {"retire_pass_rate": 0.9, "retire_min_visits": 4}
    trainer, policy, _ = make_trainer(
        tokenizer, verifier_client, replay_client, pool_name, replayed_per_question=2, replay_rule=retire
    )
    record = trainer.train_step()
    ((batch, _),) = policy.updates
    assert int(batch.replayed.sum()) == 0
    assert (record.replay_offered, record.replay_skipped) == (0, {"retired": 2})
    again = replay_client.report_outcomes(pool_name, trainer.history_run, 1, 1, earlier)
    assert again.duplicate and again.recorded == 0
    found = replay_client.question_stats(pool_name, question_ids=[QUESTIONS[0].question_id, "absent"]).questions
    assert [(h.visits, h.attempts, h.successes) for h in found] == [(4, 28, 26)]


class LengthLogprobPolicy(RecordingPolicy):
    """Old logprobs at every token of -0.3 x the tokens a row's response has beyond the shortest replayed one: the
    shortest answer is certain to the policy (logprob 0), a longer one less likely per token."""

    def logprobs(self, batch):
        tokens = batch.loss_mask.sum(dim=1, keepdim=True)
        shortest = tokens[batch.replayed].min()
        return (-0.3 * (tokens - shortest)).expand(batch.loss_mask.shape).clone()


def test_policy_surprise_sets_each_replayed_answers_priority_and_prioritized_draws_follow(
    tokenizer, verifier_client, replay_client, redis_url, pool_name
):
    """`replay_priority: policy_surprise` against the real replay service: after a step, each replayed success's
    stored priority is 1 - exp(mean old logprob per response token) of its row, and `prioritized` then draws the
    answer the policy finds less likely in proportion (Efraimidis-Spirakis keys: P = w / sum of w)."""
    import math

    import redis

    from rlep.services.replay.store import pool_prefix

    seed_two_successes_each(tokenizer, replay_client, pool_name)
    trainer, _, _ = make_trainer(
        tokenizer, verifier_client, replay_client, pool_name, replayed_per_question=2,
        replay_strategy="prioritized", replay_priority="policy_surprise",
    )  # fmt: skip
    trainer.policy = policy = LengthLogprobPolicy()
    record = trainer.train_step()
    ((batch, _),) = policy.updates
    assert (record.replay_priorities_updated, record.replay_priorities_status) == (4, "updated")
    shortest = int(batch.loss_mask[batch.replayed].sum(dim=1).min())
    client = redis.Redis.from_url(redis_url)
    expected = {}
    for group, q in enumerate(QUESTIONS):  # B = 2 unshuffled: group g is QUESTIONS[g]
        lengths = sorted(tokens for replayed, tokens, _, _ in rows_of_group(batch, group) if replayed)
        assert len(lengths) == 2  # "so \boxed{..}" is 3 tokens longer than "\boxed{..}"
        key = f"{pool_prefix(pool_name)}:q:{q.question_id}:prio"
        for prefix, tokens in zip(("", "so "), lengths, strict=True):
            # 1 - exp(mean logprob); the shortest answer of all is certain (0), raised to the floor (0.05).
            expected[q.question_id, prefix] = max(0.05, 1 - math.exp(-0.3 * (tokens - shortest)))
            tid = trajectory_id(q.question_id, f"{prefix}\\boxed{{{q.ground_truth}}}")
            assert client.zscore(key, tid) == pytest.approx(expected[q.question_id, prefix], rel=1e-5), (q, prefix)
    question = QUESTIONS[0]
    drawn = [
        replay_client.sample(pool_name, [question.question_id], m=1, strategy="prioritized", seed=seed)
        for seed in range(400)
    ]
    longer = sum(found[question.question_id][0].response_text.startswith("so ") for found in drawn)
    weights = expected[question.question_id, "so "], expected[question.question_id, ""]
    share = weights[0] / sum(weights)
    assert abs(longer / 400 - share) < 5 * math.sqrt(share * (1 - share) / 400), (longer, share)
