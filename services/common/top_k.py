"""A teacher's most likely tokens at each response position (on-policy distillation's forward-KL
term, docs/algorithms.md): what the teacher role answers and the actor's Update carries, checked
the same way wherever it is decoded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rolefleet.common import codec
from rolefleet.common.batch import VALUE_RANGES, SequenceBatch
from rolefleet.common.config.teacher import MAX_TOP_K
from rolefleet.common.errors import InvalidArgument
from rolefleet.common.pb import common_pb2

# A position's k probabilities sum to at most 1; float32 log-softmax rounds a little above it.
MASS_SLACK = 1e-3
TEACHER_TOP_FIELDS = ("teacher_top_ids", "teacher_top_logprobs")  # their names in the actor's Update


@dataclass(frozen=True)
class TopK:
    """Packed like a batch's responses: `ids` int64 [N, k] (most likely first) and `logprobs`
    float32 [N, k], log pi of each."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    @property
    def k(self) -> int:
        return self.ids.shape[-1]

    def map(self, fn) -> TopK:
        """`fn` applied to both tensors (the trainer's padding and slicing of per-token inputs)."""
        return TopK(fn(self.ids), fn(self.logprobs))

    def to_proto(self) -> tuple[common_pb2.Tensor, common_pb2.Tensor]:
        return codec.encode(self.ids), codec.encode(self.logprobs)

    @classmethod
    def from_proto(cls, ids: common_pb2.Tensor, logprobs: common_pb2.Tensor, batch: SequenceBatch,
                   fields: tuple[str, str], vocab_size: int | None = None) -> TopK:
        """Decoded and checked against `batch` (InvalidArgument naming the field: see `check`)."""
        top = cls(codec.decode_as(ids, fields[0], torch.int64, ndim=2).long(),
                  codec.decode_as(logprobs, fields[1], torch.float32, ndim=2).float())
        top.check(batch, fields, vocab_size)
        return top

    def check(self, batch: SequenceBatch, fields: tuple[str, str], vocab_size: int | None = None) -> None:
        """[N, k] both, 1 <= k <= MAX_TOP_K, N the batch's response tokens; ids in the vocabulary;
        logprobs finite, in the logprob range, and each position's k probabilities summing to at
        most 1."""
        ids_field, logprobs_field = fields
        n = batch.num_response_tokens
        for field, t in ((ids_field, self.ids), (logprobs_field, self.logprobs)):
            if t.dim() != 2 or t.shape[0] != n or not 1 <= t.shape[1] <= MAX_TOP_K:
                raise InvalidArgument(f"{field}.shape", f"has shape {list(t.shape)}; expected [{n}, k] (the batch's "
                                      f"response tokens, 1 <= k <= {MAX_TOP_K})")
        if self.ids.shape != self.logprobs.shape:
            raise InvalidArgument(f"{logprobs_field}.shape", f"{list(self.logprobs.shape)} differs from "
                                  f"{ids_field}'s {list(self.ids.shape)}")
        if self.ids.numel() and (int(self.ids.min()) < 0 or (vocab_size is not None and int(self.ids.max()) >= vocab_size)):
            raise InvalidArgument(ids_field, f"token ids must lie in [0, {vocab_size}); got "
                                  f"[{int(self.ids.min())}, {int(self.ids.max())}]")
        if not bool(torch.isfinite(self.logprobs).all()):
            raise InvalidArgument(logprobs_field, "contains NaN or infinite values")
        low, high, what = VALUE_RANGES["logprob"]
        if self.logprobs.numel() and bool((self.logprobs < low).any() | (self.logprobs > high).any()):
            raise InvalidArgument(logprobs_field, f"values must lie in [{low:g}, {high:g}] ({what})")
        if self.logprobs.numel() and float(self.logprobs.exp().sum(1).max()) > 1 + MASS_SLACK:
            raise InvalidArgument(logprobs_field, "a position's k probabilities sum to more than 1")
