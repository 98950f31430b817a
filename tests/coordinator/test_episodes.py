"""Multi-turn rollouts in process (`coordinator/episodes.py`): a real actor core over a tiny chat
model, an environment scripted turn by turn. The episode's token ids, loss mask and logprobs are
what one-turn-at-a-time generation gives, the rollout logprobs are the trainer's for the whole
sequence, and conversations stop at the limits."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from rolefleet.actor.client import InProcessActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.actor.rollout import derived_seed
from rolefleet.actor.turns import TurnRenderer
from rolefleet.actor.types import Continuation, FinishReason, Sample, SamplingParams
from rolefleet.common.config import parse_config
from rolefleet.coordinator.episodes import EpisodeStage, episode_metrics, with_env_rewards
from rolefleet.coordinator.rollout import to_batch
from rolefleet.reward.types import EnvItem, EnvOutcome, ScoreResult
from rolefleet.tasks import PromptRecord

pytestmark = pytest.mark.multiturn
PROMPT = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
OBSERVATION = [{"role": "tool", "content": "42"}]


@pytest.fixture(scope="module")
def actor(chat_model_dir):
    cfg = config(chat_model_dir)
    return ActorCore(cfg.actor)


def config(model: str, *overrides: str):
    return parse_config({"model": {"model_name_or_path": model}, "sampling": {"max_new_tokens": 12},
                         "actor": {"num_threads": 1, "compute_dtype": "float32", "rollout": {"max_turns": 2, "max_total_tokens": 200}},
                         "reward": {"env": {"name": "tools"}}}, list(overrides))


class ScriptedEnv:
    """A reward client whose environment answers from a script: outcome i for a conversation
    with i assistant turns; records what it was asked."""

    def __init__(self, *outcomes: EnvOutcome):
        self.outcomes, self.asked = outcomes, []

    async def step(self, items: list[EnvItem]) -> list[EnvOutcome]:
        self.asked.append(items)
        return [self.outcomes[sum(m["role"] == "assistant" for m in i.messages) - 1] for i in items]


SEED = 7


def sampled_stop(actor, at: int) -> int:
    """A token the model writes at position `at` (or soon after) and not before, sampling with
    seed SEED: a stop id that ends the first turn after about `at + 1` tokens."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=at + 12, seed=SEED, stop_at_end_of_turn=True)
    tokens = actor.generate([PROMPT], sampling)[0].response_ids.tolist()
    for i in range(at, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return tokens[i]
    pytest.fail(f"the model repeats itself: {tokens}")


def run(episodes: EpisodeStage, records, sampling):
    return asyncio.run(episodes.generate(records, sampling, 0))


def test_a_scripted_two_turn_episode_is_the_turns_and_the_observation_exactly(actor, chat_model_dir):
    stop = sampled_stop(actor, at=3)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(stop,), seed=SEED)
    env = ScriptedEnv(EnvOutcome(OBSERVATION, done=False, tool_calls=1), EnvOutcome([], done=True, reward=0.5))
    episodes = EpisodeStage(config(chat_model_dir), InProcessActorClient(actor), env)
    (sample,) = run(episodes, [PromptRecord(PROMPT, "42")], sampling)

    # What the turns are when asked for one at a time (each turn seeded as the episode seeds it),
    # and what the observation renders to.
    turn_sampling = replace(sampling, stop_at_end_of_turn=True)
    (first,) = actor.generate([PROMPT], turn_sampling)
    assert first.finish_reason == FinishReason.STOP and first.response_ids[-1] == stop
    context = torch.cat([first.prompt_ids, first.response_ids])
    observation = torch.tensor(TurnRenderer(actor.tokenizer).observation_ids(OBSERVATION, stop, "o"))
    (second,) = actor.generate([], replace(turn_sampling, seed=derived_seed(SEED, 2)), 0,
                               [Continuation(context, OBSERVATION)])
    assert torch.equal(second.prompt_ids, torch.cat([context, observation]))

    assert torch.equal(sample.prompt_ids, first.prompt_ids)
    assert torch.equal(sample.response_ids, torch.cat([first.response_ids, observation, second.response_ids]))
    expected_mask = [True] * len(first.response_ids) + [False] * len(observation) + [True] * len(second.response_ids)
    assert sample.loss_mask.tolist() == expected_mask
    assert torch.equal(sample.logprobs, torch.cat([first.logprobs, torch.zeros(len(observation)), second.logprobs]))
    assert sample.response_text == second.response_text and sample.finish_reason == second.finish_reason
    assert sample.episode.turns == 2 and sample.episode.tool_calls == 1
    assert sample.episode.observation_tokens == len(observation)
    # The environment saw the assistant turn as text, then the whole conversation so far; a last
    # turn cut off by max_new_tokens is no message to answer.
    assert env.asked[0][0].messages == [{"role": "assistant", "content": first.response_text}]
    if second.finish_reason == FinishReason.STOP:
        assert env.asked[1][0].messages[1:] == [*OBSERVATION, {"role": "assistant", "content": second.response_text}]
        assert sample.episode.env_reward == 0.5
    else:
        assert len(env.asked) == 1 and sample.episode.env_reward is None

    # Nothing was tokenized again: the trainer's logprobs of the whole sequence are the rollout's.
    batch = to_batch([sample])
    assert torch.equal(batch.loss_mask, sample.loss_mask)
    recomputed = actor.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    own = sample.loss_mask
    torch.testing.assert_close(recomputed[own], sample.logprobs[own], atol=1e-4, rtol=0)


