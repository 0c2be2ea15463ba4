#!/usr/bin/env bash
# The Docker smoke test in one command, from a fresh clone on a host with a Docker engine and no registry:
# builds the local Debian base and the images (build-local.sh), then runs smoke.py, which brings the compose
# stack up, trains, evaluates, scrapes, restarts, crashes replay and tears everything down (`down -v`;
# the images stay). Needs root (debootstrap), docker-compose and Debian's mirror; ~30-40 min on 2 cores.
#   SKIP_BUILD=1 deploy/docker/smoke.sh    # reuse the images of an earlier build
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  deploy/docker/build-local.sh
fi
# The host side (`rlep pool stats`, the training parquet) runs from the project's virtualenv.
scripts/bootstrap.sh
exec "${RLEP_VENV:-.venv}/bin/python" deploy/docker/smoke.py
