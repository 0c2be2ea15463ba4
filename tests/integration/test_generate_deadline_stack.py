"""`rlep train`'s service stack gives its rollout client `endpoints.generate_deadline`: a real gRPC replica on
loopback that stalls sees the configured deadline, and the call fails naming it."""

from __future__ import annotations

import pytest

from rlep.services.learner.config import TrainConfig
from rlep.services.rollout.client import RolloutError
from rlep.services.rollout.types import Sampling
from tests.unit.test_rollout_generate_deadline import SMALL, serve_stalled_replica

pytestmark = [pytest.mark.integration]


def test_the_learners_stack_gives_its_rollout_client_the_configured_deadline(ray_local, tmp_path):
    from rlep.services.launch.stack import ServiceStack

    with serve_stalled_replica() as (address, replica):
        endpoints = {"rollout": [address], "verifier": "127.0.0.1:9", "generate_deadline": SMALL}
        stack = ServiceStack(TrainConfig.model_validate({"endpoints": endpoints}), tmp_path)
        services = stack.start(need_replay=False)
        try:
            with pytest.raises(RolloutError, match="deadline of 1 s"):
                services.rollout.generate([[1, 2], [3]], Sampling(n=2, max_tokens=250))
        finally:
            services.rollout.close()
    assert replica.time_remaining and all(0.5 < r < 1.5 for r in replica.time_remaining), replica.time_remaining
