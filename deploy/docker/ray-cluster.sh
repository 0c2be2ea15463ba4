#!/usr/bin/env bash
# RLEP trained across a two-node Ray cluster of containers (deploy/docker/ray-cluster.yml), with a node fault:
#   1. `ray start --head` and `ray start --address` in two containers; wait until the cluster has both nodes.
#   2. A driver without the cluster's token is refused (Ray token auth; the dashboard is off).
#   3. `rlep train --ray-address auto` from the head: two rollout replicas, one per node; learner, verifier
#      and replay on the head. The training file carries its questions' worked solutions, so the replay pool
#      is seeded from it (RLEP's released format) and every step replays M successes.
#   4. After step STOP_AT: `docker stop` the worker node; training goes on with the head's replica.
#      After one more step: `docker start` it; its replica comes back and is brought to the learner's
#      weight version before it serves. Every event is printed with its time since the start.
#   5. Three steps after that, the run is stopped (SIGINT). Checks: replicas were on both nodes, no step was lost or
#      lost a sample, and the step records show 2 -> 1 -> 2 serving replicas. Then everything is torn down.
#
#   deploy/docker/ray-cluster.sh        # needs the image (deploy/docker/build-local.sh) and a Docker engine
# Env: RLEP_IMAGE (rlep:latest), STEPS (2000: a cap; the run is stopped with SIGINT a few steps after the rejoined
# replica serves, however long the rejoin takes), STOP_AT (4), KEEP=1 leaves the cluster up.
set -euo pipefail
cd "$(dirname "$0")"
steps="${STEPS:-2000}"
stop_at="${STOP_AT:-4}"
project=rlep-raycluster
compose=(docker-compose -p "$project" -f ray-cluster.yml)
started=$(date +%s)
say() { echo "[+$(($(date +%s) - started))s] $*"; }
fail() { say "FAIL: $*"; exit 1; }

./make-secrets.sh >/dev/null
[ -s secrets/ray-auth-token ] || python3 -c "import secrets; print(secrets.token_hex(32))" >secrets/ray-auth-token
chmod 0644 secrets/ray-auth-token

teardown() {
  [ "${KEEP:-0}" = 1 ] || "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
}
trap teardown EXIT
"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
"${compose[@]}" up -d
head=$("${compose[@]}" ps -q ray-head)
worker=$("${compose[@]}" ps -q ray-worker)
in_head() { docker exec "$head" "$@"; }
# A new named volume is root's: hand it to the image's user (uid 1000) before anything writes to it.
docker exec -u 0 "$head" chown 1000:1000 /cache

