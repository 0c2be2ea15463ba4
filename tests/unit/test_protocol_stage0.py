"""Issue 49 Stage 0's predictor: 16 x the share of questions with no fresh success of 8 that the pool holds."""

from __future__ import annotations

import pytest

from rlep.experiments.protocol.stage0 import figures


def test_a_question_counts_only_when_its_fresh_group_failed_and_the_pool_holds_it():
    # (k8, k64): rescuable only with 0 of 8 and >= 2 of 64; (0, 1) is not in the pool, (1, 64) has a fresh success.
    k8, k64 = [0, 0, 1, 0, 3, 0, 0, 0], [2, 1, 64, 0, 10, 5, 64, 2]
    f = figures(k8, k64)
    rescues, lo, hi = f["predicted_rescues_per_step [mean, lo95, hi95]"]
    assert rescues == pytest.approx(16 * 4 / 8)  # questions 0, 5, 6, 7
    assert lo < rescues < hi
    assert f["P(0 of 8 correct)"][0] == pytest.approx(6 / 8)
    assert f["P(in pool: >= 2 of 64 correct at T=0.7)"][0] == pytest.approx(6 / 8)
    assert f["fresh pass@1 (T=1)"][0] == pytest.approx(4 / 64)
