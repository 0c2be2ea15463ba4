"""Collection's keep/drop rule with stand-in services (the real services run in test_learner_loop.py)."""

from __future__ import annotations

from types import SimpleNamespace

from rlep_common.types import FinishReason, Verdict
from services.learner.collect import CollectConfig, collect
from services.learner.data import Question
from services.learner.trainer import Services
from services.rollout.types import Completion, SampleOut


class Rollout:
    def __init__(self, texts: dict[str, list[str]]):
        self.texts = texts

    def generate(self, prompts, sampling):
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
    services = Services(rollout=Rollout(texts), verifier=Verifier(), replay=replay)
    stats = collect(
        services, questions, "p", CollectConfig(samples_per_question=3, min_successes=2), show_progress=False
    )
    assert (stats.questions, stats.questions_kept, stats.samples, stats.successes) == (3, 1, 9, 4)
    assert [t.response_text for t in replay.added] == ["ok a", "ok b"]  # q2's two successes are one answer
    assert all(t.prompt_token_ids == (1, 2) and t.policy_version == 7 for t in replay.added)