# Polls `$1` (a shell condition run on the host) every second for at most `$2` seconds.
wait_for() {
  local what="$1" limit="$2" deadline=$(($(date +%s) + $2))
  until eval "$what"; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "timed out after ${limit}s waiting for: $what"
    sleep 1
  done
}
alive_nodes() {
  in_head python -c "import ray; ray.init(address='auto', log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null | tail -1
}
wait_for '[ "$(alive_nodes)" = 2 ]' 300
say "cluster up: 2 alive nodes (head $(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$head"), worker $(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$worker"))"

# A driver with a wrong token must be refused.
refused=$(docker exec -e RAY_AUTH_TOKEN=not-the-token -e RAY_AUTH_TOKEN_PATH= "$head" timeout 60 python -c \
  "import ray; ray.init(address='ray-head:6379', log_to_driver=False); print('CONNECTED')" 2>&1 || true)
grep -q CONNECTED <<<"$refused" && fail "a driver with a wrong Ray token joined the cluster"
grep -q "InvalidAuthToken" <<<"$refused" || fail "a driver with a wrong token failed, not on authentication: $(tail -n 3 <<<"$refused")"
say "a driver with a wrong Ray token is refused: $(grep -o 'InvalidAuthToken: [^.]*' <<<"$refused" | head -n 1)"

in_head mkdir -p /cache/cluster
in_head python -c "
from rlep.services.demo.task import make_problems, write_parquet
write_parquet(make_problems(64, 0, 'train'), '/cache/cluster/train.parquet', with_candidates=True)"
docker exec -i "$head" sh -c 'cat > /cache/cluster/train.yaml' <<EOF
run_id: ray-cluster
model: tiny
steps: $steps
replay_pool: ray-cluster
algorithm: {questions_per_step: 4, fresh_per_question: 4, replayed_per_question: 2, max_response_tokens: 24,
            overlong_buffer_tokens: 4, mini_batch_questions: 4}
optim: {lr: 1.0e-4, warmup_steps: 1, micro_batch_size: 32}
deepspeed: {zero_stage: 2}
data: {train_files: [/cache/cluster/train.parquet]}
checkpoint: {dir: /cache/cluster/ckpt, every_steps: 50}
log_file: /cache/cluster/log.jsonl
endpoints: {auth_token_file: /run/secrets/rlep_auth_token}
local:
  rollout_replicas: 2
  rollout_max_per_node: 1
  rollout_cpus: 1
  learner_cpus: 1
  rollout_engine: {dtype: float32, enforce_eager: true, max_model_len: 128}
EOF

log="$(mktemp)"
say "rlep train --ray-address auto ($steps steps) from the head; its output: $log"
docker exec "$head" rlep train --config /cache/cluster/train.yaml --ray-address auto >"$log" 2>&1 &
train=$!
last_step() { in_head sh -c 'tail -n 50 /cache/cluster/log.jsonl 2>/dev/null' | python3 -c "
import json, sys
steps = [json.loads(l).get('step', 0) for l in sys.stdin if l.strip() and 'rollout_replicas' in l]
print(max(steps, default=0))"; }
running() { kill -0 "$train" 2>/dev/null; }

wait_for 'running || fail "training ended early: $(tail -5 "$log")"; [ "$(last_step)" -ge 1 ]' 900
say "step 1 done; rollout replicas: $(in_head python -c "
import ray; ray.init(address='auto', log_to_driver=False, namespace='rlep')
print(sorted(ray.get(ray.get_actor('rlep-rollout-registry').addresses.remote()).values()))" 2>/dev/null | tail -1)"
wait_for 'running || fail "training ended early"; [ "$(last_step)" -ge "$stop_at" ]' 900
say "step $(last_step) done: docker stop the worker node"
docker stop "$worker" >/dev/null
say "worker node stopped"
after=$(($(last_step) + 1))
wait_for 'running || fail "training ended after the node stopped: $(tail -5 "$log")"; [ "$(last_step)" -ge "$after" ]' 900
say "step $(last_step) done on the head's replica alone: docker start the worker node"
docker start "$worker" >/dev/null
wait_for '[ "$(alive_nodes)" = 2 ]' 600
say "worker node rejoined the cluster; waiting for its replica"
wait_for 'grep -q "bringing .* rollout replica(s) to version" "$log" || ! running' 1200
grep -q "bringing .* rollout replica(s) to version" "$log" || fail "the rejoined replica was never brought to the learner's version"
say "learner: $(grep -o 'bringing .* rollout replica(s) to version [0-9]*' "$log" | tail -1) (at step $(last_step))"
rejoined=$(($(last_step) + 3))
wait_for 'running || fail "training ended: $(tail -5 "$log")"; [ "$(last_step)" -ge "$rejoined" ]' 600
# The run is long enough for any rejoin time; it has shown what it had to: stop it (its step log is complete
# up to here; a real run would go on, or resume from its last checkpoint).
# The image has no procps (pkill): find `rlep train` by its command line and send it SIGINT.
docker exec "$head" python -c "
import os, signal
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')
    except OSError:
        continue
    if len(argv) > 2 and argv[1].endswith(b'/rlep') and argv[2] == b'train':
        os.kill(int(pid), signal.SIGINT)
        print(f'SIGINT to rlep train (pid {pid})')
" || fail "could not signal rlep train"
wait "$train" || true
say "training stopped after step $(last_step) (SIGINT)"

# The timeline from the step records, and the checks.
in_head cat /cache/cluster/log.jsonl | python3 -c "
import json, sys
rows = [json.loads(l) for l in sys.stdin if 'rollout_replicas' in l]
print('step  replicas  failovers  version  sequences  replayed  seconds')
for r in rows:
    print(f\"{r['step']:>4}  {r['rollout_replicas']:>8}  {r['rollout_failovers']:>9}  {r['policy_version']:>7}  {r['sequences']:>9}\"
          f\"  {r['replay_used']:>8}  {r['step_seconds']:>7.1f}\")
seen = [r['rollout_replicas'] for r in rows]
assert [r['step'] for r in rows] == list(range(1, len(rows) + 1)), 'a step is missing or repeated'
assert seen[0] == 2, 'the run did not start on two replicas'
assert 1 in seen, 'no step ran on the head replica alone'
last_alone = max(i for i, n in enumerate(seen) if n == 1)
assert 2 in seen[last_alone + 1:] and seen[-1] == 2, 'the replica did not come back'
assert all(r['sequences'] == 4 * (4 + 2) for r in rows), 'a step lost samples'
print('checks passed: 2 -> 1 -> 2 serving replicas, every step complete (4 questions x (4 fresh + 2 replayed))')
" || fail "timeline checks"
grep -E "retrying the shard elsewhere|bringing|left out of|WARNING" "$log" | sed 's/^/  learner log: /' | head -20 || true
say "done"
