"""Rollout features that compose (the rollout source, `coordinator/source.py`): partial rollouts in
async mode (at any `max_staleness`, with dynamic sampling too) and over multi-turn episodes, and the
critic's warm-up in async mode. Each runs on CPU: in-process roles over a tiny model, or a scripted
actor and environment whose turns have known lengths."""

import asyncio
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from rolefleet.actor.types import FinishReason, Sample, with_ids
from rolefleet.algos import informative_groups
from rolefleet.common.config import parse_config
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.loop import Roles
from rolefleet.coordinator.pipeline import Pipeline
from rolefleet.coordinator.saved_state import CoordinatorState, read_state, write_state
from rolefleet.coordinator.source import RolloutSource
from rolefleet.coordinator.state import RunStatus
from rolefleet.critic.client import InProcessCriticClient
from rolefleet.critic.core import CriticCore
from rolefleet.reward.client import InProcessRewardClient
from rolefleet.reward.core import RewardCore
from rolefleet.reward.types import EnvOutcome
from tests.coordinator.test_partial import steps
from tests.coordinator.test_pipeline import recording

pytestmark = pytest.mark.timeout(240)


def run_async(cfg, reward=None):
    """An async run against in-process roles; the rollouts each step trained, and its records."""
    from rolefleet.actor.client import InProcessActorClient
    from rolefleet.actor.core import ActorCore

    actor = InProcessActorClient(ActorCore(cfg.actor, cfg.run.seed, cfg.pipeline.staleness_bound))
    critic = (InProcessCriticClient(CriticCore(cfg.critic, cfg.run.seed, cfg.pipeline.staleness_bound))
              if cfg.preset.uses_critic else None)
    logger = RunLogger(cfg.run.out, cfg.train.total_steps, progress=False)
    pipeline = Pipeline(cfg, Roles(actor, reward or InProcessRewardClient(RewardCore(cfg.reward)), critic), logger,
                        RunStatus(cfg.run.name, cfg.train.total_steps))
    trained = recording(pipeline)
    asyncio.run(pipeline.run())
    logger.close()
    return pipeline, trained, logger.records


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_partial_rollouts_in_async_mode_train_whole_groups_once_within_the_bound(make_config, staleness):
    cfg = make_config("algorithm=grpo", "pipeline.mode=async", f"pipeline.max_staleness={staleness}",
                      "train.total_steps=6", "train.samples_per_prompt=2", "sampling.max_new_tokens=12",
                      "pipeline.partial_rollouts.enabled=true", "pipeline.partial_rollouts.token_budget=2")
    pipeline, trained, records = run_async(cfg)
    assert [r["step"] for r in records] == list(range(1, 7))
    for rollout, record in zip(trained, records):
        assert set(Counter(s.group_id for s in rollout.samples).values()) == {2}  # whole groups only
        assert record["pipeline/version_lag/max"] <= staleness
        assert record["partial/trained_groups"] == len(rollout.records)
    assert len(pipeline.trained) == len(set(pipeline.trained))  # no sample twice
    if staleness > 0:  # the first batches, generated less than the bound ahead, carry open groups
        assert any(r["partial/carried_groups"] > 0 for r in records)
    if staleness == 0:  # nothing can wait for a later policy: every response ends in its batch
        assert all(r["partial/carried_groups"] == 0 for r in records)
        assert all(s.token_versions.unique().numel() == 1 for r in trained for s in r.samples)


def test_dynamic_sampling_with_partial_rollouts_in_async_mode_trains_informative_groups(make_config):
    class Parity(InProcessRewardClient):
        async def score(self, items):
            result = await super().score(items)
            total = torch.tensor([float(len(it.response) % 2) if it.prompt[0] in "13579" else 0.0 for it in items])
            return type(result)(total, {"parity": total.clone()}, [""] * len(items))

    cfg = make_config("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=3",
                      "train.samples_per_prompt=4", "sampling.max_new_tokens=12", "train.dynamic_sampling.enabled=true",
                      "train.dynamic_sampling.max_batches=6", "pipeline.partial_rollouts.enabled=true",
                      "pipeline.partial_rollouts.token_budget=2")
    pipeline, trained, records = run_async(cfg, Parity(RewardCore(cfg.reward)))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert any(r["partial/carried_groups"] > 0 for r in records)
    for rollout, record in zip(trained, records):
        groups = torch.tensor([s.group_id for s in rollout.samples])
        assert informative_groups(rollout.reward.total, groups).all()
        assert record["pipeline/version_lag/max"] <= 1
    assert len(pipeline.trained) == len(set(pipeline.trained))


