"""The REST contract of the eval service: request and response bodies (they become the OpenAPI schema)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlep.common.types import Verdict
from rlep.services.eval.inputs import CURRENT_POLICY
from rlep.services.rollout.types import MAX_TEMPERATURE, greedy_problem

_STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True)

# vLLM's bounds (MAX_TEMPERATURE, GREEDY_BELOW and this one) are checked here so that a request vLLM would refuse
# is refused at submission with the reason, never sent to the rollout deployment.
VLLM_MAX_N = 16384


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


class DatasetRequest(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=4096, examples=["amc23", "/data/my_eval.jsonl"])
    """A built-in set (aime24, aime25, amc23, math500, gsm8k) or the path, on the eval server, of a .jsonl file
    (problem, answer) or a verl .parquet file (prompt, reward_model.ground_truth)."""
    limit: int | None = Field(None, ge=1)
    """Evaluate only the first `limit` questions."""


class EvaluationRequest(BaseModel):
    model_config = _STRICT

    model: str = Field(min_length=1, max_length=4096, examples=[CURRENT_POLICY, "/ckpt/step_200"])
    """"current" (the policy the rollout deployment serves now) or the path, on the eval server, of a checkpoint:
    an HF directory with *.safetensors or one .safetensors file, pushed to eval's own rollout deployment."""
    datasets: list[DatasetRequest] = Field(min_length=1)
    """Evaluated in this order."""
    n: int = Field(1, ge=1, le=VLLM_MAX_N)
    """Samples per question (at most the server's limits.max_n)."""
    temperature: float = Field(0.6, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    """Sampling temperature in [0, 2]. 0 (anything below 1e-5) decodes greedily: every sample would be the same
    response, so it takes n = 1."""
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p, in (0, 1] (1 = off)."""
    max_tokens: int = Field(1024, ge=1)
    """New tokens per sample (at most the server's limits.max_tokens); prompt + max_tokens must fit the model."""
    seed: int | None = Field(0, ge=0, le=2**63 - 1)
    """Sampling seed (reproducible results); null for fresh randomness."""

    @model_validator(mode="after")
    def _greedy_takes_one_sample(self) -> EvaluationRequest:
        if problem := greedy_problem(self.n, self.temperature):
            raise ValueError(problem)
        return self


class Progress(BaseModel):
    questions_done: int = 0
    questions_total: int = 0
    samples_done: int = 0
    current_dataset: str | None = None
    """The dataset being evaluated now (null when none is)."""


class DatasetResult(BaseModel):
    """Figures over the questions scored so far (all of them once the job succeeded)."""

    dataset: str
    questions_total: int
    """Questions this job evaluates from the dataset."""
    questions: int
    """Questions scored so far."""
    samples: int
    avg_at_n: float | None
    """Mean accuracy over all samples; null until a question is scored."""
    maj_at_n: float | None
    """Share of questions whose majority answer is correct."""
    pass_at_n: float | None
    """Share of questions with at least one correct sample."""
    mean_response_tokens: float | None
    correct: int
    majority_correct: int
    any_correct: int
    response_tokens: int
    unparseable: int
    """Samples whose answer could not be found or parsed (verdict `unparseable`)."""
    truncated: int
    """Samples stopped by max_tokens."""
    verdicts: dict[str, int]
    """Samples per verifier verdict (correct, wrong, unparseable, timeout, gold_unparseable, error)."""


class EvaluationJob(BaseModel):
    id: str
    status: JobStatus
    request: EvaluationRequest
    created_at: float
    """Unix time, seconds."""
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    """Why the job failed (or was cancelled)."""
    progress: Progress
    policy_versions: list[int] = []
    """Policy versions that produced the samples (a checkpoint: the version it was pushed as)."""
    results: list[DatasetResult] = []
    """One entry per dataset begun, in request order."""
    samples_dropped: int = 0
    """Responses scored but not kept for GET /v1/evaluations/{id}/samples (past the server's max_stored_samples)."""


class JobList(BaseModel):
    jobs: list[EvaluationJob]
    """Newest first."""


class EvalSample(BaseModel):
    """One response of a job as it was scored."""

    dataset: str
    """The dataset's name as requested."""
    question: int
    """Index of the question in the dataset (0-based, in file order)."""
    sample: int
    """Index of this response among the question's n."""
    prompt: str
    """The last message of the chat sent (built-in and .jsonl sets: the problem and the \\boxed{} instruction)."""
    ground_truth: str
    data_source: str = ""
    """The question's `data_source`: the label that chose its scorer ("" = the verifier's default scorer)."""
    response: str
    """The response text. Past 16 KiB (UTF-8) it is cut there and ends with `[... N more bytes not stored]`."""
    extracted_answer: str
    """The answer the verifier found in the response ("" when none)."""
    verdict: Verdict
    score: float = 0.0
    """The scorer's score (math-verify: 1 if CORRECT, else 0; a scorer of your own: its number)."""
    truncated: bool
    """Stopped by max_tokens (finish reason LENGTH)."""
    response_tokens: int


class SamplePage(BaseModel):
    job_id: str
    total: int
    """Responses stored for the job (of the `dataset` asked for), so far if it still runs."""
    offset: int
    samples: list[EvalSample]
    """In the order they were scored: dataset by dataset, question by question."""
    samples_dropped: int
    """Responses of the job not stored (past the server's max_stored_samples): not in `total`."""
    next_offset: int | None = None
    """The `offset` of the next page; null when no stored sample follows this page (yet, if the job still runs)."""
    cut_at_bytes: bool = False
    """True when the page holds fewer than `limit` samples because more would pass the server's
    `max_sample_page_bytes` of JSON (each sample counts its prompt; a page always holds at least one)."""


class ErrorBody(BaseModel):
    detail: str | list[dict]
    """What was wrong (validation errors: one entry per problem, with its location)."""
