"""The README fits on a screen and points to docs/; every relative link in README.md, docs/ and deploy/README.md
resolves, and every `rlep` command quoted in their code blocks parses against the real command line (options and
arguments exist, required ones are given), without running it."""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
from pathlib import Path

import pytest
import typer

from rlep.services.cli.app import app

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 200
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)


def relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"^(https?:|mailto:|#)", t)]


def quoted_commands(text: str) -> list[str]:
    """`rlep ...` lines of the fenced blocks, continuation lines joined, comments and a trailing `&` dropped."""
    commands = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if not line.startswith("rlep "):
                continue
            line = re.sub(r"\s#\s.*$", "", line).rstrip().removesuffix("&").strip()
            # `[--flag value]` marks an optional part
            commands.append(" ".join(line.replace("[", "").replace("]", "").split()))
    return commands


def parse(args: list[str]):
    """The click context `rlep ARGS` parses to (sub-commands resolved); raises the CLI's usage errors."""
    command, name, parent = typer.main.get_command(app), "rlep", None
    while True:
        ctx = command.make_context(name, args, parent=parent)
        if not hasattr(command, "resolve_command"):
            return ctx
        name, command, args = command.resolve_command(ctx, [*(ctx._protected_args or []), *ctx.args])
        parent = ctx


def test_the_pages_quote_commands():
    assert sum(len(quoted_commands(page.read_text())) for page in PAGES) >= 20


def test_readme_fits_on_a_screen_and_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "make demo" in readme and "make test" in readme
    linked = {Path(t.split("#")[0]).name for t in relative_links(readme)}
    assert not [p.name for p in (REPO / "docs").glob("*.md") if p.name not in linked]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    missing = [t for t in relative_links(page.read_text()) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to missing files: {missing}"


def test_the_rules_catch_what_they_name():
    assert relative_links("[a](docs/x.md) [b](https://x.org) [c](#here)") == ["docs/x.md"]
    assert quoted_commands("```bash\nrlep train \\\n  --dry-run &   # note\nls\n```\n") == ["rlep train --dry-run"]
    with pytest.raises(Exception, match="No such option: --bogus"):
        parse(["train", "--bogus"])
    with pytest.raises(Exception, match="No such command"):
        parse(["trian"])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_quoted_command_parses(page, monkeypatch):
    monkeypatch.chdir(REPO)  # paths in the docs are relative to the repository's root
    failures = []
    for command in quoted_commands(page.read_text()):
        try:
            parse(shlex.split(command)[1:])
        except Exception as err:  # the CLI's own usage errors (typer vendors click's exception types)
            message = getattr(err, "format_message", lambda e=err: str(e))()
            if "does not exist" not in message:  # an example's file need not exist here
                failures.append(f"{command!r}: {message}")
    assert not failures, "\n".join(failures)


def test_architecture_names_every_package_module():
    """docs/architecture.md is the map of the code: a module it does not name is a room a newcomer cannot find."""
    named = set(re.findall(r"`([A-Za-z_][\w.]*)`", (REPO / "docs" / "architecture.md").read_text()))
    packages = [p for p in (REPO / "services").iterdir() if p.is_dir() and p.name != "__pycache__"]
    modules = [m for pkg in [*packages, REPO / "rlep_common"] for m in pkg.glob("*.py") if m.stem != "__init__"]
    assert len(modules) > 80
    assert not [str(m.relative_to(REPO)) for m in modules if m.stem not in named]


ARCHITECTURE = REPO / "docs" / "architecture.md"
RLEP_NAME = re.compile(r"\brlep(?:\.[\w<>]+)+")
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:proto|rlep_common|services|configs|deploy|benchmarks|experiments|tests|docs)/[\w./{},<>-]*)"
)


def expanded(name: str) -> list[str]:
    """`tests/{unit,e2e}` as `tests/unit`, `tests/e2e`; a placeholder (`<svc>`) as the glob `*`."""
    name = re.sub(r"<\w+>", "*", name)
    if match := re.search(r"\{([^{}]*)\}", name):
        return [n for part in match.group(1).split(",") for n in expanded(name.replace(match.group(0), part, 1))]
    return [name]


