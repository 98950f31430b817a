"""SequenceBatch: a ragged batch of prompt+response token sequences, packed as on the wire.

Roles keep batches packed (no padding) and pad only at the model boundary: `model_inputs()` builds
right-padded [B, L] inputs, `response_positions()` says where each response token sits in them, and
`pad_responses()` / `pack_responses()` convert per-token quantities between packed [N] and padded
[B, R] forms for the pure RL functions, which take padded tensors plus a mask.

A multi-turn response holds the model's turns and, between them, the observations the environment
appended (tool results, its messages). `loss_mask` (bool, packed [N] like the response tokens; None:
every token is the model's) marks the model's tokens: `train_mask()` is what every loss, KL, IS
correction, advantage and metric reduces over, so an observation token is read as context and
never trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from rolefleet.common import codec
from rolefleet.common.errors import InvalidArgument, LimitExceeded
from rolefleet.common.pb import common_pb2


@dataclass(frozen=True)
class BatchLimits:
    """What one request may carry: `section` is the config section holding the limits (named in
    errors, e.g. `critic.max_tokens_per_request`); `max_positions` is the model's context length."""

    section: str
    max_sequences: int
    max_tokens: int
    max_positions: int | None = None

    @classmethod
    def of(cls, section: str, cfg, max_positions: int | None = None) -> BatchLimits:
        return cls(section, cfg.max_sequences_per_request, cfg.max_tokens_per_request, max_positions)

    def check(self, sequences: int, tokens: int, field: str = "batch") -> None:
        """Sizes as declared (before decoding): too large is RESOURCE_EXHAUSTED naming the limit."""
        if sequences > self.max_sequences:
            raise LimitExceeded(f"{field}.prompt_lengths", f"{sequences} sequences exceed "
                                f"{self.section}.max_sequences_per_request={self.max_sequences}")
        if tokens > self.max_tokens:
            raise LimitExceeded(f"{field}.prompt_ids", f"{tokens} prompt + response tokens exceed "
                                f"{self.section}.max_tokens_per_request={self.max_tokens}")


