"""`rlep pool ...`: inspect and move replay pools through a running replay service."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from rlep.common.errors import UserError
from rlep.services.cli.errors import reaching, read_token

pool_app = typer.Typer(
    help="Inspect, import, export and drop replay pools (talks to `rlep serve replay`).", no_args_is_help=True
)

AddressOpt = Annotated[str, typer.Option("--address", "-a", help="Replay service host:port.")]
TokenOpt = Annotated[Path | None, typer.Option("--auth-token-file", help="Bearer token of the service.")]
DEFAULT_ADDRESS = "127.0.0.1:50062"


def _client(address: str, token_file: Path | None):
    from rlep.services.replay.client import ReplayClient

    return ReplayClient(address, token=read_token(token_file))


@contextlib.contextmanager
def _rpc_errors_exit(address: str, hint: str = "") -> Iterator[None]:
    """Turns a failed RPC into a one-line message (and `hint`) and exit code 1 instead of a traceback; an
    unreachable service or a refused token is a `UserError` naming `address`."""
    import grpc

    # A one-shot command reports the final error once; the retry warnings before it would only repeat it. The
    # level comes back afterwards: the command may run inside a longer-lived process (tests, a notebook).
    retries = logging.getLogger("rlep.common.grpc_retry")
    level = retries.level
    retries.setLevel(logging.ERROR)
    fix = "start it with `rlep serve replay`, or pass its host:port with --address"
    try:
        with reaching("replay service", address, fix):
            yield
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            hint = f"; `rlep pool list -a {address}` names the pools there{hint}"
        typer.echo(f"error: {err.code().name}: {err.details()}{hint}", err=True)
        raise typer.Exit(1) from None
    finally:
        retries.setLevel(level)


@pool_app.command("list")
def list_pools(address: AddressOpt = DEFAULT_ADDRESS, auth_token_file: TokenOpt = None) -> None:
    """Names of the pools the service holds."""
    with _rpc_errors_exit(address), _client(address, auth_token_file) as client:
        for name in client.list_pools():
            typer.echo(name)


# The replay service counts a success's token ids, or its whitespace-separated words when it has none (a pool
# imported from RLEP's released format holds text only): the label says both.
LENGTH_LABEL = "response length (tokens, or words without token ids)"


QUESTION_PAGE = 20  # questions `stats --questions` lists: the first page, by recent pass rate (hardest first)


@pool_app.command("stats")
def stats(
    pool: str,
    questions: Annotated[
        bool,
        typer.Option("--questions", help="Also the per-question history: pass rates, rescues, the first questions."),
    ] = False,
    address: AddressOpt = DEFAULT_ADDRESS,
    auth_token_file: TokenOpt = None,
) -> None:
    """Questions, trajectories, per-question counts, lengths and versions of a pool, as tables."""
    from rich.console import Console
    from rich.table import Table

    with _rpc_errors_exit(address), _client(address, auth_token_file) as client:
        s = client.stats(pool)
        page = client.question_stats(pool, limit=QUESTION_PAGE) if questions else None
    console = Console()
    summary = Table(title=f"pool {s.pool}", show_header=False)
    for label, value in (
        ("questions", s.questions),
        ("trajectories", s.trajectories),
        (LENGTH_LABEL + " (mean ± std)", f"{s.mean_response_tokens:.1f} ± {s.std_response_tokens:.1f}"),
        ("payload bytes", f"{s.payload_bytes:,}"),
        ("redis used memory", f"{s.redis_used_memory_bytes:,}"),
        ("capacity per question", s.capacity_per_question),
        ("eviction", s.eviction),
    ):
        summary.add_row(label, str(value))
    console.print(summary)
    for title, buckets in (
        ("successes per question", s.successes_per_question),
        (LENGTH_LABEL, s.response_token_histogram),
        ("policy version", s.per_policy_version),
    ):
        table = Table(title=title)
        table.add_column(title)
        table.add_column("count", justify="right")
        for bucket in buckets:
            table.add_row(bucket.label, str(bucket.count))
        console.print(table)
    if page is not None:
        _print_history(console, s, page)


def _print_history(console, s, page) -> None:
    """`stats --questions`: the history's totals, the pass-rate distribution and the first page of questions."""
    from rich.table import Table

    if not s.questions_with_history:
        console.print(f"pool {s.pool}: no per-question history yet (the learner reports it each step)")
        return
    settings = s.history_settings
    summary = Table(title=f"pool {s.pool}: per-question history", show_header=False)
    for label, value in (
        ("questions with history", s.questions_with_history),
        ("reports recorded", s.history_reports),
        ("never solved by the policy", s.never_solved_questions),
        (
            f"mastered (pass rate >= {settings.mastered_pass_rate:g} over >= {settings.mastered_min_visits} visits)",
            s.mastered_questions,
        ),
        ("rescues (replay into a group with no fresh success)", s.rescues),
        ("replayed rows", s.replayed_rows),
        ("recent window (visits) / EMA alpha", f"{settings.window} / {settings.ema_alpha:g}"),
    ):
        summary.add_row(label, str(value))
    console.print(summary)
    distribution = Table(title="recent pass rate")
    distribution.add_column("pass rate")
    distribution.add_column("questions", justify="right")
    for bucket in s.pass_rate_histogram:
        distribution.add_row(bucket.label, str(bucket.count))
    console.print(distribution)
    shown = f"first {len(page.questions)} of {page.matching}, lowest recent pass rate first"
    table = Table(title=f"questions ({shown})")
    for column in (
        "question",
        "visits",
        "attempts",
        "solved",
        "recent",
        "EMA",
        "replayed",
        "rescued",
        "last step",
        "last solved",
    ):
        table.add_column(column, justify="left" if column == "question" else "right")
    for q in page.questions:
        table.add_row(
            q.question_id,
            str(q.visits),
            str(q.attempts),
            str(q.successes),
            f"{q.pass_rate:.2f}" + (" *" if q.mastered else ""),
            f"{q.ema_pass_rate:.2f}",
            str(q.times_replayed),
            str(q.times_rescued),
            str(q.last_step),
            "never" if q.last_solved_step < 0 else str(q.last_solved_step),
        )
    console.print(table)
    if page.questions and any(q.mastered for q in page.questions):
        console.print("* mastered")


