"""`run.call_trace`: every role call on a timeline (Chrome trace event format) in the run directory."""

import asyncio
import time
from collections import defaultdict

from rolefleet.actor.client import InProcessActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.coordinator.call_trace import BLOCKED, FILE, CallTrace, read_trace, watch_event_loop
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.loop import Roles, train
from rolefleet.coordinator.state import RunStatus
from rolefleet.critic.client import InProcessCriticClient
from rolefleet.critic.core import CriticCore
from rolefleet.reward.core import RewardCore
from tests.coordinator.test_pipeline import SlowReward


def slices(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] == "X"]


def track_names(events: list[dict]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


def assert_no_overlap_within_a_track(events: list[dict]) -> None:
    per_track = defaultdict(list)
    for e in slices(events):
        per_track[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for spans in per_track.values():
        spans.sort()
        assert all(end <= nxt_start + 0.2 for (_, end), (nxt_start, _) in zip(spans, spans[1:])), spans


def test_overlapping_calls_take_lanes_and_a_failed_call_says_why(tmp_path):
    trace = CallTrace.for_run(tmp_path, "r")
    first = trace.begin("reward", "score")
    second = trace.begin("reward", "score")  # while the first is in flight: a second lane
    trace.end(first)
    third = trace.begin("reward", "score")  # the first lane is free again
    trace.end(second, RuntimeError("boom"))
    trace.end(third)
    trace.close()
    events = read_trace(tmp_path / FILE)
    names = track_names(events)
    assert [names[e["tid"]] for e in slices(events)] == ["reward.score", "reward.score (2)", "reward.score"]
    assert [e.get("args") for e in slices(events)] == [None, {"error": "RuntimeError: boom"}, None]
    assert all(e["cat"] == "reward" and e["dur"] >= 0 for e in slices(events))
    assert_no_overlap_within_a_track(events)


def test_a_resumed_run_appends_and_drops_a_line_cut_short_by_a_kill(tmp_path):
    trace = CallTrace.for_run(tmp_path, "r")
    trace.end(trace.begin("actor", "update"))
    trace.close()
    with open(tmp_path / FILE, "a") as f:
        f.write('{"ph":"X","name":"actor.upd')  # the coordinator killed mid-line
    trace = CallTrace.for_run(tmp_path, "r")
    trace.end(trace.begin("actor", "update"))
    trace.close()
    events = read_trace(tmp_path / FILE)
    assert [e["name"] for e in slices(events)] == ["actor.update", "actor.update"]
    assert sum(e["name"] == "process_name" for e in events) == 2  # one per coordinator start


def run(cfg) -> None:
    roles = Roles(InProcessActorClient(ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound)),
                  SlowReward(RewardCore(cfg.reward), delay_s=0.05),
                  InProcessCriticClient(CriticCore(cfg.critic, cfg.run.seed, cfg.pipeline.staleness_bound)))
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    try:
        asyncio.run(train(cfg, roles, logger, RunStatus(cfg.run.name, cfg.train.total_steps)))
    finally:
        logger.close()


def test_an_async_run_traces_every_role_call_inside_its_time(make_config):
    cfg = make_config("algorithm=ppo", "run.call_trace=true", "pipeline.mode=async", "pipeline.max_staleness=1",
                      "train.total_steps=4")
    before = time.time() * 1e6
    run(cfg)
    after = time.time() * 1e6
    events = read_trace(cfg.run.out / FILE)
    calls = defaultdict(int)
    for e in slices(events):
        calls[e["name"]] += 1
        assert before <= e["ts"] <= e["ts"] + e["dur"] <= after
    assert {name: calls[name] for name in ("actor.update", "critic.update", "actor.compute_logprobs")} == {
        "actor.update": 4, "critic.update": 4, "actor.compute_logprobs": 4}
    assert calls["actor.generate_stream"] >= 4 and calls["reward.score"] >= 4 and calls["critic.compute_values"] >= 4
    # The coordinator's own waits: a slow reward keeps the trainer waiting for scored batches, and
    # generation, running ahead, waits at the staleness bound.
    assert calls["coordinator.train waits (scored batch)"] >= 1
    assert calls["coordinator.generate waits (staleness bound)"] >= 1
    assert calls["coordinator.train computes targets"] == 4
    assert_no_overlap_within_a_track(events)


def test_a_blocked_event_loop_is_a_slice_over_the_time_it_was_blocked(tmp_path):
    trace = CallTrace.for_run(tmp_path, "r")

    async def main() -> tuple[float, float]:
        watch = asyncio.create_task(watch_event_loop(trace))
        await asyncio.sleep(0.1)  # the loop free: nothing to show
        start = time.time() * 1e6
        time.sleep(0.3)  # CPU work inside a callback: nothing else on the loop runs meanwhile
        end = time.time() * 1e6
        await asyncio.sleep(0.1)
        watch.cancel()
        return start, end

    start, end = asyncio.run(main())
    trace.close()
    # The slice over the block (a loaded machine may add others: its loop was late then too) starts
    # within a tick of it, ends after it, and is not much longer.
    (blocked,) = [e for e in slices(read_trace(tmp_path / FILE))
                  if e["name"] == BLOCKED and e["ts"] < end and e["ts"] + e["dur"] > start]
    assert blocked["ts"] <= start + 0.02e6 and blocked["ts"] + blocked["dur"] >= end
    assert blocked["dur"] <= (end - start) + 0.25e6


def test_no_trace_unless_asked(make_config):
    cfg = make_config("train.total_steps=1")
    run(cfg)
    assert (cfg.run.out / "metrics.jsonl").exists() and not (cfg.run.out / FILE).exists()
