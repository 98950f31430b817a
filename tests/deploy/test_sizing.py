"""What a run's pods request and what its checkpoints take (`rolefleet.deploy.sizing`): checked
against checkpoints `save_trainer` really writes, and against hand-computed numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rolefleet.app.memory import GIB, ModelDims
from rolefleet.common.config import parse_config
from rolefleet.critic.model import ValueModel
from rolefleet.deploy import sizing
from rolefleet.trainer.checkpoint import save_trainer
from rolefleet.trainer.ranks import Ranks
from rolefleet.trainer.snapshot_file import SnapshotBuffers

# Qwen2-1.5B's dimensions: the config.json alone is what the estimates read.
QWEN2_1_5B = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
              "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True}


def model_dir(path: Path, config: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def run_config(model: str, **sections) -> dict:
    return {"algorithm": "ppo", "model": {"model_name_or_path": model}, **sections}


GRPO = {"algorithm": "grpo", "train": {"samples_per_prompt": 2}}  # it compares a prompt's samples


# --- checkpoints ------------------------------------------------------------------------------

def saved_weights_bytes(model: torch.nn.Module, out: Path, snapshot: bool = False) -> int:
    """Bytes of weights/ after one AdamW step and `save_trainer`, as a trainer role writes it (a
    snapshot: its buffer file)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.float().sum() for p in model.parameters()).backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if snapshot:
        save_trainer(out, model, optimizer, scheduler, torch.Generator(), Ranks.alone(),
                     (SnapshotBuffers(), out.parent / "buffers"))
        return sum(f.stat().st_size for f in (out.parent / "buffers").iterdir())
    save_trainer(out, model, optimizer, scheduler, torch.Generator(), Ranks.alone())
    return sum(f.stat().st_size for f in (out / "weights").rglob("*") if f.is_file())


@pytest.mark.parametrize("kind", ["policy", "policy with a tied head", "value model"])
def test_the_estimate_is_what_save_trainer_writes(tmp_path, kind):
    config = LlamaConfig(vocab_size=4000, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=kind.endswith("head"))
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")
    value_model = kind == "value model"
    model = ValueModel(path, torch.device("cpu")) if value_model else LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    written = saved_weights_bytes(model, tmp_path / "checkpoint")
    cfg = parse_config(run_config(path))
    estimate = sizing.trainer_state_bytes(ModelDims.read(path), cfg.critic if value_model else cfg.actor, value_model)
    # Only torch.distributed.checkpoint's metadata is not counted: a few per cent of a model this small.
    assert 1.0 <= written / estimate < 1.05, (written, estimate)
    # A snapshot's buffer file: the same tensors, aligned, after a page of header.
    in_snapshot = saved_weights_bytes(model, tmp_path / "snapshot" / "step" / "actor", snapshot=True)
    assert 1.0 <= in_snapshot / estimate < 1.05, (in_snapshot, estimate)


def test_lora_checkpoints_hold_the_adapters_alone(tmp_path):
    path = model_dir(tmp_path / "m", QWEN2_1_5B)
    lora = {"lora": {"rank": 16, "target_modules": ["q_proj", "v_proj"]}}
    cfg = parse_config(run_config(path, actor=lora, critic=lora))
    # r x (in + out) per adapted layer: q 1536 -> 1536, v 1536 -> 256 (2 kv heads of 128).
    adapters = 28 * 16 * ((1536 + 1536) + (1536 + 256))
    dims = ModelDims.read(path)
    assert sizing.trainer_state_bytes(dims, cfg.actor, False) == 12 * adapters
    assert sizing.trainer_state_bytes(dims, cfg.critic, True) == 12 * (adapters + 1536 + 1)  # and the value head
    assert sizing.checkpoint_bytes(cfg) == 12 * (2 * adapters + 1537) + 2 * sizing.TRAINER_FILES_BYTES


def test_a_ppo_checkpoint_holds_actor_and_critic_and_grpo_the_actor(tmp_path):
    path = model_dir(tmp_path / "m", QWEN2_1_5B)
    dims = ModelDims.read(path)
    actor = 12 * dims.params + 4 * 151936 * 1536  # the tied head's name saves the embeddings again
    critic = 12 * (dims.params + 1536 + 1)  # the backbone (the tied head was the embeddings) and the value head
    ppo = sizing.checkpoint_bytes(parse_config(run_config(path)))
    assert ppo == actor + critic + 2 * sizing.TRAINER_FILES_BYTES
    assert 35 * GIB < ppo < 37 * GIB  # a 1.5B PPO run
    assert sizing.checkpoint_bytes(parse_config(run_config(path) | GRPO)) == (
        actor + sizing.TRAINER_FILES_BYTES)


def test_no_checkpoint_size_without_a_readable_model_or_without_checkpoints(tmp_path):
    assert sizing.checkpoint_bytes(parse_config(run_config(str(tmp_path / "absent")))) is None
    none_saved = {"every": 0, "every_minutes": 0, "at_end": False}
    assert sizing.checkpoint_bytes(parse_config(run_config(str(tmp_path / "absent"), checkpoint=none_saved))) == 0


