"""The agent way's own cost, without a GPU: what the OpenAI-compatible endpoint and the agent workers
add to a step beside the engine's calls (issue 51's gap between the agent way and the environment way).

A step here is what `benchmarks/tools_task.py`'s agent way does in one: `--sessions` episodes of the
example calculator agent (`examples/agents/calculator_agent.py`, the openai client) run by the
reward role's agent workers (`--workers` processes, all episodes at once), over real HTTP on
loopback, against the actor's real endpoint (uvicorn, the session store, the chat template, the
batcher) and a scripted engine: every first turn calls the calculator on its question (`--prompts`
distinct ones, each asked of as many episodes as a prompt's samples), every second answers, and
each engine call lasts `--engine-ms` (a GPU's call; sleeping, so the loop is free meanwhile as it
is while a real engine computes). The environment way would take its two calls and nothing else:
the step's wall time minus its calls' time is what the agent way adds.

    python benchmarks/endpoint_turns.py --out OUT [--sessions 256] [--prompts 32] [--workers 4] [--steps 6] [--engine-ms 300]
                                        [--profile]

Writes OUT/endpoint_turns.json: per step the wall time, engine calls, the engine's time, the batcher's
gathering and the handler's time (`actor/endpoint_*`), the endpoint loop's CPU seconds (one thread:
the part no number of cores spreads; on a machine of few cores the agent workers' CPU competes with
it and the wall time says less), and the medians. `--profile`: cProfile on the endpoint loop's thread
over the steps after the first, its functions by own time in OUT/endpoint_loop_profile.txt (and
OUT/endpoint_loop.prof for pstats; the
profiler slows the loop: read the shares, not the step times, of such a run).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
AGENT = REPO / "examples" / "agents" / "calculator_agent.py"


class ScriptedEngine:
    """Each continuation's reply: a calculator call on its first turn, an answer after a tool's result."""

    def __init__(self, tokenizer, engine_s: float):
        from rolefleet.actor.types import FinishReason, Sample

        self.Sample, self.stop = Sample, FinishReason.STOP
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] + [end]  # noqa: E731
        self.ids = ids
        self.tool_turn = tokenizer("<|im_start|>tool", add_special_tokens=False)["input_ids"]
        self.tokenizer, self.engine_s, self.calls = tokenizer, engine_s, 0
        self.events: list[tuple[str, float, int]] = []  # (what, when, rows): the step's timeline

    def __call__(self, continuations, sampling):
        self.events.append(("call", time.perf_counter(), len(continuations)))
        time.sleep(self.engine_s)
        self.calls += 1
        out = []
        for i, c in enumerate(continuations):
            context = c.context_ids.tolist()
            seen_tool = any(context[j:j + len(self.tool_turn)] == self.tool_turn for j in range(len(context)))
            a, b = re.search(r"What is (\d+) \+ (\d+)\?", self.tokenizer.decode(context)).groups()
            call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} + {b}"}})
            ids = torch.tensor(self.ids(str(int(a) + int(b)) if seen_tool else f"<tool_call>{call}</tool_call>"))
            out.append(self.Sample(i, 0, c.context_ids, ids, torch.full((len(ids),), -0.5), self.stop, 3,
                                   self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)))
        return out


def timeline(events: list[tuple[str, float, int]], start: float, wall: float) -> list[str]:
    """The step as spans from its start: each run of request arrivals (first-last, count) and each
    engine call (start-end, rows), then the episodes' end."""
    spans, arrivals = [], []
    for what, when, rows in events:
        if what == "request":
            arrivals.append(when - start)
            continue
        if arrivals:
            spans.append(f"requests {arrivals[0]:.3f}-{arrivals[-1]:.3f} ({len(arrivals)})")
            arrivals = []
        spans.append(f"call {when - start:.3f} ({rows})")
    if arrivals:
        spans.append(f"requests {arrivals[0]:.3f}-{arrivals[-1]:.3f} ({len(arrivals)})")
    return [*spans, f"end {wall:.3f}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sessions", type=int, default=256)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32, help="distinct questions among the sessions")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--engine-ms", type=float, default=300.0)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--profile", action="store_true", help="cProfile the endpoint loop's thread (steps after the first)")
    args = p.parse_args()

    from rolefleet.actor.core import ActorCore
    from rolefleet.actor.openai_api import start_endpoint
    from rolefleet.actor.types import SamplingParams
    from rolefleet.app.tiny_model import make_tiny_model
    from rolefleet.common.config import parse_config
    from rolefleet.reward.sandbox import SandboxPool, Target

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-chat-model"
    if not (model / "config.json").exists():
        make_tiny_model(model, chat=True)
    cfg = parse_config({"model": {"model_name_or_path": str(model)}},
                       ["actor.rollout.max_turns=4", "sampling.max_new_tokens=64", "actor.endpoint.port=0",
                        f"actor.endpoint.max_sessions={args.sessions}", f"reward.agent.path={AGENT}:agent",
                        f"reward.agent.workers={args.workers}", f"reward.agent.concurrency={-(-args.sessions // args.workers)}",
                        "reward.env.name=null", *args.set])
    core = ActorCore(cfg.actor)
    engine = ScriptedEngine(core.tokenizer, args.engine_ms / 1000)
    requests = core.sessions.begin  # each chat request of a session starts here: the timeline's arrivals

    def arriving(*a, **k):
        engine.events.append(("request", time.perf_counter(), 1))
        return requests(*a, **k)

    core.sessions.begin = arriving
    core.generate = lambda prompts, sampling, version, continuations: engine(continuations, sampling)  # noqa: ARG005

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="endpoint-loop").start()
    token = "bench-token"
    server = asyncio.run_coroutine_threadsafe(start_endpoint(core, cfg, None, token), loop).result()
    base = f"http://127.0.0.1:{server.port}"

    async def thread_time() -> float:
        return time.thread_time()

    def loop_cpu_s() -> float:  # the endpoint loop's thread's CPU seconds so far: the agent way's serial part
        return asyncio.run_coroutine_threadsafe(thread_time(), loop).result()

    profiler = cProfile.Profile() if args.profile else None

    async def profiling(on: bool) -> None:  # a profiler sees the thread it was enabled on: the loop's
        profiler.enable() if on else profiler.disable()

    pool = SandboxPool({"agent": Target("file", str(AGENT), "agent", {"score": False})}, args.workers, 60.0, 0,
                       "reward.agent")
    agent = cfg.reward.agent
    steps = []
    try:
        for step in range(args.steps):
            if profiler is not None and step == 1:
                asyncio.run_coroutine_threadsafe(profiling(True), loop).result()
            ids = [f"s{step}-{i}" for i in range(args.sessions)]
            keys = core.open_sessions(ids, SamplingParams(max_new_tokens=64))
            # --prompts questions, each asked of sessions / prompts episodes (a prompt's samples)
            rows = [(f"{base}/sessions/{sid}/v1", key, f"What is {12 + i % args.prompts} + 30?", str(42 + i % args.prompts),
                     {}) for i, (sid, key) in enumerate(zip(ids, keys))]
            core.endpoint_stats.take()
            cpu = loop_cpu_s()
            calls, start = engine.calls, time.perf_counter()
            outcomes = pool.agents("agent", rows, agent.concurrency, agent.timeout_s)
            wall = time.perf_counter() - start
            cpu = loop_cpu_s() - cpu
            trajectories = core.close_sessions(ids)
            failed = [o for o in outcomes if isinstance(o, str)]
            if failed:
                raise SystemExit(f"{len(failed)} episodes failed; first: {failed[0]}")
            stats = core.endpoint_stats.take()
            record = {"step": step, "wall_s": wall, "calls": engine.calls - calls,
                      "turns": statistics.mean(t.turns for t in trajectories),
                      "engine_s": stats.get("endpoint_engine_s", 0.0), "gather_s": stats.get("endpoint_gather_s", 0.0),
                      "handler_s": stats.get("endpoint_handler_s", 0.0)}
            record["beyond_engine_s"] = wall - record["engine_s"]
            record["endpoint_cpu_s"] = cpu
            record["timeline"] = timeline(engine.events, start, wall)
            engine.events.clear()
            steps.append(record)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}), flush=True)
    finally:
        if profiler is not None and args.steps > 1:
            asyncio.run_coroutine_threadsafe(profiling(False), loop).result()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(60)
            (out / "endpoint_loop_profile.txt").write_text(text.getvalue())
            profiler.dump_stats(out / "endpoint_loop.prof")  # for pstats' callers and callees
        pool.close()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
    later = steps[1:] or steps
    summary = {k: statistics.median(r[k] for r in later) for k in ("wall_s", "calls", "engine_s", "gather_s",
                                                                   "handler_s", "beyond_engine_s", "endpoint_cpu_s")}
    result = {"sessions": args.sessions, "prompts": args.prompts, "workers": args.workers, "engine_ms": args.engine_ms, "set": args.set,
              "median": summary, "steps": steps}
    (out / "endpoint_turns.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"median": {k: round(v, 3) for k, v in summary.items()}}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
