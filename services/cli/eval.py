"""`rlep eval`: submit a job to a running eval service, follow it with a progress bar, print the figures (and, with
--samples, write every response as scored to a JSONL file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from rlep.common.errors import UserError
from rlep.services.cli.errors import reaching, read_token
from rlep.services.eval.api import DatasetRequest, EvaluationJob, EvaluationRequest, JobStatus
from rlep.services.eval.client import EvalApiError, EvalClient
from rlep.services.eval.inputs import BUILTIN_DATASETS, USER_FILE_SUFFIXES


def parse_datasets(text: str) -> list[DatasetRequest]:
    """`"aime24,amc23:10"` -> aime24 whole, the first 10 questions of amc23. A name may be a file path.

    An item that is no dataset name as a whole (a built-in set, a .jsonl or .parquet path) and holds a `:` is
    NAME:COUNT, so what follows the last `:` must be a positive integer (`amc23:two` is refused here, not sent
    to the server as a dataset named "amc23:two")."""
    datasets = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, limit = item.rpartition(":")
        if name and limit.isdigit() and int(limit) > 0:
            datasets.append(DatasetRequest(name=name, limit=int(limit)))
        elif name and not (item in BUILTIN_DATASETS or item.endswith(USER_FILE_SUFFIXES)):
            raise UserError(
                f"--datasets {item}: the count after ':' must be a positive integer (got {limit!r}), "
                f"e.g. --datasets {name}:10"
            )
        else:
            datasets.append(DatasetRequest(name=item))
    if not datasets:
        raise typer.BadParameter("name at least one dataset, e.g. --datasets aime24,amc23:10")
    return datasets


def check_server_url(server: str) -> None:
    """Refuses a --server without http:// or https:// (httpx would say only that the URL lacks a protocol, and
    `reaching` would then suggest starting a service that is running)."""
    from urllib.parse import urlsplit

    if urlsplit(server).scheme not in ("http", "https"):
        raise UserError(f"--server {server} is not an http(s) URL; give its scheme, e.g. --server http://{server}")


def request_error(err: ValidationError, flags: dict[str, Any]) -> UserError:
    """pydantic's first complaint about the request as one line that names the flag (`--n 0: ...`); a rule over
    two fields (greedy sampling) names both flags as given."""
    first = err.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else None
    if field in flags:
        where = f"--{field.replace('_', '-')} {flags[field]}"
    else:
        given = [(name, value) for name, value in flags.items() if value is not None and name != "model"]
        where = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in given)
    return UserError(f"{where}: {first['msg'].removeprefix('Value error, ')}")


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def results_table(job: EvaluationJob, model: str | None = None) -> Table:
    """One row per dataset. Nothing is cut to fit the console: a long dataset path folds onto more lines of its
    cell instead of ending in an ellipsis (two paths alike but for their ends would read the same). `model` names
    what was evaluated when the job's own name for it says less (--local: "current" is the checkpoint)."""
    n = job.request.n
    headers = ("dataset", "questions", f"avg@{n}", f"maj@{n}", f"pass@{n}", "mean tokens", "unparseable", "truncated")
    # Collapsed padding keeps the eight columns within 80 characters when the names are short.
    title = Text(f"{model or job.request.model}: job {job.id} {job.status}")
    table = Table(title=title, collapse_padding=True, pad_edge=False)
    for header in headers:
        table.add_column(header, justify="left" if header == "dataset" else "right", overflow="fold")
    for result in job.results:
        table.add_row(
            Text(result.dataset),  # as it is: a name with [brackets] is no markup
            f"{result.questions}/{result.questions_total}",
            _figure(result.avg_at_n),
            _figure(result.maj_at_n),
            _figure(result.pass_at_n),
            "-" if result.mean_response_tokens is None else f"{result.mean_response_tokens:.1f}",
            f"{result.unparseable}/{result.samples}",
            f"{result.truncated}/{result.samples}",
        )
    return table