def test_the_volume_holds_keep_checkpoints_the_one_being_written_and_the_logs():
    assert sizing.volume_bytes(36 * GIB, keep=3) == 4 * 36 * GIB + 14.4 * GIB  # a tenth for the logs
    assert sizing.volume_bytes(GIB, keep=1) == 2 * GIB + sizing.LOG_HEADROOM_BYTES  # at least 10 GiB


# --- requests -----------------------------------------------------------------------------------

def test_trainer_memory_is_per_worker_footprint_fp32_load_and_offloaded_state(tmp_path):
    path = model_dir(tmp_path / "m", QWEN2_1_5B)
    p = ModelDims.read(path).params
    devices = {"actor": [0, 1], "critic": [2]}
    cfg = parse_config(run_config(path, devices=devices))
    per_worker = sizing.PROCESS_BYTES + 4 * p
    assert sizing.trainer_memory(cfg, "critic") == sizing.PROCESS_BYTES + per_worker
    assert sizing.trainer_memory(cfg, "actor") == sizing.PROCESS_BYTES + 2 * per_worker
    # AdamW's state off the GPU: 8 bytes a parameter, sharded over the actor's two workers.
    offloaded = parse_config(run_config(path, devices=devices, actor={"offload": "optimizer"}))
    assert sizing.trainer_memory(offloaded, "actor") == pytest.approx(sizing.trainer_memory(cfg, "actor") + 8 * p)


def test_requests_name_cpu_always_and_memory_where_the_model_is_readable(tmp_path):
    path = model_dir(tmp_path / "m", QWEN2_1_5B)
    devices = {"actor": [0, 1, 2, 3], "critic": [4, 5]}
    known = sizing.requests(parse_config(run_config(path, devices=devices)))
    assert {r: v["cpu"] for r, v in known.items()} == {"actor": 9, "critic": 5, "reward": 3, "coordinator": 1}
    assert all(v["memory"].endswith("Gi") for v in known.values())
    unknown = sizing.requests(parse_config(run_config(str(tmp_path / "absent"), devices=devices)))
    assert "memory" not in unknown["actor"] and "memory" not in unknown["critic"]
    assert unknown["reward"]["memory"] == known["reward"]["memory"]  # a rule reward reads no model


def test_cpu_trainers_hold_their_whole_state_in_host_memory(tmp_path):
    path = model_dir(tmp_path / "m", QWEN2_1_5B)
    cpu = parse_config(run_config(path, actor={"workers": 4, "nodes": 2}) | GRPO)
    assert sizing.pods(cpu, "actor") == 2 and sizing.workers_per_pod(cpu, "actor") == 2
    assert sizing.cpus(cpu, "actor") == 1 + 2  # a core per CPU worker
    on_gpu = parse_config(run_config(path, devices={"actor": [0, 1]}) | GRPO)
    # Weights, AdamW state, gradients and the engine's copy, rather than a load's fp32 copy.
    assert sizing.trainer_memory(cpu, "actor") > sizing.trainer_memory(on_gpu, "actor") + 2 * 16 * ModelDims.read(path).params


def test_reward_cpus_and_memory_count_its_worker_processes(tmp_path):
    cfg = parse_config(run_config(str(tmp_path), reward={"user_workers": 4, "env": {"name": "tools", "workers": 3}},
                                  actor={"rollout": {"max_turns": 2}}))
    assert sizing.cpus(cfg, "reward") == 1 + 4 + 3
    assert sizing.reward_memory(cfg) == sizing.PROCESS_BYTES + 7 * sizing.HELPER_PROCESS_BYTES


def test_gib_rounds_up_to_a_whole_gib():
    assert [sizing.gib(b) for b in (1, GIB, GIB + 1, 35.2 * GIB)] == ["1Gi", "1Gi", "2Gi", "36Gi"]


def test_each_reward_model_gpu_loads_its_copy_through_the_host(tmp_path):
    path = model_dir(tmp_path / "m", QWEN2_1_5B)
    scorer = model_dir(tmp_path / "rm", QWEN2_1_5B)
    sources = {"sources": [{"kind": "model", "path": scorer}, {"function": "exact_match"}]}
    cfg = parse_config(run_config(path, reward=sources, devices={"actor": [0], "reward": [1, 2], "critic": [3]}))
    weights = 2 * ModelDims.read(scorer).scorer_params  # bfloat16, reward.model_dtype's default
    rules = sizing.PROCESS_BYTES + 2 * sizing.HELPER_PROCESS_BYTES
    assert sizing.reward_memory(cfg) == rules + 2 * (sizing.PROCESS_BYTES + weights)
    assert sizing.cpus(cfg, "reward") == 1 + 2 + 2
    unreadable = parse_config(run_config(path, reward={"sources": [{"kind": "model", "path": str(tmp_path / "no")}]}))
    assert sizing.reward_memory(unreadable) is None and "memory" not in sizing.requests(unreadable)["reward"]
