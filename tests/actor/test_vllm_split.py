"""vLLM generating on a GPU of its own while the actor trains on another (skipped without two GPUs
and vLLM): its engine runs in processes of its own and takes each update's weights over vLLM's NCCL
transfer from the trainer. Real role processes through `rolefleet up`, so the engine's processes
and the actor group's torch.distributed world are the ones a user gets."""

import json
import subprocess
import sys

import pytest
import torch

from rolefleet.actor.rollout import vllm_installed

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(torch.cuda.device_count() < 2 or not vllm_installed(), reason="needs two GPUs and vLLM")]


@pytest.mark.timeout(900)
def test_a_grpo_run_generating_with_vllm_apart_from_training_learns(tmp_path):
    """The demo's GRPO task: the reward rises, so the engine samples from the trained weights; and
    its recorded logprobs stay those of the trainer's current weights, step after step (an engine
    left on older weights drifts away from them as the policy moves)."""
    from rolefleet.app.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", task="addition", warm_start_steps=150)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rolefleet.cli", "up", "configs/demo_grpo.yaml",
                           f"model.model_name_or_path={model}", f"run.output_dir={out}", "train.total_steps=100",
                           "devices.actor=[0, 1]", "devices.rollout=[0]", "actor.rollout.backend=vllm",
                           "actor.rollout.vllm.gpu_memory_utilization=0.3", "actor.rollout.vllm.enforce_eager=true",
                           "actor.rollout.sync_bucket_mb=1"],
                          capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    actor_log = next(out.rglob("logs/actor.log")).read_text()
    assert "1 training workers (ranks [1]), 1 rollout workers (ranks [0])" in actor_log
    assert "rollout backend: vllm" in actor_log
    steps = [json.loads(line) for line in next(out.rglob("metrics.jsonl")).read_text().splitlines()]
    rewards = [s["reward/mean"] for s in steps]
    assert len(rewards) == 100
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.1
    diffs = [s["rollout_train_logprob_diff/mean"] for s in steps]
    assert max(diffs) < 0.05, diffs
    syncs = [value for s in steps for key, value in s.items() if "weight_sync" in key]
    assert syncs and all(seconds > 0 for seconds in syncs)
