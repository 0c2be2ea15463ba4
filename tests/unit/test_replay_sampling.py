"""Replay sampling logic without Redis: index draws, strategies, buckets, question ids."""

from collections import Counter

import pytest

from rlep.common.dataset import question_id
from rlep.services.replay.sampling import (
    Candidate,
    Strategy,
    choose,
    choose_uniform_indices,
    length_bucket,
    question_rng,
    question_stream_seed,
)


def test_uniform_indices_are_distinct_in_range_and_uniform():
    counts = Counter()
    for seed in range(6000):
        picks = choose_uniform_indices(6, 2, question_stream_seed(seed, "q"))
        assert len(set(picks)) == 2 and all(0 <= i < 6 for i in picks)
        counts.update(picks)
    assert max(counts.values()) / min(counts.values()) < 1.1  # each index ~2000 times
    assert sorted(choose_uniform_indices(3, 10, 5)) == [0, 1, 2]
    assert choose_uniform_indices(0, 2, 5) == []


def test_stream_seed_depends_on_seed_and_question():
    assert question_stream_seed(1, "a") == question_stream_seed(1, "a")
    assert len({question_stream_seed(s, q) for s in range(20) for q in "abc"}) == 60


def test_recency_takes_newest_versions():
    candidates = [Candidate(f"t{i}", policy_version=v) for i, v in enumerate([3, 9, 1, 9, 5])]
    assert choose(candidates, 3, Strategy.RECENCY, question_rng(0, "q")) == ["t1", "t3", "t4"]


def test_prioritized_is_proportional_to_priority():
    candidates = [Candidate("heavy", priority=9.0), Candidate("light", priority=1.0)]
    firsts = Counter(choose(candidates, 1, Strategy.PRIORITIZED, question_rng(s, "q"))[0] for s in range(4000))
    assert 0.87 < firsts["heavy"] / 4000 < 0.93


def test_diverse_picks_the_outlier_second():
    near = [Candidate(f"n{i}", tokens=frozenset({1, 2, 3, 4 + i})) for i in range(3)]
    far = Candidate("far", tokens=frozenset({90, 91}))
    for seed in range(10):
        picked = choose([*near, far], 2, Strategy.DIVERSE, question_rng(seed, "q"))
        assert "far" in picked and len(set(picked)) == 2


def test_uniform_is_not_attribute_based():
    with pytest.raises(ValueError, match="index-based"):
        choose([Candidate("a")], 1, Strategy.UNIFORM, question_rng(0, "q"))


@pytest.mark.parametrize(("tokens", "label"), [(0, "0"), (1, "1"), (2, "2-3"), (3, "2-3"), (300, "256-511")])
def test_length_bucket(tokens, label):
    assert length_bucket(tokens) == label


def test_question_ids():
    prompt = [{"role": "user", "content": "What is 1+1?"}]
    assert question_id(prompt) == question_id([dict(prompt[0])])
    assert question_id(prompt) != question_id([{"role": "user", "content": "What is 1+2?"}])
    assert len(question_id(prompt)) == 24


def _reference_diverse(candidates, m, rng):
    """The greedy max-min pick written with Python sets, as the strategy is defined."""

    def distance(a, b):
        return 1.0 - len(a & b) / len(a | b) if a | b else 0.0

    remaining = sorted(candidates, key=lambda c: c.trajectory_id)
    rng.shuffle(remaining)
    picked = [remaining.pop(0)] if remaining else []
    while remaining and len(picked) < m:
        best = max(range(len(remaining)), key=lambda i: min(distance(remaining[i].tokens, p.tokens) for p in picked))
        picked.append(remaining.pop(best))
    return [c.trajectory_id for c in picked]


@pytest.mark.parametrize(("words", "block_columns"), [(False, 4096), (True, 4096), (False, 7)])
def test_vectorised_diverse_matches_the_set_definition(words, block_columns, monkeypatch):
    import random

    from rlep.services.replay import sampling
    from rlep.services.replay.sampling import jaccard_distances

    monkeypatch.setattr(sampling, "DIVERSE_BLOCK_COLUMNS", block_columns)  # 7: many column blocks

    maker = random.Random(5)
    candidates = []
    for i in range(40):
        tokens = {maker.randrange(60) for _ in range(maker.randrange(0, 25))}
        candidates.append(
            Candidate(f"t{i:02d}", tokens=frozenset(f"w{t}" for t in tokens) if words else frozenset(tokens))
        )
    sets = [c.tokens for c in candidates]
    expected = [[1.0 - len(a & b) / len(a | b) if a | b else 0.0 for b in sets] for a in sets]
    assert jaccard_distances(sets).tolist() == expected  # same float64 formula, so exactly equal
    for seed in range(8):
        for m in (1, 5, 40, 60):
            got = choose(candidates, m, Strategy.DIVERSE, question_rng(seed, "q"))
            assert got == _reference_diverse(candidates, m, question_rng(seed, "q")), (seed, m)
