"""The hf engine's decode loop: a KV cache the engine owns, sampling on the device, one CUDA graph
per decode step.

transformers' `generate` reads the whole cache with grouped KV heads expanded, keeps per-step
Python bookkeeping and syncs with the host every token. Here the model's projections, RoPE, norms
and MLPs stay transformers' own code; only its attention is swapped (transformers' attention
interface) for one that writes each layer's keys and values into a preallocated cache and attends
over it with the query heads folded onto their KV head, so no KV head is ever copied. Every row
decodes at the same cache slot (prompts are left-padded, RoPE positions are per row), so the whole
step (forward, sampling, logprob, stop check, state advance) has static shapes and runs as one CUDA
graph replay with no host sync; the host looks at the finished flags every `CHECK_EVERY` steps.

A batch decodes as long as its longest row, and rows that finished keep costing their share of
every step (at a 4096-token cap, 256 rows decoded over the whole cache for the sake of a few).
With `compact`, once the rows still decoding fit in half the batch (or less), they move to the
front of the same cache and decode on as a smaller batch (a power of two, at least
`COMPACT_FLOOR` rows) with a graph of its own: no second cache, a few MB of buffers per size,
kept with the batch they came from. Finished rows are not refilled with waiting sequences: a
call's sequences are one batch up to `rollout.batch_size`, and the vLLM backend schedules
continuously (docs/benchmarks.md, "The long tail").

A call decodes as a batch of `bucket_rows` rows, its sequences first and finished fillers after
them: an agent's endpoint calls, a step's later turns and evaluations come in every size, and each
size decoded as itself was a shape of its own (a cache, a warm-up step and a graph capture, kept or
built again). Buckets are a power of two or one and a half times one, so a call decodes fewer than
half again as many rows as it has; the fillers are never prefilled, and compaction drops them.

Recorded logprobs follow the project's convention (docs/algorithms.md): log softmax(logits /
temperature) of this forward, before top-k / top-p truncation.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel

from rolefleet.actor.decode_budget import COMPACT_FLOOR, DecodeBudget, bucket_rows
from rolefleet.common.modeling import compiled

log = logging.getLogger(__name__)

ATTENTION = "rolefleet_cache"
CHECK_EVERY = 16     # decode steps between looks at the finished flags (each look is a host sync)
SLOT_ROUNDING = 128  # cache lengths are rounded up to this, so calls of similar widths share a graph


class UnsupportedModel(NotImplementedError):
    """The model's attention cannot run on the engine's cache (use `actor.rollout.decode=generate`)."""


@dataclass
class KVCache:
    """Keys and values [B, Hkv, L, D] per layer. Row b's prompt starts at slot `first[b]` (left
    padding before it); the tokens of the current forward are written from slot `slot` on."""

    batch: int
    length: int
    first: torch.Tensor                      # int64 [B]
    slot: torch.Tensor                       # int64 [1]
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    rows: slice = field(default_factory=lambda: slice(None))  # the rows the current forward covers (chunked prefill)
    _masks: dict = field(default_factory=dict)

    def start(self, rows: slice = slice(None)) -> None:
        """Before each forward: masks are built once per forward (and window), shared by its layers."""
        self.rows = rows
        self._masks.clear()

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:  # first forward: shapes and dtype from the model's own projections
            self.keys[layer] = key.new_zeros((self.batch, key.shape[1], self.length, key.shape[3]))
            self.values[layer] = value.new_zeros((self.batch, value.shape[1], self.length, value.shape[3]))
        k, v = self.keys[layer][self.rows], self.values[layer][self.rows]
        index = self.slot + torch.arange(key.shape[2], device=key.device)
        k.index_copy_(2, index, key.to(k.dtype))
        v.index_copy_(2, index, value.to(v.dtype))
        return k, v

    def mask(self, queries: int, window: int | None, length: int) -> torch.Tensor:
        """[b, 1, q, length] bool over the first `length` slots: row b's query at slot s sees its own
        prompt and response up to s (and within the sliding window). A left-padding query sees only
        itself, so it is never NaN."""
        if window not in self._masks:
            keys = torch.arange(length, device=self.first.device)
            query = self.slot + torch.arange(queries, device=self.first.device)      # [q]
            seen = (keys <= query[:, None]) & (keys >= self.first[self.rows][:, None, None])  # [b, q, L]
            if window is not None:
                seen &= keys > query[:, None] - window
            self._masks[window] = (seen | (keys == query[:, None]))[:, None]
        return self._masks[window]


# Prefill shapes change with every call's prompt width, and cuDNN's attention builds an execution
# plan for each new shape: 40-60 ms of host time per engine call with the GPU idle (profiled on an
# H200). The decode step keeps cuDNN: its shape is fixed for as long as its graph is.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cache_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, rolefleet_cache: KVCache | None = None, **kwargs):
    """transformers attention-interface function over a `KVCache` (query [b, H, q, D], key and value
    [b, Hkv, q, D] after RoPE); returns [b, q, H, D] like every interface function."""
    if rolefleet_cache is None:
        raise UnsupportedModel(f"{type(module).__name__} did not pass the engine's cache to its attention")
    extras = sorted(k for k in ("softcap", "s_aux", "sinks") if kwargs.get(k) is not None)
    if extras:
        raise UnsupportedModel(f"{type(module).__name__} uses attention options the cache attention lacks: {extras}")
    k, v = rolefleet_cache.write(module.layer_idx, key, value)
    b, heads, queries, dim = query.shape
    if queries > 1:  # prefill writes slots [0, width): nothing beyond them to attend to
        k, v = k[:, :, :queries], v[:, :, :queries]
    mask = rolefleet_cache.mask(queries, sliding_window, k.shape[2])
    kv_heads = k.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if queries == 1:
        # Decode: the query heads of one KV head become that head's "query positions" ([b, Hkv, G,
        # D]), so the kernel reads each cached key once and no expanded copy of the cache is made.
        folded = query.reshape(b, kv_heads, heads // kv_heads, dim)
        out = sdpa(folded, k, v, attn_mask=mask, scale=scaling).reshape(b, heads, 1, dim)
    else:
        groups = heads // kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # prefill only
        with sdpa_kernel(PREFILL_ATTENTION):
            out = sdpa(query, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


# Opaque to torch.compile: with `compile_layers` the rest of each decoder layer is compiled around it
# (the cache's Python bookkeeping would only break the graph anyway).
AttentionInterface.register(ATTENTION, torch.compiler.disable(cache_attention))


@contextlib.contextmanager
def cache_attention_on(model: PreTrainedModel):
    """Route the model's attention to `cache_attention` for the duration (plain forwards of the same
    model keep their own implementation and masks)."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        model.config._attn_implementation = previous


