"""Seeding a run's replay pool from the training file itself (RLEP's released format).

RLEP ships `dapo-math-17k-with-experience-pool.parquet`: the DAPO-17k rows with each question's
verified successes in `reward_model.candidates`. `rlep train` on such a file imports them into
`replay_pool` before the first step, through the same path as `rlep pool import`. Adds are idempotent
(a trajectory's id hashes its question and text), so a restart or a resumed run re-imports nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def has_candidates(path: Path) -> bool:
    """True when a verl parquet file carries `reward_model.candidates`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if "reward_model" not in schema.names:
        return False
    reward_model = schema.field("reward_model").type
    return pa.types.is_struct(reward_model) and reward_model.get_field_index("candidates") >= 0


def seed_pool_from_candidates(replay, pool: str, paths: Sequence[Path]) -> int:
    """Imports the candidates of every file in `paths` that has them; returns the trajectories newly added."""
    from rlep.common.pool_parquet import read_pool_rows

    added = 0
    for path in paths:
        if not has_candidates(path):
            continue
        reply = replay.import_chunks(read_pool_rows(path, pool))
        added += reply.added
        # The normal start of such a run; a warning only when rows were refused.
        log.log(
            logging.WARNING if reply.rejected else logging.INFO,
            "replay pool %r seeded from %s: %d added, %d already there, %d rejected",
            pool,
            Path(path).name,
            reply.added,
            reply.duplicate,
            reply.rejected,
        )
    return added
