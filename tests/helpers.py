"""Test helpers: in-process gRPC servers on ephemeral loopback ports, and status assertions."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import grpc

from rolefleet.common.config import Endpoint
from rolefleet.rpc.server import start_server

# Channel options of a caller that the server refuses: it connects once. gRPC retries a closed
# channel's connection with backoff, and the server rightly counts each retry as one more refusal.
CONNECT_ONCE = [(f"grpc.{bound}_reconnect_backoff_ms", 600_000) for bound in ("initial", "min", "max")]


@contextlib.asynccontextmanager
async def serving(role: str, add_servicers: Callable[[grpc.aio.Server], list[str]]) -> AsyncIterator[str]:
    """Run a role's servicers on 127.0.0.1:<ephemeral>; yields the address to dial."""
    handle = await start_server(role, Endpoint(port=0, metrics_port=0), add_servicers)
    try:
        yield f"127.0.0.1:{handle.grpc_port}"
    finally:
        await handle.stop()


async def expect_code(call, code: grpc.StatusCode, *texts: str) -> str:
    """Await a raw stub call (or a stream's read); require `code` with every one of `texts` in the
    message."""
    try:
        await call
    except grpc.aio.AioRpcError as e:
        assert e.code() == code, (e.code(), e.details())
        for text in texts:
            assert text in e.details(), e.details()
        return e.details()
    raise AssertionError(f"expected {code.name} naming {texts}")


async def expect_invalid(call, field: str) -> str:
    """Await a raw stub call; require INVALID_ARGUMENT whose message names `field`."""
    return await expect_code(call, grpc.StatusCode.INVALID_ARGUMENT, field)


def save_after_one_update_over_two_workers(cfg, path: str, snapshot_root: str | None = None):
    """An actor over two worker processes (as `cfg.actor` shards them) generates, takes one update
    and saves it at `path` (with `snapshot_root`, a snapshot under it: then a second update runs
    and the two ranks load the snapshot back, which must give the first update's weights). Returns
    the save's answer, the weights digest after the first update, and the batch and targets of that
    update (for a next one)."""
    import torch

    from rolefleet.actor.core import ActorCore
    from rolefleet.actor.types import PolicyTargets, SamplingParams
    from rolefleet.actor.worker import ActorWorker
    from rolefleet.common.batch import SequenceBatch
    from rolefleet.trainer.workers import WorkerGroup

    group = WorkerGroup.start("actor", 2, cfg.model_dump(mode="json"), ActorWorker.from_config)
    try:
        double = ActorCore(cfg.actor, group=group)
        double.snapshot_root = snapshot_root
        samples = double.generate(["1+2=", "13+4=", "7+7="], SamplingParams(max_new_tokens=4, n=2, seed=5))
        batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        lp = double.compute_logprobs(batch, 1.0, include_reference=True)
        targets = PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens), lp.logprobs, lp.ref_logprobs)
        double.update(1, 0, batch, targets, 1.0)
        saved, digest = double.save_checkpoint(1, path, background=True), double.digest()
        if snapshot_root is not None:
            double.update(2, 1, batch, targets, 1.0)
            assert double.digest() != digest
            assert double.load_checkpoint(path) == saved and double.digest() == digest
        return saved, digest, batch, targets
    finally:
        group.stop()


@contextlib.contextmanager
def served_on_loopback(app):
    """A FastAPI `app` served by the role servers' uvicorn wrapper in an event loop of its own (a
    thread), as a role serves it: its base URL while the block runs."""
    import asyncio
    import threading

    from rolefleet.rpc.http_server import HttpServer

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def serve():
        return HttpServer(app, "127.0.0.1", 0, role="actor", name="endpoint")

    server = asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        async def stop():  # the server, then what the app left running (the endpoint's batcher)
            await server.stop()
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


@contextlib.contextmanager
def scripted_chat_endpoint(chat_model_dir: str, answer: Callable[[int], str], max_turns: int,
                           max_total_tokens: int = 1024, wrap: Callable | None = None):
    """The actor's OpenAI-compatible endpoint on loopback over the tiny chat model's tokenizer, whose
    'policy' answers `answer(n)` on a session's n-th turn (then its end-of-turn token): (its session
    store, its base URL) while the block runs. `wrap`: an ASGI app around the endpoint's, served instead."""
    import torch
    from transformers import AutoTokenizer

    from rolefleet.actor.completions import CompletionBatcher
    from rolefleet.actor.openai_api import Endpoint as OpenAIEndpoint
    from rolefleet.actor.sessions import SessionLimits, SessionStore
    from rolefleet.actor.types import FinishReason, Sample

    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(continuations, sampling):
        out = []
        for i, c in enumerate(continuations):
            text = answer(tok.decode(c.context_ids.tolist()).count("<|im_start|>assistant"))
            ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"] + [end])
            out.append(Sample(i, 0, c.context_ids, ids, torch.zeros(len(ids)), FinishReason.STOP, 0, text))
        return out

    store = SessionStore(tok, SessionLimits(64, max_total_tokens, max_turns, 3600), None)
    app = OpenAIEndpoint(store, CompletionBatcher(generate, 16), tok, "run-token", "policy", 8).app()
    with served_on_loopback(wrap(app) if wrap else app) as url:
        yield store, url
