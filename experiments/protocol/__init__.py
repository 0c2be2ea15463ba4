"""Issue 29's protocol: RLEP against the M=0 baseline over paired seeds, its pools, archive and report.

`run` (the runner: `python -m rlep.experiments.protocol.run --help`), `config` (`ProtocolConfig`, the ablation cells,
each run's TrainConfig), `training` (the shared warm-up, one RL run), `pool` (phase 1: collection, coverage,
diversity), `archive` (finished runs kept in the repository, read back on resume), `finished` (what `--report-only`
reads back), `figures` and `report` (per-seed and paired figures; tables, PNG, JSON), `compare` (the statistics),
`intervals` (t intervals, the bootstrap beside them, Holm), `endpoints` (issue 49's named endpoints on a fixed
horizon, CPU pairing), `decision` (its pre-registered rule), `endpoint_tables` (their tables), `summary_report` (a
summary JSON reported again), `pilots` (the candidate tasks' pilots). Results, the archive included, are under
`results/`.
"""
