"""Generation ahead of training (`algorithm.max_staleness` = k >= 1): the next k steps' fresh groups are generated
and scored on one background thread while the current step trains.

`GatherAhead.take(step)` returns step `step`'s `Gathered` (waiting for it if it is not done) after queueing the
gathers of the steps up to `step + k`. They run one after another on a single thread (one generation at a time,
as in a synchronous run), so the gather of step s + j starts no earlier than step s takes its data, when the
replicas serve the weights step s trains. Step s + j trains j versions later: its samples are at most j <= k
versions stale. `fresh_staleness` measures it per sample from the versions the replicas stamped, and
`drop_stale_groups` enforces the bound for what the construction cannot promise (a replica that rejoined on
old weights mid-gather).

Synchronous runs (k = 0) never create a `GatherAhead`: their steps gather after the previous push, as before.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from rlep.common.types import Trajectory
from rlep.services.learner.step_inputs import Gathered, StepInputs, StepTimer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Staleness:
    """Versions between the weights that generated each fresh sample and the weights that train on it."""

    max: int
    mean: float


def fresh_staleness(fresh: list[list[Trajectory]], trained_version: int) -> Staleness:
    """Staleness of a step's fresh samples when the learner's weights are `trained_version`."""
    gaps = [trained_version - t.policy_version for group in fresh for t in group]
    if not gaps:
        return Staleness(0, 0.0)
    return Staleness(max(gaps), sum(gaps) / len(gaps))


def drop_stale_groups(gathered: Gathered, trained_version: int, max_staleness: int) -> int:
    """Leaves out (in place) every group with a sample staler than `max_staleness`; returns how many."""
    keep = [
        i
        for i, group in enumerate(gathered.fresh)
        if all(trained_version - t.policy_version <= max_staleness for t in group)
    ]
    dropped = len(gathered.fresh) - len(keep)
    if dropped:
        gathered.questions = [gathered.questions[i] for i in keep]
        gathered.prompts = [gathered.prompts[i] for i in keep]
        gathered.fresh = [gathered.fresh[i] for i in keep]
    return dropped


class GatherAhead:
    """Runs `StepInputs.gather` for the next steps on one background thread (see the module docstring)."""

    def __init__(self, inputs: StepInputs, max_staleness: int, last_step: int):
        if max_staleness < 1:
            raise ValueError("GatherAhead needs max_staleness >= 1 (0 is the synchronous step)")
        self._inputs, self._depth, self._last_step = inputs, max_staleness, last_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlep-gather-ahead")
        self._pending: deque[tuple[int, Future[tuple[Gathered, StepTimer]]]] = deque()

    def _gather(self, step: int) -> tuple[Gathered, StepTimer]:
        timer = StepTimer()
        return self._inputs.gather(step, timer), timer

    def take(self, step: int, timer: StepTimer) -> tuple[Gathered, StepTimer]:
        """Step `step`'s gathered groups and the timer of their generation; the wait is `timer`'s rollout_wait."""
        if self._pending and self._pending[0][0] != step:
            # Steps are taken in order; anything else (a restart of the loop) starts the queue over.
            self.discard()
        next_step = self._pending[-1][0] + 1 if self._pending else step
        while next_step <= min(step + self._depth, self._last_step - 1):
            self._pending.append((next_step, self._pool.submit(self._gather, next_step)))
            next_step += 1
        _, future = self._pending.popleft()
        with timer.phase("rollout_wait"):
            return future.result()

    def discard(self) -> None:
        """Forgets every queued gather (one already running finishes first: the cursor is not shared mid-draw)."""
        while self._pending:
            _, future = self._pending.pop()
            if not future.cancel():
                future.exception()  # wait for it; its result is not used
        log.debug("gather-ahead queue discarded")

    def close(self) -> None:
        self.discard()
        self._pool.shutdown(wait=True)
