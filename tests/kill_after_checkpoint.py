"""`rlep` that dies by SIGKILL right after one training step's checkpoint is written, as a crash would.

Test-only fault injection (tests/integration/test_learner_loop.py): the resume test kills the learner at a known
point instead of racing a poll of the step log. The production trainer knows nothing of it: this script wraps
`Trainer.save_checkpoint` before handing its arguments to the `rlep` CLI.

    python tests/kill_after_checkpoint.py <step> train --config ... [rlep arguments]
"""

from __future__ import annotations

import os
import signal
import sys


def kill_after_checkpoint(step: int) -> None:
    """Makes every `Trainer` of this process SIGKILL it once the checkpoint of `step` (1-based) is on disk."""
    from rlep.services.learner.trainer import Trainer

    save = Trainer.save_checkpoint

    def save_then_die(self: Trainer):
        path = save(self)
        if self.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    Trainer.save_checkpoint = save_then_die


def main() -> None:
    step, args = int(sys.argv[1]), sys.argv[2:]
    kill_after_checkpoint(step)
    from rlep.services.cli.app import app

    app(args=args, prog_name="rlep")


if __name__ == "__main__":
    main()
