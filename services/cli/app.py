"""`rlep` command line: one sub-command per service and job.

Heavy modules (torch, grpc, math-verify, vLLM, DeepSpeed) are imported inside the commands, after
the arguments are parsed, so `rlep --help` answers at once.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import typer

from rlep.common.errors import UserError
from rlep.services.cli.errors import RlepGroup, config_error, reaching
from rlep.services.cli.model_import import model_app
from rlep.services.cli.pool import pool_app

app = typer.Typer(
    cls=RlepGroup,
    help="RLEP: RL post-training of LLMs with experience replay.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
serve_app = typer.Typer(help="Run one service: rlep serve <service> --host 127.0.0.1 --port N.", no_args_is_help=True)
proto_app = typer.Typer(help="Generate or check the gRPC stubs under proto/.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")
app.add_typer(proto_app, name="proto")
app.add_typer(pool_app, name="pool")
app.add_typer(model_app, name="model")


@app.callback()
def main(
    ctx: typer.Context,
    verbose: Annotated[bool, typer.Option("--verbose", help="Print the traceback of an error too.")] = False,
) -> None:
    """RLEP: RL post-training of LLMs with experience replay."""
    ctx.meta["rlep.verbose"] = verbose


class ServiceEntry(NamedTuple):
    """What `rlep serve <service>` needs besides what serves it (`rlep.services.launch.serve.SERVE_FOREVER`);
    the config class is imported only when the command runs."""

    config_class: str
    help: str


SERVICES: dict[str, ServiceEntry] = {
    "verifier": ServiceEntry(
        "rlep.services.verifier.config:VerifierConfig",
        "math-verify behind gRPC (rlep.verifier.v1.Verifier), in a process pool with timeouts.",
    ),
    "replay": ServiceEntry(
        "rlep.services.replay.config:ReplayConfig",
        "The experience pool (rlep.replay.v1.ReplayBuffer) over Redis; starts its own Redis without redis_url.",
    ),
    "rollout": ServiceEntry(
        "rlep.services.rollout.config:RolloutConfig",
        "One vLLM worker (rlep.rollout.v1.Rollout): generates groups, takes weight pushes in place.",
    ),
    "eval": ServiceEntry(
        "rlep.services.eval.config:EvalConfig",
        "Evaluation jobs over REST (default port 8080): Avg/Maj/Pass@N through rollout + verifier, kept in Redis.",
    ),
    "sandbox": ServiceEntry(
        "rlep.services.sandbox.config:SandboxServiceConfig",
        "Runs a policy's tool code (rlep.sandbox.v1.Sandbox) under bubblewrap and limits, fair slots per caller.",
    ),
}


def _load(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML config file.", exists=True, dir_okay=False)
]
HostOpt = Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")]
PortOpt = Annotated[int | None, typer.Option(help="gRPC port (0 = any free port).")]
TokenOpt = Annotated[Path | None, typer.Option("--auth-token-file", help="Require this bearer token on every RPC.")]
MetricsOpt = Annotated[int | None, typer.Option("--metrics-port", help="Serve Prometheus /metrics on this port.")]
HealthPortOpt = Annotated[
    int | None,
    typer.Option("--health-port", help="Answer gRPC health checks on this port too (plaintext, 0 = any free one)."),
]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override any field: --set num_workers=4.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the resolved config as JSON and exit.")]


# `rlep serve` flags -> the `server` field each sets. A flag sets only its own field; the rest of `server` keeps
# the service's defaults (load_config).
SERVER_FLAGS = {
    "--host": "host",
    "--port": "port",
    "--auth-token-file": "auth_token_file",
    "--metrics-port": "metrics_port",
    "--health-port": "health_port",
}


def _resolve(service: str, config: Path | None, flags: dict[str, Any], sets: list[str] | None) -> Any:
    """The service's config: defaults < `config` < env (`RLEP_<SERVICE>__...`) < `--set` < `flags` (None: unset)."""
    from rlep.common.config import load_config

    config_cls = _load(SERVICES[service].config_class)
    server_fields = config_cls.model_fields["server"].annotation.model_fields
    for flag, field in SERVER_FLAGS.items():
        if flags[flag] is not None and field not in server_fields:
            raise ValueError(f"{flag} does not apply to {service}: its server section has no {field} field")
    overrides = {f"server.{field}": flags[flag] for flag, field in SERVER_FLAGS.items()}
    return load_config(config_cls, config, overrides, env_prefix=service, sets=sets)


def _serve(service: str, config: Path | None, flags: dict[str, Any], sets: list[str] | None, dry_run: bool) -> None:
    try:
        resolved = _resolve(service, config, flags, sets)
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        raise config_error(err, _load(SERVICES[service].config_class)) from err
    if dry_run:
        from rlep.common.config import dump_config_json

        typer.echo(dump_config_json(resolved))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlep.common.lifecycle import dump_stacks_on_signal
    from rlep.services.launch.serve import SERVE_FOREVER

    dump_stacks_on_signal()
    listen = f"{resolved.server.host}:{resolved.server.port}"
    redis_url = getattr(resolved, "redis_url", None) or "the self-started redis-server"
    try:
        with reaching("Redis", redis_url, "start Redis there or fix redis_url (--set redis_url=redis://HOST:PORT/0)"):
            SERVE_FOREVER[service](resolved)
    except (OSError, RuntimeError) as err:
        from rlep.common.redis_server import DataDirInUse

        if isinstance(err, DataDirInUse):
            raise UserError(f"{err}; stop that process, or give this one --set local_redis_dir=OTHER_DIR") from err
        if not _is_port_in_use(err):
            raise
        raise UserError(
            f"cannot listen on {listen} (or its --metrics-port or --health-port): the port is in use; "
            "pick another --port (0 = any free port) or stop the process holding it"
        ) from err


