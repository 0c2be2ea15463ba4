#!/usr/bin/env bash
# Writes the secrets docker-compose.yml mounts, once: a random bearer token shared by every service
# (and Prometheus), Redis' password (hex: it goes into redis:// URLs as it is), and Grafana's admin
# password. Existing files are kept, so re-running is safe.
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)/secrets"
mkdir -p "$dir"
for name in auth-token redis-password grafana-admin-password; do
  if [ ! -s "$dir/$name" ]; then
    python3 -c "import secrets; print(secrets.token_hex(32))" > "$dir/$name"
    echo "wrote $dir/$name"
  fi
done
# Readable by the containers' non-root users (rlep uid 1000, redis 999, Prometheus' nobody, Grafana 472).
chmod 0644 "$dir"/*
