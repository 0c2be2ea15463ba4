#!/usr/bin/env bash
# Fills a folder with the wheels a GPU machine without network lacks for scripts/gpu-check.sh (docs/gpu.md): the
# learner's libraries as manylinux wheels for that machine's Python, DeepSpeed as a pure wheel built from its sdist (no
# compiled ops: there is no ninja there, and the learner then uses torch's fused AdamW), and the project's own wheel.
# Versions are the ones this checkout's virtualenv runs, so the GPU check runs what the tests here run.
#
#   scripts/gpu-wheels.sh [--python-version 3.12] [DIR]     # `make gpu-wheels`; DIR defaults to gpu-wheels/
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=3.12
if [ "${1:-}" = "--python-version" ]; then python_version=$2; shift 2; fi
dir=${1:-gpu-wheels}
venv_python="${RLEP_VENV:-.venv}/bin/python"
# What the learner imports and the GPU machine (docs/gpu.md) may lack. gpu_site.py installs the
# libraries only where the machine's own are missing or too old (grpcio, protobuf, typing-extensions, msgpack).
libraries=(pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson einops py-cpuinfo msgpack
           grpcio grpcio-health-checking grpcio-reflection protobuf)
# The size that travels with the checkout to the GPU machine, all in all.
checkout_limit_bytes=$((64 * 1024 * 1024))

version() { "$venv_python" -c "from importlib.metadata import version; print(version('$1'))"; }
pip=("$venv_python" -m pip --disable-pip-version-check)

rm -rf "$dir" && mkdir -p "$dir"
pins=()
for name in "${libraries[@]}"; do pins+=("$name==$(version "$name")"); done
"${pip[@]}" download --quiet --no-deps --only-binary=:all: --dest "$dir" --python-version "$python_version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 "${pins[@]}"

# DeepSpeed publishes only an sdist: build it without ops, and refuse a wheel with compiled code in it.
DS_BUILD_OPS=0 "${pip[@]}" wheel --quiet --no-deps --wheel-dir "$dir" "deepspeed==$(version deepspeed)"
deepspeed_wheel=$(ls "$dir"/deepspeed-*-py3-none-any.whl)
if unzip -l "$deepspeed_wheel" | grep -q '\.so$'; then
  echo "gpu-wheels: $deepspeed_wheel holds compiled ops; it must be pure (DS_BUILD_OPS=0)" >&2
  exit 1
fi

# The project from a copy of the files git tracks or would track: an in-tree build would reuse a stale build/.
source=$(mktemp -d)
trap 'rm -rf "$source"' EXIT
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' path; do if [ -f "$path" ]; then printf '%s\0' "$path"; fi; done \
  | xargs -0 cp --parents -p -t "$source"
"${pip[@]}" wheel --quiet --no-deps --no-build-isolation --wheel-dir "$dir" "$source"

ls -l "$dir" | tail -n +2
wheels_bytes=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
checkout_bytes=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total=$((wheels_bytes + checkout_bytes))
echo "gpu-wheels: $((wheels_bytes / 1024)) KiB of wheels in $dir/; with the checkout $((total / 1024 / 1024)) MiB of the 64 MiB that travel"
if [ "$total" -gt "$checkout_limit_bytes" ]; then
  echo "gpu-wheels: over the 64 MiB the device machine takes" >&2
  exit 1
fi
