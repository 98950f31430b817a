"""The vllm rollout backend on a GPU (skipped where CUDA or vLLM is missing): the logprob convention
against the trainer's recompute, new weights after an update, sleep and wake, and a run that learns."""

import pytest
import torch

from rolefleet.actor.core import ActorCore
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from tests.actor.test_stops import PROMPTS, stops_at_first_stop_id

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
# bf16 vLLM forward against the trainer's bf16-autocast recompute over fp32 weights.
MEAN_TOLERANCE, MAX_TOLERANCE = 0.02, 0.2


def vllm_actor(model_dir, *overrides):
    cfg = parse_config({"model": {"model_name_or_path": model_dir}},
                       ["actor.rollout.backend=vllm", "actor.rollout.vllm.gpu_memory_utilization=0.3",
                        "actor.lr=1e-2", *overrides])
    return ActorCore(cfg.actor)


@pytest.fixture(scope="module")
def actor(two_eos_dir):
    """One engine per process (in-process vLLM): the checkpoint whose generation config lists two
    eos ids besides the tokenizer's, so every test also sees the stop set at work."""
    return vllm_actor(two_eos_dir[0])


def check_against_trainer(actor, samples, temperature):
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    recomputed = actor.compute_logprobs(batch, temperature, include_reference=False).logprobs
    diff = (torch.cat([s.logprobs for s in samples]) - recomputed).abs()
    assert diff.mean() < MEAN_TOLERANCE and diff.max() < MAX_TOLERANCE, (diff.mean(), diff.max())
    return batch


def test_vllm_samples_under_the_logprob_convention(actor):
    from rolefleet.actor.rollout_vllm import VllmRolloutEngine

    assert isinstance(actor.worker.engine, VllmRolloutEngine)
    samples = actor.generate(["1+2=", "13+4=", "7+7="], SamplingParams(max_new_tokens=8, n=4, seed=0, temperature=0.7))
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, i) for p in range(3) for i in range(4)]
    check_against_trainer(actor, samples, 0.7)
    stops_at_first_stop_id(samples, set(actor.stop_ids))  # a stop token ends its response, and is part of it


def test_vllm_stops_at_every_id_of_the_generation_config_and_of_the_request(actor, two_eos_dir):
    eos, ids = actor.tokenizer.eos_token_id, two_eos_dir[1]
    assert actor.stop_ids == tuple(sorted({eos, *ids}))
    samples = actor.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=4, seed=2))
    stops_at_first_stop_id(samples, {eos, *ids})
    assert {int(s.response_ids[-1]) for s in samples if s.finish_reason.name == "STOP"} & set(ids)
    seven = actor.tokenizer.convert_tokens_to_ids("7")
    asked = actor.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=4, seed=2, stop_token_ids=(seven,)))
    stops_at_first_stop_id(asked, {eos, seven, *ids})
    assert any(int(s.response_ids[-1]) == seven for s in asked)


def test_vllm_greedy_repeats_and_agrees_with_the_hf_engine(actor, two_eos_dir):
    from tests.actor.test_trainer import make_core

    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    first = [s.response_ids.tolist() for s in actor.generate(PROMPTS, greedy)]
    assert first == [s.response_ids.tolist() for s in actor.generate(PROMPTS, greedy)]
    hf = make_core(two_eos_dir[0], "actor.rollout.backend=hf", "actor.compute_dtype=float32")
    agree = sum(a == s.response_ids.tolist() for a, s in zip(first, hf.generate(PROMPTS, greedy)))
    assert agree >= len(PROMPTS) - 1  # bf16 against fp32 may flip a near tie


def test_vllm_generates_from_the_new_weights_after_an_update(actor):
    samples = actor.generate(["1+2=", "5+5="], SamplingParams(max_new_tokens=6, n=4, seed=1))
    batch = check_against_trainer(actor, samples, 1.0)
    lp = actor.compute_logprobs(batch, 1.0, include_reference=False)
    adv = torch.linspace(-1, 1, batch.num_response_tokens)
    version = actor.policy_version
    actor.update(version + 1, version, batch, PolicyTargets(adv, lp.logprobs), 1.0)
    after = actor.generate(["1+2=", "5+5="], SamplingParams(max_new_tokens=6, n=4, seed=1))
    assert all(s.policy_version == version + 1 for s in after)
    check_against_trainer(actor, after, 1.0)  # the recompute uses the updated trainer weights


def test_sleep_frees_memory_and_wake_restores_generation(actor):
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    actor.worker.engine.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    assert free_asleep > free_awake + (1 << 28)  # at least the KV cache (256 MiB) came back
    actor.worker.engine.load_weights(actor.worker.model.named_parameters())
    actor.worker.engine.wake()
    assert torch.cuda.mem_get_info()[0] < free_asleep - (1 << 28)
    samples = actor.generate(["2+2="], SamplingParams(max_new_tokens=4, n=2, seed=2))
    check_against_trainer(actor, samples, 1.0)


def test_truncating_requests_are_refused_not_mislabelled(actor):
    from rolefleet.common.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="sampling.top_p"):
        actor.generate(["1+2="], SamplingParams(top_p=0.9))


@pytest.mark.timeout(900)
def test_a_grpo_run_with_the_vllm_backend_learns(tmp_path):
    """configs/demo_grpo.yaml's task and settings (100 steps) through `rolefleet up` (real role
    processes) with vLLM generating. Its own processes: vLLM's sleep-mode allocator is one per
    process, and this module's actor already holds it."""
    import json
    import subprocess
    import sys

    from rolefleet.app.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", task="addition", warm_start_steps=150)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rolefleet.cli", "up", "configs/demo_grpo.yaml",
                           f"model.model_name_or_path={model}", f"run.output_dir={out}", "train.total_steps=100",
                           "devices.actor=[0]", "actor.rollout.backend=vllm", "actor.rollout.vllm.gpu_memory_utilization=0.3"],
                          capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rewards = [json.loads(line)["reward/mean"] for line in next(out.rglob("metrics.jsonl")).read_text().splitlines()]
    assert len(rewards) == 100
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.1
