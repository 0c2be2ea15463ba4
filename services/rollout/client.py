"""Typed client of the rollout replicas: fans a batch out across them, gathers it back in order, pushes weights.

Used by the learner, `rlep collect` and eval. Replicas are plain gRPC addresses: given explicitly
(Kubernetes, standalone workers) or read from the Ray Serve deployment's registry
(`RolloutClient.from_ray`). A shard whose replica fails with a transient error (UNAVAILABLE: the
replica died or is restarting) is retried on another replica, so one lost replica costs no data.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc

from rlep.common.grpc_channel import make_channel
from rlep.common.grpc_retry import RETRYABLE_CODES
from rlep.common.wire import FINISH_FROM_PROTO
from rlep.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlep.services.rollout.config import GenerateDeadline
from rlep.services.rollout.discovery import Resolver, resolve_service
from rlep.services.rollout.types import Completion, SampleOut, Sampling, shard_seed
from rlep.services.weights.transport import AutoTransport, StateDictSource, WeightPush, WeightTransport
from rlep.services.weights.wire import encode_chunk

log = logging.getLogger(__name__)

# A prompt: token ids, raw text, or chat messages ({"role": ..., "content": ...}).
PromptLike = Sequence[int] | str | Sequence[Mapping[str, str]]
# A replica that dies mid-call surfaces as one of these; the shard goes to another replica.
FAILOVER_CODES = RETRYABLE_CODES | {grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL}


class RolloutError(RuntimeError):
    """No replica could serve a shard (every attempt failed)."""


@dataclass
class Replica:
    address: str
    stub: rollout_pb2_grpc.RolloutStub


@dataclass(frozen=True)
class ReplicaTarget:
    """How another process reaches a set of replicas: plain values, so it can cross to the learner's process
    that holds the weights (which then pushes them itself: `RolloutClient.from_target`)."""

    addresses: tuple[str, ...]
    token: str | None
    timeout_s: float
    dtype: str | None = None
    """The dtype the replicas' engines hold weights in (`RolloutStatus.dtype`, when they all agree): a push is cast
    to it before it is sent (what vLLM would do on load), so a float32 learner sends bfloat16 replicas half the
    bytes. None: unknown, pushes keep the starting checkpoint's dtype."""


@dataclass(frozen=True)
class PushResult:
    """Which replicas took a weight push and which were down (they get the weights when they are back)."""

    version: int
    updated: tuple[str, ...]
    down: tuple[str, ...] = ()
    replies: tuple[rollout_pb2.UpdateWeightsResponse, ...] = ()
    """The replicas' answers, in the order of `updated`."""


def prompt_to_proto(prompt: PromptLike) -> rollout_pb2.Prompt:
    if isinstance(prompt, str):
        return rollout_pb2.Prompt(text=prompt)
    items = list(prompt)
    if items and isinstance(items[0], Mapping):
        messages = [rollout_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in items]
        return rollout_pb2.Prompt(chat=rollout_pb2.ChatPrompt(messages=messages))
    return rollout_pb2.Prompt(tokens=rollout_pb2.TokenPrompt(token_ids=[int(t) for t in items]))


def sampling_to_proto(s: Sampling) -> rollout_pb2.SamplingOptions:
    return rollout_pb2.SamplingOptions(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        stop=s.stop,
        seed=s.seed,
    )


def completion_from_proto(c: rollout_pb2.Completion) -> Completion:
    samples = [
        SampleOut(
            token_ids=list(s.token_ids),
            text=s.text,
            logprobs=list(s.logprobs),
            finish_reason=FINISH_FROM_PROTO[s.finish_reason],
            policy_version=s.policy_version,
        )
        for s in c.samples
    ]
    return Completion(prompt_token_ids=list(c.prompt_token_ids), samples=samples)


