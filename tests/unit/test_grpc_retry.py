"""call_with_retry: which failures are retried, and for how long (a fake RPC and clock: pure logic)."""

from __future__ import annotations

import grpc
import pytest

from rlep.common.grpc_retry import call_with_retry


class Failure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name.lower()


class Outage:
    """An RPC that fails with `code` until the clock reaches `until` (never, by default), then answers."""

    def __init__(self, code: grpc.StatusCode, until: float = float("inf")):
        self.code, self.until, self.now, self.tries = code, until, 0.0, 0

    def __call__(self, request, timeout):
        self.tries += 1
        if self.now < self.until:
            raise Failure(self.code)
        return f"answer to {request}"

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds

    def clock(self) -> float:
        return self.now


def call(outage: Outage, **kwargs):
    return call_with_retry(outage, "q", timeout_s=1.0, sleep=outage.sleep, clock=outage.clock, **kwargs)


def test_without_an_outage_budget_a_down_server_gets_three_tries():
    outage = Outage(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.RpcError):
        call(outage)
    assert outage.tries == 3


def test_a_server_back_within_the_outage_budget_answers_the_same_call():
    outage = Outage(grpc.StatusCode.UNAVAILABLE, until=40.0)
    assert call(outage, outage_s=60.0) == "answer to q"
    assert 40.0 <= outage.now < 40.0 + 2 * 5.0  # at most one capped backoff (5 s, jittered x2) past the return
    assert outage.tries > 3


def test_a_longer_outage_fails_once_its_budget_is_spent():
    outage = Outage(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.RpcError) as failure:
        call(outage, outage_s=60.0)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    assert outage.now == pytest.approx(60.0)  # the last wait is cut to the budget, not slept past it


@pytest.mark.parametrize("code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT])
def test_only_unavailable_uses_the_outage_budget(code):
    outage = Outage(code)
    with pytest.raises(grpc.RpcError):
        call(outage, outage_s=60.0)
    assert outage.tries == (3 if code == grpc.StatusCode.DEADLINE_EXCEEDED else 1)
