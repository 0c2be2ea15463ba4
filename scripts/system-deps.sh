#!/usr/bin/env bash
# Debian tools the tests run for real, installed only when missing (so a prepared machine skips apt):
# prometheus + promtool (a live scrape in tests/integration/test_prometheus.py) and docker-compose (offline
# `config` validation of docker-compose.yml; no engine needed) and fuse3 (fusermount3 + libfuse3: the power-cut
# file system of tests/integration/test_power_cut.py) and bubblewrap (the tool sandbox's namespaces,
# tests/integration/test_sandbox.py). `make test` and .ci/run call this.
set -euo pipefail
missing=()
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: missing ${missing[*]}; install them (Debian: apt-get install ${missing[*]}) or the tests that run them fail" >&2
  exit 0
fi
echo "system-deps: installing ${missing[*]}" >&2
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
