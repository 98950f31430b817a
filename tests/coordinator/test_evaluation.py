"""Evaluation during training (`eval.*`): when it runs, what it records, that it changes nothing,
and its config and data errors."""

import asyncio
import json
import logging

import pytest

from rolefleet.actor.client import InProcessActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.common.config import ConfigError
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.evaluation import Evaluator
from rolefleet.coordinator.loop import Roles
from rolefleet.coordinator.state import RunStatus
from rolefleet.reward.client import InProcessRewardClient
from rolefleet.reward.core import RewardCore
from rolefleet.tasks import DataError
from tests.coordinator.test_loop import run

EVAL_KEYS = {"eval/reward/mean", "eval/exact_match/mean", "eval/pass@1", "eval/response_length/mean",
             "eval/clip_ratio", "eval/prompts", "eval/policy_version", "eval/time_s"}


def grpo(make_config, *overrides):
    return make_config("algorithm=grpo", "train.samples_per_prompt=2", "eval.every=2", "eval.max_prompts=12",
                       *overrides)


def roles_of(cfg):
    actor = ActorCore(cfg.actor, max_staleness=cfg.pipeline.staleness_bound)
    return actor, Roles(InProcessActorClient(actor), InProcessRewardClient(RewardCore(cfg.reward)), None)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_evaluations_run_before_training_every_n_steps_and_at_the_end(make_config, mode):
    cfg = grpo(make_config, "train.total_steps=5", f"pipeline.mode={mode}")
    status, records = run(cfg, roles_of(cfg)[1])
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    evaluated = {r["step"]: r for r in records if "eval/reward/mean" in r}
    assert sorted(evaluated) == [0, 2, 4, 5]
    for step, r in evaluated.items():
        assert EVAL_KEYS <= set(r), step
        assert r["eval/prompts"] == 12 and r["eval/policy_version"] == step
        assert 0 <= r["eval/pass@1"] <= 1 and r["eval/pass@1"] == pytest.approx(r["eval/exact_match/mean"])
    assert set(records[0]) == {"step", "policy_version", *EVAL_KEYS, "eval/errors", "eval/train_overlap"}
    assert status.step == 5 and [r["step"] for r in status.history] == [0, 1, 2, 3, 4, 5]
    saved = [json.loads(line) for line in (cfg.run.out / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in saved] == [step for step in (0, 2, 4, 5) for _ in range(12)]
    assert {s["finish_reason"] for s in saved} <= {"stop", "length"} and all(s["response"] is not None for s in saved)


def test_greedy_evaluation_repeats_exactly_and_changes_no_weights_version_or_ledger(make_config):
    cfg = grpo(make_config)
    actor, roles = roles_of(cfg)
    evaluator = Evaluator.for_run(cfg, PromptDataset.for_run(cfg))
    before = (actor.digest(), actor.policy_version, actor.ledger.last_step, dict(actor.ledger.results))

    async def twice():
        return [await evaluator.run(1, roles.actor.generate, roles.reward.score) for _ in range(2)]

    first, second = asyncio.run(twice())
    first.pop("eval/time_s"), second.pop("eval/time_s")
    assert first == second
    assert (actor.digest(), actor.policy_version, actor.ledger.last_step, dict(actor.ledger.results)) == before


def test_sampled_evaluation_reports_pass_at_k(make_config):
    cfg = grpo(make_config, "eval.samples_per_prompt=4", "eval.temperature=1.0")
    _, roles = roles_of(cfg)
    record = asyncio.run(Evaluator.for_run(cfg, PromptDataset.for_run(cfg)).run(1, roles.actor.generate,
                                                                               roles.reward.score))
    assert record["eval/pass@1"] <= record["eval/pass@4"] <= 1
    assert record["eval/pass@1"] == pytest.approx(record["eval/reward/mean"])  # exact_match scores 0 or 1


def test_a_built_in_task_evaluates_on_prompts_left_out_of_training(make_config):
    cfg = grpo(make_config, "data.size=400", "eval.max_prompts=50")
    held_out = {r.prompt for r in PromptDataset.for_eval(cfg).records}
    train = PromptDataset.for_run(cfg)
    assert len(held_out) == 50
    assert not held_out & {r.prompt for r in train.records}
    assert train.stats["data/held_out"] > 0
    assert PromptDataset.for_run(make_config()).stats.get("data/held_out") is None  # eval off: all of them


def test_eval_seed_fixes_the_held_out_draw_across_run_seeds(make_config):
    def held_out(*overrides):
        return [r.prompt for r in PromptDataset.for_eval(grpo(make_config, "data.size=400", "eval.max_prompts=50",
                                                              *overrides)).records]

    assert held_out("run.seed=0") != held_out("run.seed=1")  # by default, the run's seed draws them
    assert held_out("run.seed=0", "eval.seed=0") == held_out("run.seed=1", "eval.seed=0")
    assert held_out("run.seed=1", "eval.seed=0") == held_out("run.seed=0")
    cfg = grpo(make_config, "data.size=400", "eval.max_prompts=50", "run.seed=1", "eval.seed=0")
    train = {r.prompt for r in PromptDataset.for_run(cfg).records}
    assert not set(held_out("run.seed=1", "eval.seed=0")) & train  # still left out of training


def write_jsonl(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "ground_truth": "1"}) + "\n" for p in prompts))
    return str(path)


