"""The import contract of docs/architecture.md: layers only point down, and a service uses another
only through its public modules. Every `import` of every module is checked (also those inside
functions, where the heavy ones are), so an upward import fails here, in CI, with the line that made it.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A module may import its own package, any lower layer, and (in a service layer) another
# service's public modules only. `rlep.common.v1` (the shared stubs) is matched before `rlep.common`.
LAYERS: list[tuple[str, list[str]]] = [
    ("stubs", ["rlep.common.v1", "rlep.replay.v1", "rlep.rollout.v1", "rlep.verifier.v1"]),
    ("common", ["rlep.common"]),
    ("weight transport", ["rlep.services.weights"]),
    ("services", ["rlep.services.verifier", "rlep.services.replay", "rlep.services.rollout"]),
    ("learner and eval", ["rlep.services.learner", "rlep.services.eval"]),
    ("command line", ["rlep.services.cli", "rlep.services.demo"]),
]
# What one service may import of another (below the command line, which wires them all together):
# its typed client, the plain data that client takes and returns, and the config a caller gives it.
PUBLIC_MODULES = ("client", "types", "config")


def package_of(module: str) -> tuple[int, str] | None:
    """(layer index, package) of an `rlep` module; None for third-party modules and the bare `rlep`."""
    for index, (_, packages) in enumerate(LAYERS):
        for package in packages:
            if module == package or module.startswith(package + "."):
                return index, package
    return None


def violation(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported`, or None when it may."""
    source, target = package_of(importer), package_of(imported)
    if source is None or target is None or source[1] == target[1]:
        return None
    (source_layer, _), (target_layer, package) = source, target
    if target_layer > source_layer:
        return f"upward: layer {LAYERS[source_layer][0]!r} imports layer {LAYERS[target_layer][0]!r}"
    if target_layer >= LAYERS.index(LAYERS[3]) and source_layer < len(LAYERS) - 1:
        rest = imported.removeprefix(package + ".")
        if imported == package or rest.split(".")[0] not in PUBLIC_MODULES:
            return f"{package} is used only through {', '.join(PUBLIC_MODULES)}"
    return None


def source_modules() -> dict[str, Path]:
    """Module name -> file, from pyproject's package-dir (the one place the layout is declared)."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = {}
    for package, folder in settings["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules.setdefault(".".join((package, *parts)), path)
    return modules


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import module` imports pkg.module when it is one.
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def contract_breaches(modules: dict[str, Path]) -> list[str]:
    breaches = []
    for module, path in modules.items():
        for line, imported in imports_of(module, path):
            reason = violation(module, imported)
            if reason:
                breaches.append(f"{path}:{line}: {module} imports {imported} ({reason})")
    return breaches


def test_every_import_follows_the_layers():
    assert contract_breaches(source_modules()) == []


def test_every_source_module_is_in_a_layer():
    unplaced = [m for m in source_modules() if package_of(m) is None and m not in ("rlep", "rlep.services")]
    assert all(m.startswith(("rlep.configs", "rlep.replay", "rlep.rollout", "rlep.verifier")) for m in unplaced), (
        unplaced
    )


@pytest.mark.parametrize(
    ("importer", "imported", "reason"),
    [
        ("rlep.common.config", "rlep.services.replay.client", "upward"),
        ("rlep.services.weights.payload", "rlep.services.rollout.types", "upward"),
        ("rlep.services.rollout.server", "rlep.services.learner.trainer", "upward"),
        ("rlep.services.learner.trainer", "rlep.services.cli.stack", "upward"),
        ("rlep.common.v1.trajectory_pb2", "rlep.common.files", "upward"),
        ("rlep.services.learner.trainer", "rlep.services.rollout.engine", "only through"),
        ("rlep.services.eval.runner", "rlep.services.verifier.judge", "only through"),
        ("rlep.services.replay.server", "rlep.services.verifier.judge", "only through"),  # a sibling: same rule
    ],
)
def test_the_contract_refuses(importer, imported, reason):
    assert reason in (violation(importer, imported) or "")


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("rlep.services.learner.trainer", "rlep.services.rollout.client"),
        ("rlep.services.eval.api", "rlep.services.rollout.types"),
        ("rlep.services.learner.policy", "rlep.services.weights.broadcast"),
        ("rlep.services.cli.stack", "rlep.services.verifier.main"),
        ("rlep.services.replay.server", "rlep.replay.v1.replay_pb2"),
        ("rlep.common.wire", "rlep.common.v1.trajectory_pb2"),
    ],
)
def test_the_contract_allows(importer, imported):
    assert violation(importer, imported) is None


def test_an_upward_import_in_a_file_is_found(tmp_path):
    """File to breach: an import inside a function of a common module, naming a service, is reported with its line."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    from rlep.services.replay.client import ReplayClient\n")
    [breach] = contract_breaches({"rlep.common.bad": bad})
    assert breach.startswith(f"{bad}:5: rlep.common.bad imports rlep.services.replay.client.ReplayClient (upward")
