"""Mistakes a user can act on, and the one place the `rlep` app reports them.

Any layer raises `UserError("<what is wrong>; <the fix>")` (`rlep.common.errors`) where it finds the
mistake. `RlepGroup.invoke`, the click group under every `rlep` command, prints `error: <message>` on stderr
and exits 2 with no traceback (`rlep --verbose ...` prints the traceback as well). `reaching` turns the
library errors that mean "that service is not there" (gRPC UNAVAILABLE, httpx connect errors, Redis
connection errors) into a `UserError` at the call site that knows which service and address it tried;
`config_error` does the same for pydantic's config errors, naming the nearest valid key. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import sys
import traceback
import typing
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperGroup

from rlep.common.errors import UserError

USER_ERROR_EXIT_CODE = 2


class RlepGroup(TyperGroup):
    """The `rlep` group: a `UserError` raised by any command becomes `error: <message>` and exit code 2."""

    def invoke(self, ctx: Any) -> Any:
        from rlep.common.files import TokenFileError

        try:
            return super().invoke(ctx)
        except (UserError, TokenFileError) as err:  # a token file is read wherever a config names it
            if ctx.meta.get("rlep.verbose"):
                traceback.print_exc()
            from rich.console import Console
            from rich.markup import escape

            message = f"{err}; pass a file holding the token" if isinstance(err, TokenFileError) else str(err)
            # The message as it is: `amc23:two:` is no emoji code, a path with [brackets] no markup.
            console = Console(stderr=True, highlight=False, emoji=False)
            console.print(f"[red]error:[/red] {escape(message)}", markup=True, soft_wrap=True)
            raise typer.Exit(USER_ERROR_EXIT_CODE) from None


def _unreachable_reason(err: BaseException) -> str | None:
    """Why `err` says a service did not answer, or None when it means something else.

    The library modules are looked up, not imported: an error of a module nobody imported cannot occur.
    """
    grpc, httpx, redis = (sys.modules.get(name) for name in ("grpc", "httpx", "redis"))
    if grpc is not None and isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        return "connection refused" if err.code() == grpc.StatusCode.UNAVAILABLE else None
    if httpx is not None and isinstance(err, httpx.TransportError):
        return str(err) or type(err).__name__
    if redis is not None and isinstance(err, redis.exceptions.ConnectionError):
        return str(err)
    return None


def _refused_token(err: BaseException) -> bool:
    grpc = sys.modules.get("grpc")
    codes = ("UNAUTHENTICATED", "PERMISSION_DENIED")
    return grpc is not None and isinstance(err, grpc.RpcError) and hasattr(err, "code") and err.code().name in codes


@contextlib.contextmanager
def reaching(service: str, address: str, fix: str) -> Iterator[None]:
    """Inside: a call to `service` at `address`. A failure to connect or a refused token becomes a `UserError`.

    Args:
        service: what the user knows it as, e.g. "replay service", "Redis".
        address: where it was looked for (host:port or URL), so the message names it.
        fix: how to start it or point at another one, e.g. "start one with `rlep serve replay` or pass --address".
    """
    try:
        yield
    except Exception as err:
        reason = _unreachable_reason(err)
        if reason is not None:
            raise UserError(f"cannot reach the {service} at {address} ({reason}); {fix}") from err
        if _refused_token(err):
            raise UserError(
                f"the {service} at {address} refused the auth token ({err.details()}); "
                "pass --auth-token-file with the token file the service was started with"
            ) from err
        raise


def read_token(path: Any) -> str | None:
    """The token in `path` (None without one); a missing, unreadable or empty file is a `UserError`."""
    from rlep.common.files import TokenFileError, read_token_file

    try:
        return read_token_file(path)
    except TokenFileError as err:
        raise UserError(f"{err}; pass a file holding the token") from err


def config_error(err: ValueError, config_class: type) -> UserError:
    """A `UserError` for a config that failed to load: pydantic's first error as one line, or `err` as it is.

    An unknown key is named with its dotted path and the nearest valid key (`did you mean ...?`).
    """
    from pydantic import ValidationError

    if not isinstance(err, ValidationError):
        return UserError(f"config: {err}")
    first, more = err.errors()[0], err.error_count() - 1
    dotted = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        message = f"unknown key `{dotted}`" + _nearest_key(config_class, first["loc"])
    else:
        reason = first["msg"].removeprefix("Value error, ")
        message = f"invalid `{dotted}`: {reason}" if dotted else f"invalid config: {reason}"
    return UserError(message + (f" (and {more} more error{'s' * (more > 1)})" if more else ""))


def _nearest_key(config_class: type, loc: tuple) -> str:
    """`; did you mean `a.b`?` for the field of `config_class` nearest to `loc`, or `` when none is near."""
    models = [config_class]
    for part in loc[:-1]:
        fields = [model.model_fields[part] for model in models if part in getattr(model, "model_fields", {})]
        models = [t for field in fields for t in _model_types(field.annotation)]
    names = sorted({name for model in models for name in model.model_fields})
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    prefix = "".join(f"{part}." for part in loc[:-1])
    if close:
        return f"; did you mean `{prefix}{close[0]}`?"
    return f"; the keys here are: {', '.join(names)}" if names else ""


def _model_types(annotation: Any) -> list[type]:
    """The pydantic models an annotation can hold (a model, a union of them, an Optional one)."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return [annotation]
    return [t for arg in typing.get_args(annotation) for t in _model_types(arg)]
