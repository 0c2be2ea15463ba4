"""Faults during training steps: a rollout replica dies, a verifier worker dies. No step and no data are lost."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rlep.common.types import Verdict
from tests.loop_util import arithmetic_parquet, seed_pool, train_config
from tests.unit.test_rollout_replica_port import free_range

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "rlep-rollout-faults"


@pytest.fixture(scope="module")
def fault_setup(ray_local, tmp_path_factory, redis_url):
    """Two rollout replicas on Ray Serve (each with /metrics, on two consecutive ports from a free base), verifier
    and replay actors, one DeepSpeed learner actor."""
    from rlep.common.tiny_model import cached_model
    from rlep.services.launch.stack import ServiceStack
    from rlep.services.launch.training import policy_tokenizer
    from rlep.services.learner.cursor import load_questions
    from rlep.services.learner.ray_policy import RayPolicy
    from rlep.services.learner.trainer import Trainer

    tmp = tmp_path_factory.mktemp("faults")
    rows = arithmetic_parquet(tmp / "train.parquet", 16, seed=2)
    config = train_config(
        tmp,
        tmp / "train.parquet",
        questions_per_step=8,
        fresh_per_question=8,
        max_response_tokens=48,
        overlong_buffer_tokens=0,
        mini_batch_questions=8,
    )
    local = config.local.model_copy(
        update={"rollout_replicas": 2, "replay_redis_url": redis_url, "rollout_metrics_port": free_range(2)}
    )
    config = config.model_copy(update={"local": local, "steps": 100})
    model_dir = cached_model("tiny")
    stack = ServiceStack(config, model_dir, app_name=APP)
    services = stack.start(need_replay=True)
    seed_pool(stack, config.replay_pool, rows)
    policy = RayPolicy(model_dir, config)
    trainer = Trainer(
        config,
        model_dir,
        load_questions([tmp / "train.parquet"]),
        policy,
        services,
        policy_tokenizer(model_dir, config),
    )
    trainer.start()
    yield trainer, stack
    policy.close()
    stack.close()


def _restarted(client, victim: int) -> bool:
    """Both replicas answer, and the killed one is not among them (Serve started a new one)."""
    client.refresh()
    statuses = [status for _, status in client.check(timeout_s=10)]
    return len(statuses) == 2 and None not in statuses and victim not in [s.pid for s in statuses]


class KillingStub:
    """A replica's stub whose first Generate SIGKILLs that replica once the call is on its way."""

    def __init__(self, stub, pid: int):
        self._stub, self._pid = stub, pid
        self.killed = threading.Event()

    def __getattr__(self, name):
        return getattr(self._stub, name)

    def Generate(self, request, timeout=None):  # noqa: N802 - the stub's method name
        call = self._stub.Generate.future(request, timeout=timeout)
        if not self.killed.is_set():
            self.killed.set()
            os.kill(self._pid, signal.SIGKILL)
        return call.result()


def test_every_replica_rlep_train_starts_serves_rollout_metrics(fault_setup):
    """`local.rollout_metrics_port`: both replicas on this one node serve /metrics on a slot of their own, their
    addresses are in the registry, and a Generate shows in each one's rlep_rollout_* series."""
    import urllib.parse
    import urllib.request

    from rlep.services.rollout.types import Sampling
    from tests.metrics_util import series_value

    trainer, stack = fault_setup
    client = trainer.services.rollout
    base = stack.config.local.rollout_metrics_port
    urls = stack.rollout_metrics_urls()
    assert sorted(urls) == sorted(replica.address for replica in client.replicas)
    assert sorted(urllib.parse.urlsplit(url).port for url in urls.values()) == [base, base + 1]
    completions = client.generate(["1+1=", "2+2=", "3+3=", "4+4="], Sampling(n=2, max_tokens=4, temperature=1.0))
    assert len(completions) == 4
    for address, url in urls.items():
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert series_value(text, 'rlep_rollout_requests_total{method="Generate",code="OK"}') >= 1, address
        assert series_value(text, "rlep_rollout_generated_tokens_total") > 0, address
        assert series_value(text, "rlep_rollout_generate_seconds_count") >= 1, address


def test_rollout_replica_killed_mid_step(fault_setup):
    trainer, stack = fault_setup
    client = trainer.services.rollout
    assert len(client.replicas) == 2
    victim_replica, victim = client.replicas[0], client.status()[0].pid  # status() follows replicas' order
    first = trainer.train_step()
    # The replica dies while a shard of the next step is out to it; the shard must be retried on the other one.
    victim_replica.stub = KillingStub(victim_replica.stub, victim)
    failovers = client.failovers
    second = trainer.train_step()
    assert victim_replica.stub.killed.is_set(), "the step sent no shard to the victim"
    assert client.failovers > failovers, "no shard was retried on the other replica"
    assert second.rollout_failovers == client.failovers > first.rollout_failovers  # the step record says so
    assert first.rollout_replicas == 2 and second.rollout_replicas == 1  # the dead one is out of service
    assert second.step == first.step + 1
    assert second.sequences == 8 * (8 + 2)  # nothing lost: every question got all G fresh samples

    # Serve restarts the replica (a new vLLM engine); the next step brings it to the learner's version before it
    # serves. Steps trained while it restarts would only slow the restart down on a small machine: wait for it.
    deadline = time.monotonic() + 300
    while not _restarted(client, victim):
        if time.monotonic() > deadline:
            pytest.fail("the killed rollout replica did not come back within 300 s")
        threading.Event().wait(1.0)  # no event to wait on: Serve restarts the process on its own
    assert client.versions().count(trainer.version) == 1  # the new replica holds its starting weights until pushed to
    back = trainer.train_step()
    assert back.rollout_replicas == 2 and back.sequences == 80
    assert trainer.services.rollout.versions() == [trainer.version, trainer.version]


def test_verifier_worker_crash_mid_step_costs_nothing(fault_setup):
    import ray

    trainer, stack = fault_setup
    real = trainer.services.verifier
    pids = ray.get(stack.actor("verifier").pids.remote())
    seen: list = []

    class CrashingVerifier:
        """The real client; the worker process is killed just as this step's batch goes out to it."""

        def verify(self, items):
            if not seen:  # the step's first call (fresh samples; replayed answers are verified next)
                os.kill(pids[0], signal.SIGKILL)
            outcomes = real.verify(items)
            seen.append((len(items), outcomes))
            return outcomes

    trainer.services.verifier = CrashingVerifier()
    try:
        record = trainer.train_step()
    finally:
        trainer.services.verifier = real
    (count, outcomes), (replayed_count, replayed_outcomes) = seen
    assert len(outcomes) == count == 64 and len(replayed_outcomes) == replayed_count == 16
    assert not [o for o in outcomes + replayed_outcomes if o.verdict == Verdict.ERROR]
    assert record.sequences == 80 and record.replay_used == 16
    assert ray.get(stack.actor("verifier").pids.remote()) != pids  # the dead worker was replaced
