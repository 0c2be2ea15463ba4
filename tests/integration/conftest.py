"""Real servers on loopback, started once per test session."""

from __future__ import annotations

import pytest

from rlep.common.config import ServerConfig


@pytest.fixture(scope="session")
def auth_token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text("s3cret-token\n")
    return path


@pytest.fixture(scope="session")
def verifier(auth_token_file):
    """A real verifier (2 math-verify worker processes) requiring a bearer token, with /metrics."""
    from rlep.services.verifier.config import VerifierConfig
    from rlep.services.verifier.main import start_verifier

    config = VerifierConfig(
        server=ServerConfig(port=0, metrics_port=0, auth_token_file=auth_token_file, max_request_bytes=8 * 2**20),
        num_workers=2,
        item_timeout_s=5.0,
        max_items_per_request=1000,
    )
    running = start_verifier(config)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def verifier_client(verifier, auth_token_file):
    from rlep.services.verifier.client import VerifierClient

    token = auth_token_file.read_text().strip()
    with VerifierClient(f"127.0.0.1:{verifier.port}", token=token, chunk_items=500) as client:
        yield client


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """The machine's Redis on 127.0.0.1:6379 when it answers (CI), else a self-started redis-server."""
    import redis

    try:
        if redis.Redis(port=6379, socket_connect_timeout=1).ping():
            yield "redis://127.0.0.1:6379/0"
            return
    except redis.ConnectionError:
        pass
    from rlep.common.redis_server import start_local_redis

    local = start_local_redis(tmp_path_factory.mktemp("redis"))
    yield local.url
    local.stop()


@pytest.fixture(scope="session")
def replay(redis_url, auth_token_file):
    """A real replay server over real Redis, requiring a bearer token, with /metrics."""
    from rlep.services.replay.config import ReplayConfig
    from rlep.services.replay.main import start_replay

    config = ReplayConfig(
        server=ServerConfig(port=0, metrics_port=0, auth_token_file=auth_token_file),
        redis_url=redis_url,
        capacity_per_question=8,
        max_questions_per_sample=50_000,
    )
    running = start_replay(config)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def replay_client(replay, auth_token_file):
    from rlep.services.replay.client import ReplayClient

    with ReplayClient(f"127.0.0.1:{replay.port}", token=auth_token_file.read_text().strip()) as client:
        yield client


@pytest.fixture
def pool_name(request, replay_client):
    """A fresh pool name per test, dropped afterwards (the CI Redis is shared)."""
    import uuid

    name = f"test-{request.node.name[:40]}-{uuid.uuid4().hex[:8]}".replace("[", "_").replace("]", "_")
    yield name
    if name in replay_client.list_pools():
        replay_client.drop(name, confirm=name)


# Eager mode starts in ~3 s instead of ~45 s of torch.compile; float32 makes logprobs exactly comparable.
ROLLOUT_ENGINE = {"model": "tiny", "dtype": "float32", "max_model_len": 512, "max_num_seqs": 64, "enforce_eager": True}


@pytest.fixture(scope="session")
def rollout(auth_token_file):
    """A real vLLM CPU worker (the locally built tiny model, float32) behind gRPC, with a token and /metrics."""
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.main import start_rollout

    config = RolloutConfig(
        server=ServerConfig(port=0, metrics_port=0, auth_token_file=auth_token_file), engine=ROLLOUT_ENGINE, max_n=64
    )
    running = start_rollout(config)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def rollout_client(rollout, auth_token_file):
    from rlep.services.rollout.client import RolloutClient

    client = RolloutClient([f"127.0.0.1:{rollout.port}"], token=auth_token_file.read_text().strip(), timeout_s=300)
    yield client
    client.close()


@pytest.fixture(scope="session")
def eval_rollout(auth_token_file):
    """Eval's own rollout deployment (a second tiny vLLM worker): evaluating a checkpoint pushes weights here,
    never to the `rollout` fixture, which stands for the policy being trained."""
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.main import start_rollout

    config = RolloutConfig(
        server=ServerConfig(port=0, auth_token_file=auth_token_file), engine=ROLLOUT_ENGINE, max_n=64
    )
    running = start_rollout(config)
    yield running
    running.stop()


@pytest.fixture
def eval_config(rollout, verifier, redis_url, auth_token_file, tmp_path):
    """An eval service config over the session's real rollout and verifier, small limits, a 2 s lease, and a
    fresh Redis key prefix (deleted afterwards: the CI Redis is shared). No checkpoint_rollout: tests that
    evaluate checkpoints add `eval_rollout`. User files are allowed under the test's tmp_path only."""
    from rlep.services.eval.config import EvalConfig

    rollout_settings = {
        "addresses": [f"127.0.0.1:{rollout.port}"],
        "timeout_s": 300,
        "auth_token_file": str(auth_token_file),
    }
    settings = eval_settings(
        rollout_settings,
        verifier.port,
        redis_url,
        auth_token_file,
        tmp_path,
        limits={"max_n": 8, "max_questions": 200, "max_tokens": 128, "max_queued_jobs": 20},
        questions_per_call=4,
    )
    config = EvalConfig.model_validate(settings)
    yield config
    delete_keys(redis_url, config.key_prefix)


def eval_settings(
    rollout: dict,
    verifier_port: int,
    redis_url: str,
    auth_token_file,
    tmp_path,
    *,
    limits: dict,
    questions_per_call: int,
) -> dict:
    """Settings of a test's eval service: loopback port, the token, a fresh Redis key prefix (the CI Redis is
    shared: delete it afterwards with `delete_keys`), a 2 s lease, user files under tmp_path only."""
    import uuid

    token = {"auth_token_file": str(auth_token_file)}
    return {
        "server": {"port": 0, **token},
        "redis_url": redis_url,
        "key_prefix": f"rlep:eval:test-{uuid.uuid4().hex[:8]}:",
        "rollout": rollout,
        "verifier": {"address": f"127.0.0.1:{verifier_port}", **token},
        "limits": limits,
        "questions_per_call": questions_per_call,
        "lease_s": 2,
        "allowed_roots": [str(tmp_path)],
    }


def delete_keys(redis_url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def eval_service(eval_config):
    """A real eval service (HTTP on a free loopback port, jobs in Redis) for one test."""
    from rlep.services.eval.main import start_eval

    running = start_eval(eval_config)
    yield running
    running.stop()


@pytest.fixture
def eval_client(eval_service, auth_token_file):
    from rlep.services.eval.client import EvalClient

    with EvalClient(eval_service.url, token=auth_token_file.read_text().strip()) as client:
        yield client


@pytest.fixture(scope="module")
def hf_model(rollout):
    """The `rollout` fixture's model in transformers (float32), the reference its logprobs are checked against."""
    import torch
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(rollout.engine.model_path, dtype=torch.float32).eval()


@pytest.fixture
def stub(rollout, auth_token_file):
    """A raw gRPC stub of the `rollout` fixture (for requests the typed client would never send)."""
    from rlep.common.grpc_channel import make_channel
    from rlep.rollout.v1 import rollout_pb2_grpc

    return rollout_pb2_grpc.RolloutStub(make_channel(f"127.0.0.1:{rollout.port}", auth_token_file.read_text().strip()))