def test_the_critics_warm_up_in_async_mode_holds_the_policy_and_generation_goes_on(make_config):
    cfg = make_config("algorithm=ppo", "pipeline.mode=async", "pipeline.max_staleness=1", "train.total_steps=5",
                      "train.samples_per_prompt=2", "train.critic_warmup_steps=2")
    pipeline, _, records = run_async(cfg)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r.get("critic_warmup", 0.0) for r in records] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [r["policy_version"] for r in records] == [0, 0, 1, 2, 3]  # no update while the critic warms up
    assert all(r["pipeline/version_lag/max"] <= 1 for r in records)
    assert len(pipeline.trained) == len(set(pipeline.trained)) == 5 * cfg.train.prompts_per_step * 2


# --- partial rollouts over multi-turn episodes (a scripted actor and environment) --------------------

STOP, OBS = 9, [7, 7]


class TurnActor:
    """Every turn of group g is 3 tokens long (g even) or 6 (g odd), ending at STOP; the first token
    of a conversation names its group; an observation renders to OBS. Tokens of policy `version`
    have id 10 + version and logprob -1 - version."""

    def __init__(self):
        self.version, self.calls = 0, []

    async def generate(self, prompts, sampling, first_group_id=0, continuations=None):
        self.calls.append((len(prompts), [c.resume_from > 0 for c in continuations or []], sampling.max_new_tokens))
        if prompts:
            rows = [(first_group_id + p, p, k, torch.tensor([1, 1, 1]), 0) for p in range(len(prompts))
                    for k in range(sampling.n)]
        else:
            rows = [(int(c.context_ids[3]) - 100, i, 0,
                     c.context_ids if c.resume_from else torch.cat([c.context_ids, torch.tensor(OBS)]),
                     len(c.context_ids) - c.resume_from if c.resume_from else 0) for i, c in enumerate(continuations)]
        out = []
        for group, p, k, context, done in rows:
            turn = 3 if group % 2 == 0 else 6
            new = min(sampling.max_new_tokens, turn - done)
            ids = [100 + group if len(context) == 3 and j == 0 else
                   (STOP if done + j == turn - 1 else 10 + self.version) for j in range(new)]
            reason = FinishReason.STOP if done + new == turn else FinishReason.LENGTH
            out.append(Sample(p, k, context, torch.tensor(ids), torch.full((new,), -1.0 - self.version), reason,
                              self.version, f"g{group}:{done + new}"))
        return with_ids(out, first_group_id) if prompts else out


class TwoTurnEnv:
    """A tool result after the first turn, done with reward 1 after the second."""

    async def step(self, items):
        return [EnvOutcome([{"role": "tool", "content": "42"}], done=False, tool_calls=1)
                if sum(m["role"] == "assistant" for m in it.messages) == 1 else EnvOutcome([], done=True, reward=1.0)
                for it in items]


def multi_turn_source(actor):
    cfg = parse_config({"model": {"model_name_or_path": "m"}, "algorithm": "grpo",
                        "data": {"task": "addition", "size": 64}, "sampling": {"max_new_tokens": 6},
                        "train": {"prompts_per_step": 2, "samples_per_prompt": 2},
                        "actor": {"rollout": {"max_turns": 2, "max_total_tokens": 20}}, "reward": {"env": {"name": "tools"}},
                        "pipeline": {"max_staleness": 2, "partial_rollouts": {"enabled": True, "token_budget": 4}}})
    return RolloutSource(cfg, actor, TwoTurnEnv(), PromptDataset.for_run(cfg), lambda: actor.version)


def test_partial_rollouts_carry_a_conversation_between_steps_and_through_a_checkpoint():
    """Group 0's turns are short: its conversations end in step 1. Group 1's first turn is cut at
    the budget and resumed; its second turn follows the tool's answer in step 2, with the next
    policy. Its sample is both turns and the observation, masked, each token with its policy."""
    actor = TurnActor()
    source = multi_turn_source(actor)
    (first,), state = steps(source, actor, 1)
    assert sorted({s.group_id for s in first.samples}) == [0]
    assert all(s.episode.turns == 2 and s.episode.env_reward == 1.0 for s in first.samples)
    assert first.stats["partial/carried_groups"] == 1
    (carried,) = state.carried
    assert carried.group_id == 1 and all(r.pending == [{"role": "tool", "content": "42"}] for r in carried.responses)

    def second_step(source, state):
        (second,), _ = steps(source, actor, 1, state)
        return [s for s in second.samples if s.group_id == 1]

    with tempfile.TemporaryDirectory() as directory:
        write_state(Path(directory), state, Path.write_bytes)
        saved = read_state(Path(directory))
    resumed_actor_version = actor.version
    group1 = second_step(source, state)
    actor.version = resumed_actor_version
    again = second_step(multi_turn_source(actor), saved)  # a resumed run goes on the same way
    for sample in group1:
        assert sample.response_ids.tolist() == [101, 10, 10, 10, 10, STOP, *OBS, 11, 11, 11, 11, 11, STOP]
        assert sample.loss_mask.tolist() == [True] * 6 + [False] * 2 + [True] * 6
        own = sample.loss_mask
        assert sample.token_versions[own].tolist() == [0] * 6 + [1] * 6 and sample.policy_version == 0
        assert sample.logprobs[own].tolist() == [-1.0] * 6 + [-2.0] * 6 and (sample.logprobs[~own] == 0).all()
        assert sample.episode.turns == 2 and sample.episode.tool_calls == 1 and sample.episode.env_reward == 1.0
    assert [(s.sample_id, s.response_ids.tolist()) for s in again] == [(s.sample_id, s.response_ids.tolist())
                                                                      for s in group1]
    # The first turn was resumed where the budget cut it: nothing asked for again.
    assert (0, [True, True], 2) in actor.calls


