"""Chunked per-token scores: equal to the full-vocabulary reference in value and gradient, on tiny HF models too."""

from __future__ import annotations

import pytest
import torch

from rlep.services.learner.batch import (
    ScoringModel,
    has_plain_lm_head,
    score_chunk_count,
    token_entropy,
    token_logprobs,
    token_scores,
)
from rlep.services.learner.micro_batch_plan import max_micro_batch_tokens


def _head_inputs(rows: int = 3, length: int = 11, hidden: int = 8, vocab: int = 50, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(rows, length, hidden, generator=gen)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen) * 2.0)  # peaked and flat rows alike
    tokens = torch.randint(0, vocab, (rows, length), generator=gen)
    return states, head, tokens


@pytest.mark.parametrize("chunk", [1, 7, 30, 1000])  # one position, chunks across rows, one chunk
def test_chunked_scores_equal_the_full_vocabulary_reference(chunk):
    states, head, tokens = _head_inputs()
    logprobs, entropy = token_scores(states, head, tokens, chunk_positions=chunk)
    with torch.no_grad():
        logits = head(states)
    torch.testing.assert_close(logprobs, token_logprobs(logits, tokens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, token_entropy(logits), atol=1e-5, rtol=1e-5)
    assert logprobs.shape == entropy.shape == (3, 10) and logprobs.dtype == entropy.dtype == torch.float32


@pytest.mark.parametrize("chunk", [4, 1000])
def test_chunked_gradient_equals_the_full_vocabulary_gradient(chunk):
    states, head, tokens = _head_inputs(seed=1)
    weights = torch.randn(3, 10, generator=torch.Generator().manual_seed(2))  # like advantages x mask

    def gradients(score) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = states.clone().requires_grad_(True)
        head.zero_grad()
        (score(hidden) * weights).sum().backward()
        return hidden.grad, head.weight.grad.clone()

    chunked = gradients(lambda h: token_scores(h, head, tokens, chunk_positions=chunk)[0])
    full = gradients(lambda h: token_logprobs(head(h), tokens))
    for got, want in zip(chunked, full, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_entropy_carries_no_gradient_and_can_be_skipped():
    states, head, tokens = _head_inputs()
    logprobs, entropy = token_scores(states.requires_grad_(True), head, tokens, chunk_positions=5)
    assert logprobs.requires_grad and not entropy.requires_grad
    logprobs_only, none = token_scores(states, head, tokens, with_entropy=False, chunk_positions=5)
    assert none is None
    torch.testing.assert_close(logprobs_only, logprobs)


def test_the_identity_head_scores_given_logits():
    logits = torch.randn(2, 6, 9) * 3
    tokens = torch.randint(0, 9, (2, 6))
    logprobs, entropy = token_scores(logits, torch.nn.Identity(), tokens, chunk_positions=4)
    torch.testing.assert_close(logprobs, token_logprobs(logits, tokens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, token_entropy(logits), atol=1e-5, rtol=1e-5)


def _tiny_qwen2(tie: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
    )
    return Qwen2ForCausalLM(config)


def _padded_batch(vocab: int):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (3, 12), generator=gen)
    attention = torch.ones_like(tokens)
    attention[1, 7:] = 0  # right padding, as build_batch lays rows out
    attention[2, 10:] = 0
    return tokens, attention


@pytest.mark.parametrize("tie", [True, False])
def test_scoring_model_matches_full_logits_in_value_and_gradient(tie):
    model = _tiny_qwen2(tie)
    scorer = ScoringModel(model, chunk_positions=5)
    assert scorer.plain_head
    tokens, attention = _padded_batch(model.config.vocab_size)
    weights = torch.randn(3, 11, generator=torch.Generator().manual_seed(4))

    model.zero_grad()
    logprobs, entropy = scorer(input_ids=tokens, attention_mask=attention)
    (logprobs * weights).sum().backward()
    chunked_grads = {k: p.grad.clone() for k, p in model.named_parameters()}

    model.zero_grad()
    logits = model(input_ids=tokens, attention_mask=attention).logits
    reference = token_logprobs(logits, tokens)
    (reference * weights).sum().backward()
    torch.testing.assert_close(logprobs, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, token_entropy(logits.detach()), atol=1e-5, rtol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(chunked_grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert set(scorer.state_dict()) == set(model.state_dict())  # checkpoints keep HF names


def test_softcapped_logits_take_the_full_logits_path():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.5,  # small, so softcapping visibly changes the logits
    )
    model = Gemma2ForCausalLM(config).eval()
    scorer = ScoringModel(model, chunk_positions=5)
    assert not scorer.plain_head and not has_plain_lm_head(config)
    tokens, attention = _padded_batch(config.vocab_size)
    with torch.no_grad():
        logprobs, entropy = scorer(input_ids=tokens, attention_mask=attention)
        logits = model(input_ids=tokens, attention_mask=attention).logits
        hidden = model.get_decoder()(input_ids=tokens, attention_mask=attention).last_hidden_state
        from_head, _ = token_scores(hidden, model.get_output_embeddings(), tokens)
    torch.testing.assert_close(logprobs, token_logprobs(logits, tokens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, token_entropy(logits), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(from_head, logprobs, atol=1e-2)  # the head alone would be wrong here


def test_bf16_model_scores_match_its_full_logits():
    model = _tiny_qwen2(tie=True).to(torch.bfloat16)
    tokens, attention = _padded_batch(model.config.vocab_size)
    with torch.no_grad():
        logprobs, entropy = ScoringModel(model, chunk_positions=5)(input_ids=tokens, attention_mask=attention)
        logits = model(input_ids=tokens, attention_mask=attention).logits
    assert logprobs.dtype == torch.float32
    # bf16 matmuls over a different number of rows may round differently: agreement to bf16 precision.
    torch.testing.assert_close(logprobs, token_logprobs(logits, tokens), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(entropy, token_entropy(logits), atol=2e-2, rtol=2e-2)


def test_the_head_runs_as_often_in_every_micro_batch_of_a_run():
    """ZeRO-3 prefetches by the order modules ran in the last forward + backward: micro-batches of different lengths
    must run the head the same number of times (forward and backward's recompute), or DeepSpeed drops the trace.
    Values and gradients stay those of the full logits, empty chunks included (4 positions in 5 chunks)."""
    model = _tiny_qwen2(tie=False)
    chunks = score_chunk_count(max_micro_batch_tokens(max_rows=3, max_tokens=None, longest_row=12), 8)
    assert chunks == 5  # 3 rows x 12 tokens in chunks of <= 8 positions
    scorer = ScoringModel(model, chunk_positions=8, chunks=chunks)
    calls = []
    model.lm_head.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    gen = torch.Generator().manual_seed(5)
    runs = []
    for rows, length in [(1, 5), (2, 9), (3, 12)]:  # 4, 16 and 33 positions
        tokens = torch.randint(0, model.config.vocab_size, (rows, length), generator=gen)
        attention = torch.ones_like(tokens)
        calls.clear()
        model.zero_grad()
        logprobs, _ = scorer(input_ids=tokens, attention_mask=attention)
        logprobs.sum().backward()
        runs.append(len(calls))
        assert sum(calls) == 2 * rows * (length - 1)  # every position once forward, once in backward's recompute
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        reference = token_logprobs(model(input_ids=tokens, attention_mask=attention).logits, tokens)
        reference.sum().backward()
        torch.testing.assert_close(logprobs, reference, atol=1e-5, rtol=1e-5)
        for got, param in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(got, param.grad, atol=1e-5, rtol=1e-4)
    assert runs == [2 * chunks] * 3


def test_a_zero3_run_sizes_its_head_chunks_for_its_largest_micro_batch():
    from rlep.common.config import CONFIG_DIR, load_config
    from rlep.services.learner.config import TrainConfig
    from rlep.services.learner.policy import head_chunks

    recipe = load_config(TrainConfig, CONFIG_DIR / "recipes" / "rlep.yaml")
    assert head_chunks(recipe) == 16  # 4 rows x (1,024 + 3,072) tokens / 1,024 positions per chunk
    budget = recipe.model_copy(update={"optim": recipe.optim.model_copy(update={"micro_batch_tokens": 6000})})
    assert head_chunks(budget) == 6  # the token budget bounds a micro-batch: 6,000 / 1,024 -> 6
    zero2 = recipe.model_copy(update={"deepspeed": recipe.deepspeed.model_copy(update={"zero_stage": 2})})
    assert head_chunks(zero2) == 1  # no prefetch trace to keep: as many 1,024-position chunks as a batch needs