@pool_app.command("import")
def import_pool(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="verl parquet with candidates")],
    pool: Annotated[str, typer.Option("--pool", help="Pool to fill (created if new).")],
    address: AddressOpt = DEFAULT_ADDRESS,
    auth_token_file: TokenOpt = None,
) -> None:
    """Load RLEP's released pool format (reward_model.candidates) as successes; re-running an interrupted import
    completes it (chunks are applied one by one, and adds are idempotent). The file is checked first: a wrong schema,
    or no importable row, imports nothing and creates no pool."""
    from rich.progress import Progress

    from rlep.common.pool_parquet import PoolFileError, RowLimits, check_pool_file, read_pool_rows
    from rlep.services.replay.config import ReplayConfig

    # Rows are sized against the replay service's default bounds: one over-size row is refused alone instead of
    # failing its chunk, and with it every re-run of the import.
    defaults = ReplayConfig.model_fields
    limits = RowLimits(defaults["max_question_bytes"].default, defaults["max_trajectory_bytes"].default)
    try:
        check = check_pool_file(path, limits)
    except PoolFileError as err:
        raise UserError(str(err)) from err
    if check.importable == 0 and not check.history_only:
        raise UserError(f"{path}: nothing to import: all {check.rows} rows refused ({check.describe_refused()})")
    # Each chunk is applied atomically, not the whole file; adds are idempotent, so a re-run completes it.
    hint = "\nthe chunks sent before the error are stored; run the same import again to complete it"
    with _rpc_errors_exit(address, hint), Progress() as progress, _client(address, auth_token_file) as client:
        task = progress.add_task(f"importing {path.name}", total=check.importable)

        def chunks():
            for chunk in read_pool_rows(check, pool, limits):  # the handle checked above, not the path again
                yield chunk
                progress.advance(task, len(chunk.questions))

        reply = client.import_chunks(chunks())
    refused = f"; {sum(check.refused.values())} rows refused ({check.describe_refused()})" if check.refused else ""
    skipped = (
        f"; {check.skipped_candidates} candidates over {limits.trajectory_bytes:,} bytes skipped"
        if check.skipped_candidates
        else ""
    )
    if check.skipped_traces:
        skipped += (
            f"; {check.skipped_traces} tool traces left out (unreadable, another question's, unmasked or too big)"
        )
    histories = (
        f"; histories imported {reply.histories_imported}, kept {reply.histories_kept}"
        if reply.histories_imported or reply.histories_kept
        else ""
    )
    typer.echo(
        f"{pool}: added {reply.added}, duplicate {reply.duplicate}, rejected {reply.rejected}, evicted {reply.evicted}"
        + refused
        + skipped
        + histories
    )


@pool_app.command("export")
def export_pool(
    pool: str,
    path: Annotated[Path, typer.Argument(dir_okay=False, help="parquet file to write")],
    address: AddressOpt = DEFAULT_ADDRESS,
    auth_token_file: TokenOpt = None,
) -> None:
    """Write a pool in RLEP's released format (one row per question, successes as candidates). The file is written
    under a temporary name beside PATH and renamed once complete: an interrupted export leaves PATH as it was."""
    from rich.progress import Progress

    from rlep.common.pool_parquet import PoolFileError, write_pool_rows

    if path.suffix.lower() != ".parquet":  # the bytes are parquet whatever the name says
        raise UserError(
            f"{path}: export writes parquet, not {path.suffix or 'a file without suffix'}; name a .parquet file"
        )
    if not path.parent.is_dir():
        raise UserError(f"folder {path.parent} does not exist; create it first, or write {path.name} elsewhere")
    if path.is_symlink():  # checked before any RPC; write_pool_rows refuses it again
        raise UserError(f"{path} is a symbolic link; export writes a file of its own: name another path")
    with _rpc_errors_exit(address), Progress() as progress, _client(address, auth_token_file) as client:
        task = progress.add_task(f"exporting {pool}", total=client.stats(pool).questions)

        def chunks():
            for chunk in client.export(pool):
                yield chunk
                progress.advance(task, len(chunk.questions))

        try:
            rows = write_pool_rows(chunks(), path)
        except PoolFileError as err:
            raise UserError(str(err)) from err
    typer.echo(f"wrote {rows} questions to {path}")


@pool_app.command("drop")
def drop(
    pool: str,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
    address: AddressOpt = DEFAULT_ADDRESS,
    auth_token_file: TokenOpt = None,
) -> None:
    """Delete a pool and every trajectory in it."""
    if not yes:
        typer.confirm(f"Delete pool {pool!r} and all its trajectories?", abort=True)
    with _rpc_errors_exit(address), _client(address, auth_token_file) as client:
        deleted = client.drop(pool, confirm=pool)
    typer.echo(f"dropped {pool}: {deleted} trajectories")