def missing_rlep_names(text: str, modules: dict[str, Path]) -> list[str]:
    """`rlep....` names in `text` that are neither a module of the package nor a top-level name of one
    (`rlep.common.config.CONFIG_DIR`); a placeholder (`rlep.<svc>.v1`) needs one module to match it."""
    missing = []
    for name in sorted(set(RLEP_NAME.findall(text))):
        pattern = expanded(name.rstrip("."))[0]
        if "*" in pattern:
            found = any(fnmatch.fnmatchcase(m, pattern) for m in modules)
        else:
            module, _, attribute = pattern.rpartition(".")
            found = pattern in modules or (
                module in modules and attribute in top_level_names(ast.parse(modules[module].read_text()))
            )
        if not found:
            missing.append(name)
    return missing


def top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def missing_repo_paths(text: str, root: Path) -> list[str]:
    """Repository paths in `text` (under a top-level folder) that do not exist; a placeholder needs one match."""
    return [
        path
        for name in sorted(set(REPO_PATH.findall(text)))
        for path in expanded(name.rstrip(".,"))
        if not next(iter(root.glob(path.rstrip("/"))), None)
    ]


def test_every_module_and_path_the_architecture_page_names_exists():
    """A stale name on the map (a module moved, a folder renamed) fails here."""
    from tests.unit.test_architecture import source_modules

    text = ARCHITECTURE.read_text()
    assert len(RLEP_NAME.findall(text)) > 10 and len(REPO_PATH.findall(text)) > 10
    assert missing_rlep_names(text, source_modules()) == []
    assert missing_repo_paths(text, REPO) == []


def test_the_name_checks_catch_stale_names(tmp_path):
    from tests.unit.test_architecture import source_modules

    modules = source_modules()
    text = "`rlep.services.launch.stack` `rlep.common.config.CONFIG_DIR` `rlep.<svc>.v1` `rlep.services.cli.stack`"
    assert missing_rlep_names(text + " `rlep.common.config.NO_SUCH`", modules) == [
        "rlep.common.config.NO_SUCH",
        "rlep.services.cli.stack",
    ]
    assert missing_rlep_names("`rlep.<svc>.v9`", modules) == ["rlep.<svc>.v9"]
    (tmp_path / "services" / "replay").mkdir(parents=True)
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    text = "services/<svc>/ and tests/{unit,gpu} and `benchmarks/x.py`."
    assert missing_repo_paths(text, tmp_path) == ["benchmarks/x.py", "tests/gpu"]


def test_the_ports_table_is_what_code_configs_compose_and_chart_use():
    """Issue 32: the table called 9461-9464 default ports while `rlep serve` started no /metrics. Now: the gRPC
    column is the code's default, the /metrics column what configs/, compose and the chart set, and the code's
    default is off, as the page says."""
    import yaml

    from rlep.services.eval.config import EvalConfig
    from rlep.services.learner.config import TrainConfig
    from rlep.services.replay.config import ReplayConfig
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.sandbox.config import SandboxServiceConfig
    from rlep.services.verifier.config import VerifierConfig

    rows = {
        cells[0]: cells
        for line in (REPO / "docs" / "services.md").read_text().splitlines()
        if line.startswith("| ") and len(cells := [c.strip() for c in line.strip("|").split("|")]) == 6
    }
    compose = (REPO / "docker-compose.yml").read_text()
    chart = (REPO / "deploy/helm/rlep/templates/networkpolicy.yaml").read_text()
    chart_ports = dict(re.findall(r'"(\w+)" (\d+)', re.search(r"\$metricsPorts := dict (.*) }}", chart).group(1)))
    services = {
        "verifier": VerifierConfig(),
        "replay": ReplayConfig(),
        "rollout": RolloutConfig(),
        "sandbox": SandboxServiceConfig(),
    }
    for service, config in services.items():
        grpc_port, metrics_port = rows[service][2], rows[service][3]
        assert grpc_port == str(config.server.port), service
        assert config.server.metrics_port is None, f"{service}: the page says /metrics is off unless set"
        configured = yaml.safe_load((REPO / "configs" / f"{service}.yaml").read_text())["server"]["metrics_port"]
        assert metrics_port == str(configured) == chart_ports[service], service
        assert f"--metrics-port={metrics_port}" in compose, service
    assert TrainConfig().metrics_port is None
    learner_port = yaml.safe_load((REPO / "configs" / "train.yaml").read_text())["metrics_port"]
    assert rows["learner"][3] == str(learner_port) == chart_ports["learner"]
    assert f"metrics_port={learner_port}" in compose
    assert rows["eval"][2].startswith(str(EvalConfig().server.port)) and chart_ports["eval"] == "8080"
