"""Experiments: multi-run protocols that compare training settings over seeds (`rlep.experiments.protocol`).

The top layer of the package: it runs jobs through the launch room and the demo's task, and nothing imports it.
Speed and memory measurements beside a reference are `benchmarks/`, not here.
"""
