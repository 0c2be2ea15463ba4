"""Typed client of the verifier service, used by the learner, collection and eval."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rlep.common.grpc_channel import make_channel
from rlep.common.grpc_retry import call_with_retry
from rlep.common.types import Verdict
from rlep.common.wire import VERDICT_FROM_PROTO
from rlep.verifier.v1 import verifier_pb2, verifier_pb2_grpc

# A step's batch (512 questions x 16 responses) takes tens of seconds on a few cores; allow it.
DEFAULT_TIMEOUT_S = 600.0
# Below the server's default max_items_per_request so one call never hits the limit.
DEFAULT_CHUNK_ITEMS = 4096


@dataclass(frozen=True)
class VerifyOutcome:
    reward: float
    verdict: Verdict
    extracted_answer: str
    seconds: float
    score: float = 0.0
    """The scorer's score (math: 1 if CORRECT, else 0)."""


@dataclass(frozen=True)
class ScoredItem:
    """One item to score, as a Verify call carries it (client and server alike)."""

    response: str
    ground_truth: str
    data_source: str = ""
    """Picks the verifier's scorer; "" (or a label not in its `scorers`) picks its `default_scorer`."""
    extra: str = ""
    """A JSON object's text for non-math scorers ("" = {})."""


def _item(item: tuple[str, str] | ScoredItem) -> verifier_pb2.VerifyItem:
    if isinstance(item, ScoredItem):
        return verifier_pb2.VerifyItem(
            response=item.response, ground_truth=item.ground_truth, data_source=item.data_source, extra=item.extra
        )
    response, ground_truth = item
    return verifier_pb2.VerifyItem(response=response, ground_truth=ground_truth)


class VerifierClient:
    """`VerifierClient("127.0.0.1:50061").verify([(response, ground_truth), ...])`."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        chunk_items: int = DEFAULT_CHUNK_ITEMS,
        outage_s: float = 0.0,
    ):
        """`outage_s`: how long a call keeps retrying a server that does not answer (call_with_retry)."""
        self._channel = make_channel(address, token)
        self._stub = verifier_pb2_grpc.VerifierStub(self._channel)
        self._timeout_s = timeout_s
        self._chunk_items = chunk_items
        self._outage_s = outage_s

    def verify(self, items: Sequence[tuple[str, str] | ScoredItem]) -> list[VerifyOutcome]:
        """Checks (response, ground_truth) pairs (the default scorer) or `ScoredItem`s; outcomes in the same order."""
        outcomes: list[VerifyOutcome] = []
        for start in range(0, len(items), self._chunk_items):
            chunk = items[start : start + self._chunk_items]
            request = verifier_pb2.VerifyRequest(items=[_item(item) for item in chunk])
            reply = call_with_retry(self._stub.Verify, request, self._timeout_s, outage_s=self._outage_s)
            outcomes.extend(
                VerifyOutcome(r.reward, VERDICT_FROM_PROTO[r.verdict], r.extracted_answer, r.seconds, r.score)
                for r in reply.results
            )
        return outcomes

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> VerifierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Verifies(Protocol):
    def verify(self, items: Sequence[tuple[str, str]]) -> list[VerifyOutcome]: ...


def verify_groups(
    verifier: Verifies, groups: Sequence[tuple[str, Sequence[str]]], data_sources: Sequence[str] | None = None
) -> list[list[VerifyOutcome]]:
    """Checks every group's responses against its ground truth, all in one `verify` (the verifier batches and
    spreads them over its workers); the outcomes come back grouped as given.

    Args:
        groups: `(ground_truth, responses)` per question (or per completion).
        data_sources: each group's data set (`Question.data_source`), which picks the verifier's scorer for it
            (docs/rewards.md); None or "" = the verifier's default scorer.

    Returns:
        One list of outcomes per group, in the order of its responses.
    """
    sources = data_sources if data_sources is not None else [""] * len(groups)
    if len(sources) != len(groups):
        raise ValueError(f"{len(groups)} groups but {len(sources)} data sources")
    items: list[tuple[str, str] | ScoredItem] = [
        ScoredItem(response, truth, source) if source else (response, truth)
        for (truth, responses), source in zip(groups, sources, strict=True)
        for response in responses
    ]
    outcomes = iter(verifier.verify(items))
    return [[next(outcomes) for _ in responses] for _, responses in groups]
