"""Attention of packed micro-batches (`<role>.sequence_packing`) without a dense mask.

Packed, a micro-batch is one row of T tokens, its sequences one after another. Given position
restarts, transformers' sdpa path builds a dense T x T block-diagonal mask and attends over every
pair, masked: at 32k tokens a 1 GiB mask and ~T^2 work where only each sequence's own causal pairs
count. Here the same attention runs through FlexAttention with a block mask built straight from
the sequence lengths (no T x T tensor, no compiled mask function): a tile of 128 x 128 pairs is
skipped where no sequence spans both its queries and keys, run unmasked where one sequence covers
it below the diagonal, and masked per pair only on the rest (the tiles a boundary or the diagonal
crosses). `<role>.packed_attention: auto` (the default) picks it on CUDA for micro-batches of at
least `AUTO_FLEX_MIN_TOKENS` tokens, where it is faster (below that FlexAttention's fixed cost loses
to sdpa's small dense mask); `flex` and `sdpa` force one.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "rolefleet_packed"
BLOCK = 128  # FlexAttention's tile (queries and keys)


# Measured on an H100 at the 0.5B shape (docs/benchmarks.md, "Packed attention"): flex lost below a
# few thousand tokens a micro-batch (0.82x at 996, 0.91x at 2,532) and won above (1.50x at 8,676,
# 3.43x at 33,252): sdpa's dense mask costs the square of the micro-batch, the block mask each
# sequence's own square.
AUTO_FLEX_MIN_TOKENS = 4096


def resolve(choice: str, device: torch.device) -> str:
    """`<role>.packed_attention` on `device`: "flex", "sdpa", or "auto" (on CUDA: by each packed
    micro-batch's size, `flex_for`); off CUDA `auto` is sdpa (FlexAttention has no CPU backward)."""
    if choice == "auto":
        return "auto" if device.type == "cuda" else "sdpa"
    return choice


def flex_for(attention: str, tokens: int) -> bool:
    """Whether a packed micro-batch of `tokens` attends through FlexAttention under `attention`."""
    return attention == "flex" or (attention == "auto" and tokens >= AUTO_FLEX_MIN_TOKENS)


def document_block_mask(lengths: torch.Tensor, device: torch.device) -> BlockMask:
    """The causal mask of sequences of `lengths` packed one after another, as a BlockMask."""
    lengths = lengths.to(device=device, dtype=torch.long)
    total = int(lengths.sum())
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    blocks = -(-total // BLOCK)
    # Each tile's first and last sequence (a sequence id per token is nondecreasing).
    padded = torch.cat([doc, doc[-1:].expand(blocks * BLOCK - total)]).view(blocks, BLOCK)
    first, last = padded[:, 0], padded[:, -1]
    q, kv = torch.arange(blocks, device=device)[:, None], torch.arange(blocks, device=device)[None, :]
    # Tiles at or below the diagonal whose query and key sequence ranges meet.
    needed = (kv <= q) & (first[kv] <= last[q]) & (first[q] <= last[kv])
    # Below the diagonal, both tiles inside one sequence: every pair counts, no mask to apply.
    full = needed & (kv < q) & (first[q] == last[q]) & (first[kv] == last[kv]) & (first[q] == first[kv])
    partial = needed & ~full

    # Per-pair rule of the partial tiles; indexed up to the last tile's end (its tail: no sequence).
    tail = torch.cat([doc, doc.new_full((blocks * BLOCK - total,), -1)])

    def mask_mod(b, h, q_idx, kv_idx):
        return (tail[q_idx] == tail[kv_idx]) & (q_idx >= kv_idx)

    def as_indices(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = tiles.sum(1, dtype=torch.int32)
        # Each row's tiles first (stable order by "not wanted"), as FlexAttention reads them.
        order = torch.argsort((~tiles).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    kv_num, kv_idx = as_indices(partial)
    full_num, full_idx = as_indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(total, total))


@functools.cache
def _compiled_flex():
    # Dynamic shapes: one graph for every micro-batch length (a new T must not recompile mid-run).
    return torch.compile(flex_attention, dynamic=True)


def packed_flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: BlockMask, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: [B, heads, T, D] in, [B, T, heads, D] out."""
    if dropout:
        raise NotImplementedError("packed FlexAttention has no attention dropout (sdpa has)")
    eager = torch.compiler.is_compiling() or query.device.type != "cuda"  # inside compiled layers: traced there
    flex = flex_attention if eager else _compiled_flex()
    out = flex(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention of a model set up by `use_packed_attention`: a packed micro-batch (its mask a
    BlockMask) through FlexAttention, anything else (padded rows, a plain mask, no mask) through sdpa
    as before. Chosen per call by the mask, not by a switch around the forward: activation
    checkpointing runs each layer's forward again during the backward, after any such switch is over."""
    if isinstance(attention_mask, BlockMask):
        return packed_flex_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, packed_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # masks of non-packed calls: sdpa's, as before


def use_packed_attention(model: torch.nn.Module) -> None:
    """Route `model`'s attention through `packed_attention` from now on (idempotent). Only from sdpa,
    the implementation transformers loads by default: it is what non-packed calls keep."""
    config = model.config
    if config._attn_implementation == ATTENTION:
        return
    if config._attn_implementation != "sdpa":
        raise ValueError(f"packed_attention=flex needs the model's attention implementation to be sdpa, not "
                         f"{config._attn_implementation!r} (set <role>.packed_attention: sdpa)")
    config._attn_implementation = ATTENTION
