"""`algorithm: sft` against in-process roles (`coordinator/supervised.py`): the held-out completions'
loss falls, only completion tokens reach the update, the rollout engine takes weights only when an
evaluation samples, a stopped run resumes to the weights and records of a run straight through, and
data without completions is refused before the first step."""

from __future__ import annotations

import json

import pytest

from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.tasks import DataError
from tests.conftest import built_once, tiny_config
from tests.coordinator.test_checkpoints import metrics, run

pytestmark = pytest.mark.timeout(300)
SFT = ("algorithm=sft", "actor.lr=1e-3", "train.prompts_per_step=16", "eval.every=4", "eval.max_prompts=32",
       "eval.temperature=0.0")


@pytest.fixture(scope="module")
def untrained_model(tmp_path_factory) -> str:
    """The tiny model with random weights: its completion loss starts near ln(vocabulary), so what
    SFT teaches shows in a few steps on any CPU. (The suite's warm-started model already knows the
    task: twelve steps moved its loss by less than the steps' noise, up or down by the machine.)"""
    return built_once(tmp_path_factory, "untrained-model", make_tiny_model)


def test_sft_lowers_the_held_out_completion_loss_and_trains_completion_tokens_only(untrained_model, tmp_path,
                                                                                   monkeypatch):
    from rolefleet.actor.core import ActorCore

    seen = []
    real = ActorCore.update

    def spy(self, step, version, batch, targets, temperature):
        seen.append((batch, targets))
        return real(self, step, version, batch, targets, temperature)

    monkeypatch.setattr(ActorCore, "update", spy)
    cfg = tiny_config(untrained_model, tmp_path, *SFT, "train.total_steps=12")
    status, actor, _ = run(cfg)
    records = metrics(cfg)
    losses = [r["eval/sft_loss"] for r in records if "eval/sft_loss" in r]
    assert [r["step"] for r in records if "eval/sft_loss" in r] == [0, 4, 8, 12]
    # Seeds 0-4: 3.93-4.02 at the start, 2.76-2.79 after 12 steps, falling at every evaluation.
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.8 * losses[0], losses
    assert all("eval/pass@1" in r for r in records if "eval/sft_loss" in r)  # the generation evaluation too
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, 13)) and actor.policy_version == 12
    # The engine took the weights when an evaluation sampled (the last after step 12), not every update.
    assert actor.worker.rollout_version == 12 and all(r["actor/weight_sync_s"] == 0.0 for r in steps)
    assert all(r["sft/examples"] == 16 and r["sft/tokens"] > 0 and r["actor/nll"] > 0 for r in steps)
    # What reached the update: the answers (and their end), never a prompt token.
    tok = actor.tokenizer
    for batch, targets in seen:
        for prompt, response in zip(batch.prompts(), batch.responses()):
            assert tok.decode(prompt.tolist()).endswith("=")
            assert response[-1].item() == tok.eos_token_id and tok.decode(response[:-1].tolist()).strip().isdigit()
        assert targets.old_logprobs is None and bool((targets.advantages == 1).all())


def test_a_stopped_sft_run_resumes_to_the_run_straight_through(make_config, tmp_path):
    common = (*SFT, "train.total_steps=6", "checkpoint.every=3", "eval.every=0", "actor.num_mini_batches=2")
    straight_cfg = make_config(*common, f"run.output_dir={tmp_path / 'straight'}")
    _, straight, _ = run(straight_cfg)
    assert straight.worker.rollout_version == 0  # nothing sampled: the engine was never sent weights
    cfg = make_config(*common, f"run.output_dir={tmp_path / 'resumed'}")
    status, _, _ = run(cfg, stop_after=3)
    assert status.step == 3
    resumed = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": True})})
    status, actor, _ = run(resumed)
    assert status.step == 6 and actor.digest() == straight.digest()
    assert [(r["step"], r["sft/loss"]) for r in metrics(cfg)] == [(r["step"], r["sft/loss"]) for r in metrics(straight_cfg)]


def test_a_file_without_completions_is_refused_naming_the_key_and_chat_conversations_train(make_config, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "3+4=", "ground_truth": "7"}) + "\n")
    cfg = make_config("algorithm=sft", f"data.path={data}", "eval.every=0", "data.task=null")
    with pytest.raises(DataError, match=r"data.completion_key: .*d.jsonl.* has no 'completion' column"):
        run(cfg)
    assert not (cfg.run.out / "metrics.jsonl").exists() or metrics(cfg) == []


def test_the_config_check_refuses_sft_data_without_completions_before_any_role_starts(tiny_model_dir, tmp_path):
    from rolefleet.app.preflight import check_data
    from rolefleet.common.config import parse_config

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "3+4=", "ground_truth": "7"}) + "\n")
    raw = {"model": {"model_name_or_path": tiny_model_dir}, "algorithm": "sft", "data": {"task": None, "path": str(data)}}
    [problem] = check_data(parse_config(raw))
    assert problem.startswith("data.completion_key: ") and "has no 'completion' column" in problem
    data.write_text(json.dumps({"prompt": "3+4=", "answer": "7"}) + "\n")
    assert check_data(parse_config(raw, ["data.completion_key=answer"])) == []


