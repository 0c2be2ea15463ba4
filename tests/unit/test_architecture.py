"""The import contract of docs/architecture.md: layers only point down, a service uses another only through
its public modules, only the launch room wires services from their `main`/`ray_app`, and no modules import
each other in a circle. Every `import` of every module is checked (also those inside
functions, where the heavy ones are), so a breach fails here, in CI, with the line that made it.
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
    ("stubs", ["rlep.common.v1", "rlep.replay.v1", "rlep.rollout.v1", "rlep.verifier.v1", "rlep.sandbox.v1"]),
    ("common", ["rlep.common"]),
    ("weight transport", ["rlep.services.weights"]),
    ("services", ["rlep.services.verifier", "rlep.services.replay", "rlep.services.rollout", "rlep.services.sandbox"]),
    ("learner and eval", ["rlep.services.learner", "rlep.services.eval"]),
    ("launch", ["rlep.services.launch"]),
    ("demo", ["rlep.services.demo"]),
    ("command line", ["rlep.services.cli"]),
    # Multi-run protocols: they run jobs through the launch room and the demo's task; nothing imports them.
    ("experiments", ["rlep.experiments"]),
]
SERVICES_LAYER, LAUNCH_LAYER = ([name for name, _ in LAYERS].index(layer) for layer in ("services", "launch"))
# What one service may import of another (below the launch room, which wires them together, and what
# runs jobs through it): its typed client, the plain data that client takes and returns, and the config a
# caller gives it.
PUBLIC_MODULES = ("client", "types", "config")
# A service's wiring: `main` (config -> build -> serve) and its Ray Serve app. Only the launch room starts
# services from them (`rlep serve <svc>` and `rlep doctor`'s replica check too, through `launch.serve`); a
# service's own modules may use its own.
WIRING_MODULES = ("main", "ray_app")
WIRING_PACKAGE = "rlep.services.launch"


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
    (source_layer, importer_package), (target_layer, package) = source, target
    if target_layer > source_layer:
        return f"upward: layer {LAYERS[source_layer][0]!r} imports layer {LAYERS[target_layer][0]!r}"
    if target_layer < SERVICES_LAYER:
        return None
    room = "" if imported == package else imported.removeprefix(package + ".").split(".")[0]
    if room in WIRING_MODULES and importer_package != WIRING_PACKAGE:
        return f"{package}.{room} wires a service: only {WIRING_PACKAGE} imports it"
    if source_layer < LAUNCH_LAYER and room not in PUBLIC_MODULES:
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


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module of the package it imports: the first line that does}; an imported name (`from m import f`)
    counts as its module, a module's own name is left out."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for line, imported in imports_of(module, path):
            target = imported
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.setdefault(target, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every group of modules that import each other in a circle (strongly connected components, Tarjan's
    algorithm), each as one circle through it: [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, {}):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = {stack.pop()}
            while module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_circle_through(graph, group) for group in groups]


def _circle_through(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """A shortest circle from the group's first module back to it, inside the group (breadth first)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if target in group and target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def described(graph: dict[str, dict[str, int]], modules: dict[str, Path], circle: list[str]) -> str:
    """`a (file:line) -> b (file:line) -> a`: each step with the line of the import that makes it."""
    steps = [f"{a} ({modules[a]}:{graph[a][b]})" for a, b in zip(circle, circle[1:], strict=False)]
    return " -> ".join([*steps, circle[-1]])


def test_every_import_follows_the_layers():
    assert contract_breaches(source_modules()) == []


def test_no_modules_import_each_other_in_a_circle():
    """A circle (even through an import inside a function) makes the modules one room in all but name: neither can
    be read, tested or moved without the other, and the import order decides which half-built module the other
    sees."""
    modules = source_modules()
    graph = import_graph(modules)
    assert [described(graph, modules, circle) for circle in import_cycles(graph)] == []


def test_the_demo_never_imports_the_command_line():
    """The demo runs its jobs through the launch room; the command line may import the demo, never the reverse."""
    modules = source_modules()
    demo = {m: p for m, p in modules.items() if m.startswith("rlep.services.demo")}
    assert demo
    assert [
        f"{path}:{line}: {imported}"
        for module, path in demo.items()
        for line, imported in imports_of(module, path)
        if imported.startswith("rlep.services.cli")
    ] == []


