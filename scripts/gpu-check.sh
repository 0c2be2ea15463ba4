#!/usr/bin/env bash
# The GPU check (docs/gpu.md §4): on a GPU machine with no network, from this checkout and the wheels `make gpu-wheels`
# put in gpu-wheels/, installs what the machine lacks into a temporary site, then runs tests/gpu, the probe of the
# learner's other paths (tests/gpu/paths_probe.py) and `benchmarks/learner_gpu.py --shape 0.5b`. Each step runs under
# `timeout`, within one budget for the whole check; a step that fails or runs out of time is recorded and the next runs.
#
#   bash scripts/gpu-check.sh                  # everything, within $GPU_CHECK_BUDGET_S (480 s)
#   bash scripts/gpu-check.sh --install-only   # the install and import step alone
#
# Writes to $OUT (default: a new folder under /tmp): summary.txt (each step: result, exit code, seconds),
# versions.txt (the machine, the wheels installed or not and why, versions, the learner's imports), check.log (every
# step's output), tests_gpu.xml, paths.json and learner_gpu_0.5b.json. Exit code 1 when any step failed.
# Settings: PYTHON (python3), GPU_WHEELS (gpu-wheels), GPU_SITE (/tmp/rlep-gpu-site).
set -uo pipefail # no -e: a failed step is recorded and the check goes on
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
wheels=${GPU_WHEELS:-gpu-wheels}
site=${GPU_SITE:-/tmp/rlep-gpu-site}
OUT=${OUT:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
deadline=$((SECONDS + ${GPU_CHECK_BUDGET_S:-480}))
mkdir -p "$OUT"
: >"$OUT/summary.txt"
: >"$OUT/check.log"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 # no network there: fail at once rather than wait on a download
failed=0

# step NAME LIMIT_S COMMAND...: COMMAND under `timeout` (its whole process group), for LIMIT_S at most and never past
# the check's deadline; its output goes to $log (check.log unless the caller sets it) and to the console.
step() {
  local name=$1 limit=$2 started=$SECONDS left=$((deadline - SECONDS)) code result
  shift 2
  ((limit > left)) && limit=$left
  if ((limit <= 0)); then
    printf '%-14s %-9s\n' "$name" "SKIPPED (the check's budget is spent)" | tee -a "$OUT/summary.txt"
    failed=1
    return 1
  fi
  echo "=== $name (at most ${limit} s): $*" | tee -a "${log:-$OUT/check.log}"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "${log:-$OUT/check.log}"
  code=${PIPESTATUS[0]}
  result=ok
  ((code != 0)) && result=FAILED
  # 124: `timeout` stopped it; 137: killed 10 s later (or by the kernel for memory, well before the limit)
  ((code == 124 || (code == 137 && SECONDS - started >= limit))) && result="TIMED OUT"
  printf '%-14s %-9s exit %3d %5d s\n' "$name" "$result" "$code" $((SECONDS - started)) | tee -a "$OUT/summary.txt"
  ((code == 0)) || failed=1
  return "$code"
}

install_site() {
  {
    echo "checkout $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)'), $(date -u +%FT%TZ)"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    else
      echo "no nvidia-smi"
    fi
    echo "--- carried wheels ($wheels/) against the machine's packages"
  } >"$OUT/versions.txt"
  local listed needed=()
  # Decided before the site is on PYTHONPATH: what the machine itself has.
  listed=$("$python" scripts/gpu_site.py needed "$wheels" 2>>"$OUT/versions.txt") || {
    echo "gpu-check: cannot read $wheels/ (see $OUT/versions.txt)" | tee -a "$OUT/summary.txt"
    return 1
  }
  mapfile -t needed <<<"$listed"
  rm -rf "$site"
  step install 90 "$python" -m pip install --quiet --no-index --no-deps --no-cache-dir --disable-pip-version-check \
    --target "$site" "${needed[@]}" || return 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "--- with $site on PYTHONPATH" >>"$OUT/versions.txt"
  log="$OUT/versions.txt" step imports 120 "$python" scripts/gpu_site.py versions
}

if [ "${1:-}" = "--install-only" ]; then
  install_site
  exit $?
fi
install_site
# pytest's own settings but --timeout (pytest-timeout may be missing there; `timeout` bounds the step).
step tests_gpu 150 "$python" -m pytest tests/gpu -m gpu -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
  --junitxml "$OUT/tests_gpu.xml"
step paths_probe 120 "$python" tests/gpu/paths_probe.py --out "$OUT/paths.json"
step learner_gpu 240 "$python" benchmarks/learner_gpu.py --shape 0.5b --out "$OUT/learner_gpu_0.5b.json"
echo "gpu-check: $((SECONDS)) s in all; figures in $OUT" | tee -a "$OUT/summary.txt"
exit "$failed"