def test_an_sft_run_without_evaluation_is_not_held_to_the_generation_length(tiny_model_dir):
    """Nothing is generated: `sampling.max_new_tokens` past the model's positions is no problem."""
    from rolefleet.app.preflight import check_models
    from rolefleet.common.config import parse_config

    raw = {"model": {"model_name_or_path": tiny_model_dir}, "data": {"task": "addition"}}
    long = ["sampling.max_new_tokens=100000", "eval.every=0"]
    assert check_models(parse_config(raw, ["algorithm=sft", *long]), ["actor"]) == []
    [problem] = check_models(parse_config(raw, ["algorithm=reinforce_pp", *long]), ["actor"])
    assert problem.startswith("sampling.max_new_tokens")


@pytest.mark.parametrize("overlong", ["filter", "truncate", "error"])
def test_examples_longer_than_the_model_takes_are_fitted_before_the_first_step(make_config, tmp_path, monkeypatch,
                                                                             overlong):
    """One completion of 300 tokens among short ones, for a model of 128 positions: dropped or cut
    as the run starts (the run trains), or refused then naming it; never a step that fails on it."""
    from rolefleet.actor.core import ActorCore

    lengths, real = [], ActorCore.update

    def spy(self, step, version, batch, targets, temperature):
        lengths.extend((batch.prompt_lengths + batch.response_lengths).tolist())
        return real(self, step, version, batch, targets, temperature)

    monkeypatch.setattr(ActorCore, "update", spy)
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(16)]
    rows.insert(5, {"prompt": "1+1=", "completion": "2" * 300})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_config("algorithm=sft", f"data.path={data}", "data.task=null", "eval.every=0", "train.total_steps=2",
                      "train.prompts_per_step=16", f"data.overlong={overlong}")
    if overlong == "error":
        with pytest.raises(DataError, match=r"^data.max_example_tokens: .*d.jsonl #5: its \d+ prompt \+ completion "
                                            r"tokens exceed the 128 positions of model "):
            run(cfg)
        assert lengths == [] and (not (cfg.run.out / "metrics.jsonl").exists() or metrics(cfg) == [])
        return
    status, _, _ = run(cfg)
    assert status.step == 2 and len(lengths) == 32 and max(lengths) <= 128
    first = metrics(cfg)[0]
    assert (first["data/records"], first["data/filtered"], first["data/truncated"]) == (
        (16, 1, 0) if overlong == "filter" else (17, 0, 1))
    # Every epoch of the fitted data holds the cut example (truncate) or only the 16 short ones (filter).
    assert (max(lengths) == 128) == (overlong == "truncate")
    # An explicit limit below the model's: every trained sequence within it.
    lengths.clear()
    status, _, _ = run(make_config("algorithm=sft", f"data.path={data}", "data.task=null", "eval.every=0",
                                   "train.total_steps=1", "train.prompts_per_step=8", f"data.overlong={overlong}",
                                   "data.max_example_tokens=7", f"run.output_dir={tmp_path / 'seven'}"))
    assert status.step == 1 and lengths and max(lengths) <= 7


def test_with_overlong_error_a_long_example_is_refused_by_the_config_check_and_a_long_held_out_one_at_start(
        tiny_model_dir, make_config, tmp_path):
    from rolefleet.app.preflight import check_data
    from rolefleet.common.config import parse_config

    long = json.dumps({"prompt": "1+1=", "completion": "2" * 300}) + "\n"
    short = "".join(json.dumps({"prompt": f"{a}+{a}=", "completion": str(2 * a)}) + "\n" for a in range(8))
    data, held = tmp_path / "d.jsonl", tmp_path / "h.jsonl"
    data.write_text(short + long)
    raw = {"model": {"model_name_or_path": tiny_model_dir}, "algorithm": "sft", "data": {"task": None, "path": str(data)}}
    [problem] = check_data(parse_config(raw, ["data.overlong=error", "eval.every=0"]))
    assert problem.startswith("data.max_example_tokens: ") and "d.jsonl #8: its " in problem, problem
    assert check_data(parse_config(raw, ["eval.every=0"])) == []  # filter: the coordinator drops it, saying so
    # Held-out examples are fitted as the training ones: refused at the start, not skipped.
    data.write_text(short)
    held.write_text(short + long)
    cfg = make_config("algorithm=sft", f"data.path={data}", "data.task=null", f"eval.path={held}", "eval.every=1",
                      "train.total_steps=1", "train.prompts_per_step=4", "data.overlong=error")
    with pytest.raises(DataError, match=r"^data.max_example_tokens: eval.path .*h.jsonl #8: its "):
        run(cfg)
    dropped = make_config("algorithm=sft", f"data.path={data}", "data.task=null", f"eval.path={held}", "eval.every=1",
                          "train.total_steps=1", "train.prompts_per_step=4", f"run.output_dir={tmp_path / 'dropped'}")
    status, _, _ = run(dropped)
    assert status.step == 1 and all(r["eval/sft_loss"] > 0 for r in metrics(dropped))  # over the 8 short ones