def test_every_source_module_is_in_a_layer():
    unplaced = [m for m in source_modules() if package_of(m) is None and m not in ("rlep", "rlep.services")]
    stub_packages = ("rlep.configs", "rlep.replay", "rlep.rollout", "rlep.verifier", "rlep.sandbox")
    assert all(m.startswith(stub_packages) for m in unplaced), unplaced


@pytest.mark.parametrize(
    ("importer", "imported", "reason"),
    [
        ("rlep.common.config", "rlep.services.replay.client", "upward"),
        ("rlep.services.weights.payload", "rlep.services.rollout.types", "upward"),
        ("rlep.services.rollout.server", "rlep.services.learner.trainer", "upward"),
        ("rlep.services.learner.trainer", "rlep.services.launch.stack", "upward"),
        ("rlep.services.learner.trainer", "rlep.services.launch", "upward"),
        ("rlep.services.demo.runner", "rlep.services.cli.errors", "upward"),
        ("rlep.services.demo.runner", "rlep.services.cli", "upward"),
        ("rlep.services.launch.training", "rlep.services.demo.runner", "upward"),
        ("rlep.services.launch.stack", "rlep.services.cli.app", "upward"),
        ("rlep.services.cli.app", "rlep.experiments.protocol.run", "upward"),
        ("rlep.services.demo.runner", "rlep.experiments.protocol.compare", "upward"),
        ("rlep.services.eval.runner", "rlep.services.rollout.main", "wires a service"),
        ("rlep.services.learner.trainer", "rlep.services.rollout.ray_app", "wires a service"),
        ("rlep.services.demo.runner", "rlep.services.verifier.main", "wires a service"),
        ("rlep.services.demo.runner", "rlep.services.eval.ray_app", "wires a service"),
        ("rlep.services.cli.doctor_workers", "rlep.services.rollout.main", "wires a service"),
        ("rlep.services.cli.app", "rlep.services.verifier.main.serve_forever", "wires a service"),
        ("rlep.experiments.protocol.training", "rlep.services.rollout.ray_app", "wires a service"),
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
        ("rlep.services.launch.stack", "rlep.services.verifier.main"),
        ("rlep.services.launch.stack", "rlep.services.rollout.ray_app"),
        ("rlep.services.launch.training", "rlep.services.learner.trainer"),
        ("rlep.experiments.protocol.training", "rlep.services.launch.training"),
        ("rlep.experiments.protocol.pool", "rlep.services.demo.task"),
        ("rlep.services.demo.runner", "rlep.services.launch.training"),
        ("rlep.services.demo.runner", "rlep.services.learner.cursor"),
        ("rlep.services.cli.train", "rlep.services.demo.runner"),
        ("rlep.services.launch.serve", "rlep.services.rollout.main"),
        ("rlep.services.cli.doctor_workers", "rlep.services.launch.serve"),
        ("rlep.services.rollout.server", "rlep.services.rollout.main"),  # its own package
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


def test_a_lazy_circle_in_files_is_found(tmp_path):
    """File to breach: two modules that import each other, one of them inside a function, form a circle."""
    (a := tmp_path / "a.py").write_text("from rlep.common import b\n\n\ndef f():\n    return b.g()\n")
    (b := tmp_path / "b.py").write_text("def g():\n    from rlep.common.a import f\n\n    return f\n")
    (c := tmp_path / "c.py").write_text("import rlep.common.a\n")  # imports the circle, is not in it
    modules = {"rlep.common.a": a, "rlep.common.b": b, "rlep.common.c": c}
    graph = import_graph(modules)
    assert import_cycles(graph) == [["rlep.common.a", "rlep.common.b", "rlep.common.a"]]
    assert described(graph, modules, ["rlep.common.a", "rlep.common.b", "rlep.common.a"]) == (
        f"rlep.common.a ({a}:1) -> rlep.common.b ({b}:2) -> rlep.common.a"
    )
    b.write_text("def g():\n    return 1\n")
    assert import_cycles(import_graph(modules)) == []
