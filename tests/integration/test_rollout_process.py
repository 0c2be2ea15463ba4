"""`rlep serve rollout` as a process under a supervisor: it stops within seconds on SIGTERM, it retires itself
(NOT_SERVING, non-zero exit) when its vLLM engine core dies, and it removes a killed worker's payload files."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlep.common.grpc_channel import make_channel
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.rollout.main import ENGINE_FAILED_EXIT_CODE
from tests.conftest import free_port
from tests.health_util import statuses_until_not_serving
from tests.service_process import ROLLOUT_STARTUP_TIMEOUT_S, ServiceProcess, start_service
from tests.unit.test_weights_staging import MAKER

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SETS = ["engine.enforce_eager=true", "engine.dtype=float32", "engine.max_model_len=512", "max_n=64"]
# A stop that waits for the running batch, then vLLM's default 5 s engine shutdown, took ~40 s here; aborting
# takes 5-9 s on 2 busy cores (load average ~15). Past 15 s the worker's own hard exit (status 1) fires.
STOP_WITHIN_S = 15.0


def start_worker(tmp_path) -> ServiceProcess:
    """A worker staging pushes in `tmp_path`/staging, its output in `tmp_path`/rollout-<n>.out."""
    (staging := tmp_path / "staging").mkdir(exist_ok=True)
    output = tmp_path / f"rollout-{len(list(tmp_path.glob('rollout-*.out')))}.out"
    return start_service("rollout", output, sets=[*SETS, f"staging_dir={staging}"], timeout_s=ROLLOUT_STARTUP_TIMEOUT_S)


def long_call(stub: rollout_pb2_grpc.RolloutStub, timeout_s: float) -> grpc.Future:
    """A call that generates far longer than the tests wait (64 prompts x 16 samples x up to 480 tokens)."""
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(text=f"Q: {i}+{i}=?\nA: ") for i in range(64)],
        sampling=rollout_pb2.SamplingOptions(n=16, temperature=1.0, max_tokens=480),
    )
    call = stub.Generate.future(request, timeout=timeout_s)
    deadline = time.monotonic() + 60
    while stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).requests_in_flight < 1:  # the call is in
        assert time.monotonic() < deadline and not call.done(), "the long call never reached the worker"
    return call


def dead_makers_payload(directory) -> str:
    """A payload file whose maker (a process staging it like a worker) was SIGKILLed."""
    maker = subprocess.Popen([sys.executable, "-c", MAKER, str(directory)], stdout=subprocess.PIPE, text=True)
    path = maker.stdout.readline().strip()
    maker.kill()
    maker.wait()
    return path


def stop_within_seconds_while_generating(worker: ServiceProcess) -> None:
    """SIGTERM during a long generation: the worker exits 0 within STOP_WITHIN_S and the call ends."""
    try:
        stub = rollout_pb2_grpc.RolloutStub(make_channel(worker.address))
        call = long_call(stub, timeout_s=300)
        started = time.monotonic()
        worker.stop(timeout_s=120)
        stopped_s = time.monotonic() - started
    finally:
        worker.kill()
    print(f"SIGTERM during generation: exited {worker.returncode} after {stopped_s:.1f} s")
    assert worker.returncode == 0 and stopped_s < STOP_WITHIN_S
    assert call.exception(timeout=10).code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def test_a_dead_engine_core_retires_the_worker(tmp_path):
    worker = start_worker(tmp_path)
    try:
        channel = make_channel(worker.address)
        stub = rollout_pb2_grpc.RolloutStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        call = long_call(stub, timeout_s=120)
        [core] = [p for p in psutil.Process(worker.pid).children() if "EngineCore" in " ".join(p.cmdline())]
        core.kill()
        killed = time.monotonic()
        statuses = statuses_until_not_serving(watch)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        # The in-flight call fails over (UNAVAILABLE), and the process ends for its supervisor to restart it.
        assert call.exception(timeout=60).code() == grpc.StatusCode.UNAVAILABLE
        worker.wait(timeout_s=60)
    finally:
        worker.kill()
    print(f"engine core killed: exit {worker.returncode} after {time.monotonic() - killed:.1f} s")
    assert worker.returncode == ENGINE_FAILED_EXIT_CODE, worker.output()[-3000:]


def _greedy(stub: rollout_pb2_grpc.RolloutStub) -> tuple[int, list[int], list[float]]:
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(text="Q: 2+3=?\nA: ")],
        sampling=rollout_pb2.SamplingOptions(n=1, temperature=0.0, max_tokens=12),
    )
    [sample] = stub.Generate(request, timeout=120).completions[0].samples
    return sample.policy_version, list(sample.token_ids), list(sample.logprobs)


def test_a_sender_killed_after_loading_began_retires_the_worker_and_its_restart_serves_the_old_weights(tmp_path):
    """A push in buckets replaces the model layer by layer; when the learner dies after the first bucket the model is
    part old, part new: the worker turns NOT_SERVING within the broadcast's timeout and exits for its supervisor,
    and the worker it restarts clears leftover payloads, serves the weights it started with, and stops within
    seconds on SIGTERM while generating."""
    import multiprocessing

    from transformers import AutoModelForCausalLM

    from rlep.services.weights.broadcast import BroadcastGroup, manifest
    from rlep.services.weights.transport import broadcast_messages
    from tests.integration import broadcast_peers
    from tests.integration.test_rollout import perturbed_state_dict

    timeout_s = 30.0
    worker = start_worker(tmp_path)
    try:
        channel = make_channel(worker.address)
        stub = rollout_pb2_grpc.RolloutStub(channel)
        model_path = stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).model
        before = _greedy(stub)
        state_dict = perturbed_state_dict(AutoModelForCausalLM.from_pretrained(model_path), seed=1)
        bucket = max(t.numel() * t.element_size() for t in state_dict.values())
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

        group = BroadcastGroup("127.0.0.1", free_port(), 2, "gloo", timeout_s)
        call = stub.UpdateWeights.future(iter(broadcast_messages(1, manifest(state_dict), group, 1, bucket)))
        sender = multiprocessing.get_context("spawn").Process(
            target=broadcast_peers.send_and_die, args=(group, state_dict, len(state_dict) // 2), daemon=True
        )
        sender.start()
        sender.join(timeout_s * 2)
        assert sender.exitcode == -signal.SIGKILL  # died half way, many buckets after loading began
        died = time.monotonic()
        statuses = statuses_until_not_serving(watch)
        retired_s = time.monotonic() - died
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        error = call.exception(timeout=timeout_s)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "part version 0, part version 1" in error.details()
        worker.wait(timeout_s=60)
    finally:
        worker.kill()
    print(f"sender killed mid-push: NOT_SERVING after {retired_s:.1f} s, exit {worker.returncode}")
    assert retired_s < timeout_s and worker.returncode == ENGINE_FAILED_EXIT_CODE

    # What its supervisor does: a new worker, which first removes payload files their makers left (one made by a
    # process SIGKILLed while staging), then serves the weights it started with and stops within seconds on SIGTERM.
    # (One worker start checks the three: each costs ~40 s of a loaded 2-core machine.)
    leftover = dead_makers_payload(tmp_path / "staging")
    assert leftover and (tmp_path / "staging" / leftover).exists()
    worker = start_worker(tmp_path)
    try:
        assert not (tmp_path / "staging" / leftover).exists(), "a killed worker's payload outlived the next start"
        assert _greedy(rollout_pb2_grpc.RolloutStub(make_channel(worker.address))) == before
    except BaseException:
        worker.kill()
        raise
    stop_within_seconds_while_generating(worker)
