"""Offline factory for tiny causal LMs: a character-level tokenizer built with `tokenizers` and a
small Llama-shaped model, saved as a normal model directory (config, safetensors, tokenizer files).

Tests and the demo load the result with `from_pretrained`, the same code path as real checkpoints;
nothing is downloaded. Llama-shaped because transformers loads a qwen2 directory with its own
byte-level tokenizer class, which would drop this tokenizer's pre-tokenizer. An optional supervised warm start on a built-in task gives RL a policy that
already solves some prompts, so the reward curve of a few minutes of CPU training is visible.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

from rolefleet.app.shapes import SHAPES, ModelShape
from rolefleet.common.model_paths import share_read_access
from rolefleet.tasks import make_task

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
ALPHABET = string.digits + string.ascii_lowercase + " +-*/=()?.,:"
# Chat models (`chat=True`) also have what chat turns and Hermes tool calls are written with, after
# the alphabet, so a plain model's ids are unchanged: the turn tokens (special, as in Qwen's
# tokenizer), the tool-call tags (plain added tokens: a response's text keeps them), and the
# characters of JSON and of the task's questions.
CHAT_CHARACTERS = '\n{}[]"_<>|!#&;ABCDEFGHIJKLMNOPQRSTUVWXYZ'
TURN_TOKENS = ["<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>"]
# ChatML with the tools named in a system message (their schemas would cost a character-level
# model hundreds of positions); `tools` entries are chat-template tool schemas.
TINY_TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools: {% for t in tools %}{{ t.function.name }}"
    "{% if not loop.last %},{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(vocab_size: int | None = None, chat: bool = False) -> PreTrainedTokenizerFast:
    """One token per character; `vocab_size` pads the vocabulary with `<extra_i>` tokens to a real
    model's size, so embedding and LM-head shapes (and their cost) are those of that model. `chat`:
    a chat template (`TINY_TOOL_CHAT_TEMPLATE`) and the tokens it and tool calls need."""
    tokens = [*SPECIAL_TOKENS, *ALPHABET]
    if chat:
        tokens += [*CHAT_CHARACTERS, *TURN_TOKENS, *TOOL_TAGS]
    if vocab_size is not None:
        tokens += [f"<extra_{i}>" for i in range(max(0, vocab_size - len(tokens)))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per char
    tok.decoder = decoders.Fuse()  # join characters without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if chat:
        tokenizer.add_special_tokens({"additional_special_tokens": TURN_TOKENS})
        tokenizer.add_tokens(TOOL_TAGS)  # matched whole, decoded in the text (not special)
        tokenizer.chat_template = TINY_TOOL_CHAT_TEMPLATE
    return tokenizer


def _llama_config(tokenizer: PreTrainedTokenizerFast, shape: ModelShape, **extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.positions,
        attention_bias=shape.attention_bias,
        tie_word_embeddings=shape.tied,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, shape: ModelShape, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(_llama_config(tokenizer, shape))


def padded_examples(examples: list[tuple[list[int], list[bool]]], pad_id: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Supervised examples (token ids, which of them are trained) as right-padded (input_ids,
    labels: -100 where not trained, attention_mask) [B, L]."""
    width = max(len(seq) for seq, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (seq, trained) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq)] = torch.where(torch.tensor(trained), torch.tensor(seq), -100)
        mask[i, : len(seq)] = 1
    return ids, labels, mask


def warm_start(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, task: str, steps: int,
               seed: int, batch_size: int = 64, lr: float = 3e-3) -> float:
    """Supervised steps on `task` answers (loss on answer + EOS only; a tool task: on the assistant
    turns of a conversation that calls the calculator, `tool_trace`). Returns the last loss."""
    if task == "tool_arithmetic":
        from rolefleet.app.tool_warm_start import warm_start_on_tools  # import cycle: it imports this module

        return warm_start_on_tools(model, tokenizer, steps, seed, batch_size=batch_size, lr=lr)
    records = make_task(task, size=steps * batch_size, seed=seed + 1)
    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        pairs = _answer_examples(tokenizer, rng.sample(records, min(batch_size, len(records))))
        ids, labels, mask = padded_examples(pairs, tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    log.info("warm start: %d steps on %s, final loss %.3f", steps, task, loss.item())
    return loss.item()


def _answer_examples(tokenizer, records) -> list[tuple[list[int], list[bool]]]:
    """(ids, trained) per record: the prompt, then the answer and EOS, trained."""
    out = []
    for r in records:
        prompt, answer = tokenizer(r.prompt)["input_ids"], tokenizer(r.ground_truth)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + answer, [False] * len(prompt) + [True] * len(answer)))
    return out


def make_tiny_model(out_dir: str | Path, task: str | None = None, warm_start_steps: int = 0,
                    hidden: int | None = None, layers: int | None = None, seed: int = 0,
                    shape: str = "tiny", dtype: torch.dtype | None = None, chat: bool | None = None) -> Path:
    """Build, optionally warm-start, and save a model + tokenizer directory of the named shape
    (hidden / layers override it) with weights in `dtype` (None: float32); returns its path. `chat`
    (default: for a tool task's warm start): a chat template, the tokens of turns and tool calls,
    512 positions, and the end-of-turn token among the generation config's eos ids. The
    weights are initialised on the default device: a benchmark builds a 7B model on its GPU in
    seconds, where the CPU takes minutes."""
    out = Path(out_dir)
    dims = SHAPES[shape]
    dims = dataclasses.replace(dims, hidden=hidden or dims.hidden, layers=layers or dims.layers)
    if hidden and shape == "tiny":
        dims = dataclasses.replace(dims, intermediate=4 * hidden)
    if chat is None:  # a tool task's warm start writes chat turns
        chat = task == "tool_arithmetic"
    if chat:  # conversations with tool calls take hundreds of characters
        dims = dataclasses.replace(dims, positions=max(dims.positions, 512))
    tokenizer = build_tokenizer(dims.vocab, chat=chat)
    model = build_model(tokenizer, dims, seed=seed)
    if chat:  # as chat checkpoints list their end-of-turn token (Qwen2.5's <|im_end|>) beside eos
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    if task and warm_start_steps > 0:
        warm_start(model, tokenizer, task, warm_start_steps, seed)
    out.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        model.to(dtype)
        model.config.dtype = dtype  # what the files hold, as a real checkpoint's config says
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    share_read_access(out)
    return out


# A two-turn chat template in the character alphabet, for reward-model tests of the templated path.
TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"


def make_tiny_reward_model(out_dir: str | Path, seed: int = 0, num_labels: int = 1, pad_token: bool = True,
                           chat_template: str | None = None, positions: int | None = None) -> Path:
    """A random sequence-classification reward model (the tiny Llama shape and tokenizer, a scalar
    `score` head) saved like a real reward checkpoint, so it loads through AutoModelForSequenceClassification.
    `pad_token=False` saves a tokenizer and config without a pad token (as many base checkpoints are);
    `num_labels` other than 1 builds the classifier a reward model must refuse."""
    out = Path(out_dir)
    dims = SHAPES["tiny"]
    if positions:
        dims = dataclasses.replace(dims, positions=positions)
    tokenizer = build_tokenizer(dims.vocab)
    if not pad_token:
        tokenizer.pad_token = None
    if chat_template:
        tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    config = _llama_config(tokenizer, dims, num_labels=num_labels)
    if not pad_token:
        config.pad_token_id = None
    model = LlamaForSequenceClassification(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    share_read_access(out)
    return out
