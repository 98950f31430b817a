"""Model dimensions `rolefleet tiny-model --shape` can build (plain data: the CLI lists them
without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a generated model; `vocab` None means the character tokenizer's own size."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int | None = None
    positions: int = 128
    attention_bias: bool = False
    tied: bool = True  # the LM head is the input embedding (Qwen2 to 3B); False: a head of its own


# Real model dimensions with random weights, for benchmarks and for trying a deployment without a
# checkpoint. Llama-shaped (see the module docstring); Qwen2's q/k/v biases are kept.
SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(),
    "qwen2-0.5b": ModelShape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936,
                             positions=32768, attention_bias=True),
    "qwen2-1.5b": ModelShape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936,
                             positions=32768, attention_bias=True),
    # 7.6B parameters: fp32 master weights, gradients and AdamW state alone are 122 GB.
    "qwen2.5-7b": ModelShape(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064,
                             positions=32768, attention_bias=True, tied=False),
}
