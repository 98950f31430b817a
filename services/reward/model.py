"""Reward model scoring: a transformers sequence-classification checkpoint with one output.

Each sample is re-tokenized with the reward model's own tokenizer (the policy's token ids mean
nothing to it): through its chat template when it has one, as
[{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], else as the plain
text prompt + response. Rows are packed into batches by a token budget, longest first, and the
scores come back in the items' order.
"""

from __future__ import annotations

import logging
import threading

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rolefleet.common import progress
from rolefleet.common.batch import token_budget_groups
from rolefleet.common.errors import InvalidArgument
from rolefleet.common.modeling import check_model_path, disable_dropout, pick_device, release_memory
from rolefleet.reward.types import ScoreItem

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardModelScorer:
    """`score(items)` -> float32 [n]: the model's scalar output for each prompt + response.

    Thread-safe: one forward at a time (the reward server scores requests from worker threads)."""

    def __init__(self, path: str, dtype: str = "float32", max_tokens_per_batch: int = 16384,
                 device: torch.device | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"reward model dtype {dtype!r}: valid: {', '.join(DTYPES)}")
        if max_tokens_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
        self.path = check_model_path(path)
        self.device = device or pick_device()
        # bf16 matmuls on a CPU are slower than fp32 and gain nothing: the CPU always computes fp32.
        self.dtype = DTYPES[dtype] if self.device.type != "cpu" else torch.float32
        self.max_tokens_per_batch = max_tokens_per_batch
        self.model = self._load_model()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.max_tokens = self._max_tokens()
        self.pad_id = self._pad_id()
        self.truncated = 0  # samples cut to max_tokens (see `_truncate`)
        self.scored = 0
        self.batches = 0
        self._lock = threading.Lock()
        # No KV cache for a single forward; encoder models take no such argument.
        self._forward_options = {"use_cache": False} if hasattr(self.model.config, "use_cache") else {}

    def _load_model(self) -> torch.nn.Module:
        # The head size is in the config: refuse before loading any weights.
        num_labels = AutoConfig.from_pretrained(self.path).num_labels
        progress.report(f"loading reward model {self.path}")
        if num_labels != 1:
            raise ValueError(f"reward model {self.path}: a reward model has one output (num_labels=1), this "
                             f"checkpoint has num_labels={num_labels} (a classifier, or a causal LM without "
                             "a reward head?)")
        model, info = AutoModelForSequenceClassification.from_pretrained(
            self.path, dtype=self.dtype, output_loading_info=True)
        # A head transformers had to create at random would score every sample with noise, silently.
        if missing := sorted(info["missing_keys"]):
            raise ValueError(f"reward model {self.path}: the checkpoint lacks weights {missing[:4]} (a causal "
                             "LM, not a trained reward model?)")
        return disable_dropout(model).to(self.device).eval()

    def _max_tokens(self) -> int | None:
        config = self.model.config.get_text_config()
        limits = [getattr(config, key, None) for key in ("max_position_embeddings", "n_positions")]
        # Tokenizers without a limit report a huge sentinel (1e30): only a plausible one counts.
        limits.append(self.tokenizer.model_max_length if self.tokenizer.model_max_length < 10**7 else None)
        limits = [n for n in limits if isinstance(n, int) and n > 0]
        return min(limits) if limits else None

    def _pad_id(self) -> int:
        """Many base checkpoints have no pad token: EOS pads then. Padded positions are masked, so
        the id only matters to the model's pooling (see `_batch`)."""
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            pad = self.model.config.get_text_config().eos_token_id
        if isinstance(pad, list):
            pad = pad[0]
        if pad is None:
            raise ValueError(f"reward model {self.path}: the tokenizer has neither a pad nor an EOS token")
        return int(pad)

    # --- text -> ids ---------------------------------------------------------------------------------

    def encode(self, item: ScoreItem) -> list[int]:
        """The token ids the model reads for `item`, truncated to `max_tokens`."""
        if self.tokenizer.chat_template:
            messages = [{"role": "user", "content": item.prompt}, {"role": "assistant", "content": item.response}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
            # The template writes its own BOS and turn markers: adding special tokens would double them.
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(item.prompt + item.response)["input_ids"]
        return self._truncate(list(ids))

    def _truncate(self, ids: list[int]) -> list[int]:
        """Keep the first token and the end: the score is read at the last token (decoder reward
        models) or the first (encoder ones, [CLS]), and the end of the response matters more to a
        judgement than the start of a long prompt."""
        if self.max_tokens is None or len(ids) <= self.max_tokens:
            return ids
        self.truncated += 1
        if self.truncated == 1 or self.truncated % 100 == 0:  # counted always, logged sparsely
            log.warning("reward model input of %d tokens cut to %d (%d samples so far)", len(ids),
                        self.max_tokens, self.truncated)
        return ids[:1] + ids[len(ids) - self.max_tokens + 1:]

    # --- batching ------------------------------------------------------------------------------------

    def plan(self, lengths: list[int]) -> list[list[int]]:
        """Item indices per batch: padded size (rows x longest) within the token budget, as the
        trainers' micro-batches are cut."""
        return token_budget_groups(lengths, self.max_tokens_per_batch)

    def _batch(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids and attention mask. Decoder reward models read the score at the last
        token that is not the config's pad id: a row that itself ends with the pad id (EOS standing in
        for a missing pad token) would be read one token early, so such a batch pads with another id."""
        last = {row[-1] for row in rows}
        pad = self.pad_id if self.pad_id not in last else min(set(range(len(last) + 1)) - last)
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = torch.tensor(row)
            mask[r, :len(row)] = 1
        self.model.config.get_text_config().pad_token_id = pad
        return ids, mask

    # --- scoring -------------------------------------------------------------------------------------

    def score(self, items: list[ScoreItem]) -> torch.Tensor:
        """float32 [len(items)], in the items' order."""
        scores = torch.empty(len(items), dtype=torch.float32)
        # Under the lock from tokenizing on: a fast tokenizer is not safe to share between threads.
        with self._lock, torch.inference_mode():
            encoded = [self.encode(item) for item in items]
            for i, ids in enumerate(encoded):
                if not ids:
                    raise InvalidArgument(f"items[{i}]", "prompt and response are both empty: nothing to score")
            for indices in self.plan([len(ids) for ids in encoded]):
                ids, mask = self._batch([encoded[i] for i in indices])
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                    **self._forward_options).logits
                scores[indices] = logits.float().reshape(len(indices)).cpu()
                self.batches += 1
        self.scored += len(items)
        return scores

    def close(self) -> None:
        self.model = None
        release_memory()
