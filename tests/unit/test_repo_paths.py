"""No test, config or service file names a path outside the repository, so a fresh clone runs every test.

The rule, applied line by line to the text files under ROOTS. A line offends when it holds:
- a climb above the checkout: `REPO_ROOT.parent` (any name `REPO` or `*ROOT`), `Path(__file__)` followed by
  more `.parent`s (or a higher `.parents[i]`) than the file is deep, or a string literal starting with `../`;
- a sibling folder's data: `../shared` or `"shared" / "data"`;
- a machine's own folder: `/work/`, or a home folder (`/home/<user>`, `/root`, `/Users/<user>`, `~/`,
  `Path.home()`) other than the cache `<home>/.cache/rlep` and `/home/rlep`, the home of the user that
  deploy/docker/Dockerfile creates inside the image.
Not covered: paths built at run time (from variables or environment variables), temporary folders, and
benchmarks/, which is not scanned: benchmarks/verifier.py reads the full data sets beside the checkout.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("tests", "configs", "services", "rlep_common", "experiments")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".json", ".jsonl", ".txt", ".sh", ".cfg", ".ini", ".jinja"}
SELF = "tests/unit/test_repo_paths.py"  # its examples below offend on purpose

PATTERNS = {
    "climbs above the repository root": re.compile(r"\b(?:REPO|[A-Z_]*ROOT)\.parents?\b"),
    "relative path climbing out of the working folder": re.compile(r"[\"']\.\.[/\\]"),
    "sibling shared/ folder": re.compile(r"\.\.[/\\]shared\b|[\"']shared[\"']\s*/\s*[\"']data[\"']"),
    "a machine's /work/ folder": re.compile(r"/work/"),
}
FILE_CLIMB = re.compile(
    r"Path\(__file__\)(?:\.resolve\(\)|\.absolute\(\))?(?P<chain>(?:\.parent\b)+|\.parents\[(?P<i>\d+)\])"
)
HOME = re.compile(
    r"(?P<home>(?<![\w.])/home/[\w.-]+|(?<![\w.])/root\b|(?<![\w.])/Users/[\w.-]+|(?<![\w/])~(?=/)|Path\.home\(\))"
)
RLEP_CACHE = re.compile(r"/\.cache/rlep\b|\s*/\s*[\"']\.cache[\"']\s*/\s*[\"']rlep[\"']")


def offences(rel_path: str, text: str) -> list[str]:
    """`path:line: what` for each line of `text` (a file at `rel_path` in the repository) naming a path outside it."""
    depth = len(Path(rel_path).parts)  # Path(__file__).parents[depth - 1] is the repository root
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        reasons = [reason for reason, pattern in PATTERNS.items() if pattern.search(line)]
        for climb in FILE_CLIMB.finditer(line):
            levels = int(climb["i"]) + 1 if climb["i"] is not None else climb["chain"].count(".parent")
            if levels > depth:
                reasons.append(f"Path(__file__) climbs {levels} levels from a file {depth} deep")
        for home in HOME.finditer(line):
            if home["home"] != "/home/rlep" and not RLEP_CACHE.match(line, home.end()):
                reasons.append(f"home folder {home['home']} outside ~/.cache/rlep")
        found += [f"{rel_path}:{number}: {reason}: {line.strip()}" for reason in reasons]
    return found


def project_text_files() -> list[Path]:
    return sorted(
        path
        for root in ROOTS
        for path in (REPO / root).rglob("*")
        if path.suffix in TEXT_SUFFIXES and path.is_file() and "__pycache__" not in path.parts
    )


GOOD = [
    'TEST_DATA = REPO_ROOT / "tests" / "data"',
    "REPO = Path(__file__).resolve().parents[2]",  # tests/unit/x.py: the root itself
    'out = Path.home() / ".cache" / "rlep" / "models"',
    "default: ~/.cache/rlep/collect/POOL-FP.json",
    'weights = tmp_path / "shared" / "w.safetensors"',
    'bad = f"{tmp_path}/../{outside.name}/secret.jsonl"',
    '{"mountPath": "/home/rlep/.cache"}',
]
BAD = [
    'SHARED = REPO_ROOT.parent / "shared" / "data"',
    'DATA = Path(__file__).resolve().parents[3] / "data"',
    "p = Path(__file__).parent.parent.parent.parent",
    'rows = read_jsonl("../shared/data/math500.jsonl")',
    'path = "../data/train.parquet"',
    'model = "/work/main/models/smollm2"',
    "python run.py --model /home/alice/models/m",
    'cache = Path.home() / "models"',
    "model: ~/models/smollm2",
    'open("/root/data.jsonl")',
]


@pytest.mark.parametrize("line", GOOD)
def test_rule_accepts_paths_inside_the_repository_or_the_cache(line):
    assert offences("tests/unit/test_example.py", line) == []


@pytest.mark.parametrize("line", BAD)
def test_rule_names_file_and_line_of_a_path_outside(line):
    assert {o.split(": ")[0] for o in offences("tests/unit/test_example.py", "ok = 1\n" + line)} == {
        "tests/unit/test_example.py:2"
    }


def test_no_file_names_a_path_outside_the_repository():
    files = [path for path in project_text_files() if path.relative_to(REPO).as_posix() != SELF]
    assert len(files) > 100 and REPO / "tests" / "conftest.py" in files  # the scan cannot pass by finding nothing
    found = [o for path in files for o in offences(path.relative_to(REPO).as_posix(), path.read_text(encoding="utf-8"))]
    assert not found, "paths outside the repository (a fresh clone lacks them):\n" + "\n".join(found)