@dataclass(frozen=True)
class SequenceBatch:
    prompt_ids: torch.Tensor        # int64 [sum(prompt_lengths)]
    prompt_lengths: torch.Tensor    # int64 [B]
    response_ids: torch.Tensor      # int64 [sum(response_lengths)]
    response_lengths: torch.Tensor  # int64 [B]
    loss_mask: torch.Tensor | None = None  # bool [sum(response_lengths)]: the model's tokens; None: all

    @classmethod
    def from_lists(cls, prompts: list[torch.Tensor], responses: list[torch.Tensor],
                   loss_masks: list[torch.Tensor | None] | None = None) -> SequenceBatch:
        """`loss_masks`: per response, bool [R] or None (all the model's); the batch keeps a packed
        mask only when some response has observation tokens, so single-turn batches stay as they were."""
        if len(prompts) != len(responses):
            raise ValueError("prompts and responses differ in length")
        def cat(xs: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([x.to(torch.int64) for x in xs]) if xs else torch.zeros(0, dtype=torch.int64)
        mask = None
        if loss_masks is not None and any(m is not None and not bool(m.all()) for m in loss_masks):
            mask = torch.cat([torch.ones(len(r), dtype=torch.bool) if m is None else m.to(torch.bool)
                              for r, m in zip(responses, loss_masks)])
        return cls(
            prompt_ids=cat(prompts),
            prompt_lengths=torch.tensor([len(p) for p in prompts], dtype=torch.int64),
            response_ids=cat(responses),
            response_lengths=torch.tensor([len(r) for r in responses], dtype=torch.int64),
            loss_mask=mask,
        )

    def __len__(self) -> int:
        return int(self.prompt_lengths.numel())

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_ids.numel())

    def prompts(self) -> list[torch.Tensor]:
        return list(torch.split(self.prompt_ids, self.prompt_lengths.tolist()))

    def responses(self) -> list[torch.Tensor]:
        return list(torch.split(self.response_ids, self.response_lengths.tolist()))

    def loss_masks(self) -> list[torch.Tensor | None]:
        """Each response's bool [R] mask (None when the batch has none)."""
        if self.loss_mask is None:
            return [None] * len(self)
        return list(torch.split(self.loss_mask, self.response_lengths.tolist()))

    def select(self, index: torch.Tensor | list[int]) -> SequenceBatch:
        idx = torch.as_tensor(index, dtype=torch.int64).tolist()
        prompts, responses, masks = self.prompts(), self.responses(), self.loss_masks()
        return SequenceBatch.from_lists([prompts[i] for i in idx], [responses[i] for i in idx],
                                        [masks[i] for i in idx])

    def micro_batches(self, max_tokens: int, packed: bool = False, multiple_of: int = 1) -> list[torch.Tensor]:
        """Row groups within `max_tokens`: the sum of their prompt+response lengths when `packed`
        (the model reads them one after another, `packed_inputs`), else their padded size (rows x
        longest). A sequence longer than the budget goes alone. Rows are sorted by length first, so
        sequences padded together are of similar length and little compute goes to padding.
        `multiple_of` (the workers sharing them): the largest groups are halved until the count is a
        multiple of it, where rows allow, so no worker idles or runs a throw-away pass."""
        lengths = (self.prompt_lengths + self.response_lengths).tolist()
        groups = token_budget_groups(lengths, max_tokens, packed)
        while len(groups) % multiple_of:
            cost = [sum(lengths[i] for i in g) if packed else len(g) * max(lengths[i] for i in g) for g in groups]
            largest = max((i for i in range(len(groups)) if len(groups[i]) > 1), key=cost.__getitem__, default=None)
            if largest is None:
                break  # single rows all: the workers' shares stay uneven
            rows = groups.pop(largest)
            groups[largest:largest] = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
        return [torch.tensor(sorted(g), dtype=torch.int64) for g in groups]

    def map_micro_batches(self, max_tokens: int, fn: Callable[[SequenceBatch], tuple[torch.Tensor, ...]],
                          packed: bool = False) -> tuple[torch.Tensor, ...]:
        """Run `fn` on each micro-batch (see `micro_batches`) and put the packed per-token tensors it
        returns back in this batch's token order, on the CPU, one per output of `fn`: [N, ...], fp32
        (integer outputs keep their type)."""
        done = [(rows, tuple((part.float() if part.is_floating_point() else part).cpu()
                             for part in fn(self.select(rows))))
                for rows in self.micro_batches(max_tokens, packed)]
        width = len(done[0][1]) if done else 0
        return tuple(self.merge_rows([(rows, parts[i]) for rows, parts in done]) for i in range(width))

    def merge_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One packed [N, ...] tensor from (rows, packed values of those rows) parts that cover the
        batch (the shares of several workers): fp32, or the parts' integer type."""
        first = parts[0][1] if parts else torch.empty(0)
        integer = not first.is_floating_point()
        out = torch.empty((self.num_response_tokens, *first.shape[1:]),
                          dtype=first.dtype if integer else torch.float32)
        for rows, values in parts:
            if len(rows):
                out[self.token_index(rows)] = values.cpu() if integer else values.float().cpu()
        return out

    def token_index(self, rows: torch.Tensor) -> torch.Tensor:
        """Packed-token indices of the responses of `rows`, in row order (for slicing [N] tensors)."""
        starts = torch.cumsum(self.response_lengths, 0) - self.response_lengths
        return torch.cat([torch.arange(int(starts[r]), int(starts[r] + self.response_lengths[r])) for r in rows])

    # --- model boundary -------------------------------------------------------------------------

    def model_inputs(self, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded (input_ids [B, L], attention_mask [B, L]) of prompt+response."""
        seqs = [torch.cat([p, r]) for p, r in zip(self.prompts(), self.responses())]
        width = max((len(s) for s in seqs), default=0)
        input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(seqs), width), dtype=torch.int64)
        for i, s in enumerate(seqs):
            input_ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        return input_ids, mask

    def packed_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [1, T], position_ids [1, T]): every prompt+response one after another, no
        padding, positions restarting at 0 for each sequence. transformers reads the restarts as
        sequence boundaries (given no attention mask): its sdpa attention then gets a block-diagonal
        causal mask, so attention never crosses them."""
        seqs = [torch.cat([p, r]) for p, r in zip(self.prompts(), self.responses())]
        positions = torch.cat([torch.arange(len(s)) for s in seqs])
        return torch.cat(seqs)[None], positions[None]

    def packed_response_positions(self) -> torch.Tensor:
        """[N] index in `packed_inputs()` of the position whose output predicts each packed response
        token (as `response_positions` for the padded layout)."""
        rows, within = self._response_index
        lengths = self.prompt_lengths + self.response_lengths
        starts = torch.cumsum(lengths, 0) - lengths
        return starts[rows] + self.prompt_lengths[rows] + within - 1

    @cached_property
    def _response_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.repeat_interleave(torch.arange(len(self)), self.response_lengths)
        starts = torch.cumsum(self.response_lengths, 0) - self.response_lengths
        within = torch.arange(self.num_response_tokens) - torch.repeat_interleave(starts, self.response_lengths)
        return rows, within

    def response_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row [N], column [N]) in `model_inputs()` of the position whose output predicts each
        packed response token: token j of a response follows prompt_len + j - 1."""
        rows, within = self._response_index
        return rows, self.prompt_lengths[rows] + within - 1

    def response_mask(self) -> torch.Tensor:
        """bool [B, R_max]: True on real response tokens of the padded response layout."""
        width = int(self.response_lengths.max()) if len(self) else 0
        return torch.arange(width)[None, :] < self.response_lengths[:, None]

    def train_mask(self) -> torch.Tensor:
        """bool [B, R_max]: the tokens losses, advantages and metrics reduce over: the real response
        tokens the model produced (observation tokens of a multi-turn response are out)."""
        mask = self.response_mask()
        if self.loss_mask is not None:
            mask = mask & self.pad_responses(self.loss_mask, fill=False)
        return mask

    def with_rows_trained(self, keep: torch.Tensor) -> SequenceBatch:
        """This batch with the tokens of the rows not in `keep` ([B] bool) out of the loss mask: what
        a policy update is given so that those responses get no gradient (`train.overlong: filter`)."""
        if bool(keep.all()):
            return self
        rows = keep.bool().repeat_interleave(self.response_lengths)
        return replace(self, loss_mask=self.packed_train_mask() & rows)

    def packed_train_mask(self) -> torch.Tensor:
        """bool [N]: `train_mask` packed like the response tokens."""
        if self.loss_mask is None:
            return torch.ones(self.num_response_tokens, dtype=torch.bool)
        return self.loss_mask

    def pad_responses(self, packed: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Packed per-token values [N, ...] -> right-padded [B, R_max, ...]."""
        rows, within = self._response_index
        mask = self.response_mask()
        out = torch.full((*mask.shape, *packed.shape[1:]), fill, dtype=packed.dtype, device=packed.device)
        # Index assignment keeps autograd: gradients flow from the padded tensor back to `packed`.
        out[rows.to(packed.device), within.to(packed.device)] = packed
        return out

    def pack_responses(self, padded: torch.Tensor) -> torch.Tensor:
        """Right-padded [B, R_max] -> packed [N] (the inverse of pad_responses)."""
        rows, within = self._response_index
        return padded[rows.to(padded.device), within.to(padded.device)]

    # --- wire -----------------------------------------------------------------------------------

    def to_proto(self) -> common_pb2.SequenceBatch:
        msg = common_pb2.SequenceBatch(
            prompt_ids=codec.encode(self.prompt_ids),
            prompt_lengths=codec.encode(self.prompt_lengths),
            response_ids=codec.encode(self.response_ids),
            response_lengths=codec.encode(self.response_lengths),
        )
        if self.loss_mask is not None:
            msg.loss_mask.CopyFrom(codec.encode(self.loss_mask.to(torch.bool)))
        return msg

    @classmethod
    def from_proto(cls, msg: common_pb2.SequenceBatch, field: str = "batch",
                   limits: BatchLimits | None = None) -> SequenceBatch:
        """Decode and validate; with `limits`, the declared sizes are checked before decoding."""
        if limits is not None:
            sequences = codec.declared_numel(msg.prompt_lengths, f"{field}.prompt_lengths")
            tokens = (codec.declared_numel(msg.prompt_ids, f"{field}.prompt_ids")
                      + codec.declared_numel(msg.response_ids, f"{field}.response_ids"))
            limits.check(sequences, tokens, field)

        def ints(name: str) -> torch.Tensor:
            return codec.decode_as(getattr(msg, name), f"{field}.{name}", torch.int64, ndim=1)

        mask = None
        if msg.HasField("loss_mask"):
            if limits is not None:  # a mask has one entry per response token: checked before it is decoded
                declared = codec.declared_numel(msg.loss_mask, f"{field}.loss_mask")
                responses = codec.declared_numel(msg.response_ids, f"{field}.response_ids")
                if declared != responses:
                    raise InvalidArgument(f"{field}.loss_mask", f"declares {declared} entries for {responses} "
                                          "response tokens")
            mask = _decode_mask(msg.loss_mask, f"{field}.loss_mask")
        batch = cls(*(ints(n) for n in ("prompt_ids", "prompt_lengths", "response_ids", "response_lengths")),
                    loss_mask=mask)
        batch.validate(field)
        return batch

    def check_limits(self, limits: BatchLimits, field: str = "batch", vocab_size: int | None = None) -> None:
        """What a core checks before touching its model: the request limits, ids in the vocabulary,
        and no sequence longer than the model's positions."""
        limits.check(len(self), self.prompt_ids.numel() + self.response_ids.numel(), field)
        self.validate(field, vocab_size)
        if limits.max_positions is not None:
            longest = int((self.prompt_lengths + self.response_lengths).max())
            if longest > limits.max_positions:
                raise InvalidArgument(f"{field}.response_lengths", f"a {longest}-token sequence exceeds the "
                                      f"model's {limits.max_positions} positions")

    def validate(self, field: str = "batch", vocab_size: int | None = None) -> None:
        if len(self) == 0:
            raise InvalidArgument(f"{field}.prompt_lengths", "batch is empty")
        if self.response_lengths.numel() != len(self):
            raise InvalidArgument(
                f"{field}.response_lengths",
                f"has {self.response_lengths.numel()} entries but prompt_lengths has {len(self)}",
            )
        for name, ids, lengths in (
            ("prompt", self.prompt_ids, self.prompt_lengths),
            ("response", self.response_ids, self.response_lengths),
        ):
            if bool((lengths < 1).any()):
                raise InvalidArgument(f"{field}.{name}_lengths", "every sequence needs at least one token")
            # Python ints: an int64 sum can wrap around and let absurd lengths through.
            total = sum(lengths.tolist())
            if total != ids.numel():
                raise InvalidArgument(f"{field}.{name}_ids",
                                      f"holds {ids.numel()} tokens but {name}_lengths sum to {total}")
            if ids.numel() and int(ids.min()) < 0:
                raise InvalidArgument(f"{field}.{name}_ids", "token ids must be >= 0")
            if vocab_size is not None and ids.numel() and int(ids.max()) >= vocab_size:
                raise InvalidArgument(f"{field}.{name}_ids", f"token id {int(ids.max())} >= vocab size {vocab_size}")
        if self.loss_mask is not None:
            if self.loss_mask.dtype != torch.bool or self.loss_mask.dim() != 1 \
                    or self.loss_mask.numel() != self.response_ids.numel():
                raise InvalidArgument(f"{field}.loss_mask", f"must be bool [{self.response_ids.numel()}] (one per "
                                      f"response token), got {self.loss_mask.dtype} {list(self.loss_mask.shape)}")

    def per_token(self, msg: common_pb2.Tensor, field: str) -> torch.Tensor:
        """Decode a packed per-response-token float tensor and check it matches this batch."""
        return self.check_per_token(codec.decode_as(msg, field, torch.float32, ndim=1), field)

    def check_per_token(self, tensor: torch.Tensor, field: str, kind: str | None = None) -> torch.Tensor:
        """Require a finite float tensor of shape [sum(response_lengths)]; `kind` adds the range of
        its quantity ("logprob" or "target", see VALUE_RANGES)."""
        if tensor.dim() != 1 or tensor.numel() != self.num_response_tokens:
            raise InvalidArgument(
                f"{field}.shape",
                f"has shape {list(tensor.shape)} but the batch has {self.num_response_tokens} response tokens",
            )
        if not bool(torch.isfinite(tensor).all()):
            raise InvalidArgument(field, "contains NaN or infinite values")
        if kind is not None:
            low, high, what = VALUE_RANGES[kind]
            if bool((tensor < low).any() | (tensor > high).any()):
                raise InvalidArgument(field, f"values must lie in [{low:g}, {high:g}] ({what}); got "
                                      f"[{tensor.min().item():.4g}, {tensor.max().item():.4g}]")
        return tensor


