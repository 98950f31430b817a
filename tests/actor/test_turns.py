"""Continuing a conversation (`Continuation`): the observation is rendered as the chat template
writes it after an assistant turn, appended to the tokens as they are, and bad continuations are
refused naming the field before anything is generated; the vLLM engine gets the same token-id
prompts and stop set."""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import grpc
import pytest
import torch

from rolefleet.actor.core import ActorCore
from rolefleet.actor.turns import TurnRenderer
from rolefleet.actor.types import Continuation, FinishReason, SamplingParams
from rolefleet.common.config import parse_config
from rolefleet.common.errors import FailedPrecondition, InvalidArgument, LimitExceeded

pytestmark = pytest.mark.multiturn
PROMPT = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def actor(chat_model_dir):
    cfg = parse_config({"model": {"model_name_or_path": chat_model_dir}},
                       ["actor.num_threads=1", "actor.max_prompt_bytes=4096", "actor.max_sequences_per_request=4"])
    return ActorCore(cfg.actor)


def test_an_observation_renders_as_the_template_writes_it_after_a_turn(actor):
    tok = actor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = TurnRenderer(tok).observation_ids([{"role": "tool", "content": "42"}], end, "o")
    assert tok.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # The whole conversation, rendered by the template in one go, is the same tokens.
    turn = tok("<tool_call>{}</tool_call>", add_special_tokens=False)["input_ids"] + [end]
    messages = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
                {"role": "tool", "content": "42"}]
    whole = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok(PROMPT, add_special_tokens=False)["input_ids"] + turn + ids == tok(whole, add_special_tokens=False)["input_ids"]
    # A turn that ended at another stop token (eos): the template's end of turn is appended too.
    eos = TurnRenderer(tok).observation_ids([{"role": "tool", "content": "42"}], tok.eos_token_id, "o")
    assert tok.decode(eos).startswith("<|im_end|>\n<|im_start|>tool")


def test_the_end_of_turn_token_stops_a_turn_when_asked(actor):
    end = actor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert actor.end_of_turn == end
    seen = {}

    def spy(prompt_ids, sampling, version):
        seen["stops"] = sampling.stop_token_ids
        return iter([[]])

    engine = actor.worker.engine
    original, engine.generate = engine.generate, spy
    try:
        list(actor.generate_chunks([PROMPT], SamplingParams(stop_at_end_of_turn=True, stop_token_ids=(5,))))
        assert seen["stops"] == (5, end)
        list(actor.generate_chunks([PROMPT], SamplingParams(stop_token_ids=(5,))))
        assert seen["stops"] == (5,)  # single-turn requests: as before
    finally:
        engine.generate = original


def continuation(actor, **change):
    context = torch.tensor(actor.tokenizer(PROMPT)["input_ids"] + [5, 6, actor.end_of_turn])
    return replace(Continuation(context, [{"role": "tool", "content": "42"}]), **change)


def test_a_continuation_generates_after_the_rendered_observation(actor):
    c = continuation(actor)
    (sample,) = actor.generate([], SamplingParams(max_new_tokens=3, seed=1), 0, [c])
    rendered = TurnRenderer(actor.tokenizer).observation_ids(c.observation, actor.end_of_turn, "o")
    assert sample.prompt_ids.tolist() == c.context_ids.tolist() + rendered
    assert 1 <= len(sample.response_ids) <= 3 and len(sample.logprobs) == len(sample.response_ids)


@pytest.mark.parametrize("change, sampling, error, field", [
    ({"observation": []}, {}, InvalidArgument, "continuations[0].observation"),
    ({"observation": [{"role": "tool"}]}, {}, InvalidArgument, "continuations[0].observation[0]"),
    ({"observation": [{"role": "tool", "content": "x" * 5000}]}, {}, LimitExceeded, "continuations[0].observation"),
    ({"context_ids": torch.tensor([10**6])}, {}, InvalidArgument, "continuations[0].context_ids"),
    ({"context_ids": torch.tensor([], dtype=torch.int64)}, {}, InvalidArgument, "continuations[0].context_ids"),
    ({}, {"n": 2}, InvalidArgument, "sampling.n"),
    ({}, {"max_new_tokens": 600}, InvalidArgument, "sampling.max_new_tokens"),
    ({"resume_from": 3}, {}, InvalidArgument, "continuations[0].observation"),
    ({"observation": [], "resume_from": 10**4}, {}, InvalidArgument, "continuations[0].resume_from"),
    ({"observation": [], "resume_from": -1}, {}, InvalidArgument, "continuations[0].resume_from"),
])
def test_a_bad_continuation_is_refused_naming_the_field(actor, change, sampling, error, field):
    with pytest.raises(error) as e:
        actor.generate([], SamplingParams(**sampling), 0, [continuation(actor, **change)])
    assert e.value.field == field


