"""`rlep eval --local`: the services one evaluation of a checkpoint needs, started in this process and stopped after.

A rollout replica that serves the checkpoint itself (no weight push: its weights are the checkpoint's), a verifier
with the training config's scorers, and an eval service on loopback ports with its own Redis in a temporary folder;
the job then evaluates the replica's policy ("current"). The same code paths as `rlep serve ...`: only who starts
them differs. Issue 47 item 5: the README's checkpoint evaluation needed an eval service with a rollout deployment
of its own, a verifier and a rollout, none of which was running after `rlep train`.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlep.common.policy_info import policy_version_of
from rlep.services.learner.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalEval:
    url: str
    """The eval service's base URL."""
    rollout: str
    verifier: str


@contextlib.contextmanager
def local_eval_services(config: TrainConfig, model_dir: Path) -> Iterator[LocalEval]:
    """Starts a verifier (`config.verifier`, `local.verifier_workers`), a rollout replica of `model_dir`
    (`local.rollout_engine`) and an eval service over them; stops them all on the way out."""
    from rlep.services.eval.config import EvalConfig
    from rlep.services.eval.main import start_eval
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.main import start_rollout
    from rlep.services.verifier.config import VerifierConfig
    from rlep.services.verifier.main import start_verifier

    loopback = {"host": "127.0.0.1", "port": 0}
    with contextlib.ExitStack() as stack:
        verifier = start_verifier(
            VerifierConfig.model_validate(
                {"num_workers": config.local.verifier_workers, "server": loopback, **config.verifier.model_dump()}
            )
        )
        stack.callback(verifier.stop)
        engine = config.local.rollout_engine.model_copy(update={"model": str(model_dir)})
        rollout = start_rollout(
            RolloutConfig(engine=engine, server=loopback, initial_version=policy_version_of(model_dir))
        )
        stack.callback(rollout.stop)
        redis_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rlep-eval-redis-"))
        rollout_address, verifier_address = f"127.0.0.1:{rollout.port}", f"127.0.0.1:{verifier.port}"
        service = start_eval(
            EvalConfig.model_validate(
                {
                    "server": loopback,
                    "local_redis_dir": redis_dir,
                    "rollout": {"addresses": [rollout_address]},
                    "verifier": {"address": verifier_address},
                    "allowed_roots": ["/"],  # the user's own files on the user's own machine: no server to shield
                }
            )
        )
        stack.callback(service.stop)
        yield LocalEval(service.url, rollout_address, verifier_address)
