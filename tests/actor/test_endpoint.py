"""The actor's OpenAI-compatible endpoint (`actor/openai_api.py`, `actor/sessions.py`), in process:
the official `openai` client over an ASGI transport (no socket), against a real ActorCore of the
tiny chat model. Sessions keep the ids the model sampled (token in, token out), refuse what does not
extend them, and answer bad requests with OpenAI error objects naming the field."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch

from rolefleet.actor.completions import CompletionBatcher
from rolefleet.actor.core import ActorCore
from rolefleet.actor.openai_api import Endpoint
from rolefleet.actor.types import FinishReason, PolicyTargets, Sample, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.errors import InvalidArgument, LimitExceeded

pytestmark = pytest.mark.multiturn
TOKEN = "run-token"
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


def an_actor(model_dir: str) -> ActorCore:
    cfg = parse_config({"model": {"model_name_or_path": model_dir}},
                       ["actor.num_threads=1", "actor.rollout.max_turns=4", "actor.rollout.max_total_tokens=512", "sampling.max_new_tokens=8",
                        "actor.endpoint.max_sessions=8", "reward.env.name=feedback"])
    return ActorCore(cfg.actor)


@pytest.fixture(scope="module")
def actor(chat_model_dir):
    return an_actor(chat_model_dir)


class Scripted:
    """A stand-in for the engine: each call answers the next scripted token ids (and records what
    it was asked), so that a test decides what the model 'sampled'."""

    def __init__(self, actor: ActorCore, replies: list[list[int]]):
        self.actor, self.replies, self.asked = actor, list(replies), []

    def __call__(self, continuations, sampling):
        self.asked.append(([c.context_ids.clone() for c in continuations], sampling))
        out = []
        for i, c in enumerate(continuations):
            ids = torch.tensor(self.replies.pop(0), dtype=torch.int64)
            out.append(Sample(i, 0, c.context_ids, ids, torch.full((len(ids),), -0.5), FinishReason.STOP, 3,
                              self.actor.tokenizer.decode(ids.tolist(), skip_special_tokens=True)))
        return out


def client_of(actor: ActorCore, generate, base: str = "/v1", key: str = TOKEN) -> openai.AsyncOpenAI:
    batcher = CompletionBatcher(generate, 16, decode=actor.tokenizer.decode)
    app = Endpoint(actor.sessions, batcher, actor.tokenizer, TOKEN, "policy", 32).app()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://actor")
    return openai.AsyncOpenAI(base_url=f"http://actor{base}", api_key=key, http_client=http, max_retries=0)


def engine(actor: ActorCore):
    return lambda continuations, sampling: actor.generate([], sampling, 0, continuations)


def spelled_apart(tok) -> list[int]:
    """Token ids whose text, tokenized again, is other ids: the characters of a token the tokenizer
    has whole (a merge, or an added token such as `<tool_call>`), sampled one by one."""
    for text, whole in sorted(tok.get_vocab().items(), key=lambda kv: -len(kv[0])):
        piece = tok.convert_tokens_to_string([text])
        if len(piece) < 2 or tok(piece, add_special_tokens=False)["input_ids"] != [whole]:
            continue
        chars = [tok(c, add_special_tokens=False)["input_ids"] for c in piece]
        if all(len(c) == 1 for c in chars):
            return [c[0] for c in chars]
    raise AssertionError("the tokenizer has no token spelled by others")


def test_the_trained_ids_are_the_sampled_ones_where_the_conversation_retokenizes_otherwise(actor):
    tok = actor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    apart = spelled_apart(tok)
    first, second = [*apart, end], [apart[0], *apart, end]
    script = Scripted(actor, [first, second])
    [key] = actor.open_sessions(["drift"], SamplingParams(temperature=1.0, max_new_tokens=64))
    client = client_of(actor, script, "/sessions/drift/v1", key)

    async def episode():
        r1 = await client.chat.completions.create(model="policy", messages=QUESTION)
        messages = [*QUESTION, r1.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "And times 2?"}]
        r2 = await client.chat.completions.create(model="policy", messages=messages)
        return messages, r2

    messages, r2 = asyncio.run(episode())
    [t] = actor.close_sessions(["drift"])
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    observation = actor.turns.observation_ids([{"role": "user", "content": "And times 2?"}], end, "o")
    assert t.prompt_ids.tolist() == tok(prompt, add_special_tokens=False)["input_ids"]
    assert t.response_ids.tolist() == first + observation + second
    assert t.own.tolist() == [True] * len(first) + [False] * len(observation) + [True] * len(second)
    assert t.logprobs[t.own].tolist() == [-0.5] * (len(first) + len(second)) and t.logprobs[~t.own].abs().sum() == 0
    assert t.versions.tolist() == [3] * len(t.response_ids) and t.turns == 2
    # The second request's context was the recorded ids, not the conversation rendered again ...
    assert script.asked[1][0][0].tolist() == t.prompt_ids.tolist() + first + observation
    # ... which here would be other ids: the sampled characters tokenize again as one token.
    whole = [*messages, {"role": "assistant", "content": r2.choices[0].message.content}]
    again = tok(tok.apply_chat_template(whole, tokenize=False), add_special_tokens=False)["input_ids"]
    assert again[:len(t.prompt_ids) + len(t.response_ids)] != t.prompt_ids.tolist() + t.response_ids.tolist()


def test_a_session_samples_with_the_run_s_sampling_and_records_the_engine_s_tokens(actor):
    [key] = actor.open_sessions(["real"], SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6))
    seen = []

    def spy(continuations, sampling):
        seen.append(sampling)
        return engine(actor)(continuations, sampling)

    client = client_of(actor, spy, "/sessions/real/v1", key)
    reply = asyncio.run(client.chat.completions.create(model="x", messages=QUESTION, temperature=0.2, max_tokens=4,
                                                        logprobs=True))
    [t] = actor.close_sessions(["real"])
    assert seen[0].temperature == pytest.approx(0.7) and seen[0].top_p == pytest.approx(0.9)
    assert seen[0].max_new_tokens == 4 and seen[0].stop_at_end_of_turn and seen[0].seed < 0
    assert len(t.response_ids) == reply.usage.completion_tokens <= 4
    assert [c.logprob for c in reply.choices[0].logprobs.content] == pytest.approx(t.logprobs.tolist())


def test_tool_calls_come_back_as_openai_function_calls_and_their_results_extend_the_session(actor):
    tok = actor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call = tok('<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>',
               add_special_tokens=False)["input_ids"] + [end]
    script = Scripted(actor, [call, tok("42", add_special_tokens=False)["input_ids"] + [end]])
    [key] = actor.open_sessions(["tools"], SamplingParams(max_new_tokens=64))
    client = client_of(actor, script, "/sessions/tools/v1", key)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                               "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]

    async def episode():
        r1 = await client.chat.completions.create(model="policy", messages=QUESTION, tools=tools)
        message = r1.choices[0].message
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}
        r2 = await client.chat.completions.create(model="policy", tools=tools,
                                                  messages=[*QUESTION, message.model_dump(), result])
        return r1, r2

    r1, r2 = asyncio.run(episode())
    assert r1.choices[0].finish_reason == "tool_calls"
    fn = r1.choices[0].message.tool_calls[0].function
    assert fn.name == "add" and json.loads(fn.arguments) == {"a": 12, "b": 30}
    assert r2.choices[0].message.content == "42" and r2.choices[0].finish_reason == "stop"
    # The tools were in the prompt the model saw (this template writes their names in a system message).
    assert "tools: add" in tok.decode(script.asked[0][0][0].tolist()).split("<|im_start|>user")[0]
    [t] = actor.close_sessions(["tools"])
    assert t.turns == 2 and "<|im_start|>tool\n42" in tok.decode(t.response_ids[~t.own].tolist())


def test_streaming_gives_the_same_completion_in_server_sent_events(actor):
    end = actor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = actor.tokenizer("hello there", add_special_tokens=False)["input_ids"] + [end]
    client = client_of(actor, Scripted(actor, [ids]))

    async def chunks():
        stream = await client.chat.completions.create(model="policy", messages=QUESTION, stream=True,
                                                      stream_options={"include_usage": True})
        return [c async for c in stream]

    got = asyncio.run(chunks())
    text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
    assert text == "hello there"
    assert [c.choices[0].finish_reason for c in got if c.choices][-1] == "stop"
    assert got[-1].usage.completion_tokens == len(ids)


def test_outside_a_session_n_samples_are_returned_and_nothing_is_recorded(actor):
    client = client_of(actor, engine(actor))
    open_before = len(actor.sessions)
    reply = asyncio.run(client.chat.completions.create(model="policy", messages=QUESTION, n=3, max_tokens=3,
                                                        seed=7))
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert 3 <= reply.usage.completion_tokens <= 9  # three completions of 1-3 tokens each
    assert len(actor.sessions) == open_before
    async def models():
        return [m.id async for m in client.models.list()]

    assert asyncio.run(models()) == ["policy"]


def status_of(call) -> tuple[int, dict]:
    try:
        asyncio.run(call)
    except openai.APIStatusError as e:
        return e.status_code, e.body
    raise AssertionError("the request succeeded")


def test_bad_requests_get_openai_errors_naming_what_is_wrong_and_change_no_session(actor):
    end = actor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    [key] = actor.open_sessions(["bad"], SamplingParams(max_new_tokens=8))
    script = Scripted(actor, [[5, end]] * 8)
    session = client_of(actor, script, "/sessions/bad/v1", key)
    r1 = asyncio.run(session.chat.completions.create(model="p", messages=QUESTION))
    before = actor.sessions.session("bad", None).ids.clone()
    history = [*QUESTION, r1.choices[0].message.model_dump()]
    create = session.chat.completions.create
    cases = [
        (create(model="p", messages=[*QUESTION, {"role": "assistant", "content": "other"},
                                     {"role": "user", "content": "?"}]), 409, "messages[1]"),
        (create(model="p", messages=QUESTION), 409, "add nothing"),
        (create(model="p", messages=[*history, {"role": "user", "content": "?"}], tools=[
            {"type": "function", "function": {"name": "f"}}]), 409, "tools differ"),
        (create(model="p", messages=[*history, {"role": "user", "content": "?"}], n=0), 400, "n"),
        (create(model="p", messages=[*history, {"role": "user", "content": "?"}], n=2), 400, "n must be 1"),
        (create(model="p", messages=[*history, {"role": "user", "content": "?"}], stop=["two words"]), 400, "stop[0]"),
        (create(model="p", messages=[*history, {"role": "user", "content": "?"}], tool_choice="required"),
         400, "tool_choice"),
        (create(model="p", messages=[*history, {"role": "user", "content": "?"}], presence_penalty=1.0),
         400, "presence_penalty"),
        (create(model="p", messages=[*history, {"role": "user", "content": 3}]), 400, "messages[2].content"),
        (create(model="p", messages=[*history, {"role": "assistant", "content": "x"}]), 400, "assistant"),
        (create(model="p", messages=[]), 400, "messages"),
    ]
    for call, status, named in cases:
        code, body = status_of(call)
        assert code == status, (named, body)
        assert named in json.dumps(body), (named, body)
    assert torch.equal(actor.sessions.session("bad", None).ids, before)
    # Without the session's key, or for a session that does not exist.
    stranger = client_of(actor, script, "/sessions/bad/v1", "not-its-key")
    assert status_of(stranger.chat.completions.create(model="p", messages=QUESTION))[0] == 404
    nobody = client_of(actor, script, "/sessions/nobody/v1")
    assert status_of(nobody.chat.completions.create(model="p", messages=QUESTION))[0] == 404
    outside = client_of(actor, script, "/v1", "wrong")
    assert status_of(outside.chat.completions.create(model="p", messages=QUESTION))[0] == 401
    # Past the session's turns (actor.rollout.max_turns = 4): 429 naming the limit.
    messages = history
    for _ in range(3):
        messages = [*messages, {"role": "user", "content": "again"}]
        reply = asyncio.run(create(model="p", messages=messages))
        messages = [*messages, reply.choices[0].message.model_dump()]
    code, body = status_of(create(model="p", messages=[*messages, {"role": "user", "content": "more"}]))
    assert code == 429 and "actor.rollout.max_turns" in body["message"]
    assert actor.close_sessions(["bad"])[0].turns == 4


def test_sessions_are_limited_and_an_unknown_one_closes_empty(actor):
    open_before = len(actor.sessions)
    with pytest.raises(LimitExceeded, match="actor.endpoint.max_sessions"):
        actor.open_sessions([f"s{i}" for i in range(9)], SamplingParams())
    assert len(actor.sessions) == open_before
    with pytest.raises(InvalidArgument, match=r"session_ids\[0\]"):
        actor.open_sessions(["no spaces"], SamplingParams())
    [t] = actor.close_sessions(["never"])
    assert t.turns == 0 and "no such session" in t.error


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_schemathesis_finds_no_server_error_no_answer_outside_the_schema_and_no_ignored_auth(actor, tmp_path):
    """The endpoint on loopback, fuzzed against its own OpenAPI schema with the run's token (and,
    by schemathesis's `ignored_auth` check, without it): completions of the tiny model's included.
    Every check but `positive_data_acceptance`: a request the schema admits may still be refused
    400 for what no schema says (its last message the assistant's, a role the chat template refuses)."""
    import subprocess

    from tests.deploy.tools import tool
    from tests.helpers import served_on_loopback

    app = Endpoint(actor.sessions, CompletionBatcher(engine(actor), 16), actor.tokenizer, TOKEN, "policy", 8).app()
    with served_on_loopback(app) as url:
        proc = subprocess.run(
            [tool("schemathesis"), "run", f"{url}/openapi.json", "--checks", "all",
             "--exclude-checks", "positive_data_acceptance",
             "--max-examples", "15", "--seed", "1", "--request-timeout", "20", "--max-failures", "5",
             "-H", f"Authorization: Bearer {TOKEN}"], capture_output=True, text=True, timeout=200, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_requests_arriving_together_share_one_engine_call_each_cut_to_its_own_limit():
    calls = []

    def generate(continuations, sampling):
        calls.append((len(continuations), sampling.max_new_tokens))
        return [Sample(i, 0, c.context_ids, torch.arange(10, 10 + sampling.max_new_tokens),
                       torch.full((sampling.max_new_tokens,), -1.0), FinishReason.STOP, 0, "whole")
                for i, c in enumerate(continuations)]

    async def agents():
        batcher = CompletionBatcher(generate, 16, window_s=0.02, decode=lambda ids: f"cut to {len(ids)}")

        async def one(delay, limit):
            await asyncio.sleep(delay)
            return await batcher.complete(torch.tensor([1, 2]), SamplingParams(max_new_tokens=limit))

        # Arrivals a few ms apart, within the window of each other: one call for all four.
        out = await asyncio.gather(one(0, 6), one(0.005, 3), one(0.01, 6), one(0.015, 1))
        await batcher.close()
        return out

    out = asyncio.run(agents())
    assert calls == [(4, 6)]
    assert [len(s.response_ids) for [s] in out] == [6, 3, 6, 1]
    assert [s.finish_reason for [s] in out] == [FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP,
                                                FinishReason.LENGTH]
    assert out[1][0].response_text == "cut to 3" and out[1][0].logprobs.tolist() == [-1.0] * 3
    assert out[1][0].response_ids.tolist() == [10, 11, 12]


def test_a_long_stream_of_arrivals_is_one_call_and_a_full_call_does_not_wait_for_the_window():
    """A step's agents reach the endpoint over far more than a few windows (each request is parsed
    and rendered on the loop): while they keep coming the call waits, and one call takes them all.
    Once a call's worth of sequences waits, it starts at once."""
    calls = []

    def generate(continuations, sampling):
        calls.append((len(continuations), time.perf_counter()))
        return [Sample(i, 0, c.context_ids, torch.arange(10, 12), torch.zeros(2), FinishReason.STOP, 0, "x")
                for i, c in enumerate(continuations)]

    async def stream(max_sequences, arrivals, gap_s, window_s):
        batcher = CompletionBatcher(generate, max_sequences, window_s=window_s)

        async def one(delay):
            await asyncio.sleep(delay)
            return await batcher.complete(torch.tensor([1, 2]), SamplingParams(max_new_tokens=2))

        start = time.perf_counter()
        await asyncio.gather(*(one(i * gap_s) for i in range(arrivals)))
        await batcher.close()
        return start

    asyncio.run(stream(64, 60, 0.004, 0.015))  # 240 ms of arrivals, ten windows are 150 ms
    assert [n for n, _ in calls] == [60]
    calls.clear()
    start = asyncio.run(stream(4, 4, 0.0, 1.0))  # a full call: no one-second window
    assert [n for n, _ in calls] == [4] and calls[0][1] - start < 0.5


def test_agents_outside_the_cluster_claim_episodes_drive_them_and_post_their_rewards(actor):
    from rolefleet.actor.types import AgentTask

    end = actor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    script = Scripted(actor, [[5, end]] * 4)
    batcher = CompletionBatcher(script, 16, decode=actor.tokenizer.decode)
    app = Endpoint(actor.sessions, batcher, actor.tokenizer, TOKEN, "policy", 32).app()
    actor.open_sessions(["x1", "x2"], SamplingParams(max_new_tokens=8),
                        [AgentTask(QUESTION, "42", {"id": 1}), AgentTask("plain text", "7", {})])

    async def outside():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://actor") as http:
            run = {"Authorization": f"Bearer {TOKEN}"}
            first = (await http.post("/v1/episodes", headers=run)).json()
            second = (await http.post("/v1/episodes", headers=run)).json()
            none = await http.post("/v1/episodes", headers=run)
            refused = await http.post("/v1/episodes", headers={"Authorization": "Bearer nope"})
            client = openai.AsyncOpenAI(base_url=first["base_url"], api_key=first["key"], http_client=http,
                                        max_retries=0)
            await client.chat.completions.create(model="policy", messages=first["prompt"])
            own = {"Authorization": f"Bearer {first['key']}"}
            posted = await http.post(f"/v1/episodes/{first['id']}/reward", headers=own, json={"reward": 0.5})
            again = await http.post(f"/v1/episodes/{first['id']}/reward", headers=own, json={"reward": 1.0})
            nan = await http.post(f"/v1/episodes/{second['id']}/reward", headers=run, content=b'{"reward": NaN}',
                                  )
            other = await http.post(f"/v1/episodes/{second['id']}/reward", headers=own, json={"reward": 1.0})
            return first, second, none, refused, posted, again, nan, other

    first, second, none, refused, posted, again, nan, other = asyncio.run(outside())
    # Claimed in the order the run opened them, each with its task and its own session.
    assert (first["id"], first["prompt"], first["ground_truth"], first["extra"]) == ("x1", QUESTION, "42", {"id": 1})
    assert first["base_url"] == "http://actor/sessions/x1/v1" and second["prompt"] == "plain text"
    assert none.status_code == 404 and "no episode is waiting" in none.json()["error"]["message"]
    assert refused.status_code == 401
    assert posted.status_code == 200 and again.status_code == 409 and nan.status_code == 400
    assert other.status_code == 404  # one session's key posts for no other
    assert actor.session_rewards(["x1", "x2", "nobody"]) == [0.5, None, None]
    [t1, t2] = actor.close_sessions(["x1", "x2"])
    assert t1.turns == 1 and t2.turns == 0


def test_a_session_named_in_the_header_is_the_session_of_its_base_url(actor):
    """`X-Session-Id` under /v1 (the run's token): the same session as its own base URL, recorded alike."""
    end = actor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    actor.open_sessions(["hdr"], SamplingParams(max_new_tokens=8))
    client = client_of(actor, Scripted(actor, [[5, end]]))
    asyncio.run(client.chat.completions.create(model="policy", messages=QUESTION, extra_headers={"X-Session-Id": "hdr"}))
    [t] = actor.close_sessions(["hdr"])
    assert t.turns == 1 and t.response_ids.tolist() == [5, end]
    code, _ = status_of(client.chat.completions.create(model="policy", messages=QUESTION,
                                                       extra_headers={"X-Session-Id": "hdr"}))
    assert code == 404  # closed


def test_the_endpoint_reports_its_engine_calls_gathering_and_request_work_with_the_next_update(chat_model_dir):
    """`actor/endpoint_*` in an update's record: what the agents waited for since the last update,
    where a gap between an agent's step and the environment's shows (docs/benchmarks.md)."""
    actor = an_actor(chat_model_dir)  # its own: it takes an update
    [key] = actor.open_sessions(["timed"], SamplingParams(max_new_tokens=4))
    batcher = CompletionBatcher(engine(actor), 16, window_s=0.01, decode=actor.tokenizer.decode,
                                stats=actor.endpoint_stats)
    app = Endpoint(actor.sessions, batcher, actor.tokenizer, TOKEN, "policy", 32).app()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://actor")
    client = openai.AsyncOpenAI(base_url="http://actor/sessions/timed/v1", api_key=key, http_client=http,
                                max_retries=0)

    async def two_turns():
        first = await client.chat.completions.create(model="x", messages=QUESTION)
        await client.chat.completions.create(model="x", messages=[
            *QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And again?"}])
        await batcher.close()

    asyncio.run(two_turns())
    [t] = actor.close_sessions(["timed"])
    batch = SequenceBatch.from_lists([t.prompt_ids], [t.response_ids], [t.own])
    lp = actor.compute_logprobs(batch, 1.0, include_reference=True)
    targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs, lp.ref_logprobs)
    stats = actor.update(actor.ledger.last_step + 1, actor.policy_version, batch, targets, 1.0).stats
    assert stats["endpoint_requests"] == 2 and stats["endpoint_calls"] == 2 and stats["endpoint_sequences"] == 2
    assert stats["endpoint_sequences_per_call"] == 1.0
    assert stats["endpoint_engine_s"] > 0 and stats["endpoint_handler_s"] > 0
    assert stats["endpoint_gather_s"] >= 0.015  # each call waited a window (10 ms) for more requests
    assert actor.endpoint_stats.take() == {}  # taken: the next update reports only what follows


def test_a_call_waits_past_quiet_windows_for_sessions_yet_to_ask_but_no_longer_than_a_call_lasts():
    """Agents that come back at different times (each ran a tool): while the endpoint knows sessions
    are yet to ask, the call waits for them past quiet windows, so a turn is one engine call, not a
    call for the stragglers too; without such sessions, a quiet window ends the wait as before; and
    a session that never asks holds a call up no longer than the last engine call took."""
    calls = []
    # Times far apart against a loaded machine's delays: an engine call of 0.2 s, windows of 20 ms
    # (100 of them: 2 s), a straggler 6 windows late.
    engine_s, window_s, straggler_s = 0.2, 0.02, 0.12

    def generate(continuations, sampling):
        calls.append(len(continuations))
        time.sleep(engine_s)  # an engine call's time: the most a call waits for stragglers after the first
        return [Sample(i, 0, c.context_ids, torch.arange(10, 12), torch.zeros(2), FinishReason.STOP, 0, "x")
                for i, c in enumerate(continuations)]

    async def agents(delays, expected, first_call=False):
        asked = []
        batcher = CompletionBatcher(generate, 64, window_s=window_s, pending=lambda: max(0, expected - len(asked)))
        if first_call:  # a call before: its duration bounds the wait
            await batcher.complete(torch.tensor([1, 2]), SamplingParams(max_new_tokens=2))
            calls.clear()

        async def one(delay):
            await asyncio.sleep(delay)
            asked.append(delay)
            return await batcher.complete(torch.tensor([1, 2]), SamplingParams(max_new_tokens=2))

        start = time.perf_counter()
        await asyncio.gather(*(one(d) for d in delays))
        await batcher.close()
        return time.perf_counter() - start

    # Three agents, the last back six quiet windows after the others: one call.
    asyncio.run(agents([0, 0, straggler_s], expected=3))
    assert calls == [3]
    calls.clear()
    # No session expected to ask: the quiet window ends the wait, the straggler gets its own call.
    asyncio.run(agents([0, 0, straggler_s], expected=0))
    assert calls == [2, 1]
    calls.clear()
    # A fourth session that never asks: after a 0.2 s call, the wait ends 0.2 s on, not 100 windows (2 s).
    took = asyncio.run(agents([0, 0], expected=3, first_call=True))
    assert calls == [2] and took < 1.2, took


def test_the_sessions_yet_to_ask_are_those_whose_last_reply_called_tools(actor):
    """Not a session no agent has touched (agents run a part at a time: the later parts' would be
    waited for in vain), nor one whose last reply was plain (its agent is done, as a rule)."""
    store = actor.sessions
    ids = ["pa", "pb", "pc"]
    before = store.pending()
    store.open(ids, SamplingParams(max_new_tokens=4))
    assert store.pending() == before  # opened, not yet asked in
    a, b = store.session("pa", None), store.session("pb", None)
    messages = [{"role": "user", "content": "1+1?"}]
    piece = Sample(0, 0, torch.tensor([1]), torch.tensor([5, 6]), torch.zeros(2), FinishReason.STOP, 0, "2")
    turn = store.begin(a, messages, None, None, a.sampling)
    store.record(turn, piece, {"role": "assistant", "content": "2"})
    assert store.pending() == before and not a.asks_again  # a plain reply: done
    turn = store.begin(b, messages, None, None, b.sampling)
    store.record(turn, piece, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{\"x\": 1}"}}]})
    assert b.asks_again and store.pending() == before + 1  # b comes back with the tool's result
    turn = store.begin(b, [*messages, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}], None, None, b.sampling)
    assert store.pending() == before  # its request in flight
    store.release(turn)
    store.close(ids)
    assert store.pending() == before


