"""Typed client of the verifier service, used by the learner, collection and eval."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rlep.common.grpc_utils import call_with_retry, make_channel
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

    def verify(self, items: Sequence[tuple[str, str]]) -> list[VerifyOutcome]:
        """Checks (response, ground_truth) pairs; outcomes in the same order."""
        outcomes: list[VerifyOutcome] = []
        for start in range(0, len(items), self._chunk_items):
            chunk = items[start : start + self._chunk_items]
            request = verifier_pb2.VerifyRequest(
                items=[verifier_pb2.VerifyItem(response=r, ground_truth=g) for r, g in chunk]
            )
            reply = call_with_retry(self._stub.Verify, request, self._timeout_s, outage_s=self._outage_s)
            outcomes.extend(
                VerifyOutcome(r.reward, VERDICT_FROM_PROTO[r.verdict], r.extracted_answer, r.seconds)
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


def verify_groups(verifier: Verifies, groups: Sequence[tuple[str, Sequence[str]]]) -> list[list[VerifyOutcome]]:
    """Checks every group's responses against its ground truth, all in one `verify` (the verifier batches and
    spreads them over its workers); the outcomes come back grouped as given.

    Args:
        groups: `(ground_truth, responses)` per question (or per completion).

    Returns:
        One list of outcomes per group, in the order of its responses.
    """
    outcomes = iter(verifier.verify([(response, truth) for truth, responses in groups for response in responses]))
    return [[next(outcomes) for _ in responses] for _, responses in groups]