def _is_port_in_use(err: BaseException) -> bool:
    """grpc reports a taken port as RuntimeError("Failed to bind ..."), sockets as OSError(EADDRINUSE)."""
    import errno

    return (isinstance(err, OSError) and err.errno == errno.EADDRINUSE) or "Failed to bind" in str(err)


def _add_serve_command(service: str, help_text: str) -> None:
    """One `rlep serve <service>` command; every service takes the same flags."""

    def command(
        config: ConfigOpt = None,
        host: HostOpt = None,
        port: PortOpt = None,
        auth_token_file: TokenOpt = None,
        metrics_port: MetricsOpt = None,
        health_port: HealthPortOpt = None,
        set_: SetOpt = None,
        dry_run: DryRunOpt = False,
    ) -> None:
        flags = {
            "--host": host,
            "--port": port,
            "--auth-token-file": auth_token_file,
            "--metrics-port": metrics_port,
            "--health-port": health_port,
        }
        _serve(service, config, flags, set_, dry_run)

    serve_app.command(service, help=help_text)(command)


for _service, _entry in SERVICES.items():
    _add_serve_command(_service, _entry.help)


def _without_traceback(run: Callable[[], Any]) -> Any:
    """The result of `run`; a missing tool or a protoc failure is a message and exit code 2, not a traceback."""
    try:
        return run()
    except RuntimeError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err


@proto_app.command("gen")
def proto_gen() -> None:
    """Regenerate the Python stubs next to every .proto file."""
    from rlep.services.cli.protogen import generate

    written = _without_traceback(generate)
    folders = sorted({str(path.parent.parent.parent) for path in written})
    typer.echo(f"wrote {len(written)} files under {', '.join(folders)}")


@proto_app.command("check")
def proto_check() -> None:
    """Fail if the committed stubs differ from what the .proto files generate."""
    from rlep.services.cli.protogen import stale_stubs

    stale = _without_traceback(stale_stubs)
    if stale:
        typer.echo("stale stubs (run `rlep proto gen`): " + ", ".join(stale), err=True)
        raise typer.Exit(1)
    typer.echo("stubs match their .proto files")


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Option(help='"current" (the policy being served) or a checkpoint path on the server.')],
    datasets: Annotated[
        str, typer.Option(help="Comma-separated built-in names or server-side file paths, each NAME or NAME:LIMIT.")
    ],
    n: Annotated[int | None, typer.Option(help="Samples per question.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Temperature in [0, 2]; 0 is greedy, needs --n 1.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling threshold.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="New tokens per sample.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    server: Annotated[str, typer.Option(help="Base URL of the eval service.")] = "http://127.0.0.1:8080",
    auth_token_file: Annotated[Path | None, typer.Option(help="Bearer token file of the eval service.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the finished job as JSON instead of a table.")] = False,
    samples: Annotated[
        Path | None,
        typer.Option(
            "--samples",
            dir_okay=False,
            help="Once the job has ended, write every response (prompt, response, extracted answer, verdict, "
            "truncated) to this JSONL file.",
        ),
    ] = None,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="No eval service needed: start a rollout replica of --model, a verifier and an eval service here, "
            "evaluate, stop them.",
        ),
    ] = False,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            exists=True,
            help="With --local: the training config whose verifier (scorers) and local.rollout_engine settings to use.",
        ),
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="With --local: override a training config field.")
    ] = None,
) -> None:
    """Evaluate a model on math sets through a running eval service (`rlep serve eval`), or with --local through
    services started for this job: Avg@N, Maj@N, Pass@N.

    Sampling options left out are left out of the request, so they take the defaults of the service's request
    schema (EvaluationRequest in services/eval/api.py; a running service shows them at /docs).
    """
    from pydantic import ValidationError

    from rlep.services.cli.eval import check_server_url, parse_datasets, request_error, run_eval, run_local_eval
    from rlep.services.eval.api import EvaluationRequest

    if not local and (config or set_):
        raise UserError("--config and --set apply to --local only (a running eval service has its own config)")
    check_server_url(server)
    options = {"n": n, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed}
    try:
        request = EvaluationRequest(
            model=model,
            datasets=parse_datasets(datasets),
            **{name: value for name, value in options.items() if value is not None},
        )
    except ValidationError as err:
        raise request_error(err, {"model": model, **options}) from err
    if local:
        run_local_eval(config, set_, request, as_json=as_json, samples_file=samples)
    else:
        run_eval(server, auth_token_file, request, as_json=as_json, samples_file=samples)


from rlep.services.cli.train import register as _register_learner_commands  # noqa: E402 - typer only, light

_register_learner_commands(app)

from rlep.services.cli.doctor import doctor as _doctor  # noqa: E402 - typer only, light

app.command("doctor")(_doctor)

if __name__ == "__main__":
    app()
