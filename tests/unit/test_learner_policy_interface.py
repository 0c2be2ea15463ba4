"""The `Policy` Protocol is the one list of policy calls: the local `DeepSpeedPolicy`, `RayPolicy` and its actor
all offer exactly its calls with its signatures, and the generated Ray methods forward and fan out as marked."""

from __future__ import annotations

import inspect

import pytest

from rlep.services.learner import ray_policy
from rlep.services.learner.policy import DeepSpeedPolicy
from rlep.services.learner.policy_interface import Policy, spread_calls
from rlep.services.learner.ray_policy import PolicyProcess, RayPolicy

# Every call but broadcast_address and sender_device (asked of rank 0 alone) goes to all ranks.
RANK0_RESULT = {
    "logprobs", "reference_logprobs", "logprobs_with_processed", "update", "state_dict", "push_weights",
    "load_checkpoint", "rng_state", "weight_manifest",
}  # fmt: skip
NO_RESULT = {"save_hf", "save_checkpoint", "broadcast_weights"}


def protocol_calls() -> set[str]:
    return {name for name, member in vars(Policy).items() if inspect.isfunction(member) and not name.startswith("_")}


def without_ray_tracing(signature: inspect.Signature) -> inspect.Signature:
    """Ray adds `_ray_trace_ctx` to every actor method's signature when `ray.remote` is applied."""
    return signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "_ray_trace_ctx"])


def test_spread_calls_are_every_call_but_those_asked_of_rank_0():
    assert protocol_calls() == RANK0_RESULT | NO_RESULT | {"broadcast_address", "sender_device"}
    assert spread_calls() == {**dict.fromkeys(RANK0_RESULT, True), **dict.fromkeys(NO_RESULT, False)}


@pytest.mark.parametrize("implementation", [DeepSpeedPolicy, RayPolicy, PolicyProcess])
def test_implementations_offer_the_protocols_calls_with_its_signatures(implementation):
    calls = protocol_calls() if implementation is not PolicyProcess else set(spread_calls())
    for name in calls:
        method = getattr(implementation, name)
        assert method is not getattr(Policy, name), f"{implementation.__name__}.{name} is the Protocol's stub"
        got = without_ray_tracing(inspect.signature(method))
        assert got == inspect.signature(getattr(Policy, name)), f"{implementation.__name__}.{name}"


def test_the_actor_forwards_each_call_to_its_policy():
    class Recording:
        def __getattr__(self, name):
            return lambda *args, **kwargs: (name, args, kwargs)

    process = PolicyProcess()
    process.policy = Recording()
    assert process.update("batch", rows_per_mini_batch=4) == ("update", ("batch",), {"rows_per_mini_batch": 4})
    assert process.save_hf("out", "tok") == ("save_hf", ("out", "tok"), {})


def test_ray_policy_calls_every_actor_and_answers_as_marked(monkeypatch):
    class Method:
        def __init__(self, rank, name, calls):
            self.rank, self.name, self.calls = rank, name, calls

        def remote(self, *args, **kwargs):
            self.calls.append((self.rank, self.name, args, kwargs))
            return f"{self.name} from rank {self.rank}"

    class Actor:
        def __init__(self, rank, calls):
            self.rank, self.calls = rank, calls

        def __getattr__(self, name):
            return Method(self.rank, name, self.calls)

    calls: list = []
    monkeypatch.setattr(ray_policy.ray, "get", lambda refs: list(refs))
    policy = object.__new__(RayPolicy)  # no actors started: only the generated methods are under test
    policy.actors = [Actor(rank, calls) for rank in range(3)]

    assert policy.update("batch", 8) == "update from rank 0"
    assert calls == [(rank, "update", ("batch", 8), {}) for rank in range(3)]
    calls.clear()
    assert policy.save_checkpoint("dir", "step_1", client_state={}) is None
    assert calls == [(rank, "save_checkpoint", ("dir", "step_1"), {"client_state": {}}) for rank in range(3)]