def test_a_conversation_without_room_gets_an_empty_turn_and_the_others_go_on(actor):
    """An observation that fills the model's positions ends its conversation alone: it is answered
    with no tokens (finish_reason LENGTH), in its place among the request's samples."""
    positions = actor.max_positions
    long = continuation(actor, observation=[{"role": "tool", "content": " 7" * positions}])
    samples = actor.generate([], SamplingParams(max_new_tokens=3, seed=1), 5, [continuation(actor), long, continuation(actor)])
    samples.sort(key=lambda s: s.prompt_index)  # the empty turns come last, after the engine's chunks
    assert [s.prompt_index for s in samples] == [0, 1, 2] and [s.group_id for s in samples] == [5, 6, 7]
    full = samples[1]
    assert full.finish_reason == FinishReason.LENGTH and not len(full.response_ids) and not len(full.logprobs)
    assert len(full.prompt_ids) > positions - 3
    for s in (samples[0], samples[2]):
        assert 1 <= len(s.response_ids) <= 3
    # Every conversation full: nothing is generated, each answered so.
    (alone,) = actor.generate([], SamplingParams(max_new_tokens=3), 0, [long])
    assert alone.finish_reason == FinishReason.LENGTH and not len(alone.response_ids)


def test_room_is_what_the_rollout_engine_holds(actor, monkeypatch):
    """A vllm engine's KV cache sized below the model's positions (`actor.rollout.vllm.max_model_len`)
    bounds the room: a conversation past it gets the empty turn too."""
    short = continuation(actor)
    monkeypatch.setattr(actor, "generate_positions", len(short.context_ids) + 8)
    samples = actor.generate([], SamplingParams(max_new_tokens=3, seed=1), 0, [short, continuation(actor)])
    assert all(s.finish_reason == FinishReason.LENGTH and not len(s.response_ids) for s in samples)
    with pytest.raises(InvalidArgument, match="sampling.max_new_tokens"):
        actor.generate([PROMPT], SamplingParams(max_new_tokens=len(short.context_ids) + 8))


def test_a_resumed_response_generates_on_with_nothing_appended(actor):
    """Partial rollouts: a response cut at a token budget is generated on from its tokens as they
    are; the sample's text is the whole response's, decoded in one piece."""
    (first,) = actor.generate([PROMPT], SamplingParams(max_new_tokens=3, seed=1))
    context = torch.cat([first.prompt_ids, first.response_ids])
    (on,) = actor.generate([], SamplingParams(max_new_tokens=4, seed=2), 0,
                           [Continuation(context, [], resume_from=len(first.prompt_ids))])
    assert torch.equal(on.prompt_ids, context) and 1 <= len(on.response_ids) <= 4
    whole = torch.cat([first.response_ids, on.response_ids]).tolist()
    assert on.response_text == actor.tokenizer.decode(whole, skip_special_tokens=True)


def test_prompts_and_continuations_together_are_refused(actor):
    with pytest.raises(InvalidArgument, match="prompts"):
        actor.generate([PROMPT], SamplingParams(), 0, [continuation(actor)])


def test_a_tokenizer_without_a_chat_template_cannot_continue(tiny_model_dir):
    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir}}, ["actor.num_threads=1"])
    plain = ActorCore(cfg.actor)
    with pytest.raises(FailedPrecondition, match="no chat template"):
        plain.generate([], SamplingParams(), 0, [Continuation(torch.tensor([5, 6]), [{"role": "tool", "content": "1"}])])


