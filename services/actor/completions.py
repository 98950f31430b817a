"""Chat completions batched into the rollout engine's calls (the OpenAI-compatible endpoint's
generation, `actor/openai_api.py`).

Agents await their completions one request each; the engine is fastest with many sequences per
call. Requests that arrive while a call runs wait for the next one and go together: each call takes
every request then waiting (of the same sampling, at most `actor.max_sequences_per_request`), so a
step's agents, awaiting the endpoint together, have their turns generated as one batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rolefleet.actor.types import Continuation, Sample, SamplingParams

Generate = Callable[[list[Continuation], SamplingParams], list[Sample]]


@dataclass
class _Request:
    context: torch.Tensor
    n: int
    done: asyncio.Future = field(repr=False)


class CompletionBatcher:
    """`complete(context, sampling, n)`: n samples after `context`, generated in an engine call with
    the other requests waiting at the time."""

    def __init__(self, generate: Generate, max_sequences: int):
        """`generate(continuations, sampling)`: blocking, one sample per continuation (run off the loop)."""
        self.generate, self.max_sequences = generate, max_sequences
        self._waiting: dict[SamplingParams, list[_Request]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def complete(self, context: torch.Tensor, sampling: SamplingParams, n: int = 1) -> list[Sample]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._serve(), name="endpoint-batcher")
        request = _Request(context, n, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(sampling, []).append(request)
        self._wake.set()
        return await request.done

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _serve(self) -> None:
        while True:
            await self._wake.wait()
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

    async def _call(self, sampling: SamplingParams, batch: list[_Request]) -> None:
        # n samples of a request: n continuations of its context (a continuation is one sequence).
        owner = [r for r in batch for _ in range(r.n)]
        continuations = [Continuation(r.context, [], resume_from=len(r.context)) for r in owner]
        try:
            samples = await asyncio.to_thread(self.generate, continuations, sampling)
        except Exception as exc:  # noqa: BLE001 - each waiting request answers with the failure
            for r in batch:
                if not r.done.done():
                    r.done.set_exception(exc)
            return
        by_request: dict[int, list[Sample]] = {}
        for s in sorted(samples, key=lambda s: s.prompt_index):
            by_request.setdefault(id(owner[s.prompt_index]), []).append(s)
        for r in batch:
            if not r.done.done():
                r.done.set_result(by_request.get(id(r), []))
