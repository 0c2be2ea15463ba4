"""Generates the Python stubs of every `.proto` of the `rlep` package and checks committed stubs are current.

A proto's import path (`rlep/replay/v1/replay.proto`) is where its stubs import from (`rlep.replay.v1`).
In a source checkout those files live in two folders: `proto/rlep/` (the services' contracts) and
`rlep_common/v1/` (the shared `rlep.common.v1` types, inside the `rlep.common` package they belong to);
protoc sees both under their import paths (`-Irlep/common=rlep_common`). In an installed wheel both are
inside the `rlep` package, so the same code finds them there (`rlep proto check` works outside a checkout).

Stubs are committed (so installs need no code generation) and `tests/unit/test_proto_stubs.py`
regenerates them into a temporary folder and compares byte for byte, so they cannot drift.
"""

from __future__ import annotations

import filecmp
import shutil
import tempfile
from pathlib import Path

STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# Import-path prefix -> folder; the longer prefix first, so protoc resolves `rlep/common/...` there.
Roots = dict[str, Path]


def package_roots() -> Roots:
    """The folders of the installed (or editable) `rlep` and `rlep.common` packages."""
    import rlep
    import rlep.common

    return {"rlep/common": Path(rlep.common.__path__[0]), "rlep": Path(rlep.__path__[0])}


def proto_files(roots: Roots | None = None) -> dict[str, Path]:
    """Every .proto: its import path -> its file."""
    found: dict[str, Path] = {}
    for prefix, folder in (roots or package_roots()).items():
        for path in sorted(folder.rglob("*.proto")):
            found.setdefault(f"{prefix}/{path.relative_to(folder).as_posix()}", path)
    return dict(sorted(found.items()))


def _compile(out_root: Path, roots: Roots) -> dict[Path, Path]:
    """Runs protoc (grpcio-tools) on every .proto; returns generated file -> where its committed copy lives."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise RuntimeError("generating stubs needs grpcio-tools: pip install 'rlep[proto]'") from exc

    files = proto_files(roots)
    args = [
        "protoc",
        *(f"-I{prefix}={folder}" for prefix, folder in roots.items()),
        f"-I{_well_known_protos()}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return {
        out_root / (name.removesuffix(".proto") + suffix): path.with_name(path.stem + suffix)
        for name, path in files.items()
        for suffix in STUB_SUFFIXES
    }


def generate(roots: Roots | None = None) -> list[Path]:
    """Regenerates every stub next to its .proto; returns the files written."""
    with tempfile.TemporaryDirectory() as tmp:
        outputs = _compile(Path(tmp), roots or package_roots())
        for fresh, committed in outputs.items():
            shutil.copyfile(fresh, committed)
        return sorted(outputs.values())


def _well_known_protos() -> Path:
    import grpc_tools

    return Path(grpc_tools.__file__).parent / "_proto"


def stale_stubs(roots: Roots | None = None) -> list[str]:
    """Stub files whose committed copy is missing or differs from freshly generated output."""
    with tempfile.TemporaryDirectory() as tmp:
        outputs = _compile(Path(tmp), roots or package_roots())
        return sorted(
            str(fresh.relative_to(tmp))
            for fresh, committed in outputs.items()
            if not committed.exists() or not filecmp.cmp(fresh, committed, shallow=False)
        )
