"""Rollout under hostile callers (issue 31 items 1 and 8): idle weight streams, and `shared_file` probes of paths
that are not payloads. Starts vLLM (a tiny model): only with `--with-rollout`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import grpc

from hostile.common import Service, idle_streams
from rlep.common.grpc_channel import make_channel
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc


def rollout_items(work: Path) -> dict:
    sets = ["engine.model=tiny", "engine.enforce_eager=true", "engine.max_model_len=256"]
    rollout = Service("rollout", *sets)
    stub = rollout_pb2_grpc.RolloutStub(make_channel(rollout.address))
    generate = lambda timeout=10: stub.Generate(  # noqa: E731
        rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(text="Q: 1+1=?\nA: ")], sampling=rollout_pb2.SamplingOptions(n=1, max_tokens=4)
        ),
        timeout=timeout,
    )
    try:
        generate(timeout=120)  # the first one pays vLLM's warm-up (over 10 s on 2 busy cores), which is not measured
        out = {
            "1 idle UpdateWeights streams": [
                idle_streams(rollout.address, lambda c: rollout_pb2_grpc.RolloutStub(c).UpdateWeights, generate, n)
                for n in (16, 64)
            ]
        }
        probes = {}
        for path in ("/etc/passwd", "/nonexistent/file", str(Path(tempfile.gettempdir()) / "rlep-push-x.safetensors")):
            header = rollout_pb2.WeightChunk(
                header=rollout_pb2.WeightHeader(version=99, total_bytes=17, sha256="0" * 64)
            )
            try:
                stub.UpdateWeights(iter([header, rollout_pb2.WeightChunk(shared_file=path)]), timeout=10)
                probes[path] = "OK"
            except grpc.RpcError as err:
                probes[path] = f"{err.code().name}: {err.details()}"
        out["8 shared_file answers identical for every path"] = len(set(probes.values())) == 1
        out["8 shared_file answer"] = next(iter(probes.values()))
    finally:
        rollout.stop()
    return out