def split_evenly(count: int, parts: int) -> list[range]:
    """Contiguous ranges covering [0, count), sizes differing by at most one, empty ones dropped."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        if size:
            ranges.append(range(start, start + size))
        start += size
    return ranges


def replica_addresses_on_ray(app_name: str = "rlep-rollout", wait_s: float = 120.0, expect: int = 1) -> list[str]:
    """Addresses of the live replicas of a Ray Serve rollout deployment (services/rollout/registry.py)."""
    from rlep.services.rollout.registry import replica_addresses

    return replica_addresses(app_name, wait_s=wait_s, expect=expect)


def rollout_stub(channel: grpc.Channel) -> rollout_pb2_grpc.RolloutStub:
    """A stub whose UpdateWeights also takes a streamed push's `DataChunk` views, each encoded in one copy
    (services/weights/wire.py); the bytes on the wire are protobuf's."""
    stub = rollout_pb2_grpc.RolloutStub(channel)
    stub.UpdateWeights = channel.stream_unary(
        "/rlep.rollout.v1.Rollout/UpdateWeights",
        request_serializer=encode_chunk,
        response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString,
    )
    return stub


class RolloutClient:
    """Args:
    timeout_s: deadline of one weight push (UpdateWeights).
    generate_deadline: deadline of one Generate call, from its size (default: `GenerateDeadline()`).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        token: str | None = None,
        timeout_s: float = 600.0,
        max_prompts_per_call: int = 1024,
        attempts: int = 3,
        generate_deadline: GenerateDeadline | None = None,
    ):
        if not addresses:
            raise ValueError("RolloutClient needs at least one replica address")
        self._token, self._timeout_s = token, timeout_s
        self._generate_deadline = generate_deadline or GenerateDeadline()
        self._max_prompts_per_call, self._attempts = max_prompts_per_call, attempts
        self.replicas = [self._connect(a) for a in addresses]
        # Replicas that serve generation; None = all. A replica found down is left out until a
        # check finds it up and on the right weights again (see `check`, `set_serving`).
        self._serving: list[Replica] | None = None
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="rollout-client")
        self._resolve: Callable[[], Sequence[str]] | None = None
        # Shard attempts that failed on one replica and went on to another (a replica lost mid-call).
        self.failovers = 0
        self._failovers_lock = threading.Lock()
        self._engine_dtype: str | None = None  # asked once, by the first `target`

    def _connect(self, address: str) -> Replica:
        channel = make_channel(address, self._token, max_message_bytes=512 * 1024 * 1024)
        return Replica(address, rollout_stub(channel))

    @classmethod
    def from_target(cls, target: ReplicaTarget) -> RolloutClient:
        """A client of the replicas `target` names, e.g. in the learner process that pushes the weights."""
        return cls(target.addresses, token=target.token, timeout_s=target.timeout_s)

    def target(self, replicas: Sequence[Replica] | None = None) -> ReplicaTarget:
        """The serving replicas (or `replicas`) as a `ReplicaTarget`, for a push made by another process."""
        chosen = replicas if replicas is not None else self.serving()
        return ReplicaTarget(tuple(r.address for r in chosen), self._token, self._timeout_s, self.engine_dtype())

    def engine_dtype(self) -> str | None:
        """The dtype every answering replica's engine runs in, or None when they differ or none answers."""
        if self._engine_dtype is None:
            dtypes = {s.dtype for _, s in self.check() if s is not None}
            self._engine_dtype = dtypes.pop() if len(dtypes) == 1 else None
        return self._engine_dtype

    @classmethod
    def from_ray(cls, app_name: str = "rlep-rollout", **kwargs) -> RolloutClient:
        """Replicas of a running Ray Serve rollout deployment (services/rollout/registry.py)."""
        from rlep.services.rollout.registry import replica_addresses

        client = cls(replica_addresses(app_name), **kwargs)
        client._resolve = lambda: replica_addresses(app_name)
        return client

    @classmethod
    def from_service(cls, service: str, resolve: Resolver = socket.getaddrinfo, **kwargs) -> RolloutClient:
        """Replicas named by DNS, `NAME:PORT` (Kubernetes: a headless Service; services/rollout/discovery.py);
        `refresh` resolves the name again (with `resolve`, `socket.getaddrinfo` unless a test passes another)."""
        addresses = resolve_service(service, resolve)
        if not addresses:
            raise RolloutError(f"rollout service {service!r} does not resolve to any replica")
        client = cls(addresses, **kwargs)
        client._resolve = lambda: resolve_service(service, resolve)
        return client

    @property
    def follows_a_source(self) -> bool:
        """Whether `refresh` re-reads the replicas from somewhere (DNS, the Ray registry); False: a fixed list."""
        return self._resolve is not None

    def refresh(self) -> list[str]:
        """Re-reads the replica list (Ray: replicas restarted by Serve come back under new addresses; DNS: pods
        rescheduled under new IPs). A source that names no replica (DNS down, no pod Ready) changes nothing.

        Returns the addresses that are new; they start at their initial weights until pushed to.
        """
        if self._resolve is None:
            return []
        known = {r.address: r for r in self.replicas}
        addresses = list(self._resolve())
        if not addresses:
            log.warning("the rollout replica source named no replica; keeping the %d known", len(known))
            return []
        self.replicas = [known.get(a) or self._connect(a) for a in addresses]
        if self._serving is not None:
            self._serving = [r for r in self._serving if r.address in addresses]
        return [a for a in addresses if a not in known]

    def serving(self) -> list[Replica]:
        return self._serving if self._serving else self.replicas

    def set_serving(self, replicas: Sequence[Replica]) -> None:
        self._serving = list(replicas)

    def check(self, timeout_s: float = 10.0) -> list[tuple[Replica, rollout_pb2.RolloutStatus | None]]:
        """Every replica with its status, or None when it does not answer (down or restarting)."""
        out = []
        for replica in self.replicas:
            try:
                out.append((replica, replica.stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=timeout_s)))
            except grpc.RpcError as err:
                if err.code() not in FAILOVER_CODES:
                    raise
                out.append((replica, None))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[PromptLike], sampling: Sampling) -> list[Completion]:
        """One Completion per prompt, in order; the prompts are spread over all replicas."""
        if not prompts:
            return []
        protos = [prompt_to_proto(p) for p in prompts]
        replicas = self.serving()
        shards = []
        for whole in split_evenly(len(protos), len(replicas)):
            for start in range(whole.start, whole.stop, self._max_prompts_per_call):
                shards.append(range(start, min(start + self._max_prompts_per_call, whole.stop)))

        def shard(i: int, prompts: range):
            options = sampling_to_proto(replace(sampling, seed=shard_seed(sampling.seed, prompts.start)))
            return self._pool.submit(self._generate_shard, replicas, protos[prompts.start : prompts.stop], options, i)

        futures = [shard(i % len(replicas), s) for i, s in enumerate(shards)]
        out: list[Completion] = []
        for future in futures:
            out.extend(future.result())
        return out

    def _generate_shard(self, replicas: list[Replica], prompts, options, first: int) -> list[Completion]:
        request = rollout_pb2.GenerateRequest(prompts=prompts, sampling=options)
        deadline_s = self._generate_deadline.seconds(len(prompts), options.n, options.max_tokens)
        errors = []
        for attempt in range(self._attempts * len(replicas)):
            replica = replicas[(first + attempt) % len(replicas)]
            try:
                reply = replica.stub.Generate(request, timeout=deadline_s)
            except grpc.RpcError as err:
                if err.code() not in FAILOVER_CODES:
                    raise
                error = f"{replica.address}: {err.code().name} {err.details()}"
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    error += (
                        f" ({len(prompts)} prompts x n={options.n} x {options.max_tokens} tokens passed its deadline "
                        f"of {deadline_s:.0f} s; a replica that is only slow needs a larger generate_deadline)"
                    )
                log.warning("rollout replica failed, retrying the shard elsewhere: %s", error)
                with self._failovers_lock:
                    self.failovers += 1
                errors.append(error)
                continue
            return [completion_from_proto(c) for c in reply.completions]
        raise RolloutError("no replica served the shard: " + "; ".join(errors[-3:]))

    # -- weights and status ------------------------------------------------------------------
    def status(self) -> list[rollout_pb2.RolloutStatus]:
        return [r.stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=30) for r in self.replicas]

    def reported_workers(self, addresses: Sequence[str]) -> list[int]:
        """The vLLM workers of the replicas at `addresses` (GetStatus `workers`; 0 from an older server), which a
        weight broadcast's group gives ranks to (services/weights/transport.py `BroadcastTransport`)."""
        by_address = {r.address: r for r in self.replicas}
        return [by_address[a].stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=30).workers for a in addresses]

    def versions(self) -> list[int]:
        """Policy versions of the replicas that answer."""
        return [s.policy_version for _, s in self.check() if s is not None]

    def max_model_len(self) -> int:
        """Prompt + response tokens every replica accepts (the smallest replica's limit)."""
        return min(s.max_model_len for s in self.status())

    def push_weights(
        self,
        state_dict: StateDictSource,
        version: int,
        transport: WeightTransport | None = None,
        replicas: Sequence[Replica] | None = None,
    ) -> list[rollout_pb2.UpdateWeightsResponse]:
        """Brings every serving replica (or `replicas`) to `version`: a full, checkpoint-named state dict (or a
        function giving it) sent by `transport` (services/weights/transport.py; default `AutoTransport`: one
        shared-memory file when every replica is on this host, else streamed over gRPC). A replica that is down
        is taken out of serving until a check finds it back (see `take_push_result`)."""
        targets = list(replicas if replicas is not None else self.serving())
        result = self.deliver_weights(state_dict, version, transport, targets)
        self.take_push_result(result)
        return list(result.replies)

    def deliver_weights(
        self,
        state_dict: StateDictSource,
        version: int,
        transport: WeightTransport | None = None,
        replicas: Sequence[Replica] | None = None,
    ) -> PushResult:
        """Sends one version to `replicas` (default: all of this client's) and says who took it; changes nothing
        in this client. Raises RolloutError when none took it, and any error that is not a replica being down."""
        targets = list(replicas if replicas is not None else self.replicas)
        transport = transport or AutoTransport()
        with transport.prepare(state_dict, version, [r.address for r in targets]) as push:
            return self._push_all(targets, push, version)

    def take_push_result(self, result: PushResult) -> None:
        """Leaves the replicas a push found down out of serving (the next check brings them back once they
        answer and have been updated)."""
        if result.down:
            self._serving = [r for r in self.serving() if r.address not in result.down]

    def _push_all(self, targets: Sequence[Replica], push: WeightPush, version: int) -> PushResult:
        """Pushes to every target; a replica that is down is reported, unless the push needs them all."""
        calls = zip(targets, push.requests, strict=True)
        futures = [(r, self._pool.submit(r.stub.UpdateWeights, m, timeout=self._timeout_s)) for r, m in calls]
        push.after_start()
        if push.all_replicas:
            replies = tuple(future.result() for _, future in futures)
            return PushResult(version, tuple(r.address for r in targets), replies=replies)
        replies, updated, down = [], [], []
        for replica, future in futures:
            try:
                replies.append(future.result())
                updated.append(replica.address)
            except grpc.RpcError as err:
                if err.code() not in FAILOVER_CODES:
                    raise
                log.warning(
                    "rollout replica %s is down (%s); it gets the weights when it is back", replica.address, err.code()
                )
                down.append(replica.address)
        if down and len(down) == len(targets):
            raise RolloutError(f"no rollout replica took the weights: {down} are down")
        return PushResult(version, tuple(updated), tuple(down), tuple(replies))
