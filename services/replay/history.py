"""Per-question history of a replay pool, in Redis beside the pool: what each step's fresh responses did.

Key schema (beside `store.py`'s; the `{P}` hash tag keeps a pool's keys in one slot):

    rlep:replay:{P}:hist        HASH  question id -> record (binary: `question_history.RECORD_HEAD`, the window)
    rlep:replay:{P}:hrate       ZSET  "<pass rate as 16 hex digits>:<question id>", every question with history
    rlep:replay:{P}:hnever      ZSET  the same members, questions never solved by the policy's own samples
    rlep:replay:{P}:hmastered   ZSET  the same members, mastered questions
    rlep:replay:{P}:hmeta       HASH  settings (window, alpha, mastered_rate, mastered_visits), counters
                                      (questions, reports, rescues, replayed_rows, never, mastered, run_seq,
                                      b0..b9: questions per pass-rate bucket)
    rlep:replay:{P}:hruns       ZSET  run id, score = order of its last report (the oldest is forgotten)
    rlep:replay:{P}:hrunstep    HASH  run id -> its last recorded step

The three index sets hold every member at score 0, so they sort lexically: the pass rate's IEEE-754 bits in hex
sort as the rates do, a band [lo, hi] is one lexical range, and a page resumes after the last member it returned
(a cursor that stays valid while reports land). Every call costs O(log n + page) in Redis; GetPoolStats reads
`hmeta` alone. The record of a question is bounded: 13 numbers and a window of at most 64 visits.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import redis

from rlep.replay.v1 import replay_pb2
from rlep.services.replay.history_lua import IMPORT_SCRIPT, REPORT_SCRIPT
from rlep.services.replay.question_history import (
    PASS_RATE_BUCKETS,
    HistorySettings,
    Outcome,
    QuestionFilter,
    QuestionQuery,
    QuestionRecord,
    rate_key,
)
from rlep.services.replay.store import ROOT, pool_prefix
from rlep.services.replay.types import PoolNotFound

# An outcome's numbers as the report script reads them (struct '>I4I4dI4B'): attempts, successes, mean reward,
# replayed, rescued.
OUTCOME = struct.Struct(">IIdIB")
# One import Lua call: like adds (store.ADD_CHUNK_ROWS), small calls keep Redis responsive to other clients.
IMPORT_CHUNK = 500
INDEX_KEYS = {
    QuestionFilter.ALL: "hrate",
    QuestionFilter.BAND: "hrate",
    QuestionFilter.NEVER_SOLVED: "hnever",
    QuestionFilter.MASTERED: "hmastered",
}


@dataclass(frozen=True)
class ReportResult:
    recorded: int
    duplicate: bool
    last_step: int


@dataclass(frozen=True)
class HistoryCounters:
    """A pool's history figures, from `hmeta` alone (GetPoolStats)."""

    questions: int = 0
    reports: int = 0
    rescues: int = 0
    replayed_rows: int = 0
    never_solved: int = 0
    mastered: int = 0
    pass_rate_buckets: tuple[int, ...] = (0,) * PASS_RATE_BUCKETS
    settings: HistorySettings | None = None  # None before the pool's first report or import


@dataclass(frozen=True)
class Page:
    records: list[QuestionRecord]
    next_cursor: str
    matching: int
    settings: HistorySettings | None = None


def _settings(meta: dict[str, str]) -> HistorySettings | None:
    if "window" not in meta:
        return None
    return HistorySettings(
        int(meta["window"]), float(meta["alpha"]), float(meta["mastered_rate"]), int(meta["mastered_visits"])
    )