class ScriptedActor:
    """An actor whose every turn is TURN (ending at its stop token, cut to max_new_tokens) and whose
    observations render to OBS_IDS: conversations whose lengths the test knows."""

    TURN, OBS_IDS, STOP = [5, 6, 9], [7, 7], 9

    def __init__(self):
        self.requests = []

    async def generate(self, prompts, sampling, first_group_id=0, continuations=None):
        self.requests.append((len(prompts), len(continuations or []), sampling.max_new_tokens))
        contexts = ([torch.tensor([1, 2, 3])] * len(prompts) if prompts else
                    [torch.cat([c.context_ids, torch.tensor(self.OBS_IDS)]) for c in continuations])
        turn = self.TURN[:sampling.max_new_tokens]
        reason = FinishReason.STOP if turn[-1] == self.STOP else FinishReason.LENGTH
        return [Sample(prompt_index=p, sample_index=i, prompt_ids=context, response_ids=torch.tensor(turn),
                       logprobs=torch.full((len(turn),), -0.5), finish_reason=reason, policy_version=3,
                       response_text="turn", group_id=first_group_id + p)
                for p, context in enumerate(contexts) for i in range(sampling.n)]


def scripted(cfg, env):
    return EpisodeStage(cfg, ScriptedActor(), env)


def test_a_conversation_that_never_ends_stops_at_max_turns(chat_model_dir):
    env = ScriptedEnv(*[EnvOutcome(OBSERVATION, done=False)] * 10)
    episodes = scripted(config(chat_model_dir, "actor.rollout.max_turns=4"), env)
    samples = run(episodes, [PromptRecord(PROMPT, "42"), PromptRecord(PROMPT, "7")], SamplingParams(n=2))
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    turn, obs = ScriptedActor.TURN, ScriptedActor.OBS_IDS
    for s in samples:
        assert s.episode.turns == 4 and s.policy_version == 3
        assert s.response_ids.tolist() == turn + (obs + turn) * 3
        assert s.loss_mask.tolist() == [True] * 3 + ([False] * 2 + [True] * 3) * 3
        assert s.logprobs.tolist() == [-0.5] * 3 + ([0.0] * 2 + [-0.5] * 3) * 3
    # Each turn answered once, the fourth too (for its reward and done); no fifth turn is asked for.
    assert [len(items) for items in env.asked] == [4, 4, 4, 4]
    assert [r[:2] for r in episodes.actor.requests] == [(2, 0), (0, 4), (0, 4), (0, 4)]


def test_the_total_token_limit_cuts_the_conversation(chat_model_dir):
    env = ScriptedEnv(*[EnvOutcome(OBSERVATION, done=False)] * 10)
    # 3 + (2 + 3) = 8 after two turns; the third turn has 11 - 8 - 2 = 1 token of room: cut there.
    episodes = scripted(config(chat_model_dir, "actor.rollout.max_turns=8", "actor.rollout.max_total_tokens=11"), env)
    (sample,) = run(episodes, [PromptRecord(PROMPT, "42")], SamplingParams(max_new_tokens=16))
    assert len(sample.response_ids) == 11 and sample.episode.turns == 3
    assert sample.loss_mask.tolist() == [True] * 3 + [False] * 2 + [True] * 3 + [False] * 2 + [True]
    assert sample.finish_reason == FinishReason.LENGTH
    # Each turn asked for at most what was left (the observation not yet known).
    assert [r[2] for r in episodes.actor.requests] == [11, 8, 3]
    # An observation that alone fills the budget: the conversation ends before it, on the model's turn.
    episodes = scripted(config(chat_model_dir, "actor.rollout.max_turns=8", "actor.rollout.max_total_tokens=9"), env)
    (sample,) = run(episodes, [PromptRecord(PROMPT, "42")], SamplingParams(max_new_tokens=16))
    assert sample.response_ids.tolist() == [5, 6, 9, 7, 7, 5, 6, 9] and sample.loss_mask[-1]


