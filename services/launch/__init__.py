"""The launch room: starts the services a job needs and runs it (`stack`: the services, on Ray or given;
`training`: a training run; `collection`: phase 1 into a replay pool; `serve`: one service in this process, for
`rlep serve` and `rlep doctor`). Between learner/eval and the demo and the command line, which call it; the one
place that wires services from their `main` and `ray_app`."""
