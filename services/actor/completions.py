"""Chat completions batched into the rollout engine's calls (the OpenAI-compatible endpoint's
generation, `actor/openai_api.py`).

Agents await their completions one request each; the engine is fastest with many sequences per
call. Requests that arrive while a call runs wait for the next one and go together: each call takes
every request then waiting (of the same sampling, at most `actor.max_sequences_per_request`), so a
step's agents, awaiting the endpoint together, have their turns generated as one batch. A call on
an idle engine first waits while requests keep arriving (`actor.endpoint.batch_window_ms` after the
last, at most a hundred times that, or until a call's worth waits): the agents of a step send their
turns within milliseconds of each other, and a call that took only the first would leave the others
a call of their own.

The window alone cuts a turn short where agents come back at different times (each ran its tool,
or its own code, for a while): the engine would make a second call for the stragglers, which costs
nearly what the first did (decoding is a step per token for every row at once). So where the
endpoint knows how many sessions are yet to ask (`pending`, `SessionStore.pending`: open, none in
flight, and their last reply called tools, or no request yet as far as the agents at once leave
room), the call waits for them too, past quiet windows, but never longer than the last engine call
lasted (what a call of their own would cost them) nor a hundred windows.

Requests that differ only in how many tokens they may take (a session near its token limit) share
a call: it generates up to the largest, and each sample is cut to its own request's limit (a
prefix of a sample is a sample, its logprobs unchanged, ended by length).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from rolefleet.actor.types import Continuation, FinishReason, Sample, SamplingParams

Generate = Callable[[list[Continuation], SamplingParams], list[Sample]]
Decode = Callable[[list[int]], str]
MAX_WINDOWS = 100  # an idle engine's call waits at most this many batch windows for more requests


@dataclass
class EndpointStats:
    """Where the endpoint's time went since it was last asked (`take`, at every update: the step's
    record's `actor/endpoint_*`): a step's agents wait for the engine's calls, for the batcher's
    gathering of their requests (the engine idle meanwhile) and for the requests' own host work on
    the actor's event loop."""

    requests: int = 0
    calls: int = 0
    sequences: int = 0
    gather_s: float = 0.0   # the engine idle while a call's requests were gathered
    engine_s: float = 0.0   # in engine calls
    handler_s: float = 0.0  # the requests' own work in the endpoint's handler (rendering, parsing the reply)

    def __post_init__(self):
        self._lock = threading.Lock()  # added to from the endpoint's loop, taken from an update's thread

    def add(self, **amounts: float) -> None:
        with self._lock:
            for key, amount in amounts.items():
                setattr(self, key, getattr(self, key) + amount)

    def take(self) -> dict[str, float]:
        """The figures since the last take (none when the endpoint served nothing), reset."""
        with self._lock:
            taken = {f.name: getattr(self, f.name) for f in fields(self)}
            for f in fields(self):
                setattr(self, f.name, type(taken[f.name])(0))
        if not taken["requests"]:
            return {}
        out = {f"endpoint_{k}": float(v) for k, v in taken.items()}
        out["endpoint_sequences_per_call"] = taken["sequences"] / max(1, taken["calls"])
        return out


@dataclass
class _Request:
    context: torch.Tensor
    n: int
    limit: int                       # its max_new_tokens
    done: asyncio.Future = field(repr=False)


