"""rlep.experiments.protocol.pilots' figures of one pilot: the issue-29 bar (start <= 20%, peak >= 2.5x start) and the
candidates' settings (a full pilot run is a benchmark: ~25 min)."""

from __future__ import annotations

import pytest

from rlep.experiments.protocol import pilots


def run(curve, plateau_step=40):
    return {
        "curve": curve,
        "steps": curve[-1][0],
        "plateau_step": plateau_step,
        "step_seconds": [1.0, 3.0],
        "wall_seconds": 9.0,
    }


@pytest.mark.parametrize(
    ("curve", "meets"),
    [
        ([[0, 0.15], [10, 0.30], [20, 0.40]], True),  # 2.67x from 15%
        ([[0, 0.15], [10, 0.30], [20, 0.35]], False),  # only 2.33x
        ([[0, 0.25], [10, 0.70], [20, 0.70]], False),  # starts above 20%
        ([[0, 0.0], [10, 0.0]], False),  # never learns: no gain at all
    ],
)
def test_the_bar_is_start_at_most_20_percent_and_peak_at_least_2_5_times_it(curve, meets):
    figures = pilots.pilot_figures("sum5-20", 0.1, run(curve))
    assert figures["meets_bar"] is meets
    assert figures["start"] == curve[0][1] and figures["peak"] == max(a for _, a in curve)


def test_a_pilot_that_hit_the_cap_says_so():
    figures = pilots.pilot_figures("sum3-50", None, run([[0, 0.1], [400, 0.5]], plateau_step=None))
    assert figures["capped"] and figures["step_seconds_mean"] == 2.0 and figures["peak_step"] == 400


def test_every_candidate_is_a_valid_protocol_config_with_room_in_its_eval_split(tmp_path):
    from rlep.services.demo.task import make_problems

    for name in pilots.CANDIDATES:
        cfg = pilots.pilot_config(name, tmp_path)
        assert cfg.work_dir == tmp_path / name and cfg.max_steps % cfg.eval_every == 0
        assert len(make_problems(cfg.eval_questions, 0, "eval", cfg.terms, cfg.max_value)) == cfg.eval_questions
