"""The hostile-client campaign of `benchmarks/hostile_clients.py`, one module per service attacked: `replay`,
`verifier` (its HTTP scorers too), `eval`, `rollout`, `load` (what held must keep holding) and `mixed` (64 callers
of every kind at once, beside a legitimate client); `common` holds the service process and the probes they share."""