def test_eval_prompts_that_are_also_trained_on_are_counted_and_warned_about(make_config, tmp_path, caplog):
    train = write_jsonl(tmp_path / "train.jsonl", ["1+0=", "0+1=", "2+2="])
    held = write_jsonl(tmp_path / "held.jsonl", ["1+0=", "5+5=", "6+6="])
    cfg = grpo(make_config, f"data.path={train}", "data.task=null", f"eval.path={held}")
    with caplog.at_level(logging.WARNING):
        evaluator = Evaluator.for_run(cfg, PromptDataset.for_run(cfg))
    assert evaluator.overlap == 1 and "1 of the 3 held-out prompts also appear" in caplog.text


def test_bad_eval_settings_are_config_errors_naming_the_key(make_config, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ["1+0="])
    with pytest.raises(ConfigError, match="eval.path: evaluation of a run on a prompt file"):
        grpo(make_config, f"data.path={train}", "data.task=null")
    with pytest.raises(ConfigError, match="eval.path .*missing.jsonl is not a file"):
        grpo(make_config, f"eval.path={tmp_path / 'missing.jsonl'}")
    with pytest.raises(ConfigError, match="greedy samples are all alike"):
        grpo(make_config, "eval.samples_per_prompt=2")
    with pytest.raises(ConfigError, match="eval.temperature must be 0"):
        grpo(make_config, "eval.temperature=0.001")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1=", "ground_truth": "2"}\nnot json\n')
    cfg = grpo(make_config, f"eval.path={broken}")
    with pytest.raises(DataError, match=r"^eval.path: .*broken.jsonl:2: not JSON"):
        PromptDataset.for_eval(cfg)
    no_column = write_jsonl(tmp_path / "q.jsonl", ["1+1="])
    with pytest.raises(DataError, match=r"^eval.path: .*q.jsonl:1: no 'question' column.*eval.prompt_key names"):
        PromptDataset.for_eval(grpo(make_config, f"eval.path={no_column}", "eval.prompt_key=question"))


def test_preflight_refuses_an_evaluation_larger_than_one_request(make_config):
    from rolefleet.app.preflight import check_request_limits

    cfg = grpo(make_config, "eval.max_prompts=50", "eval.samples_per_prompt=4", "eval.temperature=1",
               "reward.max_items_per_request=100")
    assert any(p.startswith("reward.max_items_per_request=100 is below an evaluation's") for p in
               check_request_limits(cfg))


def test_preflight_reports_unreadable_eval_data(make_config, tmp_path):
    from rolefleet.app.preflight import check_data

    broken = tmp_path / "broken.jsonl"
    broken.write_text("[1, 2]\n")
    problems = check_data(grpo(make_config, f"eval.path={broken}"))
    assert problems and problems[0].startswith("eval.path: ")


def test_a_recovered_run_does_not_evaluate_the_start_twice(make_config):
    cfg = grpo(make_config, "train.total_steps=2")
    _, roles = roles_of(cfg)
    status = RunStatus(cfg.run.name, 2)
    evaluator = Evaluator.for_run(cfg, PromptDataset.for_run(cfg))

    class Logger:
        records = [{"step": 0}]

    asyncio.run(evaluator.before_training(Logger(), status, roles.actor.generate, roles.reward.score))
    assert status.history == []


def test_the_console_summary_counts_steps_not_the_evaluation_before_them(tmp_path, capsys):
    """The periodic summary line averages training steps; the record of step 0 holds no reward."""
    from rolefleet.coordinator.logger import RunLogger

    logger = RunLogger(tmp_path, total_steps=4, progress=True, report_every=2, trackers=[])
    logger.log_eval({"step": 0, "policy_version": 0, "eval/reward/mean": 0.5, "eval/pass@1": 0.5,
                     "eval/response_length/mean": 3.0, "eval/clip_ratio": 0.0, "eval/prompts": 4.0, "eval/time_s": 0.1})
    for step in (1, 2, 3):
        logger.log({"step": step, "policy_version": step, "reward/mean": 0.25 * step, "kl": 0.0, "timing/step_s": 1.0})
    logger.close()
    out = capsys.readouterr().out
    assert "eval      0  reward 0.500  pass@1 0.500" in out
    assert "step     3  reward 0.625 (mean of last 2)" in out  # steps 2 and 3
    assert logger.summary().startswith("3 steps; mean reward 0.500")