class HistoryStore:
    """Per-question history of every pool in one Redis. Thread-safe (redis-py's connection pool)."""

    def __init__(self, client: redis.Redis, settings: HistorySettings, max_runs: int):
        self.client = client
        self.settings = settings
        self.max_runs = max_runs
        self._report = client.register_script(REPORT_SCRIPT)
        self._import = client.register_script(IMPORT_SCRIPT)

    def _head(self, pool: str) -> list:
        s = self.settings
        return [pool_prefix(pool), f"{ROOT}:pools", pool, s.window, repr(s.ema_alpha), repr(s.mastered_pass_rate)] + [
            s.mastered_min_visits
        ]

    def report(
        self,
        pool: str,
        run_id: str,
        step: int,
        policy_version: int,
        outcomes: Sequence[Outcome],
        questions: Sequence[replay_pb2.Question] = (),
    ) -> ReportResult:
        """Records one step's outcomes in one atomic call; a step at or below the run's last is a duplicate.

        Raises PoolNotFound for a pool that does not exist (a report does not create one).
        """
        args: list = [*self._head(pool), run_id, step, policy_version, self.max_runs, len(questions)]
        for question in questions:
            args += [question.question_id, question.SerializeToString()]
        pack = OUTCOME.pack
        args.append(b"".join(pack(o.attempts, o.successes, o.mean_reward, o.replayed, o.rescued) for o in outcomes))
        args += [o.question_id for o in outcomes]
        reply = self._report(args=args)
        if reply[0] == -1:
            raise PoolNotFound(pool)
        return ReportResult(int(reply[0]), bool(reply[1]), int(float(reply[2])))

    def import_records(self, pool: str, records: Sequence[QuestionRecord]) -> tuple[int, int]:
        """Stores records where the pool has no history for the question; (imported, kept as they were)."""
        imported = kept = 0
        for start in range(0, len(records), IMPORT_CHUNK):
            args = self._head(pool)
            for record in records[start : start + IMPORT_CHUNK]:
                args += [record.question_id, record.encode()]
            reply = self._import(args=args)
            if reply[0] == -1:
                raise PoolNotFound(pool)
            imported, kept = imported + int(reply[0]), kept + int(reply[1])
        return imported, kept

    def records(self, pool: str, question_ids: Sequence[str]) -> list[QuestionRecord | None]:
        """The named questions' records (None where a question has no history), in order."""
        if not question_ids:
            return []
        texts = self.client.hmget(f"{pool_prefix(pool)}:hist", list(question_ids))
        return [QuestionRecord.decode(q, t) if t else None for q, t in zip(question_ids, texts, strict=True)]

    def meta(self, pool: str) -> tuple[HistoryCounters, bool]:
        """The pool's history counters, and whether the pool exists, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.sismember(f"{ROOT}:pools", pool)
        pipe.hgetall(f"{pool_prefix(pool)}:hmeta")
        exists, raw = pipe.execute()
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        count = lambda name: int(meta.get(name, 0))  # noqa: E731
        counters = HistoryCounters(
            questions=count("questions"),
            reports=count("reports"),
            rescues=count("rescues"),
            replayed_rows=count("replayed_rows"),
            never_solved=count("never"),
            mastered=count("mastered"),
            pass_rate_buckets=tuple(count(f"b{b}") for b in range(PASS_RATE_BUCKETS)),
            settings=_settings(meta),
        )
        return counters, bool(exists)

    def counters(self, pool: str) -> HistoryCounters:
        counters, exists = self.meta(pool)
        if not exists:
            raise PoolNotFound(pool)
        return counters

    def page(self, pool: str, query: QuestionQuery) -> Page:
        """One page of the questions `query.filter` matches, by pass rate then id (O(log n + limit))."""
        counters = self.counters(pool)
        key = f"{pool_prefix(pool)}:{INDEX_KEYS[query.filter]}"
        low, high = "-", "+"
        if query.filter == QuestionFilter.BAND:
            # Members are "<rate>:<qid>"; ';' sorts right after ':', so "(<hi>;" ends the band after every id.
            low, high = f"[{rate_key(query.min_pass_rate)}", f"({rate_key(query.max_pass_rate)};"
        start = f"({query.cursor}" if query.cursor else low
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebylex(key, start, high, start=0, num=query.limit + 1)
        pipe.zlexcount(key, low, high)
        members, matching = pipe.execute()
        more = len(members) > query.limit
        members = [m.decode() for m in members[: query.limit]]
        qids = [m.split(":", 1)[1] for m in members]
        records = [r for r in self.records(pool, qids) if r is not None]  # one that vanished meanwhile: left out
        return Page(records, members[-1] if more else "", int(matching), counters.settings)

    def named(self, pool: str, question_ids: Sequence[str]) -> Page:
        counters = self.counters(pool)
        records = [r for r in self.records(pool, question_ids) if r is not None]
        return Page(records, "", len(records), counters.settings)

    def iter_history_only(self, pool: str, batch: int) -> Iterator[tuple[list[bytes | None], list[QuestionRecord]]]:
        """Questions with history but no success, in batches: (their stored Question protos or None, records).

        Pages the pass-rate index by lexical range, so questions reported meanwhile may or may not be included.
        """
        prefix = pool_prefix(pool)
        start = "-"
        while True:
            members = self.client.zrangebylex(f"{prefix}:hrate", start, "+", start=0, num=batch)
            if not members:
                return
            start = b"(" + members[-1]
            qids = [m.decode().split(":", 1)[1] for m in members]
            held = self.client.smismember(f"{prefix}:questions", qids)
            alone = [q for q, h in zip(qids, held, strict=True) if not h]
            if alone:
                metas = self.client.hmget(f"{prefix}:qmeta", alone)
                records = self.records(pool, alone)
                kept = [(m, r) for m, r in zip(metas, records, strict=True) if r is not None]
                yield [m for m, _ in kept], [r for _, r in kept]
