"""Evaluation jobs in Redis: the source of truth, shared by every eval replica and surviving their restarts.

Keys under the configured prefix P (default `rlep:eval:`):
- `P job:<id>`    hash: status, request / progress / results / policy_versions (JSON), created_at,
                  started_at, finished_at, error, attempt
- `P jobs`        sorted set of job ids by creation time (listing)
- `P queue`       list of queued job ids; a worker claims from the right end
- `P state:<s>`   set of job ids per status (the `rlep_eval_jobs{state}` gauge)
- `P lease:<id>`  the running attempt's token, with a TTL its worker keeps renewing
- `P samples:<id>` list of the job's responses as scored (EvalSample JSON without prompt and ground truth,
                  eval/samples.py), the first max_stored_samples; emptied when an attempt starts (a requeued
                  job starts over)
- `P questions:<id>` hash: each question's prompt and ground truth, once per job, by `question_key`

Every status change is one Lua script, so a job is always in exactly one state set. Writes by a worker
(progress and samples) are fenced by its attempt token: once a job is cancelled, requeued or declared dead,
the old worker's writes are refused and it stops. A running job whose lease expired (its service died) is
marked failed by any replica's reaper, with the reason.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence

import redis
from pydantic import ValidationError

from rlep.services.eval.api import (
    DatasetRequest,
    DatasetResult,
    EvaluationJob,
    EvaluationRequest,
    JobStatus,
    Progress,
    SamplePage,
)
from rlep.services.eval.samples import PageFill, QuestionSamples, dataset_ranges, page_spans, question_key

_TRANSITION = """
local p, id, attempt, from, to = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local job = p .. 'job:' .. id
local status = redis.call('HGET', job, 'status')
if not status then return {0, ''} end
if not string.find(',' .. from .. ',', ',' .. status .. ',', 1, true) then return {0, status} end
if attempt ~= '' and redis.call('HGET', job, 'attempt') ~= attempt then return {0, status} end
for i = 6, #ARGV, 2 do redis.call('HSET', job, ARGV[i], ARGV[i + 1]) end
if to ~= '' and to ~= status then
  redis.call('SMOVE', p .. 'state:' .. status, p .. 'state:' .. to, id)
  redis.call('HSET', job, 'status', to)
  if status == 'queued' then redis.call('LREM', p .. 'queue', 0, id) end
  if status == 'running' then redis.call('DEL', p .. 'lease:' .. id) end
  if to == 'queued' then redis.call('HDEL', job, 'attempt'); redis.call('RPUSH', p .. 'queue', id) end
end
return {1, status}
"""

_CLAIM = """
local p, attempt, now, lease_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
while true do
  local id = redis.call('RPOP', p .. 'queue')
  if not id then return false end
  local job = p .. 'job:' .. id
  if redis.call('HGET', job, 'status') == 'queued' then
    redis.call('HSET', job, 'status', 'running', 'attempt', attempt, 'started_at', now)
    redis.call('HDEL', job, 'samples_dropped')
    redis.call('DEL', p .. 'samples:' .. id, p .. 'questions:' .. id)
    redis.call('SMOVE', p .. 'state:queued', p .. 'state:running', id)
    redis.call('SET', p .. 'lease:' .. id, attempt, 'PX', lease_ms)
    return id
  end
end
"""

# A running attempt's progress fields and dropped-sample count, question records, then samples appended to the
# job's list.
_SAVE = """
local p, id, attempt, dropped = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local nfields, nquestions = tonumber(ARGV[5]), tonumber(ARGV[6])
local job = p .. 'job:' .. id
if redis.call('HGET', job, 'status') ~= 'running' or redis.call('HGET', job, 'attempt') ~= attempt then return 0 end
local questions = 7 + 2 * nfields
local rows = questions + 2 * nquestions
for i = 7, questions - 1, 2 do redis.call('HSET', job, ARGV[i], ARGV[i + 1]) end
if dropped > 0 then redis.call('HINCRBY', job, 'samples_dropped', dropped) end
for i = questions, rows - 1, 2 do redis.call('HSET', p .. 'questions:' .. id, ARGV[i], ARGV[i + 1]) end
for i = rows, #ARGV do redis.call('RPUSH', p .. 'samples:' .. id, ARGV[i]) end
return 1
"""

# Samples go to Redis in calls of about this many bytes (a chunk of questions x n can hold far more).
SAMPLE_CALL_BYTES = 4 << 20
# Rows read per LRANGE of a samples page (a row is at most ~200 KB: two 16 KiB texts of 6-byte escapes).
READ_BATCH_ROWS = 16

_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

_REAP = """
local p, id, reason, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local job = p .. 'job:' .. id
if redis.call('HGET', job, 'status') ~= 'running' or redis.call('EXISTS', p .. 'lease:' .. id) == 1 then
  return 0
