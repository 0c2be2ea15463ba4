"""Eval's request rules: sampling fields within vLLM's ranges, the per-job cost bound, and jobs stored under
older rules still readable."""

import json

import pytest
from pydantic import ValidationError

from rlep.services.eval.api import DatasetRequest, EvaluationRequest
from rlep.services.eval.config import EvalConfig, EvalLimits
from rlep.services.eval.server import validate_request
from rlep.services.eval.store import _stored_request

AMC3 = [DatasetRequest(name="amc23", limit=3)]


def test_greedy_decoding_takes_one_sample():
    with pytest.raises(ValidationError) as err:
        EvaluationRequest(model="current", datasets=AMC3, n=4, temperature=0)
    [error] = err.value.errors()
    assert (
        "greedy sampling gives n identical samples; send n=1 or temperature > 0 (got n=4, temperature=0;"
        in error["msg"]
    )
    with pytest.raises(ValidationError, match=r"\(got n=\d+, temperature=5e-06; below 1e-05"):
        EvaluationRequest(model="current", datasets=AMC3, n=2, temperature=5e-6)
    assert EvaluationRequest(model="current", datasets=AMC3, n=1, temperature=0).n == 1
    assert EvaluationRequest(model="current", datasets=AMC3, n=2, temperature=1e-5).n == 2


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 2.01, "less than or equal to 2"),
        ("temperature", float("nan"), "finite number"),
        ("top_p", 0.0, "greater than 0"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("n", 0, "greater than or equal to 1"),
        ("n", 16385, "less than or equal to 16384"),
    ],
)
def test_sampling_fields_stay_within_vllms_ranges(field, value, message):
    with pytest.raises(ValidationError) as err:
        EvaluationRequest(model="current", datasets=AMC3, **{field: value})
    [error] = err.value.errors()
    assert error["loc"] == (field,) and message in error["msg"]


def test_a_job_costs_at_most_max_job_tokens():
    request = EvaluationRequest(model="current", datasets=AMC3, n=2, max_tokens=10)  # 3 x 2 x 10 = 60 tokens
    assert validate_request(request, EvalConfig(limits=EvalLimits(max_job_tokens=60))).questions_total == 3
    with pytest.raises(ValueError) as err:
        validate_request(request, EvalConfig(limits=EvalLimits(max_job_tokens=59)))
    assert str(err.value) == (
        "3 questions x n=2 x max_tokens=10 = 60 new tokens is above this server's limit of 59 per job "
        "(limits.max_job_tokens): ask for fewer"
    )


def test_a_job_stored_under_looser_rules_still_reads():
    stored = {"model": "current", "datasets": [{"name": "amc23", "limit": 3}], "n": 4, "temperature": 0.0}
    request = _stored_request(json.dumps(stored | {"top_p": 1.0, "max_tokens": 8, "seed": 0}))
    assert (request.n, request.temperature, request.datasets) == (4, 0.0, AMC3)
    assert json.loads(request.model_dump_json())["temperature"] == 0.0
