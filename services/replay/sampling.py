"""Replay logic that needs no Redis: sampling strategies, length buckets (request checks: `requests`).

Sampling is deterministic for a given seed: each question gets its own generator seeded from
(seed, question id), so the result for one question does not depend on which other questions are
in the request, nor on their order. Strategies:

- `uniform`: M distinct successes uniformly without replacement (the paper).
- `recency`: the M with the highest policy version (ties broken by trajectory id).
- `prioritized`: without replacement, probability proportional to a stored priority
  (Efraimidis-Spirakis keys u^(1/w)); the learner may set priorities, e.g. to rarity of success.
- `diverse`: a random first pick, then greedily the success least similar to those already picked
  (max-min Jaccard distance between token-id sets; one (n, n) distance matrix per question, so
  O(n^2) memory and time in the number of stored successes n).

A question with fewer than M successes returns all it has; the response says how many exist.
The learner decides how to fill the group (it trains on the smaller mixed group rather than
padding with empty responses as RLEP's reference does, since an empty response with reward 1
would teach the policy to stop at once).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np


class Strategy(StrEnum):
    UNIFORM = "uniform"
    RECENCY = "recency"
    PRIORITIZED = "prioritized"
    DIVERSE = "diverse"


class Eviction(StrEnum):
    OLDEST = "oldest"
    LOWEST_PRIORITY = "lowest_priority"


def _question_digest(seed: int, question_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\0{question_id}".encode()).digest()[:8], "big")


def question_rng(seed: int, question_id: str) -> random.Random:
    return random.Random(_question_digest(seed, question_id))


# Uniform sampling runs inside Redis (one Lua call per step), so its generator must be one that
# Lua's doubles compute exactly: Park-Miller's minimal standard LCG (products stay below 2^53).
PARK_MILLER_MODULUS = 2_147_483_647
PARK_MILLER_MULTIPLIER = 48_271


def question_stream_seed(seed: int, question_id: str) -> int:
    """The LCG state a question starts from, in 1..2^31-2."""
    return _question_digest(seed, question_id) % (PARK_MILLER_MODULUS - 1) + 1


def choose_uniform_indices(available: int, m: int, stream_seed: int) -> list[int]:
    """min(m, available) distinct indices in 0..available-1, uniformly, O(m).

    A partial Fisher-Yates shuffle over a virtual identity array, driven by Park-Miller. This is
    the reference of the Lua twin in `rlep.services.replay.store` (a test checks they agree).
    """
    state, swapped, picks = stream_seed, {}, []
    for i in range(min(m, available)):
        state = state * PARK_MILLER_MULTIPLIER % PARK_MILLER_MODULUS
        j = i + state % (available - i)
        picks.append(swapped.get(j, j))
        swapped[j] = swapped.get(i, i)
    return picks


@dataclass(frozen=True)
class Candidate:
    """A stored success as the non-uniform strategies see it."""

    trajectory_id: str
    policy_version: int = 0
    priority: float = 1.0
    tokens: frozenset[int] = frozenset()


def choose(candidates: Sequence[Candidate], m: int, strategy: Strategy, rng: random.Random) -> list[str]:
    """Ids of up to m distinct candidates, in pick order, for the strategies that look at attributes.

    `uniform` needs no attributes: the store draws `choose_uniform_indices` and reads only those.
    """
    if strategy == Strategy.UNIFORM:
        raise ValueError("uniform sampling is index-based: use choose_uniform_indices")
    if strategy == Strategy.RECENCY:
        ranked = sorted(candidates, key=lambda c: (-c.policy_version, c.trajectory_id))
        return [c.trajectory_id for c in ranked[:m]]
    if strategy == Strategy.PRIORITIZED:
        ordered = sorted(candidates, key=lambda c: c.trajectory_id)
        keys = [(math.log(rng.random() or 1e-300) / max(c.priority, 1e-12), c.trajectory_id) for c in ordered]
        return [tid for _, tid in sorted(keys, reverse=True)[:m]]
    if strategy == Strategy.DIVERSE:
        return _choose_diverse(sorted(candidates, key=lambda c: c.trajectory_id), m, rng)
    raise ValueError(f"unknown strategy {strategy!r}")


DIVERSE_BLOCK_COLUMNS = 4096


def jaccard_distances(token_sets: Sequence[frozenset]) -> np.ndarray:
    """(n, n) Jaccard distances between token sets, vectorised: one matrix product instead of n^2 set ops.

    Only tokens held by two or more sets can be shared, so the product runs over those columns
    alone; two empty sets are at distance 0.
    """
    n = len(token_sets)
    sizes = np.array([len(t) for t in token_sets], dtype=np.int64)
    rows_arr = np.repeat(np.arange(n), sizes)
    if all(isinstance(next(iter(t), 0), int) for t in token_sets):  # token ids: numpy end to end
        flat = np.concatenate([np.fromiter(t, dtype=np.int64, count=len(t)) for t in token_sets] or [np.zeros(0)])
        cols_arr = np.unique(flat, return_inverse=True)[1].reshape(-1).astype(np.int64)
    else:  # whitespace-split words of responses stored without token ids
        index: dict = {}
        cols_arr = np.array([index.setdefault(x, len(index)) for t in token_sets for x in t], dtype=np.int64)
    vocabulary = int(cols_arr.max()) + 1 if len(cols_arr) else 0
    shared = np.bincount(cols_arr, minlength=vocabulary) >= 2
    keep = shared[cols_arr] if len(cols_arr) else np.zeros(0, dtype=bool)
    columns = (np.cumsum(shared) - 1)[cols_arr[keep]]  # column among the shared tokens
    order = np.argsort(columns, kind="stable")
    rows_sorted, columns = rows_arr[keep][order], columns[order]
    # Column blocks bound memory to n x DIVERSE_BLOCK_COLUMNS floats whatever the vocabulary.
    inter = np.zeros((n, n), dtype=np.float64)
    for low in range(0, int(shared.sum()), DIVERSE_BLOCK_COLUMNS):
        start, end = np.searchsorted(columns, [low, low + DIVERSE_BLOCK_COLUMNS])
        block = np.zeros((n, DIVERSE_BLOCK_COLUMNS), dtype=np.float32)
        block[rows_sorted[start:end], columns[start:end] - low] = 1.0
        inter += block @ block.T  # exact: a block's counts stay below 2^24
    union = (sizes[:, None] + sizes[None, :]).astype(np.float64) - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        distances = np.where(union > 0, 1.0 - inter / np.where(union > 0, union, 1.0), 0.0)
    np.fill_diagonal(distances, 0.0)  # unshared tokens are left out of `inter`, so the diagonal is set here
    return distances


def _choose_diverse(ordered: list[Candidate], m: int, rng: random.Random) -> list[str]:
    remaining = list(ordered)
    rng.shuffle(remaining)  # random first pick, and random tie-breaking after it
    if not remaining:
        return []
    distances = jaccard_distances([c.tokens for c in remaining])
    # Greedy max-min: keep each candidate's distance to the nearest pick; argmax takes the first
    # maximum in shuffled order, the same tie-break as a scan of the remaining list.
    nearest = distances[0].copy()
    available = np.ones(len(remaining), dtype=bool)
    available[0] = False
    picked = [0]
    while len(picked) < min(m, len(remaining)):
        best = int(np.argmax(np.where(available, nearest, -np.inf)))
        picked.append(best)
        available[best] = False
        np.minimum(nearest, distances[best], out=nearest)
    return [remaining[i].trajectory_id for i in picked]


def length_bucket(tokens: int) -> str:
    """Power-of-two bucket label of a response length: "0", "1", "2-3", "4-7", ..."""
    if tokens <= 1:
        return str(max(tokens, 0))
    low = 1 << (tokens.bit_length() - 1)
    return f"{low}-{2 * low - 1}"
