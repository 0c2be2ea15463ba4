"""The learner's view of a tempered, top-p sampler (`processed_logprobs`): equal to vLLM's own, and to a hand
computation; and what `rlep train` says when the replicas return the other kind of logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from rlep.services.launch.training import logprobs_mode_problem
from rlep.services.learner.batch import LogitProcessing, processed_logprobs, token_scores


def test_a_hand_worked_nucleus():
    # probabilities at T=1: [0.5, 0.3, 0.15, 0.05]; top_p 0.7 keeps {0.5, 0.3} (the rest's mass 0.2 <= 0.3).
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    got = [float(processed_logprobs(logits, torch.tensor([t]), 1.0, 0.7)) for t in range(4)]
    assert got[0] == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)
    assert got[1] == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    assert got[2] == got[3] == float("-inf")  # outside the nucleus: the sampler could not draw them
    # Temperature 0.5 squares the probabilities before normalising; top_p 1 keeps every token.
    squared = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    assert float(processed_logprobs(logits, torch.tensor([1]), 0.5, 1.0)) == pytest.approx(
        math.log(0.09 / float(squared.sum())), abs=1e-6
    )
    # Untempered and unfiltered it is the model's own distribution.
    assert torch.equal(processed_logprobs(logits, torch.tensor([2]), 1.0, 1.0), torch.log_softmax(logits, -1)[:, 2])


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.95), (1.0, 0.5), (1.3, 0.9), (0.6, 1.0)])
def test_equal_to_vllms_processed_logprobs(temperature, top_p):
    """vLLM's v1 sampler: logits / temperature, `apply_top_k_top_p_pytorch`, log-softmax (its processed mode)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=generator) * 3
    targets = torch.randint(0, 300, (64,), generator=generator)
    p = torch.full((64,), top_p) if top_p < 1 else None
    theirs = apply_top_k_top_p_pytorch(logits.clone() / temperature, None, p).log_softmax(-1)
    ours = processed_logprobs(logits, targets, temperature, top_p)
    expected = theirs.gather(-1, targets[:, None]).squeeze(-1)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(ours[finite], expected[finite], atol=1e-6)
    if top_p < 1:
        assert torch.isinf(ours).any()  # some targets fell outside: the test covers the masking


def test_token_scores_give_the_processed_view_chunk_by_chunk():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 9, 16, generator=generator)
    head = torch.nn.Linear(16, 40, bias=False)
    tokens = torch.randint(0, 40, (3, 9), generator=generator)
    with torch.no_grad():
        raw, processed = token_scores(hidden, head, tokens, chunk_positions=5, sampling=LogitProcessing(0.8, 0.9))
        plain, entropy = token_scores(hidden, head, tokens, chunk_positions=5, with_entropy=False)
        logits = head(hidden[:, :-1]).reshape(-1, 40)
        expected = processed_logprobs(logits, tokens[:, 1:].reshape(-1), 0.8, 0.9).view(3, 8)
    assert entropy is None
    assert torch.equal(raw, plain)  # the model's own logprobs, from the same head application
    # Chunked and whole head applications are matmuls of other shapes: equal up to float rounding on some CPUs.
    assert torch.equal(processed.isinf(), expected.isinf())
    torch.testing.assert_close(processed, expected, rtol=1e-6, atol=1e-6)


def test_greedy_has_no_sampling_distribution():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        processed_logprobs(torch.zeros(1, 3), torch.tensor([0]), 0.0, 1.0)


def test_replicas_returning_the_other_logprobs_are_named():
    assert logprobs_mode_problem("raw_logprobs", {"raw_logprobs"}) is None
    assert logprobs_mode_problem("raw_logprobs", {""}) is None  # an older server: vLLM's default, raw
    assert logprobs_mode_problem("processed_logprobs", {"processed_logprobs"}) is None
    problem = logprobs_mode_problem("processed_logprobs", {"raw_logprobs", "processed_logprobs"})
    assert "engine.logprobs_mode: processed_logprobs" in problem and "raw_logprobs" in problem
    assert "processed_logprobs" in logprobs_mode_problem("raw_logprobs", {"processed_logprobs"})
