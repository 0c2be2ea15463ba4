"""A real vLLM CPU worker behind gRPC: generation, versioned weight pushes, logprobs vs transformers, bad input."""

from __future__ import annotations

import hashlib
import math
import threading
import time
import urllib.error

import grpc
import pytest
import torch
import xxhash

from rlep.common.grpc_channel import make_channel
from rlep.common.types import FinishReason
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.rollout.types import Sampling
from rlep.services.weights.broadcast import BroadcastGroup
from rlep.services.weights.payload import to_payload
from rlep.services.weights.staging import PUSH_PREFIX, default_staging_dir, staged_file
from rlep.services.weights.transport import (
    SharedFileTransport,
    StreamTransport,
    broadcast_messages,
    shared_file_messages,
    stream_payload,
)
from rlep.services.weights.wire import DataChunk
from tests.metrics_util import scrape, series_value, service_labels

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [{"role": "user", "content": "12+30=?"}]


def perturbed_state_dict(hf_model, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (t + 0.05 * torch.randn(t.shape, generator=generator)).contiguous()
        for name, t in hf_model.state_dict().items()
        if name != "lm_head.weight"
    }


def hf_logprobs(hf_model, state_dict, prompt_ids: list[int], sample_ids: list[int]) -> torch.Tensor:
    hf_model.load_state_dict(state_dict, strict=False)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + sample_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(sample_ids) - 1)
    return logprobs[positions, torch.tensor(sample_ids)]


def test_generate_all_prompt_kinds_with_logprobs_and_version(rollout_client, rollout):
    token_prompt = rollout.engine.tokenizer.encode("Q: 7+8=?\nA: ", add_special_tokens=False)
    prompts = [PROMPT, token_prompt, "Q: 1+2=?\nA: "]
    completions = rollout_client.generate(prompts, Sampling(n=3, temperature=1.0, max_tokens=24, seed=7))
    assert len(completions) == 3
    assert completions[1].prompt_token_ids == token_prompt
    assert completions[0].prompt_token_ids == rollout.engine.tokenizer.encode(
        "Q: 12+30=?\nA: ", add_special_tokens=False
    )
    version = rollout.engine.version
    for completion in completions:
        assert len(completion.samples) == 3
        for sample in completion.samples:
            assert 1 <= len(sample.token_ids) <= 24
            assert len(sample.logprobs) == len(sample.token_ids)
            assert all(lp <= 0 and math.isfinite(lp) for lp in sample.logprobs)
            assert sample.policy_version == version
            assert sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert sample.text == rollout.engine.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    # A seed makes a request reproducible.
    again = rollout_client.generate(prompts, Sampling(n=3, temperature=1.0, max_tokens=24, seed=7))
    assert [[s.token_ids for s in c.samples] for c in again] == [[s.token_ids for s in c.samples] for c in completions]


@pytest.mark.parametrize("prompts_per_call", [1024, 2], ids=["one call", "split into calls of 2"])
def test_each_prompt_of_a_seeded_request_draws_its_own_samples(rollout, auth_token_file, prompts_per_call):
    """vLLM seeds every prompt of a request with the request's seed unless told otherwise: identical prompts then
    got identical samples, and an evaluation's accuracy over Q questions varied far beyond sqrt(p(1-p)/Q). The
    client splits a call into shards: prompt i of one shard must not share prompt i of another's stream either."""
    from rlep.services.rollout.client import RolloutClient

    client = RolloutClient(
        [f"127.0.0.1:{rollout.port}"], token=auth_token_file.read_text().strip(), max_prompts_per_call=prompts_per_call
    )
    sampling = Sampling(n=2, temperature=1.0, max_tokens=16, seed=11)
    try:
        completions = client.generate([PROMPT] * 4, sampling)
        samples = [tuple(tuple(s.token_ids) for s in c.samples) for c in completions]
        assert len(set(samples)) == 4, "four identical prompts, one seed: some drew the same random stream"
        again = client.generate([PROMPT] * 4, sampling)
        assert [tuple(tuple(s.token_ids) for s in c.samples) for c in again] == samples  # still reproducible
    finally:
        client.close()