def test_overlong_shaping_measures_a_conversation_against_its_cap():
    """Multi-turn with the overlong penalty: a conversation is measured whole (turns and
    observations) against `actor.rollout.max_total_tokens`, not a turn against max_new_tokens."""
    from rolefleet.coordinator.targets import shaped_scores, truncated
    from rolefleet.reward.types import ScoreResult

    class Flat(TwoTurnEnv):
        async def score(self, items):
            total = torch.zeros(len(items))
            return ScoreResult(total, {"flat": total.clone()}, [""] * len(items))

    cfg = parse_config({"model": {"model_name_or_path": "m"}, "algorithm": "grpo",
                        "data": {"task": "addition", "size": 64}, "sampling": {"max_new_tokens": 6},
                        "train": {"prompts_per_step": 2, "samples_per_prompt": 2,
                                  "overlong": {"mode": "penalty", "buffer_tokens": 4}},
                        "actor": {"rollout": {"max_turns": 2, "max_total_tokens": 16}},
                        "reward": {"env": {"name": "tools"}}})
    assert cfg.episode_cap == 16
    source = RolloutSource(cfg, TurnActor(), Flat(), PromptDataset.for_run(cfg), lambda: 0)
    rollout = asyncio.run(source.step(1, CoordinatorState(step=0, kl_coef=0.0)))
    # Group 0: 3 + 2 + 3 = 8 tokens, clear of the buffer; group 1: 6 + 2 + 6 = 14, inside it (12-16).
    assert {s.group_id: len(s.response_ids) for s in rollout.samples} == {0: 8, 1: 14}
    scores = asyncio.run(Flat().score([None] * len(rollout.samples))).total
    shaped, _, stats = shaped_scores(cfg.train, cfg.episode_cap, rollout.batch, scores, truncated(rollout.samples))
    by_group = {s.group_id: float(v) for s, v in zip(rollout.samples, shaped)}
    assert by_group == {0: 0.0, 1: pytest.approx(-0.5)}  # (16 - 4 - 14) / 4
    assert stats["overlong/shaped_fraction"] == 0.5


def test_an_async_run_with_partial_rollouts_resumes_its_carried_episodes(make_config, tmp_path):
    """Stopped after step 1 of an async run with partial rollouts, the checkpoint holds the episodes
    open after batch 1 was generated (not those of the batches generated ahead); the resumed run
    trains them, every sample once, within the bound."""
    import json

    from rolefleet.coordinator.journal import Journal
    from tests.coordinator.test_checkpoints import run

    common = ("algorithm=grpo", "pipeline.mode=async", "pipeline.max_staleness=2", "train.total_steps=5",
              "checkpoint.every=1", "train.samples_per_prompt=2", "sampling.max_new_tokens=12",
              "pipeline.partial_rollouts.enabled=true", "pipeline.partial_rollouts.token_budget=2")
    cfg = make_config(*common, f"run.output_dir={tmp_path / 'run'}")
    run(cfg, stop_after=1)
    saved = json.loads((cfg.run.out / "checkpoints" / "step-00000001" / "coordinator.json").read_text())
    carried = {g["group_id"] for g in saved.get("carried", [])}
    assert carried and all(g["batch"] == 1 for g in saved["carried"])  # batch 1's open groups, none ahead
    status, _, _ = run(cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": True})}))
    assert status.state.name == "FINISHED"
    with Journal(cfg.run.out / "journal.sqlite") as journal:
        ids = journal.trained_sample_ids()
    assert len(ids) == len(set(ids))  # no sample trained twice across the stop
    trained_groups = {i >> 20 for i in ids}
    assert carried <= trained_groups  # the carried groups went on and were trained after the resume
    records = [json.loads(line) for line in (cfg.run.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "step" in r and r["step"] > 0] == [1, 2, 3, 4, 5]
    assert all(r["pipeline/version_lag/max"] <= 2 for r in records if "pipeline/version_lag/max" in r)