class CompletionBatcher:
    """`complete(context, sampling, n)`: n samples after `context`, generated in an engine call with
    the other requests waiting at the time."""

    def __init__(self, generate: Generate, max_sequences: int, window_s: float = 0.0, decode: Decode | None = None,
                 stats: EndpointStats | None = None, pending: Callable[[], int] | None = None):
        """`generate(continuations, sampling)`: blocking, one sample per continuation (run off the loop);
        `decode(ids)`: the text of a cut sample (the engines' decoding); `pending()`: how many
        sessions are expected to send a request and have not (see the module)."""
        self.generate, self.max_sequences, self.window_s, self.decode = generate, max_sequences, window_s, decode
        self.stats = stats or EndpointStats()
        self.pending = pending
        self._last_call_s = float("inf")  # how long the last engine call took: the most a call waits for stragglers
        self._waiting: dict[SamplingParams, list[_Request]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def complete(self, context: torch.Tensor, sampling: SamplingParams, n: int = 1) -> list[Sample]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._serve(), name="endpoint-batcher")
        request = _Request(context, n, sampling.max_new_tokens, asyncio.get_running_loop().create_future())
        key = sampling if self.decode is None else replace(sampling, max_new_tokens=1)
        self._waiting.setdefault(key, []).append(request)
        self._wake.set()
        return await request.done

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _serve(self) -> None:
        while True:
            await self._wake.wait()
            start = time.perf_counter()
            await self._gathered()
            self.stats.add(gather_s=time.perf_counter() - start)
            self._wake.clear()
            while self._waiting:
                sampling, requests = next(iter(self._waiting.items()))
                batch, rest, rows = [], [], 0
                for r in requests:
                    if batch and rows + r.n > self.max_sequences:
                        rest.append(r)
                        continue
                    batch.append(r)
                    rows += r.n
                if rest:
                    self._waiting[sampling] = rest
                else:
                    del self._waiting[sampling]
                await self._call(sampling, batch)

    async def _gathered(self) -> None:
        """Wait while requests keep arriving (the window after the last), or while sessions are yet
        to ask (for no longer than the last engine call took), until a call's worth of sequences
        waits, at most `MAX_WINDOWS` windows. The cap is generous: a step's agents reach the
        endpoint over hundreds of milliseconds (each request is parsed, rendered and tokenized on
        this loop, a millisecond or more apiece), and a call cut short leaves the rest a whole
        engine call of their own."""
        start = time.perf_counter()
        for _ in range(MAX_WINDOWS if self.window_s > 0 else 0):
            seen = self._count()
            if seen >= self.max_sequences:
                return
            await asyncio.sleep(self.window_s)
            if self._count() > seen:
                continue
            if not self.pending or not self.pending() or time.perf_counter() - start >= self._last_call_s:
                return

    def _count(self) -> int:
        return sum(r.n for requests in self._waiting.values() for r in requests)

    async def _call(self, sampling: SamplingParams, batch: list[_Request]) -> None:
        """One engine call for `batch`; whatever fails fails its requests alone, never the batcher."""
        try:
            answers = await self._generate(sampling, batch)
        except Exception as exc:  # noqa: BLE001 - each waiting request answers with the failure
            for r in batch:
                if not r.done.done():
                    r.done.set_exception(exc)
            return
        for r in batch:
            if not r.done.done():
                r.done.set_result(answers.get(id(r), []))

    async def _generate(self, sampling: SamplingParams, batch: list[_Request]) -> dict[int, list[Sample]]:
        # n samples of a request: n continuations of its context (a continuation is one sequence).
        owner = [r for r in batch for _ in range(r.n)]
        continuations = [Continuation(r.context, [], resume_from=len(r.context)) for r in owner]
        sampling = replace(sampling, max_new_tokens=max(r.limit for r in batch))
        start = time.perf_counter()
        samples = await asyncio.to_thread(self.generate, continuations, sampling)
        self._last_call_s = time.perf_counter() - start
        self.stats.add(calls=1, sequences=len(continuations), engine_s=self._last_call_s)
        answers: dict[int, list[Sample]] = {}
        for s in sorted(samples, key=lambda s: s.prompt_index):
            r = owner[s.prompt_index]
            answers.setdefault(id(r), []).append(self._cut(s, r.limit))
        return answers

    def _cut(self, s: Sample, limit: int) -> Sample:
        if len(s.response_ids) <= limit or self.decode is None:  # without decode, requests share no call
            return s
        ids = s.response_ids[:limit]
        return replace(s, response_ids=ids, logprobs=s.logprobs[:limit], finish_reason=FinishReason.LENGTH,
                       response_text=self.decode(ids.tolist()))