def write_samples(client: EvalClient, job: EvaluationJob, path: Path, console: Console) -> None:
    """Writes every stored response of `job` to `path`, one JSON object per line, and says where."""
    count = 0
    try:
        with path.open("w", encoding="utf-8") as out:
            for sample in client.iter_samples(job.id):
                out.write(sample.model_dump_json() + "\n")
                count += 1
    except OSError as err:
        console.print(f"[red]cannot write the samples[/red]: {err}")
        raise typer.Exit(1) from err
    except EvalApiError as err:  # e.g. a service older than GET /v1/evaluations/{id}/samples
        console.print(f"[red]cannot read the samples[/red]: {err}")
        raise typer.Exit(1) from err
    dropped = f" ({job.samples_dropped} more were not stored: the server's max_stored_samples)"
    message = f"{count} samples written to {path}{dropped if job.samples_dropped else ''}"
    console.print(message, soft_wrap=True, markup=False)  # the path on one line, as it is


def check_samples_file(path: Path | None) -> None:
    """--samples names a file in an existing folder: found out now, not after the job."""
    if path is not None and not path.parent.is_dir():
        raise typer.BadParameter(f"{path.parent} is not a directory", param_hint="--samples")


def run_eval(
    server: str,
    token_file: Path | None,
    request: EvaluationRequest,
    poll_s: float = 1.0,
    as_json: bool = False,
    samples_file: Path | None = None,
    model: str | None = None,
) -> None:
    """Submits, follows and reports one job; exits 1 when it fails or is cancelled, 2 when it is refused.
    Ctrl-C cancels the job on the server. With `samples_file`, the job's responses are written there once it has
    ended, a failed or cancelled job's too (those scored before it stopped; not after Ctrl-C)."""
    console = Console(stderr=as_json)
    check_samples_file(samples_file)
    fix = "start it with `rlep serve eval`, pass its URL with --server, or evaluate a checkpoint without one: --local"
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
            console.print(results_table(job, model))
        if samples_file is not None:
            write_samples(client, job, samples_file, console)
    if job.status != JobStatus.SUCCEEDED:
        console.print(f"[red]{job.status}[/red]: {job.error}")
        raise typer.Exit(1)


def run_local_eval(
    config_file: Path | None,
    sets: list[str] | None,
    request: EvaluationRequest,
    as_json: bool = False,
    samples_file: Path | None = None,
) -> None:
    """`rlep eval --local`: checks what it can in one line, starts the services the job needs here
    (services/launch/local_eval.py), runs it as `run_eval` does, and stops them."""
    import contextlib
    import os

    from rlep.common.tiny_model import resolve_model
    from rlep.services.cli.train import check_scorers_of, load_train_config, model_problem
    from rlep.services.eval.api import CURRENT_POLICY
    from rlep.services.launch.local_eval import local_eval_services

    if request.model == CURRENT_POLICY:
        raise UserError(
            "--local evaluates a checkpoint directory (or a preset) given as --model; `current` is the policy a "
            "running rollout deployment serves: drop --local and give the eval service's --server"
        )
    resolved = load_train_config(config_file, sets, {"model": request.model})
    if problem := model_problem(resolved.model):
        raise UserError(problem)
    check_scorers_of(resolved)
    for dataset in request.datasets:  # before an engine starts, not as the job's first error
        if dataset.name not in BUILTIN_DATASETS and not Path(dataset.name).is_file():
            raise UserError(
                f"--datasets {dataset.name}: no such file and no built-in set ({', '.join(BUILTIN_DATASETS)})"
            )
    check_samples_file(samples_file)  # before the engine starts
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the engine's start-up lines would bury the table
    model_dir = Path(resolve_model(resolved.model))
    console = Console(stderr=True)
    with contextlib.ExitStack() as stack:
        with console.status(f"--local: starting a rollout replica of {model_dir}, a verifier and an eval service"):
            services = stack.enter_context(local_eval_services(resolved, model_dir))
        job = request.model_copy(update={"model": CURRENT_POLICY})  # the replica serves the checkpoint itself
        run_eval(services.url, None, job, as_json=as_json, samples_file=samples_file, model=request.model)
