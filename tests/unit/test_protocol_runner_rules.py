"""Issue 49's rules for running the protocol (rlep.experiments.protocol.training, run): one fixed horizon for every
run unless `horizon: plateau`, a finished run reused only for the horizon it ran, and an arm refused on another CPU
model than its seed's baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlep.experiments.protocol.config import ProtocolConfig, run_config
from rlep.experiments.protocol.training import pairing_problem, reuse_problem, train_run

HERE = "AMD EPYC (family 25 model 17, 2445 MHz), 2 cores"
SAME_MODEL_OTHER_CLOCK = "AMD EPYC (family 25 model 17, 3100 MHz), 2 cores"
OTHER_MODEL = "AMD EPYC (family 25 model 1, 2445 MHz), 2 cores"
NO_SUCH_CPU = "Imaginary CPU (family 99 model 99, 1000 MHz), 2 cores"  # not the machine running the test


def result(steps: int, plateau_step: int | None = None, machine: str | None = HERE) -> dict:
    return {"run_id": "baseline-s0", "steps": steps, "plateau_step": plateau_step, "machine": machine}


def test_the_protocol_runs_a_fixed_horizon_and_refuses_other_cpus_by_default():
    cfg = ProtocolConfig()
    assert cfg.horizon == "fixed" and cfg.max_steps == 600 and not cfg.pair_on_other_cpu


def test_a_finished_run_stands_only_for_the_horizon_it_ran():
    assert reuse_problem(result(600), 600, stops_at_plateau=False) is None
    # Issue 29's baselines stopped at their plateaus: under a fixed horizon they are other runs.
    problem = reuse_problem(result(420, plateau_step=420), 600, stops_at_plateau=False)
    assert problem is not None and "plateau (step 420) 420 steps, this run asks 600" in problem
    assert "--set horizon=plateau" in problem
    # Under the plateau rule a baseline may stop before its cap, never run past it.
    assert reuse_problem(result(420, plateau_step=420), 600, stops_at_plateau=True) is None
    assert reuse_problem(result(620), 600, stops_at_plateau=True) is not None
    # An arm runs as many steps as its baseline, exactly.
    assert reuse_problem(result(400), 420, stops_at_plateau=False) is not None


def test_an_arm_pairs_only_on_its_baselines_cpu_model():
    assert pairing_problem(result(600, machine=HERE), HERE, allowed=False) is None
    assert pairing_problem(result(600, machine=HERE), SAME_MODEL_OTHER_CLOCK, allowed=False) is None  # a clock
    problem = pairing_problem(result(600, machine=HERE), OTHER_MODEL, allowed=False)
    assert problem is not None and "family 25 model 17" in problem and "family 25 model 1)" in problem
    assert "pair_on_other_cpu=true" in problem
    assert pairing_problem(result(600, machine=HERE), OTHER_MODEL, allowed=True) is None
    # A baseline from before runs recorded their CPU cannot be checked: the report counts it unverified.
    assert pairing_problem(result(600, machine=None), OTHER_MODEL, allowed=False) is None


def protocol_run(tmp_path: Path, steps: int):
    cfg = ProtocolConfig(work_dir=tmp_path, archive=None)
    return run_config(cfg, "rlep-s0", 0, steps, tmp_path / "warm", "unused", {})


def test_train_run_refuses_a_finished_run_of_another_horizon_before_starting_anything(tmp_path):
    run = protocol_run(tmp_path, 600)
    (done := run.checkpoint.dir / "result.json").parent.mkdir(parents=True)
    done.write_text(json.dumps(result(420, plateau_step=420) | {"run_id": "rlep-s0"}))
    with pytest.raises(SystemExit, match="rlep-s0 stopped at its plateau"):
        train_run(run, stack=None, stop_at_plateau=None)
    done.write_text(json.dumps(result(600) | {"run_id": "rlep-s0"}))
    assert train_run(run, stack=None, stop_at_plateau=None)["steps"] == 600  # reused: the stack is never touched


def test_train_run_refuses_an_arm_on_another_cpu_before_starting_anything(tmp_path):
    baseline = result(600, machine=NO_SUCH_CPU)
    with pytest.raises(SystemExit, match="must run on the same CPU"):
        train_run(protocol_run(tmp_path, 600), stack=None, stop_at_plateau=None, pair_with=baseline)


@pytest.mark.parametrize(("cell", "when"), [("rule=rescue", "rescue"), ("rule=band", "band")])
def test_a_replay_rule_cell_trains_rlep_with_its_rule_on_a_pool_of_its_own(tmp_path, cell, when):
    """Issue 48's cells: the rule reaches the run's TrainConfig, and each run gets a copy of the phase-1 pool without
    the histories earlier runs reported into it (`band` reads the pool's history: shared, runs would read each
    other's)."""
    from rlep.experiments.protocol.config import ABLATIONS

    spec = ABLATIONS[cell]
    assert spec["pool"] == "fresh-copy"
    extra = {k: v for k, v in spec.items() if k != "pool"}
    run = run_config(ProtocolConfig(work_dir=tmp_path, archive=None), f"abl-{when}-s0", 0, 200, tmp_path, "p", extra)
    assert run.algorithm.replay_rule.when == when
    assert run.algorithm.replayed_per_question == 2 and run.algorithm.replay_rule.report_outcomes


def test_a_fresh_pool_copy_keeps_every_success_and_drops_the_histories():
    from rlep.common.v1 import trajectory_pb2
    from rlep.experiments.protocol.pool import copy_pool
    from rlep.replay.v1 import replay_pb2

    class Replay:  # the two calls copy_pool makes, over real chunks
        def __init__(self, chunks):
            self.chunks, self.imported = chunks, []

        def export(self, pool):
            return [c for c in self.chunks if c.pool == pool]

        def import_chunks(self, chunks):
            self.imported.extend(chunks)

    def chunk() -> replay_pb2.PoolChunk:
        return replay_pb2.PoolChunk(
            pool="phase1",
            questions=[replay_pb2.Question(question_id="q1")],
            trajectories=[trajectory_pb2.Trajectory(question_id="q1", response_text="2")],
            histories=[replay_pb2.QuestionHistory(question_id="q1", visits=3, window_attempts=[8, 8])],
        )

    fresh = Replay([chunk()])
    copy_pool(fresh, "phase1", "run-pool", histories=False)
    [copied] = fresh.imported
    assert copied.pool == "run-pool" and not copied.histories
    assert [t.question_id for t in copied.trajectories] == ["q1"] and len(copied.questions) == 1
    whole = Replay([chunk()])
    copy_pool(whole, "phase1", "run-pool")  # online replay's copy keeps them
    assert [h.visits for h in whole.imported[0].histories] == [3]
