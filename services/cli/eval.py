"""`rlep eval`: submit a job to a running eval service, follow it with a progress bar, print the figures."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rlep.services.cli.errors import reaching, read_token
from rlep.services.eval.api import DatasetRequest, EvaluationJob, EvaluationRequest, JobStatus
from rlep.services.eval.client import EvalApiError, EvalClient


def parse_datasets(text: str) -> list[DatasetRequest]:
    """`"aime24,amc23:10"` -> aime24 whole, the first 10 questions of amc23. A name may be a file path."""
    datasets = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, limit = item.rpartition(":")
        if name and limit.isdigit():
            datasets.append(DatasetRequest(name=name, limit=int(limit)))
        else:
            datasets.append(DatasetRequest(name=item))
    if not datasets:
        raise typer.BadParameter("name at least one dataset, e.g. --datasets aime24,amc23:10")
    return datasets


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def results_table(job: EvaluationJob) -> Table:
    n = job.request.n
    table = Table(title=f"{job.request.model}: job {job.id} {job.status}")
    for header in ("dataset", "questions", f"avg@{n}", f"maj@{n}", f"pass@{n}", "mean tokens", "unparseable"):
        table.add_column(header, justify="left" if header == "dataset" else "right")
    for result in job.results:
        table.add_row(
            result.dataset,
            f"{result.questions}/{result.questions_total}",
            _figure(result.avg_at_n),
            _figure(result.maj_at_n),
            _figure(result.pass_at_n),
            "-" if result.mean_response_tokens is None else f"{result.mean_response_tokens:.1f}",
            f"{result.unparseable}/{result.samples}",
        )
    return table


def run_eval(
    server: str,
    token_file: Path | None,
    request: EvaluationRequest,
    poll_s: float = 1.0,
    as_json: bool = False,
) -> None:
    """Submits, follows and reports one job; exits 1 when it fails or is cancelled, 2 when it is refused.
    Ctrl-C cancels the job on the server."""
    console = Console(stderr=as_json)
    fix = "start it with `rlep serve eval`, or pass its URL with --server"
    with reaching("eval service", server, fix), EvalClient(server, token=read_token(token_file)) as client:
        try:
            job = client.submit(request)
        except EvalApiError as err:
            console.print(f"[red]refused[/red]: {err.detail}")
            raise typer.Exit(2) from err
        console.print(f"job {job.id} queued ({job.progress.questions_total} questions x n={request.n})")
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=as_json) as bar:
            task = bar.add_task("queued", total=job.progress.questions_total)

            def show(update: EvaluationJob) -> None:
                label = update.progress.current_dataset or str(update.status)
                bar.update(task, completed=update.progress.questions_done, description=label)

            try:
                job = client.wait(job.id, poll_s=poll_s, on_update=show)
            except KeyboardInterrupt:
                job = client.cancel(job.id)
                console.print(f"job {job.id} cancelled")
                raise typer.Exit(130) from None
    if as_json:
        typer.echo(job.model_dump_json(indent=2))
    else:
        console.print(results_table(job))
    if job.status != JobStatus.SUCCEEDED:
        console.print(f"[red]{job.status}[/red]: {job.error}")
        raise typer.Exit(1)