def test_vllm_gets_the_continued_conversation_as_token_ids(actor, monkeypatch):
    """The vllm engine (a stand-in for vLLM's module, which is not installed here) receives the
    context and rendered observation as one TokensPrompt, and the end-of-turn token among its stop ids."""
    from rolefleet.actor.rollout_vllm import VllmRolloutEngine

    calls = []

    class Completion:
        index, token_ids, finish_reason = 0, [7, actor.end_of_turn], "stop"
        logprobs = [{7: types.SimpleNamespace(logprob=-0.5)}, {actor.end_of_turn: types.SimpleNamespace(logprob=-0.1)}]

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm):
            calls.append((prompts, params))
            return [types.SimpleNamespace(outputs=[Completion()]) for _ in prompts]

    fake = types.ModuleType("vllm")
    fake.SamplingParams = lambda **kw: kw
    fake.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", fake)
    engine = object.__new__(VllmRolloutEngine)
    engine.llm, engine.tokenizer, engine.cfg, engine.stop_ids = FakeLLM(), actor.tokenizer, actor.cfg, actor.stop_ids
    engine.max_model_len, engine.wake = None, lambda: None
    monkeypatch.setattr(actor.worker, "engine", engine)
    c = continuation(actor)
    (sample,) = actor.generate([], SamplingParams(max_new_tokens=4, stop_at_end_of_turn=True), 0, [c])
    (prompts, params), = calls
    rendered = TurnRenderer(actor.tokenizer).observation_ids(c.observation, actor.end_of_turn, "o")
    assert prompts == [{"prompt_token_ids": c.context_ids.tolist() + rendered}]
    assert actor.end_of_turn in params[0]["stop_token_ids"] and params[0]["logprobs"] == 0
    assert sample.response_ids.tolist() == [7, actor.end_of_turn] and sample.logprobs.tolist() == [-0.5, pytest.approx(-0.1)]


def test_generate_with_continuations_over_grpc(actor):
    import asyncio

    from rolefleet.actor.client import GrpcActorClient
    from rolefleet.actor.server import add_to_server
    from rolefleet.common.pb import actor_pb2, actor_pb2_grpc
    from tests.helpers import expect_invalid, serving

    async def scenario():
        async with serving("actor", lambda server: add_to_server(actor, server)) as address:
            client = GrpcActorClient(address, 60.0)
            try:
                resumed = continuation(actor, observation=[], resume_from=20)  # partial rollouts
                for c in (continuation(actor), resumed):
                    (sample,) = await client.generate([], SamplingParams(max_new_tokens=2, seed=3), 0, [c])
                    (local,) = actor.generate([], SamplingParams(max_new_tokens=2, seed=3), 0, [c])
                    assert torch.equal(sample.prompt_ids, local.prompt_ids) and torch.equal(sample.response_ids,
                                                                                              local.response_ids)
                    assert sample.response_text == local.response_text
                assert torch.equal(sample.prompt_ids, resumed.context_ids)
            finally:
                await client.close()
            async with grpc.aio.insecure_channel(address) as channel:
                stub = actor_pb2_grpc.ActorServiceStub(channel)
                bad = actor_pb2.GenerateRequest(sampling=actor_pb2.SamplingParams(temperature=1, top_p=1, max_new_tokens=2,
                                                                                    n=1),
                                                continuations=[actor_pb2.Continuation()])
                await expect_invalid(stub.Generate(bad).read(), "continuations[0].context_ids")

    asyncio.run(scenario())


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["chat", "real"])
def test_the_rendered_text_s_ids_are_the_tokenizer_call_s(chat_model_dir, real_model_dir, which):
    """`TurnRenderer.encode` (the fast tokenizer's own encoder) gives what the transformers call
    gives: special tokens whole, spaces, newlines, digits and text the vocabulary splits."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model_dir if which == "chat" else real_model_dir)
    texts = ["\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", " leading space", "  two\n\n\tlines ",
             "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"347 * 29\"}}</tool_call>",
             "ünïcödé — 日本語 🙂", "<|im_end|><|im_end|>", "<|im_start", "1234567890" * 3, ""]
    renderer = TurnRenderer(tok)
    for text in texts:
        assert renderer.encode(text) == tok(text, add_special_tokens=False)["input_ids"], text