def test_pushed_weights_give_transformers_logprobs(rollout_client, rollout, hf_model):
    """After a streamed push, the worker's sampled-token logprobs equal an HF forward of the pushed weights."""
    version = rollout.engine.version + 1
    state_dict = perturbed_state_dict(hf_model, seed=version)
    [reply] = rollout_client.push_weights(state_dict, version, transport=StreamTransport())
    assert reply.version == version and rollout_client.versions() == [version]

    [completion] = rollout_client.generate([PROMPT], Sampling(n=4, temperature=1.0, max_tokens=32, seed=3))
    worst = 0.0
    for sample in completion.samples:
        assert sample.policy_version == version
        expected = hf_logprobs(hf_model, state_dict, completion.prompt_token_ids, sample.token_ids)
        worst = max(worst, (torch.tensor(sample.logprobs) - expected).abs().max().item())
    # float32 on both sides (measured ~1e-6); the residue is summation order in the kernels.
    assert worst < 1e-4, f"max |vLLM - transformers| logprob difference {worst}"


def test_zero_weights_through_shared_memory_give_uniform_logprobs(rollout_client, rollout, hf_model):
    version = rollout.engine.version + 1
    zeros = {name: torch.zeros_like(t) for name, t in perturbed_state_dict(hf_model, 0).items()}
    [reply] = rollout_client.push_weights(zeros, version, transport=SharedFileTransport())
    assert reply.version == version
    [completion] = rollout_client.generate([PROMPT], Sampling(n=2, temperature=1.0, max_tokens=16, seed=1))
    uniform = -math.log(rollout.engine.vocab_size)
    for sample in completion.samples:
        assert sample.logprobs == pytest.approx([uniform] * len(sample.token_ids), abs=1e-4)


def test_a_response_never_mixes_versions_under_concurrent_pushes(rollout_client, rollout, hf_model):
    engine = rollout.engine
    seen: list[set[int]] = []  # the versions found in each response
    errors: list[BaseException] = []
    stop = threading.Event()

    def generate_repeatedly():
        try:
            while not stop.is_set():
                completions = rollout_client.generate([PROMPT] * 4, Sampling(n=4, max_tokens=64))
                seen.append({s.policy_version for c in completions for s in c.samples})
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=generate_repeatedly) for _ in range(3)]
    for t in threads:
        t.start()
    start, behind = engine.version, engine.loads_behind_generation
    pushed = 0
    try:
        while pushed < 2 or (engine.loads_behind_generation == behind and pushed < 6):
            # Pushed while a batch generates, the load has to wait for that batch: what this test is about.
            assert engine.wait_until(lambda e: e.batch_running, timeout_s=60)
            pushed += 1
            rollout_client.push_weights(perturbed_state_dict(hf_model, start + pushed), start + pushed)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert engine.loads_behind_generation > behind, "no push landed while a batch was generating"
    assert all(len(versions) == 1 for versions in seen), seen
    assert set().union(*seen) <= set(range(start, start + pushed + 1))
    assert engine.version == start + pushed


def _long_call(stub, timeout_s: float):
    """Far more work than the tests wait for: 64 prompts x 16 samples x up to 480 tokens (~100 on average)."""
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(text=f"Q: {i}+{i}=?\nA: ") for i in range(64)],
        sampling=rollout_pb2.SamplingOptions(n=16, temperature=1.0, max_tokens=480),
    )
    return stub.Generate.future(request, timeout=timeout_s)


def test_a_cancelled_generate_aborts_its_vllm_requests(stub, rollout):
    engine = rollout.engine
    aborted = engine.aborted_requests
    call = _long_call(stub, timeout_s=300)
    assert engine.wait_until(lambda e: e.batch_running and e.running_requests > 0, timeout_s=120)
    call.cancel()
    assert engine.wait_until(lambda e: e.aborted_requests > aborted, timeout_s=60), "the cancelled call kept running"
    assert engine.running_requests == 0
    # The engine is free at once: a small call does not wait for the abandoned one's ~100k tokens.
    started = time.monotonic()
    assert _generate(stub, [TEXT]).completions[0].samples[0].token_ids
    print(f"small Generate right after a cancelled long one: {time.monotonic() - started:.2f} s")


