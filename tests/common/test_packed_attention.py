"""Packed attention without a dense mask (`common/packed_attention.py`): the block mask built from
sequence lengths is each sequence's own causal pairs and nothing else, and a packed micro-batch's
logprobs and gradients through FlexAttention equal sdpa's over the dense block-diagonal mask (and
the padded layout's). On the CPU FlexAttention runs eagerly; CUDA compiles it."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention
from transformers import AutoModelForCausalLM

from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.modeling import lm_logprobs
from rolefleet.common.packed_attention import BLOCK, document_block_mask, resolve

# Boundaries inside tiles and on them, one sequence over several tiles, many tiny ones, one token.
LENGTHS = [[300, 5, 200], [BLOCK, BLOCK, 2 * BLOCK], [3] * 50 + [1], [1], [BLOCK * 3 + 17]]


def dense_document_mask(lengths: list[int]) -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.arange(len(doc))
    return (doc[:, None] == doc[None, :]) & (positions[:, None] >= positions[None, :])


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: f"{len(x)}seqs-{sum(x)}tokens")
def test_the_block_mask_is_each_sequence_s_causal_pairs(lengths):
    total = sum(lengths)
    mask = document_block_mask(torch.tensor(lengths), torch.device("cpu"))
    # Pair by pair (the tiles' own rule where they are partial, all pairs where full, none elsewhere).
    q = torch.randn(1, 2, total, 8)
    k, v = torch.randn(1, 2, total, 8), torch.randn(1, 2, total, 8)
    out = flex_attention(q, k, v, block_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(lengths))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Tiles no sequence spans are skipped: the work is each sequence's, not the whole triangle's.
    blocks = -(-total // BLOCK)
    visited = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    assert visited <= blocks * (blocks + 1) // 2
    if lengths == [BLOCK, BLOCK, 2 * BLOCK]:
        assert visited == 1 + 1 + 3 and int(mask.full_kv_num_blocks.sum()) == 1  # the 2-tile sequence's lower tile


def packed_batch(vocab: int) -> SequenceBatch:
    torch.manual_seed(0)
    lengths = [(5, 40), (130, 3), (7, 1), (60, 90)]  # (prompt, response): 336 tokens, three tiles
    return SequenceBatch.from_lists([torch.randint(3, vocab, (p,)) for p, _ in lengths],
                                    [torch.randint(3, vocab, (r,)) for _, r in lengths])


def logprobs_and_grads(model, batch, device, packed: bool, attention: str, dtype=None):
    model.zero_grad()
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        logprobs, _ = lm_logprobs(model, batch, device, 1.0, 64, False, packed, attention=attention)
    if not torch.is_grad_enabled():
        return logprobs, []
    logprobs.sum().backward()
    return logprobs.detach(), [p.grad.clone() for p in model.parameters()]


def test_packed_logprobs_through_flex_equal_the_dense_mask_s(tiny_model_dir):
    """(FlexAttention has no backward on the CPU: the gradients are the GPU test's below.)"""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch, cpu = packed_batch(model.config.vocab_size), torch.device("cpu")
    with torch.no_grad():
        padded, _ = logprobs_and_grads(model, batch, cpu, False, "sdpa")
        for attention in ("sdpa", "flex"):
            torch.testing.assert_close(logprobs_and_grads(model, batch, cpu, True, attention)[0], padded,
                                       atol=1e-5, rtol=1e-5)


def test_flex_is_chosen_per_call_so_checkpointing_s_recompute_runs_it_too_and_other_calls_stay_sdpa(
        tiny_model_dir, monkeypatch):
    """Activation checkpointing runs each layer's forward again in the backward: that recompute must
    attend as the forward did (a BlockMask handed to sdpa fails; a dense recompute would give other
    gradients). FlexAttention has no CPU backward, so a stand-in attends over the same pairs densely
    and counts its calls."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rolefleet.common import packed_attention
    from rolefleet.common.modeling import enable_activation_checkpointing

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch, cpu = packed_batch(model.config.vocab_size), torch.device("cpu")
    expected_logprobs, expected_grads = logprobs_and_grads(model, batch, cpu, True, "sdpa")
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    calls = []

    def dense_stand_in(module, query, key, value, attention_mask, **kwargs):
        assert isinstance(attention_mask, packed_attention.BlockMask)
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, query, key, value, dense_document_mask(lengths)[None, None], **kwargs)

    monkeypatch.setattr(packed_attention, "packed_flex_attention", dense_stand_in)
    enable_activation_checkpointing(model)
    model.train()
    logprobs, grads = logprobs_and_grads(model, batch, cpu, True, "flex")
    layers = model.config.num_hidden_layers
    assert len(calls) == 2 * layers  # the forward's and the backward's recompute
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=1e-5)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5)
    # The model stays routed; calls without a BlockMask (padded rows) still go through sdpa alone.
    calls.clear()
    with torch.no_grad():
        padded, _ = logprobs_and_grads(model, batch, cpu, False, "sdpa")
        torch.testing.assert_close(padded, expected_logprobs, atol=1e-5, rtol=1e-5)
    assert calls == []


def test_flex_refuses_a_model_not_on_sdpa(tiny_model_dir):
    from rolefleet.common.packed_attention import use_packed_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    with pytest.raises(ValueError, match="packed_attention"):
        use_packed_attention(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_on_cuda_flex_is_compiled_once_and_equals_sdpa_in_bf16_with_its_gradients(tiny_model_dir, checkpointing):
    from rolefleet.common.modeling import enable_activation_checkpointing
    from rolefleet.trainer.profiling import compiled_graphs

    cuda = torch.device("cuda")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(cuda)
    if checkpointing:
        enable_activation_checkpointing(model)
        model.train()
    batch = packed_batch(model.config.vocab_size)
    sdpa = logprobs_and_grads(model, batch, cuda, True, "sdpa", torch.bfloat16)
    flex = logprobs_and_grads(model, batch, cuda, True, "flex", torch.bfloat16)
    torch.testing.assert_close(flex[0], sdpa[0], atol=2e-2, rtol=2e-2)
    for grad, expected in zip(flex[1], sdpa[1]):
        torch.testing.assert_close(grad, expected, atol=5e-2, rtol=5e-2)
    # Other lengths (another token count, another tile count) compile nothing more.
    logprobs_and_grads(model, batch.select(torch.tensor([0, 2])), cuda, True, "flex", torch.bfloat16)
    graphs = compiled_graphs()
    for rows in ([1, 3], [0, 1, 2], [3]):
        logprobs_and_grads(model, batch.select(torch.tensor(rows)), cuda, True, "flex", torch.bfloat16)
    assert compiled_graphs() == graphs


def test_auto_takes_flex_on_cuda_for_large_micro_batches_only():
    from rolefleet.common.packed_attention import AUTO_FLEX_MIN_TOKENS, flex_for

    assert resolve("auto", torch.device("cuda", 0)) == "auto" and resolve("auto", torch.device("cpu")) == "sdpa"
    assert resolve("flex", torch.device("cpu")) == "flex" and resolve("sdpa", torch.device("cuda", 0)) == "sdpa"
    assert flex_for("auto", AUTO_FLEX_MIN_TOKENS) and not flex_for("auto", AUTO_FLEX_MIN_TOKENS - 1)
    assert flex_for("flex", 1) and not flex_for("sdpa", 10**6)
    cfg = parse_config({"model": {"model_name_or_path": "m"}, "actor": {"packed_attention": "flex"}})
    assert cfg.actor.packed_attention == "flex" and cfg.critic.packed_attention == "auto"


def test_under_auto_a_large_packed_micro_batch_gets_the_block_mask_and_a_small_one_sdpa_s(tiny_model_dir,
                                                                                           monkeypatch):
    """Which attention each micro-batch took, seen from the attention function (on the CPU, where
    `resolve` never gives auto, the choice is driven as it is on CUDA)."""
    from rolefleet.common import packed_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    seen = []
    real = packed_attention.packed_flex_attention
    monkeypatch.setattr(packed_attention, "packed_flex_attention",
                        lambda *a, **k: (seen.append("flex"), real(*a, **k))[1])
    monkeypatch.setattr(packed_attention, "AUTO_FLEX_MIN_TOKENS", 300)
    small, large = packed_batch(model.config.vocab_size).select(torch.tensor([0, 2])), packed_batch(model.config.vocab_size)
    with torch.no_grad():
        lm_logprobs(model, small, torch.device("cpu"), 1.0, 64, False, True, attention="auto")  # 53 tokens
        assert seen == []
        lm_logprobs(model, large, torch.device("cpu"), 1.0, 64, False, True, attention="auto")  # 336 tokens
        assert seen and set(seen) == {"flex"}


def test_compile_warmup_meets_auto_s_block_mask_family_too():
    """`<role>.compile_warmup` compiles every family a run's micro-batches can take: under `auto` a
    packed one large enough for FlexAttention is one of them."""
    from rolefleet.common.packed_attention import flex_for
    from rolefleet.trainer.base import shape_families

    def takes_flex(attention):
        return [flex_for(attention, int((mb.prompt_lengths + mb.response_lengths).sum()))
                for mb in shape_families(True, attention)]

    assert any(takes_flex("auto")) and not all(takes_flex("auto"))
    assert not any(takes_flex("sdpa")) and all(takes_flex("flex"))
