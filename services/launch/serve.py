"""One service in this process, started from its `main`: `SERVE_FOREVER` says which function serves
`rlep serve NAME` (it blocks until a stop signal), `start_rollout_worker` starts a rollout worker for a check
that talks to it and stops it (`rlep doctor`'s replica check).

Each function imports its service's `main` inside it, with a plain import the architecture test reads, so
`rlep --help` and `--dry-run` load no grpc, vLLM or torch. The command line keeps what is its own: the flags,
the config classes, the messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlep.services.eval.config import EvalConfig
    from rlep.services.replay.config import ReplayConfig
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.main import RunningRollout
    from rlep.services.sandbox.config import SandboxServiceConfig
    from rlep.services.verifier.config import VerifierConfig


def serve_verifier(config: VerifierConfig) -> None:
    from rlep.services.verifier.main import serve_forever

    serve_forever(config)


def serve_replay(config: ReplayConfig) -> None:
    from rlep.services.replay.main import serve_forever

    serve_forever(config)


def serve_rollout(config: RolloutConfig) -> None:
    from rlep.services.rollout.main import serve_forever

    serve_forever(config)


def serve_sandbox(config: SandboxServiceConfig) -> None:
    from rlep.services.sandbox.main import serve_forever

    serve_forever(config)


def serve_eval(config: EvalConfig) -> None:
    from rlep.services.eval.main import serve_forever

    serve_forever(config)


# `rlep serve NAME` -> what serves it, given the service's resolved config.
SERVE_FOREVER: dict[str, Callable[[Any], None]] = {
    "verifier": serve_verifier,
    "replay": serve_replay,
    "rollout": serve_rollout,
    "eval": serve_eval,
    "sandbox": serve_sandbox,
}


def start_rollout_worker(config: RolloutConfig) -> RunningRollout:
    """A rollout worker started as `rlep serve rollout` starts one, without waiting for a signal: the caller
    talks to it and calls its `stop()`."""
    from rlep.services.rollout.main import start_rollout

    return start_rollout(config)
