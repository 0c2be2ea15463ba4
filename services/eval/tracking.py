"""A finished eval job's figures as TensorBoard scalars (`tensorboard_dir`), beside its REST answer.

One folder per job, so TensorBoard lists jobs as runs. Names are `<dataset>/avg@N`, `<dataset>/maj@N`,
`<dataset>/pass@N` and `<dataset>/mean_response_tokens`; the step is the newest policy version the job sampled,
so jobs run during training line up with the learner's versions. The model evaluated is a text summary.
`torch.utils.tensorboard` is imported only when a job is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlep.services.eval.api import DatasetResult


def job_scalars(results: Sequence[DatasetResult], n: int) -> dict[str, float]:
    """Scalar name -> value of every dataset's figures (those not known yet, None, are left out)."""
    scalars: dict[str, float] = {}
    for result in results:
        figures = {
            f"avg@{n}": result.avg_at_n,
            f"maj@{n}": result.maj_at_n,
            f"pass@{n}": result.pass_at_n,
            "mean_response_tokens": result.mean_response_tokens,
        }
        scalars |= {f"{result.dataset}/{name}": value for name, value in figures.items() if value is not None}
    return scalars


def write_job(directory: Path, model: str, results: Sequence[DatasetResult], n: int, step: int) -> None:
    """Writes one job's scalars (and the model evaluated) under `directory`."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(directory)) as writer:
        for name, value in job_scalars(results, n).items():
            writer.add_scalar(name, value, step)
        writer.add_text("model", model, step)