def test_an_environment_failure_ends_only_its_conversation(chat_model_dir):
    class HalfBroken(ScriptedEnv):
        async def step(self, items):
            self.asked.append(items)
            return [EnvOutcome([], done=True, error="raised ValueError: boom") if i % 2 else
                    EnvOutcome(OBSERVATION, done=False) if len(items[i].messages) == 1 else EnvOutcome([], done=True)
                    for i in range(len(items))]

    samples = run(scripted(config(chat_model_dir), HalfBroken()), [PromptRecord(PROMPT, "42")], SamplingParams(n=2))
    stats = {s.sample_index: s.episode for s in samples}
    assert stats[0].turns == 2 and not stats[0].env_error
    assert stats[1].turns == 1 and stats[1].env_error == "raised ValueError: boom"
    metrics = episode_metrics(samples)
    assert metrics["episode/env_errors"] == 1.0 and metrics["episode/turns/mean"] == 1.5
    assert metrics["episode/masked_token_frac"] == 2 / (8 + 3)
    assert samples[1].loss_mask is None  # one turn: like any single-turn sample


def test_an_observation_too_long_for_the_actor_ends_only_its_conversation(actor, chat_model_dir):
    """Longer than the model's positions (the actor answers an empty turn) or over
    actor.max_prompt_bytes (never sent): that conversation ends on its last turn; the others go on."""
    too_many_tokens = [{"role": "tool", "content": " 7" * actor.max_positions}]
    too_many_bytes = [{"role": "tool", "content": "x" * 5000}]

    class Oversized(ScriptedEnv):
        async def step(self, items):
            self.asked.append(items)
            if len(items[0].messages) > 1:
                return [EnvOutcome([], done=True) for _ in items]
            return [EnvOutcome(o, done=False) for o in (OBSERVATION, too_many_tokens, too_many_bytes)]

    cfg = config(chat_model_dir, "actor.max_prompt_bytes=4096", f"actor.rollout.max_total_tokens={4 * actor.max_positions}")
    episodes = EpisodeStage(cfg, InProcessActorClient(actor), Oversized())
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=tuple(range(actor.vocab_size)), seed=SEED)
    samples = run(episodes, [PromptRecord(PROMPT, "42")] * 3, sampling)
    ok, tokens, size = samples
    assert ok.episode.turns == 2 and ok.loss_mask is not None and not ok.episode.env_error
    for cut in (tokens, size):  # ended on its first turn: no observation in its response
        assert cut.episode.turns == 1 and cut.loss_mask is None and len(cut.response_ids) == 1
    assert not tokens.episode.env_error
    assert size.episode.env_error == "observation: 5000 bytes exceed actor.max_prompt_bytes=4096"


def test_an_observation_the_actor_would_refuse_ends_its_conversation_only_if_it_would_be_sent(chat_model_dir):
    """Too many messages, or none while the episode goes on: the conversation ends with the reason.
    The same observation with done set is never sent, so it is no error."""
    many = [{"role": "tool", "content": "1"}] * 65

    class Refusable(ScriptedEnv):
        async def step(self, items):
            self.asked.append(items)
            if len(items[0].messages) > 1:
                return [EnvOutcome([], done=True) for _ in items]
            return [EnvOutcome(many, done=False), EnvOutcome([], done=False), EnvOutcome(many, done=True),
                    EnvOutcome(OBSERVATION, done=False)]

    samples = run(scripted(config(chat_model_dir), Refusable()), [PromptRecord(PROMPT, "42")] * 4, SamplingParams())
    errors = [s.episode.env_error for s in samples]
    assert "65 messages, at most 64" in errors[0] and "no messages" in errors[1]
    assert errors[2:] == ["", ""] and [s.episode.turns for s in samples] == [1, 1, 1, 2]


def test_a_turn_cut_off_by_max_new_tokens_is_not_answered(chat_model_dir):
    env = ScriptedEnv(*[EnvOutcome(OBSERVATION, done=False)] * 10)
    (sample,) = run(scripted(config(chat_model_dir), env), [PromptRecord(PROMPT, "42")], SamplingParams(max_new_tokens=2))
    assert sample.episode.turns == 1 and sample.finish_reason == FinishReason.LENGTH and env.asked == []


def test_environment_rewards_add_to_the_scores_as_a_source(chat_model_dir):
    env = ScriptedEnv(EnvOutcome(OBSERVATION, done=False, reward=0.25, tool_calls=2, tool_errors=1, tool_timeouts=1),
                      EnvOutcome([], done=True, reward=1.0))
    samples = run(scripted(config(chat_model_dir), env), [PromptRecord(PROMPT, "42")], SamplingParams())
    scored = with_env_rewards(ScoreResult(torch.tensor([2.0]), {"exact_match": torch.tensor([2.0])}, [""]), samples)
    assert scored.total.tolist() == [3.25] and scored.sources["env"].tolist() == [1.25]
    metrics = episode_metrics(samples)
    assert (metrics["episode/tool_calls/mean"], metrics["episode/tool_errors/mean"],
            metrics["episode/tool_timeouts/mean"], metrics["episode/tool_use_rate"]) == (2.0, 1.0, 1.0, 1.0)
