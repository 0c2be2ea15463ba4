#!/usr/bin/env bash
# Builds the RLEP CPU image on a host that cannot pull from any image registry, from a Debian base made
# here with debootstrap; also builds the Redis and Prometheus images compose.local.yml runs (Debian's own
# redis-server and prometheus on the same base). Needs root (debootstrap), a Docker engine and Debian's
# package mirror. Where Docker Hub works, `docker build -f deploy/docker/Dockerfile -t rlep:latest .`
# with the Dockerfile's defaults (python:3.11-slim, PyTorch's CPU index) is all a user needs.
#
#   deploy/docker/build-local.sh            # base (once), then rlep:latest, rlep-local/redis, rlep-local/prometheus
#
# Environment:
#   RLEP_IMAGE        the image to build (rlep:latest)
#   RLEP_BASE_IMAGE   the Debian base (rlep-local/debian-py311:bookworm); rebuilt only when missing
#   DEBIAN_MIRROR     (http://deb.debian.org/debian)
#   TORCH_WHEEL_DIR   a directory holding torch-2.13.0+cpu's wheel, served to the build over loopback
#                     instead of PyTorch's index (default /opt/wheels when the wheel is there)
set -euo pipefail
cd "$(dirname "$0")/../.."
image="${RLEP_IMAGE:-rlep:latest}"
base="${RLEP_BASE_IMAGE:-rlep-local/debian-py311:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
wheel_dir="${TORCH_WHEEL_DIR:-/opt/wheels}"
work="$(mktemp -d)"
server_pid=""
cleanup() {
  [ -z "$server_pid" ] || kill "$server_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
log() { echo "build-local: $*" >&2; }

build_base() {
  # python3-dev: torch inductor (vLLM's CPU sampler) compiles against Python.h at start-up, as on
  # python:3.11-slim, which ships the headers.
  log "debootstrap bookworm from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
    bookworm "$work/root" "$mirror" >"$work/debootstrap.log" || { tail -20 "$work/debootstrap.log"; exit 1; }
  # The host's own extra CAs (a TLS-inspecting egress proxy, say): pip inside the build must trust what the
  # host trusts to reach PyPI. Only this local base gets them; the Dockerfile's default base is untouched.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$work/root/usr/local/share/ca-certificates/"
    chroot "$work/root" update-ca-certificates >/dev/null
  fi
  printf 'deb %s bookworm main\n' "$mirror" >"$work/root/etc/apt/sources.list"
  rm -rf "$work/root/var/lib/apt/lists/"* "$work/root/var/cache/apt/"*.bin
  # `docker import` keeps no environment: PATH must be set here, or the Dockerfile's PATH=/opt/venv/bin:$PATH
  # would lose the system directories. pip's vendored CA bundle does not have the host's CAs; the system one does.
  tar -C "$work/root" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    -c 'CMD ["bash"]' - "$base" >/dev/null
  rm -rf "$work/root"
}

serve_wheels() {
  # pip's --find-links reads http.server's directory listing. Loopback only; the build runs with
  # --network host to see it (and PyPI, as the host does). Sets wheel_url.
  local port
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  python3 -m http.server --bind 127.0.0.1 --directory "$wheel_dir" "$port" >"$work/http.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 50); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=1)" 2>/dev/null && break
    sleep 0.1
  done
  wheel_url="http://127.0.0.1:$port/"
}

context_tar() {
  # The classic builder (no buildx here) ignores Dockerfile.dockerignore and would send the whole checkout,
  # virtualenvs included. Build the context from that file's allow-list instead, so both agree.
  local paths
  mapfile -t paths < <(sed -n 's/^!//p' deploy/docker/Dockerfile.dockerignore)
  tar -c --exclude=__pycache__ --exclude='*.pyc' --exclude=experiments/protocol/results deploy/docker/Dockerfile \
    "${paths[@]}"
}

start=$(date +%s)
if docker image inspect "$base" >/dev/null 2>&1; then
  log "base $base exists"
else
  build_base
  log "base $base built in $(($(date +%s) - start)) s"
fi

build_args=(--build-arg "BASE_IMAGE=$base")
if compgen -G "$wheel_dir/torch-2.13.0+cpu-*.whl" >/dev/null; then
  serve_wheels
  build_args+=(--build-arg "TORCH_CPU_INDEX=" --build-arg "TORCH_FIND_LINKS=$wheel_url")
  log "torch from $wheel_dir (served on loopback)"
fi

t0=$(date +%s)
context_tar | docker build --network host "${build_args[@]}" -f deploy/docker/Dockerfile -t "$image" -
log "$image built in $(($(date +%s) - t0)) s; $(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1 / 1e9}')"

# Stand-ins for redis:7 and prom/prometheus, same paths and users as compose.local.yml expects.
t0=$(date +%s)
docker build --network host --build-arg "BASE=$base" -t rlep-local/redis:bookworm - <<'EOF' >/dev/null
ARG BASE
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
WORKDIR /data
EOF
docker build --network host --build-arg "BASE=$base" -t rlep-local/prometheus:bookworm - <<'EOF' >/dev/null
ARG BASE
FROM ${BASE}
# wget: compose's health check for Prometheus calls it, as the upstream image's busybox provides.
RUN apt-get update && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
ENTRYPOINT ["/usr/bin/prometheus"]
EOF
log "rlep-local/redis and rlep-local/prometheus built in $(($(date +%s) - t0)) s; total $(($(date +%s) - start)) s"
