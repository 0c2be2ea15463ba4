"""The start-up line of `rlep train` on the learner's and the replicas' dtypes (issue 32, item 7)."""

from __future__ import annotations

import logging

from rlep.services.launch.training import dtypes_line


def test_a_bfloat16_replica_beside_a_float32_learner_is_a_warning_naming_the_fix():
    level, line = dtypes_line("float32", {"bfloat16"})
    assert level == logging.WARNING
    assert line.startswith("dtypes: the learner trains in float32, the rollout replicas sample in bfloat16: ")
    assert "train/inference mismatch" in line and "local.rollout_engine.dtype=float32" in line


def test_matching_or_unknown_dtypes_are_one_info_line():
    assert dtypes_line("bfloat16", {"bfloat16"})[0] == logging.INFO
    level, line = dtypes_line("float32", {""})  # replicas older than the dtype field
    assert level == logging.INFO and line.endswith("sample in unknown")
