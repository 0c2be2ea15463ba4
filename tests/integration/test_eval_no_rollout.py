"""Issue 47 item 4: an eval job whose rollout deployment is not running fails with an error that names the
deployment, where it was looked for and how to start it (it said only "RolloutError: no replica served the shard").

A real eval service over real Redis; the rollout and verifier addresses are ports nobody listens on, so the job
fails at its first Generate call (under a second: connection refused is not retried for long).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from safetensors.numpy import save_file

from rlep.common.ports import free_port
from rlep.services.eval.api import DatasetRequest, EvaluationRequest, JobStatus
from rlep.services.eval.client import EvalClient
from rlep.services.eval.config import EvalConfig
from rlep.services.eval.main import start_eval
from tests.integration.conftest import delete_keys

pytestmark = pytest.mark.integration


@pytest.fixture
def no_rollout_eval(redis_url, tmp_path):
    """An eval service whose `rollout` and `checkpoint_rollout` are free ports; yields (service, config)."""
    config = EvalConfig.model_validate(
        {
            "server": {"port": 0},
            "redis_url": redis_url,
            "key_prefix": f"rlep:test:no-rollout:{uuid.uuid4().hex}:",
            "rollout": {"addresses": [f"127.0.0.1:{free_port()}"]},
            "checkpoint_rollout": {"addresses": [f"127.0.0.1:{free_port()}"]},
            "verifier": {"address": f"127.0.0.1:{free_port()}"},
            "allowed_roots": [str(tmp_path)],
        }
    )
    running = start_eval(config)
    yield running, config
    running.stop()
    delete_keys(redis_url, config.key_prefix)


def failed_job_error(service, model: str) -> str:
    with EvalClient(service.url) as client:
        job = client.submit(EvaluationRequest(model=model, datasets=[DatasetRequest(name="amc23", limit=1)]))
        job = client.wait(job.id, poll_s=0.05, timeout_s=30)
    assert job.status == JobStatus.FAILED, job
    return job.error


def test_current_without_its_rollout_names_the_deployment_and_how_to_start_it(no_rollout_eval):
    service, config = no_rollout_eval
    error = failed_job_error(service, "current")
    address = config.rollout.addresses[0]
    for needle in (f"rollout: {address}", "policy being trained", "rlep serve rollout", "rollout.addresses"):
        assert needle in error, error
    assert len(error) < 700, error  # the replicas' failures are quoted, cut short


def test_a_checkpoint_without_evals_own_rollout_names_it(no_rollout_eval, tmp_path):
    service, config = no_rollout_eval
    checkpoint = tmp_path / "model.safetensors"
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(checkpoint))
    error = failed_job_error(service, str(checkpoint))
    address = config.checkpoint_rollout.addresses[0]
    for needle in (f"checkpoint_rollout: {address}", "rlep serve rollout", "checkpoint_rollout.addresses"):
        assert needle in error, error