# Ranges of per-token inputs that train a model. An update is several optimizer steps: a value that
# overflows the loss in a later mini-batch would leave the weights half-updated (the role then
# refuses updates until restarted), so absurd values are refused before the first step instead.
VALUE_RANGES: dict[str, tuple[float, float, str]] = {
    # log p <= 0, with a little slack for engines whose log-softmax rounds above 0. A sampled token
    # below e^-1e5 is not a probability any engine produces; lower values only overflow the stats.
    "logprob": (-1e5, 1e-3, "log-probabilities are <= 0 and above -1e5"),
    # Advantages, returns and values: whitened or group-normalised targets are O(1-100); 1e6 leaves
    # room for raw reward scales while keeping A x ratio (at most e^20) far from float32 overflow.
    "target": (-1e6, 1e6, "|advantage|, |return| and |value| <= 1e6"),
}


def _decode_mask(msg: common_pb2.Tensor, field: str) -> torch.Tensor:
    """A packed loss mask: bool, or integers that are all 0 or 1, of rank 1."""
    tensor = codec.decode(msg, field)
    if tensor.dim() != 1:
        raise InvalidArgument(f"{field}.shape", f"expected 1 dimension, got shape {list(tensor.shape)}")
    if tensor.dtype.is_floating_point:
        raise InvalidArgument(f"{field}.dtype", f"expected bool (or 0/1 integers), got {msg.dtype}")
    if tensor.dtype != torch.bool:
        if tensor.numel() and bool(((tensor != 0) & (tensor != 1)).any()):
            raise InvalidArgument(field, "values must be 0 or 1")
        tensor = tensor != 0
    return tensor


def mini_batches(batch_size: int, num_mini_batches: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A random split of sequence indices into `num_mini_batches` nearly equal parts (none empty)."""
    order = torch.randperm(batch_size, generator=generator)
    return [part for part in torch.tensor_split(order, min(num_mini_batches, batch_size)) if len(part)]


def token_budget_groups(lengths: list[int], max_tokens: int, packed: bool = False) -> list[list[int]]:
    """Indices of sequences grouped longest first, each group within `max_tokens`: the sum of its
    lengths when `packed`, else its padded size (rows x longest). A sequence longer than the budget
    goes alone. Sorting first keeps sequences padded together of similar length."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    size = 0
    for i in order:
        if groups:
            # Descending order: a padded group's first row is its longest.
            grown = size + lengths[i] if packed else (len(groups[-1]) + 1) * lengths[groups[-1][0]]
            if grown <= max_tokens:
                groups[-1].append(i)
                size = grown
                continue
        groups.append([i])
        size = lengths[i]
    return groups