def test_a_generate_past_its_deadline_aborts_its_vllm_requests(stub, rollout):
    engine = rollout.engine
    aborted = engine.aborted_requests
    call = _long_call(stub, timeout_s=3)
    assert call.exception(timeout=60).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert engine.wait_until(lambda e: e.aborted_requests > aborted, timeout_s=60), "work went on past the deadline"
    assert engine.running_requests == 0


def test_refused_sampling_leaves_the_replica_serving(stub, rollout):
    """vLLM refuses these inside SamplingParams: built on the engine thread they would kill it and wedge the replica."""
    refused = [
        ({"n": 2, "temperature": 0.0}, "greedy sampling gives n identical samples; send n=1 or temperature > 0"),
        ({"temperature": 5.0}, "sampling.temperature must be in [0, 2]"),
    ]
    for sampling, message in refused:
        with pytest.raises(grpc.RpcError) as info:
            _generate(stub, [TEXT], timeout_s=30, **sampling)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
    # Still generating, with any seed the proto can carry.
    for seed in (-(2**63), 2**63 - 1):
        reply = _generate(stub, [TEXT], timeout_s=60, n=2, temperature=1.0, seed=seed)
        assert all(s.token_ids for s in reply.completions[0].samples)
    assert engine_ok(rollout)


def engine_ok(rollout) -> bool:
    return rollout.engine.failure is None and not rollout.watchdog.tripped.is_set()


def _abort_code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _generate(stub, prompts, timeout_s: float = 120, **sampling) -> rollout_pb2.GenerateResponse:
    options = {"n": 1, "max_tokens": 8, **sampling}
    return stub.Generate(
        rollout_pb2.GenerateRequest(prompts=prompts, sampling=rollout_pb2.SamplingOptions(**options)), timeout=timeout_s
    )


TEXT = rollout_pb2.Prompt(text="Q: 1+1=?\nA: ")


@pytest.mark.parametrize(
    ("prompts", "sampling", "message"),
    [
        ([], {}, "no prompts"),
        ([TEXT], {"n": 0}, "sampling.n"),
        ([TEXT], {"n": 100_000}, "sampling.n"),
        ([TEXT], {"max_tokens": 100_000}, "exceed the model length"),
        ([TEXT], {"max_tokens": 0}, "max_tokens"),
        ([TEXT], {"temperature": -1.0}, "temperature"),
        ([TEXT], {"top_p": 1.5}, "top_p"),
        ([rollout_pb2.Prompt(text="")], {}, "empty"),
        ([rollout_pb2.Prompt(tokens=rollout_pb2.TokenPrompt(token_ids=[5, 10_000]))], {}, "outside the vocabulary"),
        ([rollout_pb2.Prompt()], {}, "set one of"),
        ([rollout_pb2.Prompt(chat=rollout_pb2.ChatPrompt(messages=[{"role": "robot", "content": "x"}]))], {}, "role"),
    ],
)
def test_bad_generate_requests_are_invalid_argument(stub, prompts, sampling, message):
    err = _abort_code(lambda: _generate(stub, prompts, **sampling))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.details()


def test_unknown_fields_are_refused(rollout, auth_token_file):
    channel = make_channel(f"127.0.0.1:{rollout.port}", auth_token_file.read_text().strip())
    raw = channel.unary_unary("/rlep.rollout.v1.Rollout/Generate")
    known = rollout_pb2.GenerateRequest(prompts=[TEXT], sampling=rollout_pb2.SamplingOptions(n=1, max_tokens=4))
    unknown_field_99 = bytes([(99 << 3 | 0) & 0x7F | 0x80, 99 >> 4, 1])  # varint field 99 = 1
    err = _abort_code(lambda: raw(known.SerializeToString() + unknown_field_99, timeout=60))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown fields" in err.details()


