"""Rollout request logic without gRPC or vLLM (services/rollout/requests.py): prompts -> token ids, and weight intake
(header checks, a streamed payload staged and hashed, shared files, NCCL manifests)."""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
import xxhash

from rlep.rollout.v1 import rollout_pb2
from rlep.services.rollout.requests import PromptEncoder, WeightIntake
from rlep.services.weights.broadcast import BroadcastGroup, manifest_bytes, manifest_digest
from rlep.services.weights.payload import TensorInfo, WeightError, to_payload

STATE = {"embed.weight": torch.ones(8, 4), "norm.weight": torch.zeros(4)}


class CharTokenizer:
    """One token per character; chat renders as `role: content` lines."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def prompt(**kind) -> rollout_pb2.Prompt:
    return rollout_pb2.Prompt(**kind)


def test_prompts_become_token_ids_or_say_what_is_wrong():
    encoder = PromptEncoder(CharTokenizer(), vocab_size=100, max_model_len=16)
    chat = rollout_pb2.ChatPrompt(messages=[rollout_pb2.ChatMessage(role="user", content="hi")])
    tokens = rollout_pb2.TokenPrompt(token_ids=[1, 2, 3])
    ids = encoder.encode_all([prompt(text="ab"), prompt(chat=chat), prompt(tokens=tokens)], max_tokens=4)
    assert ids == [CharTokenizer().encode("ab"), CharTokenizer().encode("user: hi\n"), [1, 2, 3]]
    bad_role = rollout_pb2.ChatPrompt(messages=[rollout_pb2.ChatMessage(role="tool", content="x")])
    for prompts, message in [
        ([prompt(tokens=rollout_pb2.TokenPrompt(token_ids=[100]))], "prompts[0]: token id 100 outside the vocabulary"),
        ([prompt(text="a"), prompt(chat=rollout_pb2.ChatPrompt())], "prompts[1]: chat prompt without messages"),
        ([prompt(chat=bad_role)], "prompts[0]: unknown role 'tool'"),
        ([prompt(text="")], "prompts[0] is empty"),
        ([prompt()], "prompts[0]: set one of chat, tokens or text"),
        ([prompt(text="x" * 13)], "prompts[0]: 13 prompt tokens + max_tokens 4 exceed the model length 16"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            encoder.encode_all(prompts, max_tokens=4)


@pytest.fixture
def intake(tmp_path) -> WeightIntake:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(to_payload(STATE))
    (model / "config.json").write_text(json.dumps({}))
    for name in ("staging", "shared"):
        (tmp_path / name).mkdir()
    return WeightIntake(model, tmp_path / "staging", [tmp_path / "shared"])


def header_for(payload: bytes) -> rollout_pb2.WeightHeader:
    return rollout_pb2.WeightHeader(version=1, sha256=hashlib.sha256(payload).hexdigest(), total_bytes=len(payload))


def data_chunks(payload: bytes, size: int = 64):
    return iter([rollout_pb2.WeightChunk(data=payload[i : i + size]) for i in range(0, len(payload), size)])


def test_a_streamed_payload_is_staged_checked_and_removed_afterwards(intake, tmp_path):
    payload = to_payload(STATE)
    header = header_for(payload)
    assert intake.header_problem(header) is None
    with ExitStack() as staging:
        path = intake.receive(data_chunks(payload), header, staging)
        assert path.parent == tmp_path / "staging" and path.read_bytes() == payload
    assert not path.exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p, h: (p[:-1], h), "received .* bytes, header.total_bytes says"),
        (lambda p, h: (p + b"x", h), "more bytes than header.total_bytes"),
        (lambda p, h: (p, rollout_pb2.WeightHeader(version=1, sha256="0" * 64, total_bytes=len(p))), "sha256"),
    ],
)
def test_a_bad_stream_is_refused(intake, change, message):
    payload, header = change(to_payload(STATE), header_for(to_payload(STATE)))
    with ExitStack() as staging, pytest.raises(WeightError, match=message):
        intake.receive(data_chunks(payload), header, staging)


def test_a_payload_that_does_not_fit_the_model_is_refused(intake):
    payload = to_payload({"embed.weight": torch.ones(8, 4)})
    with ExitStack() as staging, pytest.raises(WeightError, match="missing 1 tensors"):
        intake.receive(data_chunks(payload), header_for(payload), staging)


def test_shared_files_must_be_payloads_in_a_shared_dir(intake, tmp_path):
    payload = to_payload(STATE)
    shared = tmp_path / "shared"
    (shared / "sub").mkdir()
    inside = shared / "rlep-push-1-a-b.safetensors"
    outside, nested, unnamed = tmp_path / inside.name, shared / "sub" / inside.name, shared / "w.safetensors"
    link = shared / "rlep-push-link.safetensors"
    secret = tmp_path / "secret.safetensors"
    for path in (inside, outside, nested, unnamed, secret):
        path.write_bytes(payload)
    link.symlink_to(secret)
    header = header_for(payload)
    with ExitStack() as staging:
        assert intake.receive(iter([rollout_pb2.WeightChunk(shared_file=str(inside))]), header, staging) == inside
        # Outside, nested, not a payload's name, a link out, missing, or the wrong size: one answer for all, so a
        # caller cannot probe the worker's files (which paths exist, and how large they are).
        wrong_size = rollout_pb2.WeightHeader(**{**_fields(header), "total_bytes": len(payload) + 1})
        refusals = [(p, header) for p in (outside, nested, unnamed, link, shared / "rlep-push-none.safetensors")]
        refusals += [(inside, wrong_size), (Path("/etc/passwd"), header)]
        messages = set()
        for path, head in refusals:
            with pytest.raises(WeightError) as info:
                intake.receive(iter([rollout_pb2.WeightChunk(shared_file=str(path))]), head, staging)
            messages.add(str(info.value))
        assert len(messages) == 1 and "rlep-push-*.safetensors directly in one of" in messages.pop()
        follow = iter([rollout_pb2.WeightChunk(shared_file=str(inside)), rollout_pb2.WeightChunk(data=b"x")])
        with pytest.raises(WeightError, match="nothing may follow a shared_file chunk"):
            intake.receive(follow, header, staging)
    assert inside.exists()  # the sender's file stays


def _fields(message) -> dict:
    return {field.name: value for field, value in message.ListFields()}


def test_implausible_headers_are_named(intake):
    good = header_for(to_payload(STATE))
    assert intake.header_problem(rollout_pb2.WeightHeader(sha256="A" * 64, total_bytes=10)).startswith(
        "header.sha256 must be 64 lowercase hex digits"
    )
    unknown = rollout_pb2.WeightHeader(digest_algorithm=99, digest="0" * 32, total_bytes=10)
    assert "unsupported header.digest_algorithm 99 (this worker knows SHA256, XXH3_128)" in intake.header_problem(
        unknown
    )
    short = rollout_pb2.WeightHeader(digest_algorithm=rollout_pb2.XXH3_128, digest="0" * 64, total_bytes=10)
    assert intake.header_problem(short) == "header.digest must be 32 lowercase hex digits for XXH3_128"
    huge = rollout_pb2.WeightHeader(sha256=good.sha256, total_bytes=1 << 40)
    assert "is not a plausible size for this model" in intake.header_problem(huge)


def test_a_broadcast_manifest_must_match_its_header_and_the_model(intake):
    entries = [(name, TensorInfo("F32", tuple(t.shape))) for name, t in STATE.items()]
    header = rollout_pb2.WeightHeader(version=1, sha256=manifest_digest(entries), total_bytes=manifest_bytes(entries))
    broadcast = rollout_pb2.NcclBroadcast(
        tensors=[rollout_pb2.TensorSpec(name=n, dtype=i.dtype, shape=i.shape) for n, i in entries],
        master_address="127.0.0.1",
        master_port=29500,
        world_size=2,
        rank_offset=1,
    )
    # No backend named: NCCL, what senders meant before the field existed; no timeout: the default.
    assert intake.broadcast_entries(header, broadcast, iter([])) == (BroadcastGroup("127.0.0.1", 29500, 2), entries)
    broadcast.backend, broadcast.timeout_s = rollout_pb2.GLOO, 5
    group, _ = intake.broadcast_entries(header, broadcast, iter([]))
    assert (group.backend, group.timeout_s) == ("gloo", 5)
    for field, value, message in [("backend", 9, "is not NCCL or GLOO"), ("timeout_s", -1, "timeout_s must be")]:
        bad = rollout_pb2.NcclBroadcast()
        bad.CopyFrom(broadcast)
        setattr(bad, field, value)
        with pytest.raises(WeightError, match=message):
            intake.broadcast_entries(header, bad, iter([]))
    broadcast.rank_offset = 0
    with pytest.raises(WeightError, match="rank_offset"):
        intake.broadcast_entries(header, broadcast, iter([]))
    header.sha256 = "0" * 64
    with pytest.raises(WeightError, match="sha256 of the manifest"):
        intake.broadcast_entries(header, broadcast, iter([]))


def xxh3_header_for(payload: bytes) -> rollout_pb2.WeightHeader:
    digest = xxhash.xxh3_128(payload).hexdigest()
    return rollout_pb2.WeightHeader(
        version=1, digest_algorithm=rollout_pb2.XXH3_128, digest=digest, total_bytes=len(payload)
    )


@pytest.mark.parametrize(("make_header", "algorithm"), [(header_for, "sha256"), (xxh3_header_for, "xxh3_128")])
@pytest.mark.parametrize("kind", ["stream", "shared_file"])
def test_a_payload_with_one_flipped_byte_is_refused(intake, tmp_path, make_header, algorithm, kind):
    """Both a current client's digest and an older client's sha256 are checked, on both ways in."""
    payload = to_payload(STATE)
    header = make_header(payload)
    assert intake.header_problem(header) is None
    corrupted = bytearray(payload)
    corrupted[len(payload) - 5] ^= 0x01  # inside the last tensor's data: the header still parses and fits
    for body, fine in ((payload, True), (bytes(corrupted), False)):
        if kind == "shared_file":
            path = tmp_path / "shared" / "rlep-push-1-a-b.safetensors"
            path.write_bytes(body)
            chunks = iter([rollout_pb2.WeightChunk(shared_file=str(path))])
        else:
            chunks = data_chunks(body)
        with ExitStack() as staging:
            if fine:
                assert intake.receive(chunks, header, staging).read_bytes() == payload
                continue
            with pytest.raises(WeightError) as info:
                intake.receive(chunks, header, staging)
        assert str(info.value) == (
            f"{algorithm} of the payload does not match the header: corrupted or changed on its way"
        )