# --- sampling ---------------------------------------------------------------------------------------

def sample_next(logits: torch.Tensor, temperature: torch.Tensor | float, top_k: int,
                top_p: torch.Tensor | float | None, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / temperature) truncated to the top-k tokens and then
    the smallest top-p nucleus (ties at the k-th logit kept, as transformers does), and its logprob
    under the untruncated tempered distribution. logits [B, V] -> (int64 [B], fp32 [B]).

    Gumbel-max (argmax of logits - log E, E ~ Exp(1)) draws exactly from the softmax without a
    softmax pass or a host sync, so it can live in a CUDA graph. top_p None: no nucleus (no sort).
    `greedy`: the most likely token (no random numbers drawn), its logprob under temperature 1
    (the caller's temperature is 1 then)."""
    scaled = logits.float() / temperature
    if greedy:
        tokens = scaled.argmax(dim=-1)
    else:
        filtered = scaled
        if top_k > 0 and top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if top_p is not None:
            ordered, order = torch.sort(filtered, dim=-1, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each token
            ordered = ordered.masked_fill(before >= top_p, float("-inf"))  # the top token always stays
            filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, ordered)
        # E = 0 would make a truncated token's -inf score NaN, and argmax picks NaN.
        noise = torch.empty_like(filtered).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
        tokens = (filtered - noise.log()).argmax(dim=-1)
    logprobs = scaled.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return tokens, logprobs


# --- the loop ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Mode:
    """What a captured step's kernels depend on beyond its buffers' contents."""

    top_k: int
    nucleus: bool  # top_p < 1
    greedy: bool   # temperature 0


@dataclass
class _Buffers:
    """Everything one decode step reads and writes: fixed addresses, so a CUDA graph can replay it."""

    cache: KVCache
    tokens: torch.Tensor          # int64 [B]: the token fed at this step
    positions: torch.Tensor       # int64 [B]: its RoPE position
    step: torch.Tensor            # int64 [1]: the output column written at this step
    finished: torch.Tensor        # bool [B]
    is_stop: torch.Tensor         # bool [V]: the request's stop ids (a fixed-size table a graph can read)
    out_tokens: torch.Tensor      # int64 [B, L]
    out_logprobs: torch.Tensor    # fp32 [B, L]
    temperature: torch.Tensor     # fp32 [1]
    top_p: torch.Tensor           # fp32 [1]
    graph: torch.cuda.CUDAGraph | None = None
    graph_pool_bytes: int = 0     # device memory the capture reserved for the graph's own intermediates
    # Smaller batches by row count, whose caches are views of this one's first rows (compaction).
    compacted: dict[int, _Buffers] = field(default_factory=dict)
    shares_cache: bool = False    # one of those: its cache's memory is its parent's

    def held_bytes(self) -> int:
        tensors = [self.out_tokens, self.out_logprobs]
        if not self.shares_cache:
            tensors += [*self.cache.keys.values(), *self.cache.values.values()]
        return (sum(t.numel() * t.element_size() for t in tensors) + self.graph_pool_bytes
                + sum(child.held_bytes() for child in self.compacted.values()))


@dataclass(frozen=True)
class Decoded:
    tokens: torch.Tensor    # int64 [B, T] on the CPU; `pad_id` after a row's first stop token
    logprobs: torch.Tensor  # fp32 [B, T]


class _Output:
    """A call's tokens and logprobs by its own rows, while compaction moves them between batches:
    each batch's columns are copied out when its rows move on (and at the end)."""

    def __init__(self, rows: int):
        self.rows = rows
        self.origin: torch.Tensor | None = None  # the call's row of each decoding row; None: never moved
        self.since = 0                           # the first column the current batch wrote
        self.tokens = self.logprobs = None

    def move(self, buf: _Buffers, pad_id: int, steps: int) -> torch.Tensor:
        """Copies out `buf`'s columns; returns its rows still decoding (ascending), which move on."""
        if self.tokens is None:
            self.tokens = buf.out_tokens.new_full((self.rows, buf.cache.length), pad_id)
            self.logprobs = buf.out_logprobs.new_zeros((self.rows, buf.cache.length))
        self._copy(buf, steps)
        keep = buf.finished.logical_not().nonzero().squeeze(1)
        self.origin = keep if self.origin is None else self.origin[keep]
        self.since = steps
        return keep

    def result(self, buf: _Buffers, steps: int) -> Decoded:
        if self.tokens is None:
            return Decoded(buf.out_tokens[:self.rows, :steps].cpu(), buf.out_logprobs[:self.rows, :steps].cpu())
        self._copy(buf, steps)
        return Decoded(self.tokens[:, :steps].cpu(), self.logprobs[:, :steps].cpu())

    def _copy(self, buf: _Buffers, steps: int) -> None:
        rows = self.origin if self.origin is not None else slice(None)
        n = self.rows if self.origin is None else len(self.origin)
        self.tokens[rows, self.since:steps] = buf.out_tokens[:n, self.since:steps]
        self.logprobs[rows, self.since:steps] = buf.out_logprobs[:n, self.since:steps]


class DecodeLoop:
    """Samples continuations of left-padded prompts with the model's own layers over a `KVCache`.

    The buffers (and the captured graph) of each shape are kept for later calls of that shape, the
    most recently used first, while all of them together fit `budget` (`decode_budget.py`): a run's
    training batches and its evaluation batches (another batch size, greedy) each replay their own
    graph. `trim` frees the least recently used ones down to a budget (the trainer wants the memory)."""

    def __init__(self, model: PreTrainedModel, device: torch.device, pad_id: int, prefill_tokens: int,
                 compile: bool = False, budget: DecodeBudget | None = None, compact: bool = True):
        """`compile` (`compile_layers`): the sampling runs compiled too. Eager, `sample_next` makes
        about ten passes over the [B, V] logits at every decode step (an fp32 copy, the tempered
        logits, the noise, its log, the noisy scores, the argmax, the log-sum-exp); profiled on a
        151k vocabulary at B=256 they took a quarter of the step's GPU time. Compiled, the noise is
        drawn inside the kernels that reduce over the logits: other random numbers than the eager
        function's, from the same seeded generator, captured into the step's graph like any other
        kernel. `compact`: finished rows leave the batch (module docstring); `budget`: none kept
        between calls when not given."""
        self.model = model
        self.compact = compact
        self.sample = compiled(sample_next) if compile else sample_next
        self.device = device
        self.pad_id = pad_id
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.prefill_tokens = prefill_tokens
        self.use_graphs = device.type == "cuda"
        self.budget = budget or DecodeBudget(0, None)
        self.built = 0  # shapes built (a warm-up step, on CUDA a capture): the engine's statistics take it
        self._side: torch.cuda.Stream | None = None  # the captures' warm-up stream
        self._slot_bytes = 0  # the newest shape's held bytes per (row, cache slot): a new shape's estimate
        self._states: OrderedDict[tuple, _Buffers] = OrderedDict()  # by shape, least recently used first

    def trim(self, max_bytes: int = 0, spare_newest: bool = False) -> None:
        """Free the least recently used shapes' buffers and graphs until the rest hold at most
        `max_bytes` (0: all of them); `spare_newest`: never the most recently used one."""
        while len(self._states) > spare_newest and (max_bytes <= 0 or self.held_bytes() > max_bytes):
            self._states.popitem(last=False)

    def held_bytes(self) -> int:
        """Device memory the kept buffers and graphs hold."""
        return sum(buf.held_bytes() for buf in self._states.values())

    @torch.no_grad()
    def run(self, prompts: list[torch.Tensor], temperature: float, top_k: int, top_p: float,
            max_new_tokens: int, seed: int, stop_ids: tuple[int, ...]) -> Decoded:
        """`temperature` 0: greedy. A row is finished at its first id of `stop_ids`."""
        width = max(len(p) for p in prompts)
        length = -(-(width + max_new_tokens) // SLOT_ROUNDING) * SLOT_ROUNDING
        mode = _Mode(top_k, top_p < 1.0, temperature == 0)
        with cache_attention_on(self.model):
            root = buf = self._prepare(bucket_rows(len(prompts)), length, mode)
            if seed >= 0:
                torch.manual_seed(seed)  # after any graph capture, whose warm-up draws random numbers
            buf.temperature.fill_(1.0 if mode.greedy else temperature)
            buf.top_p.fill_(top_p)
            buf.is_stop.zero_()
            buf.is_stop[torch.tensor(stop_ids, dtype=torch.int64, device=self.device)] = True
            self._prefill(buf, prompts, width, mode)
            out = _Output(len(prompts))
            steps = 1
            check_every = CHECK_EVERY if buf.graph is not None else 1
            while steps < max_new_tokens:
                if steps % check_every == 0:
                    decoding = int(buf.finished.logical_not().sum())
                    if decoding == 0:
                        break
                    rows = max(COMPACT_FLOOR, 1 << (decoding - 1).bit_length())
                    if self.compact and rows <= buf.cache.batch // 2:
                        keep = out.move(buf, self.pad_id, steps)
                        buf = self._compacted(root, buf, keep, rows, mode)
                if buf.graph is not None:
                    buf.graph.replay()
                else:
                    self._step(buf, mode)
                steps += 1
            return out.result(buf, steps)

    # --- steps --------------------------------------------------------------------------------------

    def _prefill(self, buf: _Buffers, prompts: list[torch.Tensor], width: int, mode: _Mode) -> None:
        """Prompts into cache slots [0, width), a token budget of rows at a time; the first token.
        The batch's rows after the prompts' are fillers: finished, attending only to the slots they
        write from `width` on (as compaction's are), never prefilled."""
        cache, n = buf.cache, len(prompts)
        first = torch.full((cache.batch,), width, dtype=torch.int64)
        first[:n] = torch.tensor([width - len(p) for p in prompts], dtype=torch.int64)
        ids = torch.full((n, width), self.pad_id, dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = p
        positions = (torch.arange(width) - first[:n, None]).clamp_min(0)
        cache.first.copy_(first)
        cache.slot.zero_()
        rows = max(1, self.prefill_tokens // width)
        last = []
        for start in range(0, len(prompts), rows):
            part = slice(start, min(start + rows, n))
            cache.start(part)
            out = self.model(input_ids=ids[part].to(self.device), position_ids=positions[part].to(self.device),
                             use_cache=False, logits_to_keep=1, rolefleet_cache=cache)
            last.append(out.logits[:, -1])
        tokens, logprobs = self._sample(torch.cat(last), buf, mode)
        tokens = torch.cat([tokens, tokens.new_full((cache.batch - n,), self.pad_id)])
        buf.out_tokens[:, 0] = tokens
        buf.out_logprobs[:n, 0] = logprobs
        buf.out_logprobs[n:, 0] = 0.0
        buf.tokens.copy_(tokens)
        buf.positions.copy_(width - first)
        buf.finished.copy_(buf.is_stop[tokens])
        buf.finished[n:] = True
        buf.step.fill_(1)
        cache.slot.fill_(width)

    def _sample(self, logits: torch.Tensor, buf: _Buffers, mode: _Mode) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(logits, buf.temperature, mode.top_k, buf.top_p if mode.nucleus else None, mode.greedy)

    def _step(self, buf: _Buffers, mode: _Mode) -> None:
        """Feed each row's last token, sample the next: only tensor ops on fixed buffers."""
        buf.cache.start()
        logits = self.model(input_ids=buf.tokens[:, None], position_ids=buf.positions[:, None], use_cache=False,
                            rolefleet_cache=buf.cache).logits[:, -1]
        tokens, logprobs = self._sample(logits, buf, mode)
        stopped = buf.is_stop[tokens]  # read before padding: the pad id may itself be a stop id
        tokens = torch.where(buf.finished, self.pad_id, tokens)
        buf.out_tokens.index_copy_(1, buf.step, tokens[:, None])
        buf.out_logprobs.index_copy_(1, buf.step, logprobs[:, None])
        buf.finished.logical_or_(stopped)
        buf.tokens.copy_(tokens)
        buf.positions.add_(1)
        buf.cache.slot.add_(1)
        buf.step.add_(1)

    def _compacted(self, root: _Buffers, buf: _Buffers, keep: torch.Tensor, rows: int, mode: _Mode) -> _Buffers:
        """`buf`'s rows `keep` (ascending) moved to the front of the cache they share with `root`,
        as `root`'s batch of `rows` rows (built on first use); the rows after them are finished
        fillers that attend only to the slots they write from here on (never to a masked-out row)."""
        n, slot = len(keep), int(buf.cache.slot)
        for store in (buf.cache.keys, buf.cache.values):
            for layer in store.values():  # slots past `slot` hold nothing yet
                layer[:n, :, :slot] = layer[keep, :, :slot]
        child = root.compacted.get(rows) or self._compacted_buffers(root, rows, mode, slot)
        child.cache.first[:n] = buf.cache.first[keep]
        child.cache.first[n:] = slot
        child.cache.slot.copy_(buf.cache.slot)
        child.tokens[:n] = buf.tokens[keep]
        child.tokens[n:] = self.pad_id
        child.positions[:n] = buf.positions[keep]
        child.positions[n:] = 0
        child.finished[:n] = False
        child.finished[n:] = True
        for name in ("step", "is_stop", "temperature", "top_p"):
            getattr(child, name).copy_(getattr(buf, name))
        return child

    def _compacted_buffers(self, root: _Buffers, rows: int, mode: _Mode, slot: int) -> _Buffers:
        """A batch of `rows` over views of `root`'s cache. Its graph's warm-up step writes slot
        `slot` of those rows, which the next real step overwrites; the random numbers the warm-up
        draws are given back, so a seeded call samples the same tokens whether or not this batch
        was built before."""
        long = dict(dtype=torch.int64, device=self.device)
        cache = KVCache(rows, root.cache.length, torch.zeros(rows, **long), torch.full((1,), slot, **long),
                        keys={layer: k[:rows] for layer, k in root.cache.keys.items()},
                        values={layer: v[:rows] for layer, v in root.cache.values.items()})
        child = self._buffers(cache, shares_cache=True)
        if self.use_graphs:
            with torch.random.fork_rng(devices=[self.device]):
                self._capture_into(child, mode)
        root.compacted[rows] = child
        return child

    # --- buffers and graphs -------------------------------------------------------------------------

    def _buffers(self, cache: KVCache, shares_cache: bool = False) -> _Buffers:
        batch, dev = cache.batch, self.device
        long = dict(dtype=torch.int64, device=dev)
        return _Buffers(cache=cache, tokens=torch.zeros(batch, **long), positions=torch.zeros(batch, **long),
                        step=torch.zeros(1, **long), finished=torch.zeros(batch, dtype=torch.bool, device=dev),
                        is_stop=torch.zeros(self.vocab, dtype=torch.bool, device=dev),
                        out_tokens=torch.zeros(batch, cache.length, **long),
                        out_logprobs=torch.zeros(batch, cache.length, dtype=torch.float32, device=dev),
                        temperature=torch.ones(1, device=dev), top_p=torch.ones(1, device=dev),
                        shares_cache=shares_cache)

    def _capture_into(self, buf: _Buffers, mode: _Mode) -> None:
        # The capture empties PyTorch's cache first (`torch.cuda.graph` does): measured from a
        # reserve taken before that, the graph's pool came out negative, so `held_bytes` sank below
        # zero and `trim` kept every shape ever decoded (a run of many batch shapes, an agent's
        # endpoint calls, ran out of memory). Emptied here first, the growth is the graph's pool.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        buf.graph = self._capture(buf, mode)
        buf.graph_pool_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved)

    def _prepare(self, batch: int, length: int, mode: _Mode) -> _Buffers:
        shape = (batch, length, mode)
        if shape in self._states:
            self._states.move_to_end(shape)
            return self._states[shape]
        # What is over the budget with the new shape goes back to the allocator, which reuses it.
        self.trim(self.budget.for_call(self.held_bytes(), reserve=self._slot_bytes * batch * length))
        long = dict(dtype=torch.int64, device=self.device)
        buf = self._buffers(KVCache(batch, length, torch.zeros(batch, **long), torch.zeros(1, **long)))
        cache = buf.cache
        try:  # allocates the cache's layers (the slot-0 garbage is overwritten)
            self._step(buf, mode)
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            if isinstance(exc, torch.OutOfMemoryError):
                raise
            raise UnsupportedModel(f"the decode loop failed on this model's first step: {exc}") from exc
        self._check_served(cache)
        if self.use_graphs:
            self._capture_into(buf, mode)
        self._states[shape] = buf
        self.built += 1
        self._slot_bytes = -(-buf.held_bytes() // (batch * length))
        # Older shapes over the budget go; this one stays for the rest of the call's batches and
        # until the engine sleeps, whatever its size.
        self.trim(self.budget.for_call(self.held_bytes()), spare_newest=True)
        return buf

    def _check_served(self, cache: KVCache) -> None:
        """Every decoder layer must have cached through `cache_attention`: a layer with other state
        (convolutions, linear attention, SSMs in hybrid models) or an attention type known only to
        its mask (chunked attention) would decode without it and sample wrong tokens silently."""
        config = self.model.config
        kinds = set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
        layers = getattr(config, "num_hidden_layers", None)
        if kinds or getattr(config, "attention_chunk_size", None):
            raise UnsupportedModel(f"{config.model_type}: layer types the decode loop cannot cache: "
                                   f"{sorted(kinds) or ['chunked_attention']}")
        if layers is not None and len(cache.keys) != layers:
            raise UnsupportedModel(f"{config.model_type}: only {len(cache.keys)} of {layers} layers used "
                                   "the engine's cache")

    def _capture(self, buf: _Buffers, mode: _Mode) -> torch.cuda.CUDAGraph | None:
        try:
            # One side stream for every capture: PyTorch keeps a cuBLAS workspace (32 MiB on Hopper) for
            # each stream cuBLAS ever ran on. A stream per capture left memory behind every new shape
            # for good: exactly 8 x 32 MiB still allocated after 8 shapes were built and trimmed (the
            # GPU test of tests/actor/test_decode.py on an H100).
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            side = self._side
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture stream, as CUDA graphs require
                self._step(buf, mode)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # Thread-local: the role's other threads (a snapshot staging the trainer's state off the
            # GPU, an update) keep using the device while this one captures; in the default global
            # mode their syncs and host registrations would abort the capture and leave the RNG
            # mid-capture for the next generate.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._step(buf, mode)
            return graph
        except torch.OutOfMemoryError:
            raise  # not a property of the model: the next call may capture
        except RuntimeError as exc:  # a model whose forward syncs with the host cannot be captured
            log.warning("decode step not capturable as a CUDA graph (%s); decoding eagerly", exc)
            self.use_graphs = False
            return None
