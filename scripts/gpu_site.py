"""The GPU check's temporary site (scripts/gpu-check.sh): which carried wheels a machine needs, and what it ends up
running with.

    python3 scripts/gpu_site.py needed WHEEL_DIR   # the wheels to install, one path a line; the reasons on stderr
    python3 scripts/gpu_site.py versions           # with the site on PYTHONPATH: versions, origins, imports

`rlep` and `deepspeed` (what the check is about) are always installed, and a project wheel that differs from the
checkout is refused. Every other carried wheel is a library: it is installed when the machine lacks it or has a version
that fails what the installed wheels require (grpcio and protobuf: the floors the stubs need, in rlep's own
requirements; pydantic-core: pydantic's exact pin). Runs on the machine's own Python, before the site is on the path,
with the standard library and `packaging` (transformers brings it).
"""

from __future__ import annotations

import importlib
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]  # the checkout
ALWAYS = ("rlep", "deepspeed")
# What the later steps import: tests/gpu, tests/gpu/paths_probe.py and benchmarks/learner_gpu.py.
LEARNER_MODULES = (
    "deepspeed",
    "peft",
    "rlep.services.learner.policy",
    "rlep.services.learner.config",
    "rlep.services.learner.micro_batch_plan",
    "rlep.common.config",
    "rlep.common.tiny_model",
)
SHOWN = ("torch", "transformers", "peft", "accelerate", "safetensors", "deepspeed", "pydantic", "pydantic-core",
         "grpcio", "protobuf", "msgpack", "typing-extensions", "pytest", "rlep")  # fmt: skip
# Imported by the services, not by the learner alone: the check notes any that a step pulls in.
SERVICE_ONLY = ("ray", "vllm", "redis")


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """A wheel's unconditional requirements (no extras), as its METADATA states them."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    requirements = [
        Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")
    ]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def stale_files(wheel: Path) -> list[str]:
    """The project wheel's files that differ from the checkout's (folders mapped as pyproject's package-dir maps
    them): a wheel built before the last edit would check old code."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    stale = []
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            parts = name.split("/")
            if parts[0] != "rlep" or name.endswith("/"):  # metadata, not a module
                continue
            # the longest package whose folder holds the file: rlep/services/x.py is services/x.py
            depth = max(d for d in range(1, len(parts)) if ".".join(parts[:d]) in package_dirs)
            source = ROOT / package_dirs[".".join(parts[:depth])] / "/".join(parts[depth:])
            if not source.is_file() or source.read_bytes() != archive.read(name):
                stale.append(str(source.relative_to(ROOT)))
    return stale


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def needed(wheel_dir: Path) -> tuple[list[Path], list[str]]:
    """(the wheels to install, one line per carried or required distribution saying what happens to it)."""
    wheels = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in sorted(wheel_dir.glob("*.whl"))}
    missing = [name for name in ALWAYS if name not in wheels]
    if missing:
        raise SystemExit(f"{wheel_dir} has no wheel of {', '.join(missing)}: run `make gpu-wheels` (docs/gpu.md)")
    stale = stale_files(wheels["rlep"])
    if stale:
        raise SystemExit(f"{wheels['rlep'].name} is older than the checkout ({', '.join(stale[:5])}"
                         f"{', ...' if len(stale) > 5 else ''}): run `make gpu-wheels` again")  # fmt: skip
    requires = {name: wheel_requirements(wheel) for name, wheel in wheels.items()}
    install = set(ALWAYS)
    while True:  # installing a wheel brings its requirements into play (pydantic pins pydantic-core)
        wanted = [r for name in install for r in requires[name]]
        added = {name for name in wheels.keys() - install if not satisfied(name, wanted)}
        if not added:
            break
        install |= added
    lines = ["(not carried and absent: for rlep, the services' libraries, which the learner alone does not import)"]
    for name in sorted(wheels.keys() | {canonicalize_name(r.name) for r in wanted}):
        have = installed_version(name)
        wants = ",".join(sorted({str(r.specifier) for r in wanted if canonicalize_name(r.name) == name} - {""}))
        wants = wants or "any"
        if name in install:
            what = f"install {parse_wheel_filename(wheels[name].name)[1]}"
        elif name in wheels:
            what = "machine's kept"
        else:  # rlep's service dependencies (ray, vllm, redis) are absent there: the learner alone does not import them
            what = "not carried" + ("" if satisfied(name, wanted) else (", absent" if have is None else ", TOO OLD"))
        lines.append(f"{name:24} machine {have or '-':14} needs {wants:22} {what}")
    return [wheels[name] for name in sorted(install)], lines


def satisfied(name: str, requirements: list[Requirement]) -> bool:
    """Whether the machine has `name` at a version every requirement on it accepts."""
    have = installed_version(name)
    specs = [r.specifier for r in requirements if canonicalize_name(r.name) == name]
    return have is not None and all(spec.contains(have, prereleases=True) for spec in specs)


def versions() -> int:
    """Prints the versions and origins of what the check runs with, then imports the learner; 1 if an import fails."""
    print(f"python {sys.version.split()[0]} ({sys.executable})")
    for name in SHOWN:
        try:
            dist = metadata.distribution(name)
            print(f"{name:20} {dist.version:18} {dist.locate_file('')}")
        except metadata.PackageNotFoundError:
            print(f"{name:20} -")
    import torch

    cuda = torch.cuda.is_available()
    print(f"torch cuda {torch.version.cuda}, available {cuda}, {torch.cuda.get_device_name() if cuda else 'no device'}")
    failed = []
    for module in LEARNER_MODULES:
        try:
            importlib.import_module(module)
        except Exception as error:  # every failing import is named, not only the first
            failed.append(module)
            print(f"import {module}: FAILED: {type(error).__name__}: {error}")
    pulled = [name for name in SERVICE_ONLY if name in sys.modules]
    print(
        f"imports: {len(LEARNER_MODULES) - len(failed)}/{len(LEARNER_MODULES)} ok; service modules: {pulled or 'none'}"
    )
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["needed"] and len(argv) == 2:
        wheels, lines = needed(Path(argv[1]))
        print("\n".join(lines), file=sys.stderr)
        print("\n".join(str(w) for w in wheels))
        return 0
    if argv == ["versions"]:
        return versions()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
