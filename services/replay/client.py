"""Typed client of the replay service, used by the learner, `rlep collect` and `rlep pool`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import grpc
from google.protobuf.message import DecodeError

from rlep.common.grpc_channel import make_channel
from rlep.common.grpc_retry import call_with_retry
from rlep.common.types import Trajectory
from rlep.common.v1 import trajectory_pb2
from rlep.common.wire import trajectory_from_proto, trajectory_to_proto
from rlep.replay.v1 import replay_pb2, replay_pb2_grpc
from rlep.services.replay.sampling import Strategy
from rlep.services.replay.types import PoolNotFound

# One step's Sample is ~1 MB and milliseconds; adds and stats on a big pool take longer.
DEFAULT_TIMEOUT_S = 60.0
# A whole export or import of a big pool takes minutes; the deadline only ends a stream whose server went silent
# (half open) instead of waiting forever. The server ends streams at its own bound (`stream_max_duration_s`, 4 h).
DEFAULT_STREAM_TIMEOUT_S = 4 * 3600.0
STRATEGY_TO_PROTO = {
    Strategy.UNIFORM: replay_pb2.UNIFORM,
    Strategy.RECENCY: replay_pb2.RECENCY,
    Strategy.PRIORITIZED: replay_pb2.PRIORITIZED,
    Strategy.DIVERSE: replay_pb2.DIVERSE,
}


def sampled_trajectories(sample: replay_pb2.QuestionSample) -> list[Trajectory]:
    """A QuestionSample's trajectories, from `trajectory_bytes` or, from a server that predates it, `trajectories`.

    Raises ValueError naming the question when an entry does not parse as a valid trajectory.
    """
    if not sample.trajectory_bytes:
        return [trajectory_from_proto(t) for t in sample.trajectories]
    try:
        return [trajectory_from_proto(trajectory_pb2.Trajectory.FromString(b)) for b in sample.trajectory_bytes]
    except (DecodeError, ValueError) as err:
        raise ValueError(f"replay returned an invalid trajectory for question {sample.question_id!r}: {err}") from err


class ReplayClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        outage_s: float = 0.0,
        stream_timeout_s: float = DEFAULT_STREAM_TIMEOUT_S,
    ):
        """`timeout_s`: the deadline of each unary call; `stream_timeout_s`: of a whole export or import;
        `outage_s`: how long a call keeps retrying a server that does not answer (call_with_retry)."""
        self._channel = make_channel(address, token)
        self.stub = replay_pb2_grpc.ReplayBufferStub(self._channel)
        self._timeout_s = timeout_s
        self._stream_timeout_s = stream_timeout_s
        self._outage_s = outage_s

    def _call(self, method, request):
        return call_with_retry(method, request, self._timeout_s, outage_s=self._outage_s)

    def add(
        self, pool: str, trajectories: Sequence[Trajectory], questions: Sequence[replay_pb2.Question] = ()
    ) -> replay_pb2.AddTrajectoriesResponse:
        request = replay_pb2.AddTrajectoriesRequest(
            pool=pool, trajectories=[trajectory_to_proto(t) for t in trajectories], questions=questions
        )
        return self._call(self.stub.AddTrajectories, request)  # idempotent: safe to retry

    def sample(
        self,
        pool: str,
        question_ids: Sequence[str],
        m: int,
        strategy: Strategy = Strategy.UNIFORM,
        seed: int = 0,
        min_policy_version: int = 0,
    ) -> dict[str, list[Trajectory]]:
        """Up to `m` stored successes per question id (fewer, or none, where the pool holds fewer).

        Raises PoolNotFound when the pool does not exist (the server answered NOT_FOUND).
        """
        request = replay_pb2.SampleRequest(
            pool=pool,
            question_ids=question_ids,
            m=m,
            seed=seed,
            strategy=STRATEGY_TO_PROTO[strategy],
            min_policy_version=min_policy_version,
            trajectories_as_bytes=True,
        )
        reply = self._not_found_as_pool_not_found(pool, self.stub.Sample, request)
        return {s.question_id: sampled_trajectories(s) for s in reply.samples}

    def report_outcomes(
        self,
        pool: str,
        run_id: str,
        step: int,
        policy_version: int,
        outcomes: Sequence[replay_pb2.QuestionOutcome],
        questions: Sequence[replay_pb2.Question] = (),
    ) -> replay_pb2.ReportOutcomesResponse:
        """Records one step's fresh outcome per question (one call per step, every question of it).

        Safe to retry: a step at or below the run's last recorded one changes nothing and answers `duplicate`.
        Raises PoolNotFound when the pool does not exist (a report does not create one).
        """
        request = replay_pb2.ReportOutcomesRequest(
            pool=pool, run_id=run_id, step=step, policy_version=policy_version, outcomes=outcomes, questions=questions
        )
        return self._not_found_as_pool_not_found(pool, self.stub.ReportOutcomes, request)

    def update_priorities(
        self, pool: str, updates: Sequence[tuple[str, str, float]], per_call: int = 4096
    ) -> tuple[int, int]:
        """Sets stored successes' priorities: (question id, trajectory id or "" for all, priority > 0). Calls of
        at most `per_call` updates (the server bounds a call); returns (updated, missing) over all. Safe to retry.
        Raises PoolNotFound when the pool does not exist."""
        updated = missing = 0
        for start in range(0, len(updates), per_call):
            request = replay_pb2.UpdatePrioritiesRequest(
                pool=pool,
                updates=[
                    replay_pb2.PriorityUpdate(question_id=q, trajectory_id=t, priority=p)
                    for q, t, p in updates[start : start + per_call]
                ],
            )
            reply = self._not_found_as_pool_not_found(pool, self.stub.UpdatePriorities, request)
            updated, missing = updated + reply.updated, missing + reply.missing
        return updated, missing

    def question_stats(
        self,
        pool: str,
        question_ids: Sequence[str] = (),
        filter: int = replay_pb2.QUESTION_FILTER_UNSPECIFIED,
        min_pass_rate: float = 0.0,
        max_pass_rate: float = 0.0,
        limit: int = 0,
        cursor: str = "",
    ) -> replay_pb2.GetQuestionStatsResponse:
        """Histories of the named questions, or one page of those `filter` matches (a `replay_pb2.QuestionFilter`;
        PASS_RATE_BAND takes [min_pass_rate, max_pass_rate]); pass `next_cursor` back for the next page."""
        request = replay_pb2.GetQuestionStatsRequest(
            pool=pool,
            question_ids=question_ids,
            filter=filter,
            min_pass_rate=min_pass_rate,
            max_pass_rate=max_pass_rate,
            limit=limit,
            cursor=cursor,
        )
        return self._not_found_as_pool_not_found(pool, self.stub.GetQuestionStats, request)

    def _not_found_as_pool_not_found(self, pool: str, method, request):
        try:
            return self._call(method, request)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                raise PoolNotFound(pool) from err
            raise

    def stats(self, pool: str) -> replay_pb2.PoolStats:
        return self._call(self.stub.GetPoolStats, replay_pb2.GetPoolStatsRequest(pool=pool))

    def list_pools(self) -> list[str]:
        return list(self._call(self.stub.ListPools, replay_pb2.ListPoolsRequest()).pools)

    def drop(self, pool: str, confirm: str) -> int:
        request = replay_pb2.DropPoolRequest(pool=pool, confirm=confirm)
        return self.stub.DropPool(request, timeout=self._timeout_s).deleted_trajectories

    def export(self, pool: str, questions_per_chunk: int = 256) -> Iterator[replay_pb2.PoolChunk]:
        request = replay_pb2.ExportPoolRequest(pool=pool, questions_per_chunk=questions_per_chunk)
        yield from self.stub.ExportPool(request, timeout=self._stream_timeout_s)

    def import_chunks(self, chunks: Iterable[replay_pb2.PoolChunk]) -> replay_pb2.AddTrajectoriesResponse:
        return self.stub.ImportPool(iter(chunks), timeout=self._stream_timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ReplayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
