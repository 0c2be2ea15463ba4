"""The worker pool's hard timeout and crash handling, on real worker processes and real math-verify."""

from __future__ import annotations

import time

import pytest

from rlep_common.types import Verdict
from services.verifier.core import CheckOptions
from services.verifier.pool import VerifyPool

pytestmark = pytest.mark.integration

# sympy evaluates this integer power in C; with math-verify's own timeout set far away, only the
# pool's hard timeout can stop it.
HANGING_ITEM = ("\\boxed{9^{9^{9}}}", "3")


def test_hung_worker_is_killed_and_replaced_without_failing_other_items():
    restarts: list[str] = []
    pool = VerifyPool(
        num_workers=1, item_timeout_s=1.0, options=CheckOptions(parse_timeout_s=60), on_restart=restarts.append
    )
    try:
        pid_before = pool.worker_pids[0]
        started = time.monotonic()
        results = pool.verify([("\\boxed{4}", "4"), HANGING_ITEM, ("\\boxed{5}", "5")])
        assert [r.verdict for r in results] == [Verdict.CORRECT, Verdict.TIMEOUT, Verdict.CORRECT]
        assert time.monotonic() - started < 30
        assert restarts == ["timeout"]
        assert pool.worker_pids[0] != pid_before
    finally:
        pool.close()


def test_verify_with_deadline_raises_timeout_error():
    pool = VerifyPool(num_workers=1, item_timeout_s=2.0, options=CheckOptions(parse_timeout_s=60))
    try:
        with pytest.raises(TimeoutError, match="unfinished"):
            pool.verify([HANGING_ITEM, ("\\boxed{1}", "1")], timeout_s=0.5)
    finally:
        pool.close()