def test_fresh_sessions_are_yet_to_ask_as_far_as_the_agents_at_once_leave_room(actor):
    """`actor.endpoint.agents_at_once` (reward.agent.workers x concurrency): that many agents drive
    sessions at a time, so of the sessions no agent has asked in yet, as many as the agents at work
    leave room for are expected."""
    from rolefleet.actor.sessions import SessionLimits, SessionStore

    store = SessionStore(actor.tokenizer, SessionLimits(64, 64, 4, 3600, agents_at_once=2), None)
    store.open(["f1", "f2", "f3"], SamplingParams(max_new_tokens=4))
    assert store.pending() == 2  # two agents at once: the third session's agent waits for a slot
    s = store.session("f1", None)
    turn = store.begin(s, [{"role": "user", "content": "2+2?"}], None, None, s.sampling)
    assert store.pending() == 1  # f1's agent is at work (its request in flight): one slot left
    piece = Sample(0, 0, torch.tensor([1]), torch.tensor([5, 6]), torch.zeros(2), FinishReason.STOP, 0, "4")
    store.record(turn, piece, {"role": "assistant", "content": "4"})
    assert store.pending() == 2  # f1's agent is done: its slot takes f3's


def test_a_first_request_asked_again_is_rendered_once(actor, monkeypatch):
    """The samples of a prompt open with the same request: its template and tokenizer run once."""
    store = actor.sessions
    rendered = []
    real = store._render_first

    def counting(messages, tools):
        rendered.append(messages[-1]["content"])
        return real(messages, tools)

    monkeypatch.setattr(store, "_render_first", counting)
    ask = [{"role": "user", "content": "What is 7 x 8? (asked twice)"}]
    first, again = store._first(ask, None), store._first(ask, None)
    assert torch.equal(first, again) and first.data_ptr() != again.data_ptr() and len(rendered) == 1
    other = store._first([{"role": "user", "content": "What is 7 x 9? (asked once)"}], None)
    assert not torch.equal(first, other) and len(rendered) == 2
    store._first(ask, [{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert len(rendered) == 3  # the tools are part of the request: rendered anew


def test_a_request_of_another_attempt_starts_its_session_over_and_one_without_leaves_it(actor):
    """`X-Episode-Attempt` (the reward role's agent runner, one value a call): a session's requests of
    one call extend it as always (409 for one that does not); the first of another call starts the
    episode over; a request without the header changes nothing of this."""
    [key] = actor.open_sessions(["att"], SamplingParams(max_new_tokens=8))
    tok = actor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    script = Scripted(actor, [tok("1", add_special_tokens=False)["input_ids"] + [end]] * 4)
    client = client_of(actor, script, "/sessions/att/v1", key)

    async def ask(attempt, messages):
        headers = {"X-Episode-Attempt": attempt} if attempt else {}
        return await client.chat.completions.create(model="policy", messages=messages, extra_headers=headers)

    async def episode():
        await ask("first", QUESTION)
        with pytest.raises(openai.ConflictError):  # the same call: the conversation must go on
            await ask("first", QUESTION)
        with pytest.raises(openai.ConflictError):  # no attempt named: as without the runner
            await ask(None, QUESTION)
        await ask("second", QUESTION)  # the call repeated: from the start again
        again = [*QUESTION, {"role": "assistant", "content": "1"}, {"role": "user", "content": "And?"}]
        await ask("second", again)
        with pytest.raises(openai.BadRequestError) as err:  # a header past its bound is named
            await ask("x" * 65, QUESTION)
        assert err.value.body["param"] == "X-Episode-Attempt"

    asyncio.run(episode())
    [t] = actor.close_sessions(["att"])
    assert t.turns == 2 and len(script.asked) == 3


def test_the_directly_served_session_route_answers_as_the_app_s_own_route(actor):
    """`rpc/http_direct.py`: session completions skip the framework's per-request layers; what they
    answer, good requests and bad, is what the FastAPI route of the same path answers."""
    tok = actor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    direct = Endpoint(actor.sessions, CompletionBatcher(Scripted(actor, [tok("7")["input_ids"] + [end]] * 8), 16),
                      actor.tokenizer, TOKEN, "policy", 32).app()
    framework = direct.app  # the FastAPI app the direct routes stand in front of
    through_app = []

    async def counted(scope, receive, send):  # what reaches the app from the direct routes' side
        through_app.append(scope["path"])
        await framework(scope, receive, send)

    direct.app = counted
    good = {"model": "policy", "messages": QUESTION}
    cases = [  # (headers, body): each sent to a fresh session of its own through each app
        ({}, good),
        ({}, {"model": "policy"}),
        ({}, {"messages": []}),
        ({}, {"messages": QUESTION, "n": 99}),
        ({}, {"messages": [{"role": "user", "content": 5}]}),
        ({}, {"messages": QUESTION, "tool_choice": {"type": "function"}}),
        ({}, {"messages": QUESTION, "n": 2}),
        ({}, b"{not json"),
        ({}, b""),
        ({"content-type": "text/plain"}, b'{"messages": []}'),
        ({"content-type": "application/vnd.x+json"}, good),
        ({"X-Episode-Attempt": "x" * 65}, good),
        ({"X-Episode-Attempt": "x" * 65}, {"messages": []}),  # the header is named before the body
        ({"Authorization": "Basic abc"}, good),
        ({"Authorization": "Bearer wrong-key"}, good),
        ({"Authorization": None}, good),
    ]

    async def answer(app, sid: str, headers: dict, body) -> tuple[int, dict]:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://actor")
        [key] = actor.open_sessions([sid], SamplingParams(max_new_tokens=4))
        sent = {"Authorization": f"Bearer {key}", **headers}
        sent = {k: v for k, v in sent.items() if v is not None}
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = await http.post(f"/sessions/{sid}/v1/chat/completions", headers=sent, **kwargs)
        actor.close_sessions([sid])
        data = r.json()
        for volatile in ("id", "created"):
            data.pop(volatile, None)
        return r.status_code, data

    async def both():
        for i, (headers, body) in enumerate(cases):
            ours = await answer(direct, f"s{i}", headers, body)
            theirs = await answer(framework, f"s{i}", headers, body)  # the same id, opened again
            if isinstance(body, bytes):  # not JSON of an object: both refuse it, in their own words
                assert ours[0] == theirs[0] == 400 and ours[1]["error"]["message"].startswith("body: "), (i, ours)
            else:
                assert ours == theirs, (i, headers, body, ours, theirs)
        assert through_app == []  # every session completion above was answered directly
        # A path or method the direct routes do not take goes to the app.
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=direct), base_url="http://actor")
        assert (await http.get("/sessions/x/v1/chat/completions")).status_code == 405
        assert (await http.get("/openapi.json")).json()["paths"]["/sessions/{session_id}/v1/chat/completions"]

    asyncio.run(both())


def test_a_body_over_the_bound_is_refused_before_it_is_read_whole():
    from starlette.responses import JSONResponse

    from rolefleet.rpc.http_direct import DirectRoute, DirectRoutes

    seen = []

    async def handle(match, headers, body):
        seen.append(body)
        return JSONResponse({"size": len(body)})

    async def fallback(scope, receive, send):
        await JSONResponse({"app": True})(scope, receive, send)

    app = DirectRoutes(fallback, [DirectRoute("POST", __import__("re").compile(r"/x"), handle)], 100,
                       lambda limit: JSONResponse({"limit": limit}, status_code=413))

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        assert (await http.post("/x", content=b"a" * 100)).json() == {"size": 100}
        r = await http.post("/x", content=b"a" * 101)
        assert r.status_code == 413 and r.json() == {"limit": 100}

        async def chunks():  # no declared length: counted as it arrives
            for _ in range(5):
                yield b"a" * 30

        assert (await http.post("/x", content=chunks())).status_code == 413
        assert (await http.post("/y", content=b"a" * 500)).json() == {"app": True}

    asyncio.run(go())
    assert seen == [b"a" * 100]


def test_a_batch_s_requests_are_each_answered_as_it_alone_would_be_in_one_engine_call(actor):
    """`POST /v1/batch/chat/completions` (the reward role's agent workers send a turn's requests so,
    reward/batching.py): each item gets the status and body its request alone gets, in order, and
    the good ones share one engine call; a streamed or non-session item is refused alone."""
    tok = actor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine_calls = Scripted(actor, [tok("7")["input_ids"] + [end]] * 16)
    app = Endpoint(actor.sessions, CompletionBatcher(engine_calls, 16), actor.tokenizer, TOKEN, "policy", 32).app()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://actor")
    good = {"model": "policy", "messages": QUESTION}
    cases = [({}, good), ({}, {"messages": []}), ({}, {"messages": [{"role": "user", "content": 5}]}),
             ({}, {"messages": QUESTION, "n": 2}), ({"content-type": "text/plain"}, good),
             ({"x-episode-attempt": "x" * 65}, good), ({"authorization": "Bearer wrong-key"}, good), ({}, good)]

    def strip(data: dict) -> dict:
        return {k: v for k, v in data.items() if k not in ("id", "created")}

    def item(sid: str, key: str, headers: dict, body) -> dict:
        return {"path": f"/sessions/{sid}/v1/chat/completions", "body": body if isinstance(body, str) else json.dumps(body),
                "headers": {"authorization": f"Bearer {key}", "content-type": "application/json", **headers}}

    async def run():
        alone = []
        for i, (headers, body) in enumerate(cases):
            [key] = actor.open_sessions([f"b{i}"], SamplingParams(max_new_tokens=4))
            one = item(f"b{i}", key, headers, body)
            r = await http.post(one["path"], content=one["body"].encode(), headers=one["headers"])
            alone.append((r.status_code, strip(r.json())))
            actor.close_sessions([f"b{i}"])
        keys = actor.open_sessions([f"b{i}" for i in range(len(cases))], SamplingParams(max_new_tokens=4))
        calls_before = len(engine_calls.asked)
        extra = [item("b0", keys[0], {}, {**good, "stream": True}), {"path": "/v1/models", "body": "{}"},
                 item("b1", keys[1], {}, "{not json")]
        r = await http.post("/v1/batch/chat/completions",
                            json={"requests": [item(f"b{i}", k, h, b) for i, (k, (h, b)) in enumerate(zip(keys, cases))] + extra})
        assert r.status_code == 200
        answers = r.json()["responses"]
        assert [(a["status"], strip(a["body"])) for a in answers[:len(cases)]] == alone
        assert [status for status, _ in alone] == [200, 400, 400, 400, 400, 400, 404, 200]
        assert len(engine_calls.asked) == calls_before + 1  # the two good ones, in one call
        streamed, elsewhere, not_json = answers[len(cases):]
        assert streamed["status"] == 400 and streamed["body"]["error"]["param"] == "stream"
        assert elsewhere["status"] == 400 and "not a session's completions" in elsewhere["body"]["error"]["message"]
        assert not_json["status"] == 400 and not_json["body"]["error"]["message"].startswith("body: ")
        actor.close_sessions([f"b{i}" for i in range(len(cases))])
        # The batch itself malformed: a 400 naming the field, nothing answered.
        bad = await http.post("/v1/batch/chat/completions", json={"requests": []})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "requests"
        assert (await http.get("/openapi.json")).json()["paths"]["/v1/batch/chat/completions"]

    asyncio.run(run())
