"""Rollout as a Ray Serve deployment: replicas register, the typed client reaches them over gRPC."""

from __future__ import annotations

import pytest

from rlep.common.config import ServerConfig
from rlep.services.rollout.types import Sampling
from tests.conftest import free_port
from tests.integration.conftest import ROLLOUT_ENGINE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "rlep-rollout-test"


@pytest.fixture(scope="module")
def serve_rollout(ray_local, auth_token_file):
    """One replica on a fixed gRPC port (as on Kubernetes, where the NetworkPolicy names it); yields the port."""
    from ray import serve

    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.ray_app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    config = RolloutConfig(server=ServerConfig(auth_token_file=auth_token_file), engine=ROLLOUT_ENGINE)
    port = free_port()
    serve.run(build_app(config, num_replicas=1, app_name=APP, num_cpus=1, port=port), name=APP, route_prefix=None)
    yield port
    serve.delete(APP)


def test_serve_deployment_answers_the_typed_client(serve_rollout, auth_token_file):
    from rlep.services.rollout.client import RolloutClient

    client = RolloutClient.from_ray(APP, token=auth_token_file.read_text().strip())
    try:
        assert [r.address for r in client.replicas] == [f"127.0.0.1:{serve_rollout}"], "not on its configured port"
        [status] = client.status()
        assert status.policy_version == 0 and status.replica_id
        prompts = [f"Q: {a}+{a}=?\nA: " for a in range(5)]
        completions = client.generate(prompts, Sampling(n=2, max_tokens=8, seed=0))
        assert len(completions) == 5
        assert all(
            len(c.samples) == 2 and all(s.token_ids and s.policy_version == 0 for s in c.samples) for c in completions
        )
        # The prompt order survives the round trip: each completion's prompt is the one sent at that index.
        texts = [client_text(c.prompt_token_ids) for c in completions]
        assert texts == prompts
        # Weights reach the replica in place; the next samples carry the new version.
        [reply] = client.push_weights(tiny_state_dict(), version=1)
        assert reply.version == 1 and client.versions() == [1]
        assert client.generate(prompts[:1], Sampling(max_tokens=4))[0].samples[0].policy_version == 1
    finally:
        client.close()


def client_text(token_ids: list[int]) -> str:
    from transformers import AutoTokenizer

    from rlep.common.tiny_model import cached_model

    return AutoTokenizer.from_pretrained(cached_model("tiny")).decode(token_ids)


def tiny_state_dict():
    import torch
    from transformers import Qwen2ForCausalLM

    from rlep.common.tiny_model import cached_model

    model = Qwen2ForCausalLM.from_pretrained(cached_model("tiny"), dtype=torch.float32)
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


def test_a_replica_whose_metrics_port_is_taken_fails_naming_the_setting(ray_local):
    """A replica asked for /metrics (`local.rollout_metrics_port`) on a port something else listens on never comes up
    without it: the Serve application fails before vLLM loads, with an error that names the setting."""
    import socket

    from ray import serve

    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.ray_app import build_app, run_app

    app = "rlep-rollout-metrics-taken"
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    config = RolloutConfig(server=ServerConfig(), engine=ROLLOUT_ENGINE)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        try:
            with pytest.raises(RuntimeError, match=rf"local.rollout_metrics_port .* {port} \(in use\)"):
                run_app(build_app(config, app_name=app, metrics_port=port), app)
        finally:
            serve.delete(app)
