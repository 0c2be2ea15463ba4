"""Generates the Python stubs of every `.proto` under `proto/` and checks committed stubs are current.

Stubs are committed (so installs need no code generation) and `tests/unit/test_proto_stubs.py`
regenerates them into a temporary folder and compares byte for byte, so they cannot drift.
"""

from __future__ import annotations

import filecmp
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def generate(out_root: Path, root: Path = PROTO_ROOT) -> list[Path]:
    """Runs protoc (grpcio-tools) on every .proto under `root`, writing stubs under `out_root`."""
    from grpc_tools import protoc

    files = proto_files(root)
    args = [
        "protoc",
        f"-I{root}",
        f"-I{_well_known_protos()}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *map(str, files),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return [out_root / f.with_name(f.stem + suffix) for f in files for suffix in STUB_SUFFIXES]


def _well_known_protos() -> Path:
    import grpc_tools

    return Path(grpc_tools.__file__).parent / "_proto"


def stale_stubs(root: Path = PROTO_ROOT) -> list[str]:
    """Stub files whose committed copy is missing or differs from freshly generated output."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), root)
        stale = []
        for path in fresh:
            committed = root / path.relative_to(tmp)
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                stale.append(str(committed.relative_to(root)))
        return stale