def _push(stub, header: rollout_pb2.WeightHeader, payload: bytes | None = None, shared_file: str | None = None):
    if shared_file is not None:
        messages = iter(shared_file_messages(header, shared_file))
    else:  # as a plain protobuf client sends them (RolloutClient's encode_chunk puts the same bytes on the wire)
        messages = (
            rollout_pb2.WeightChunk(data=bytes(c.data)) if isinstance(c, DataChunk) else c
            for c in stream_payload(header, payload)
        )
    return stub.UpdateWeights(messages, timeout=120)


def _header(version: int, payload: bytes, **override) -> rollout_pb2.WeightHeader:
    fields = {"version": version, "sha256": hashlib.sha256(payload).hexdigest(), "total_bytes": len(payload)}
    return rollout_pb2.WeightHeader(**{**fields, **override})


def test_bad_weight_pushes_are_refused_and_the_old_version_keeps_serving(stub, rollout, hf_model):
    good = perturbed_state_dict(hf_model, 11)
    version = rollout.engine.version
    renamed = dict(good)
    renamed["model.embed_tokens.weight_typo"] = renamed.pop("model.embed_tokens.weight")
    reshaped = {**good, "model.norm.weight": torch.ones(7)}
    half = {**good, "model.norm.weight": good["model.norm.weight"].to(torch.bfloat16)}
    cases = {
        "missing": to_payload(renamed),
        "shape": to_payload(reshaped),
        "dtype": to_payload(half),
    }
    for problem, payload in cases.items():
        err = _abort_code(lambda p=payload: _push(stub, _header(version + 1, p), p))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, problem
        assert "do not fit the model" in err.details(), err.details()

    payload = to_payload(good)
    checks = [
        (_header(version + 1, payload, sha256="0" * 64), payload, "sha256"),
        (_header(version + 1, payload, total_bytes=len(payload) + 10), payload, "received"),
        (_header(version + 1, payload, sha256="xyz"), payload, "64 lowercase hex"),
        (_header(version, payload), payload, "not newer"),
        (_header(version + 1, b"not safetensors at all"), b"not safetensors at all", "not a safetensors"),
    ]
    for header, body, message in checks:
        err = _abort_code(lambda h=header, b=body: _push(stub, h, b))
        assert message in err.details(), (message, err.details())
        assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)

    err = _abort_code(lambda: _push(stub, _header(version + 1, payload), shared_file="/etc/passwd"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "must name a payload file" in err.details()
    err = _abort_code(lambda: stub.UpdateWeights(iter([rollout_pb2.WeightChunk(data=b"x")]), timeout=30))
    assert "first WeightChunk must be the header" in err.details()

    # Nothing changed: same version, still generating.
    assert stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).policy_version == version
    reply = _generate(stub, [TEXT])
    assert reply.policy_version == version and reply.completions[0].samples[0].token_ids


def test_a_corrupted_payload_is_refused_and_an_older_clients_sha256_push_is_taken(stub, rollout, hf_model):
    """One flipped byte in the tensor data (the header still parses and fits) is caught on both ways in."""
    version = rollout.engine.version
    payload = to_payload(perturbed_state_dict(hf_model, 21))
    header = rollout_pb2.WeightHeader(
        version=version + 1,
        digest_algorithm=rollout_pb2.XXH3_128,
        digest=xxhash.xxh3_128(payload).hexdigest(),
        total_bytes=len(payload),
    )
    corrupted = bytearray(payload)
    corrupted[-5] ^= 0x01
    refused = "xxh3_128 of the payload does not match the header: corrupted or changed on its way"
    err = _abort_code(lambda: _push(stub, header, bytes(corrupted)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == refused
    with staged_file(default_staging_dir(), PUSH_PREFIX) as (_, path):
        path.write_bytes(corrupted)
        err = _abort_code(lambda: _push(stub, header, shared_file=str(path)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == refused
    assert stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).policy_version == version

    # A client from before `digest` sends only sha256: still checked, and taken.
    legacy = _header(version + 1, payload)
    assert not legacy.digest and legacy.digest_algorithm == rollout_pb2.DIGEST_ALGORITHM_UNSPECIFIED
    assert _push(stub, legacy, payload).version == version + 1


def test_rpcs_need_the_token(rollout):
    anonymous = rollout_pb2_grpc.RolloutStub(make_channel(f"127.0.0.1:{rollout.port}"))
    err = _abort_code(lambda: anonymous.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def _value(text: str, series: str) -> float:
    """A counter's value, 0 before its first increment (a labelled series appears only then)."""
    try:
        return series_value(text, series)
    except AssertionError:
        return 0.0


def test_status_and_metrics(stub, rollout, rollout_client, auth_token_file, hf_model):
    token = auth_token_file.read_text().strip()
    before = scrape(rollout.metrics_port, token)
    [completion] = rollout_client.generate(["Q: 3+3=?\nA: "], Sampling(n=2, max_tokens=8))
    tokens = sum(len(s.token_ids) for s in completion.samples)
    version = rollout.engine.version + 1
    rollout_client.push_weights(perturbed_state_dict(hf_model, version), version)
    status = stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
    assert status.policy_version == version
    assert status.vocab_size == 128 and status.max_model_len == 512 and status.generated_tokens > 0
    # One vLLM worker (TP=1), so a broadcast gives this replica one rank; 0 would mean "not reported".
    assert status.workers == 1 and rollout_client.reported_workers([f"127.0.0.1:{rollout.port}"]) == [1]
    after = scrape(rollout.metrics_port, token)
    assert service_labels(after) == {"rollout"}

    def grew(series: str) -> float:
        return _value(after, series) - _value(before, series)

    # One Generate and one push happened between the two scrapes, and nothing else did.
    assert grew("rlep_rollout_generated_tokens_total") == tokens
    assert grew('rlep_rollout_requests_total{code="OK",method="Generate"}') == 1
    assert grew('rlep_rollout_requests_total{code="OK",method="UpdateWeights"}') == 1
    assert grew("rlep_rollout_generate_seconds_count") == 1 and grew("rlep_rollout_queue_seconds_count") == 1
    assert grew("rlep_rollout_weight_update_seconds_count") == 1
    assert series_value(after, "rlep_rollout_weight_version") == version
    assert series_value(after, "rlep_rollout_requests_in_flight") == 0
    assert series_value(after, "rlep_rollout_batch_tokens_per_second") > 0


def test_metrics_need_the_token(rollout):
    with pytest.raises(urllib.error.HTTPError) as info:
        scrape(rollout.metrics_port)
    assert info.value.code == 401


def _broadcast_push(stub, version: int, entries, master_port: int = 29650, rank_offset: int = 1):
    """An UpdateWeights call that asks the worker to receive `entries` over NCCL (GPU workers only)."""
    group = BroadcastGroup("127.0.0.1", master_port, world_size=2)
    return stub.UpdateWeights(iter(broadcast_messages(version, entries, group, rank_offset)), timeout=30)


def test_nccl_broadcast_pushes_are_checked_and_a_cpu_worker_declines_them(stub, rollout, hf_model):
    """The GPU path's control half: the manifest is checked like any payload; a CPU worker says it can't."""
    from rlep.services.weights.broadcast import manifest

    version = rollout.engine.version
    entries = manifest(perturbed_state_dict(hf_model, 12))
    reshaped = [(n, type(i)(i.dtype, (7,)) if n == "model.norm.weight" else i) for n, i in entries]
    bad = {
        "do not fit the model": lambda: _broadcast_push(stub, version + 1, reshaped),
        "names a tensor twice": lambda: _broadcast_push(stub, version + 1, [*entries, entries[0]]),
        "rank_offset": lambda: _broadcast_push(stub, version + 1, entries, rank_offset=0),
        "master_port": lambda: _broadcast_push(stub, version + 1, entries, master_port=0),
    }
    for message, push in bad.items():
        err = _abort_code(push)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details(), (message, err.details())
    err = _abort_code(lambda: _broadcast_push(stub, version + 1, entries))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "needs a GPU worker" in err.details()
    assert stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).policy_version == version