end
redis.call('HSET', job, 'status', 'failed', 'error', reason, 'finished_at', now)
redis.call('HDEL', job, 'attempt')
redis.call('SMOVE', p .. 'state:running', p .. 'state:failed', id)
return 1
"""


def new_attempt() -> str:
    return uuid.uuid4().hex


class JobStore:
    def __init__(self, client: redis.Redis, prefix: str):
        self._redis = client
        self._prefix = prefix
        self._transition = client.register_script(_TRANSITION)
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._save = client.register_script(_SAVE)
        self._reap = client.register_script(_REAP)

    @classmethod
    def from_url(cls, url: str, prefix: str, timeout_s: float) -> JobStore:
        client = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        return cls(client, prefix)

    def ping(self) -> None:
        self._redis.ping()

    def close(self) -> None:
        self._redis.close()

    def _key(self, *parts: str) -> str:
        return self._prefix + ":".join(parts)

    # -- reading ---------------------------------------------------------------------------------
    def get(self, job_id: str) -> EvaluationJob | None:
        fields = self._redis.hgetall(self._key("job", job_id))
        return _job_from_hash(job_id, fields) if fields else None

    def list(self, limit: int, status: JobStatus | None = None) -> list[EvaluationJob]:
        """Newest first. With a status filter, the newest `limit` jobs in that state."""
        if status is not None:
            ids = self._redis.smembers(self._key("state", status))
            created = self._redis.zmscore(self._key("jobs"), list(ids)) if ids else []
            ranked = sorted(zip(ids, created, strict=True), key=lambda pair: -(pair[1] or 0))
            ids = [job_id for job_id, _ in ranked[:limit]]
        else:
            ids = self._redis.zrevrange(self._key("jobs"), 0, limit - 1)
        with self._redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(self._key("job", job_id))
            rows = pipe.execute()
        return [_job_from_hash(job_id, fields) for job_id, fields in zip(ids, rows, strict=True) if fields]

    def count(self, status: JobStatus) -> int:
        return self._redis.scard(self._key("state", status))

    def samples(
        self, job_id: str, offset: int, limit: int, max_bytes: int, dataset: str | None = None
    ) -> SamplePage | None:
        """Stored responses `offset` .. `offset + limit - 1` of a job (of one dataset), fewer if they would make a
        page of more than `max_bytes` of JSON (at least one); None for an unknown job."""
        key = self._key("samples", job_id)
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.hmget(self._key("job", job_id), ["status", "results", "samples_dropped"])
            pipe.llen(key)
            (status, results, dropped), stored = pipe.execute()
        if status is None:
            return None
        ranges = [(0, stored)] if dataset is None else dataset_ranges(json.loads(results or "[]"), stored, dataset)
        page = PageFill(max_bytes)
        questions: dict[str, str | None] = {}
        for rows in self._read_rows(key, page_spans(ranges, offset, limit)):
            records = [json.loads(row) for row in rows]
            keys = {question_key(r["dataset"], r["question"]) for r in records if "prompt" not in r}
            wanted = list(keys - questions.keys())
            if wanted:
                questions |= zip(wanted, self._redis.hmget(self._key("questions", job_id), wanted), strict=True)
            ended = False
            for row, record in zip(rows, records, strict=True):
                question = None
                if "prompt" not in record:  # a row stored before prompts were kept once per question holds its own
                    question = questions[question_key(record["dataset"], record["question"])]
                    # Written with the row; gone only if the job started over since the row was read (a claim
                    # deletes both): that attempt's samples are gone, so the page ends here.
                    ended = question is None
                if ended or not page.add(row, record, question):
                    break
            if ended or page.full:
                break
        total = sum(end - start for start, end in ranges)
        after = offset + len(page.samples)
        return SamplePage(
            job_id=job_id,
            total=total,
            offset=offset,
            samples=page.samples,
            samples_dropped=int(dropped or 0),
            next_offset=after if after < total else None,
            cut_at_bytes=page.full,
        )

    def _read_rows(self, key: str, spans: Iterable[tuple[int, int]]) -> Iterator[list[str]]:
        """The rows of `spans`, READ_BATCH_ROWS at a time: a page stops reading once it is full, so a page of large
        samples costs at most one batch more than it returns."""
        for start, end in spans:
            for first in range(start, end, READ_BATCH_ROWS):
                rows = self._redis.lrange(key, first, min(end, first + READ_BATCH_ROWS) - 1)
                if not rows:
                    return
                yield rows

    # -- writing ---------------------------------------------------------------------------------
    def create(self, request: EvaluationRequest, progress: Progress) -> EvaluationJob:
        job = EvaluationJob(
            id=uuid.uuid4().hex, status=JobStatus.QUEUED, request=request, created_at=time.time(), progress=progress
        )
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                self._key("job", job.id),
                mapping={
                    "status": job.status,
                    "request": request.model_dump_json(),
                    "progress": progress.model_dump_json(),
                    "created_at": repr(job.created_at),
                },
            )
            pipe.zadd(self._key("jobs"), {job.id: job.created_at})
            pipe.sadd(self._key("state", job.status), job.id)
            pipe.lpush(self._key("queue"), job.id)
            pipe.execute()
        return job

    def claim(self, attempt: str, lease_s: float) -> str | None:
        """Takes the oldest queued job and marks it running under `attempt`; None when the queue is empty."""
        return self._claim(args=[self._prefix, attempt, repr(time.time()), int(lease_s * 1000)])

    def _move(
        self, job_id: str, attempt: str, allowed: Iterable[JobStatus], to: str, **fields: str
    ) -> tuple[bool, str]:
        pairs = [item for pair in fields.items() for item in pair]
        applied, before = self._transition(
            args=[self._prefix, job_id, attempt, ",".join(allowed), to, *pairs]  # type: ignore[list-item]
        )
        return bool(applied), before

    def save_progress(
        self,
        job_id: str,
        attempt: str,
        progress: Progress,
        results: list[DatasetResult],
        policy_versions: list[int],
        samples: Sequence[QuestionSamples] = (),
        dropped: int = 0,
    ) -> bool:
        """Records progress, appends `samples` to the job's (their questions' records first) and counts `dropped`
        ones (scored, not stored); False when the job is no longer this attempt's (cancelled, requeued, reaped)."""
        fields = {
            "progress": progress.model_dump_json(),
            "results": json.dumps([r.model_dump(mode="json") for r in results]),
            "policy_versions": json.dumps(policy_versions),
        }
        calls = _byte_batches(samples, SAMPLE_CALL_BYTES)
        for number, (questions, rows) in enumerate(calls, 1):
            last = number == len(calls)  # the progress goes with the chunk's last samples
            pairs = [item for pair in fields.items() for item in pair] if last else []
            head = [self._prefix, job_id, attempt, dropped if last else 0, len(pairs) // 2, len(questions) // 2]
            if not self._save(args=[*head, *pairs, *questions, *rows]):
                return False
        return True

    def finish(self, job_id: str, attempt: str, status: JobStatus, error: str | None = None) -> bool:
        """Ends a running job (succeeded or failed) unless it is no longer this attempt's."""
        fields = {"finished_at": repr(time.time())}
        if error is not None:
            fields["error"] = error
        applied, _ = self._move(job_id, attempt, [JobStatus.RUNNING], status, **fields)
        return applied

    def cancel(self, job_id: str) -> tuple[bool, str]:
        """Cancels a queued or running job. Returns (applied, status before; "" for an unknown job)."""
        return self._move(
            job_id,
            "",
            [JobStatus.QUEUED, JobStatus.RUNNING],
            JobStatus.CANCELLED,
            finished_at=repr(time.time()),
            error="cancelled by request",
        )

    def requeue(self, job_id: str, attempt: str) -> bool:
        """Puts a running job back at the head of the queue, to start over (its service is shutting down)."""
        applied, _ = self._move(job_id, attempt, [JobStatus.RUNNING], JobStatus.QUEUED, started_at="")
        return applied

    def renew_lease(self, job_id: str, attempt: str, lease_s: float) -> bool:
        return bool(self._renew(keys=[self._key("lease", job_id)], args=[attempt, int(lease_s * 1000)]))

    def reap_expired(self, reason: str) -> list[str]:
        """Marks failed every running job whose lease has expired; returns their ids."""
        now = repr(time.time())
        running = self._redis.smembers(self._key("state", JobStatus.RUNNING))
        return [job_id for job_id in running if self._reap(args=[self._prefix, job_id, reason, now])]


def _byte_batches(records: Sequence[QuestionSamples], limit: int) -> list[tuple[list[str], list[str]]]:
    """The rows of `records` in order, in batches of about `limit` bytes (at least one row each), each with the
    (key, record) pairs of the questions whose first row it holds; one empty batch for none."""
    batches: list[tuple[list[str], list[str]]] = [([], [])]
    size = 0
    for record in records:
        for number, row in enumerate(record.rows):
            if batches[-1][1] and size + len(row) > limit:
                batches.append(([], []))
                size = 0
            if number == 0:
                batches[-1][0].extend((record.key, record.question))
                size += len(record.question)
            batches[-1][1].append(row)
            size += len(row)
    return batches


def _float_or_none(text: str | None) -> float | None:
    return float(text) if text else None


def _stored_request(text: str) -> EvaluationRequest:
    """A job's request as stored. Jobs outlive upgrades: one accepted under looser rules than today's (e.g. a
    temperature vLLM refuses) is still shown as it was, not turned into a 500 for every listing."""
    try:
        return EvaluationRequest.model_validate_json(text)
    except ValidationError:
        data = json.loads(text)
        datasets = [DatasetRequest.model_validate(d) for d in data.pop("datasets")]
        return EvaluationRequest.model_construct(**data, datasets=datasets)


def _job_from_hash(job_id: str, fields: dict[str, str]) -> EvaluationJob:
    return EvaluationJob(
        id=job_id,
        status=JobStatus(fields["status"]),
        request=_stored_request(fields["request"]),
        created_at=float(fields["created_at"]),
        started_at=_float_or_none(fields.get("started_at")),
        finished_at=_float_or_none(fields.get("finished_at")),
        error=fields.get("error") or None,
        progress=Progress.model_validate_json(fields.get("progress") or "{}"),
        policy_versions=json.loads(fields.get("policy_versions") or "[]"),
        results=[DatasetResult.model_validate(r) for r in json.loads(fields.get("results") or "[]")],
        samples_dropped=int(fields.get("samples_dropped") or 0),
    )
