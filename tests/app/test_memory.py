"""The memory planner's arithmetic against hand-computed cases, and preflight refusing a map that
cannot fit (naming the role, the estimate and the settings that would help)."""

import pytest
import torch
from transformers import LlamaForCausalLM

from rolefleet.app.memory import (
    ALLOCATOR_SLACK,
    COMPILED_ACTIVATION_SHARE,
    CUDA_CONTEXT,
    GIB,
    ModelDims,
    actor_estimate,
    memory_problems,
    plan,
)
from rolefleet.app.shapes import SHAPES
from rolefleet.app.tiny_model import _llama_config, build_tokenizer
from rolefleet.common.config import ConfigError, parse_config

# hidden 8, 2 layers, 2 heads of 4, one KV head, MLP 16, vocabulary 10, tied embeddings.
SMALL = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 16, "vocab_size": 10, "tie_word_embeddings": True, "model_type": "llama"}


def test_the_parameter_count_by_hand():
    # embeddings 10*8 = 80; a layer: q 64, k 32, v 32, o 64, MLP 3*8*16 = 384, norms 16 = 592; final norm 8
    assert ModelDims.of_config(SMALL).params == 80 + 2 * 592 + 8
    untied = ModelDims.of_config({**SMALL, "tie_word_embeddings": False})
    assert untied.params == 160 + 2 * 592 + 8


def test_the_activation_bytes_of_a_token_in_a_layer_by_hand():
    # two fp32 norms (input, normalised) 2*8*8, five bf16 casts 5*2*8, q/k/v before and after RoPE
    # 2*(2*8 + 2*2*4) and the attention output 2*8, the MLP's four bf16 tensors 4*2*16.
    assert ModelDims.of_config(SMALL).activation_bytes() == 128 + 80 + 80 + 128


@pytest.mark.parametrize("shape", ["tiny", "qwen2-0.5b", "qwen2-1.5b", "qwen2.5-7b"])
def test_the_count_is_the_built_models(shape):
    config = _llama_config(build_tokenizer(SHAPES[shape].vocab), SHAPES[shape])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert ModelDims.of_config(config.to_dict()).params == sum(p.numel() for p in model.parameters())


def small_model(tmp_path, **extra):
    import json

    (tmp_path / "config.json").write_text(json.dumps({**SMALL, **extra}))
    return str(tmp_path)


def cfg_for(model, *overrides):
    return parse_config({"model": {"model_name_or_path": model}, "devices": {"actor": [0]},
                         "train": {"prompts_per_step": 2, "samples_per_prompt": 2},
                         "data": {"max_prompt_tokens": 6}, "sampling": {"max_new_tokens": 10}},
                        ["actor.max_tokens_per_micro_batch=100", "actor.logprob_chunk_tokens=5", *overrides])


def parts(est):
    return {p.what: p.bytes for p in est.held} | {f"{k}: {p.what}": p.bytes for k, v in est.phases.items() for p in v}


def test_the_actor_estimate_by_hand(tmp_path):
    cfg = cfg_for(small_model(tmp_path))
    dims = ModelDims.read(cfg.actor.model_name_or_path)
    p = dims.params
    est = actor_estimate(cfg, dims, "0")
    got = parts(est)
    kv = 2 * 2 * 2 * 4 * 8 * 16  # k and v, bf16, 2 layers, one KV head of 4, 4 samples in 8 rows (a bucket), 6 + 10 tokens
    assert got == {
        "policy weights (fp32)": 4 * p, "policy AdamW state (fp32)": 8 * p, "reference weights (fp32)": 4 * p,
        "rollout engine weights (bf16)": 2 * p, "kept decode state": kv,  # within keep_decode_state_mb
        "generate: KV cache of 8 rows x 16 tokens (bf16)": 0, "generate: logits of one decode step": 4 * 8 * 10,
        "update: policy activations of one micro-batch (100 tokens)": 100 * 2 * 416,
        "update: policy gradients (fp32)": 4 * p, "update: LM head logits of 5 tokens with their gradient": 3 * 4 * 5 * 10}
    held = 18 * p + kv
    assert est.peak_phase == "update"
    assert est.total == pytest.approx((held + 100 * 2 * 416 + 4 * p + 600) * ALLOCATOR_SLACK + CUDA_CONTEXT)


def test_checkpointing_compiling_and_offload_change_what_they_should(tmp_path):
    model = small_model(tmp_path)
    dims = ModelDims.read(model)
    p = dims.params
    ckpt = parts(actor_estimate(cfg_for(model, "actor.gradient_checkpointing=true"), dims, "0"))
    assert ckpt["update: policy activations of one micro-batch (100 tokens)"] == 100 * (2 * 4 * 8 + 416)
    compiled = parts(actor_estimate(cfg_for(model, "actor.compile_layers=true"), dims, "0"))
    assert compiled["update: policy activations of one micro-batch (100 tokens)"] == pytest.approx(
        100 * 2 * 416 * COMPILED_ACTIVATION_SHARE)
    opt = actor_estimate(cfg_for(model, "actor.offload=optimizer"), dims, "0")
    assert "policy AdamW state (fp32)" not in parts(opt) and opt.host_total == 8 * p
    par = actor_estimate(cfg_for(model, "actor.offload=params", "actor.ref_offload=true"), dims, "0")
    got = parts(par)
    assert "policy weights (fp32)" not in got and "update: policy gradients (fp32)" not in got
    assert par.host_total == 16 * p + 4 * p and "logprobs" not in par.phases  # the reference's layers visit alone


def test_lora_holds_the_frozen_weights_in_bf16_and_trains_adapters_alone(tmp_path):
    model = small_model(tmp_path)
    dims = ModelDims.read(model)
    p = dims.params
    # r=2 on every linear layer (in + out features): q 8+8, k 8+4, v 8+4, o 8+8, gate, up, down 8+16 each.
    adapters = 2 * 2 * ((8 + 8) + (8 + 4) + (8 + 4) + (8 + 8) + 3 * (8 + 16))
    assert dims.adapter_params(2, "all-linear") == adapters == 512
    assert dims.adapter_params(2, ["q_proj", "v_proj", "not_a_layer"]) == 2 * 2 * (16 + 12)
    got = parts(actor_estimate(cfg_for(model, "actor.lora.rank=2"), dims, "0"))
    kv = 2 * 2 * 2 * 4 * 8 * 16
    assert got == {
        "policy frozen weights (bf16)": 2 * p, "policy LoRA adapters (r=2): weights and AdamW state": 12 * adapters,
        "rollout engine weights (bf16)": 2 * p, "kept decode state": kv,  # and no reference: adapters off
        "generate: KV cache of 8 rows x 16 tokens (bf16)": 0, "generate: logits of one decode step": 4 * 8 * 10,
        # an adapter's own bf16 cast of each input from the fp32 norms (q, k, v, gate, up): 5 * 2 * 8 bytes
        "update: policy activations of one micro-batch (100 tokens)": 100 * 2 * (416 + 80),
        "update: policy adapters' gradients (fp32)": 4 * adapters,
        "update: LM head logits of 5 tokens with their gradient": 3 * 4 * 5 * 10}
    other_ref = parts(actor_estimate(cfg_for(model, "actor.lora.rank=2", "actor.ref_model_name_or_path=/elsewhere"),
                                     dims, "0"))
    assert other_ref["reference weights (fp32)"] == 4 * p  # a reference of another model is its own copy
    sft = parts(actor_estimate(cfg_for(model, "algorithm=sft"), dims, "0"))
    assert "policy weights (fp32)" in sft and "reference weights (fp32)" not in sft  # supervised: none loaded
    par = actor_estimate(cfg_for(model, "actor.lora.rank=2", "actor.offload=params"), dims, "0")
    assert par.host_total == 4 * p + 12 * adapters and "policy frozen weights (fp32 shards)" not in parts(par)


def test_what_offloading_puts_in_host_memory_is_checked_against_the_machine(tmp_path):
    cfg = cfg_for(small_model(tmp_path), "actor.offload=optimizer", "actor.ref_offload=true")
    dims = ModelDims.read(cfg.actor.model_name_or_path)
    need = dims.params * (8 + 4)  # AdamW state and reference offloaded
    problems, warnings = memory_problems(cfg, ["actor"], None, host=need / 2)
    [problem] = problems
    assert problem.startswith(f"actor: an estimated {need / GIB:.1f} GiB of host memory") and "will not fit" in problem
    assert memory_problems(cfg, ["actor"], None, host=need / 0.95)[1]  # near: a warning
    assert memory_problems(cfg, ["actor"], None, host=need * 2) == ([], [])
    # Nothing offloaded: the checkpoint's pages while loading are reclaimable, a warning at most.
    loading = dims.params * dims.stored_bytes
    assert memory_problems(cfg_for(small_model(tmp_path)), ["actor"], None, host=2 * loading) == ([], [])
    problems, [warning] = memory_problems(cfg_for(small_model(tmp_path)), ["actor"], None, host=loading / 2)
    assert problems == [] and "while the roles load" in warning


def test_what_a_process_holds_while_it_loads(tmp_path):
    model = small_model(tmp_path, dtype="float32")
    dims = ModelDims.read(model)
    p, stored = dims.params, dims.stored_bytes
    assert stored == 4  # as its config says; a config that says nothing: bf16
    assert ModelDims.of_config(SMALL).stored_bytes == 2

    def loads(*overrides):
        [gpu, *_] = plan(cfg_for(model, *overrides), 80 * GIB)
        return {e.role: e for e in gpu.estimates}

    one = loads()["actor"]  # one GPU: the checkpoint streams to it whole, cast to fp32 there
    assert [(x.what, x.bytes) for x in one.load] == [("policy checkpoint, read whole", stored * p)]
    assert "load" not in one.phases
    four = loads("devices.actor=[0, 1, 2, 3]")["actor"]  # sharded: each rank reads its rows
    assert [(x.what, x.bytes) for x in four.load] == [("policy checkpoint, this rank's rows", stored * p / 4)]
    assert "load" not in four.phases  # the weights land in their shards: no transient on the GPU
    # Adapters go into whole weights: each GPU holds the whole fp32 policy until it is sharded.
    lora = loads("devices.actor=[0, 1, 2, 3]", "actor.lora.rank=2")["actor"]
    assert [x.bytes for x in lora.phases["load"]] == [4 * p * 3 / 4]
    assert lora.load[0].bytes == stored * p


def test_two_sharded_workers_hold_half_each(tmp_path):
    model = small_model(tmp_path)
    one = plan(cfg_for(model), 80 * GIB)
    two = plan(cfg_for(model, "devices.actor=[0, 1]"), 80 * GIB)
    assert [g.gpu for g in two] == ["0", "1"]
    weights = [parts(g.estimates[0])["policy weights (fp32)"] for g in (*one, *two)]
    assert weights[1] == weights[2] == weights[0] / 2


def test_a_split_actor_holds_its_engine_on_the_rollout_gpus_and_its_trainer_on_the_others(tmp_path):
    model = small_model(tmp_path)
    dims = ModelDims.read(model)
    p = dims.params
    gpus = plan(cfg_for(model, "devices.actor=[0, 1, 2, 3]", "devices.rollout=[0, 1]"), 80 * GIB)
    got = {g.gpu: parts(g.estimates[0]) for g in gpus}
    kv = 2 * 2 * 2 * 4 * 8 * 16
    for rollout_gpu in ("0", "1"):  # the engine alone: no trainer, no reference, no update
        assert got[rollout_gpu] == {"rollout engine weights (bf16)": 2 * p, "kept decode state": kv,
                                    "generate: KV cache of 8 rows x 16 tokens (bf16)": 0,
                                    "generate: logits of one decode step": 4 * 8 * 10}
    for train_gpu in ("2", "3"):  # sharded over the two training GPUs, not the actor's four
        assert got[train_gpu]["policy weights (fp32)"] == 4 * p / 2
        assert got[train_gpu]["reference weights (fp32)"] == 4 * p / 2
        assert "rollout engine weights (bf16)" not in got[train_gpu]
        assert not any(k.startswith("generate") for k in got[train_gpu])


def test_a_map_that_cannot_fit_is_refused_naming_role_estimate_and_settings(tmp_path):
    cfg = cfg_for(small_model(tmp_path))
    need = plan(cfg, 80 * GIB)[0].total
    problems, warnings = memory_problems(cfg, ["actor"], need / 2)
    [problem] = problems
    assert problem.startswith(f"actor on GPU 0: an estimated {need / GIB:.1f} GiB") and "will not fit" in problem
    assert "actor.gradient_checkpointing=true" in problem and "actor.offload=optimizer" in problem
    assert warnings == []
    problems, warnings = memory_problems(cfg, ["actor"], need / 0.95)  # near: a warning only
    assert problems == [] and len(warnings) == 1 and warnings[0].endswith("is near the GPU's memory")
    assert memory_problems(cfg, ["actor"], need * 2) == ([], [])
    assert memory_problems(cfg, ["critic"], need / 2) == ([], [])  # the role asked about only
    assert memory_problems(cfg, ["actor"], None) == ([], [])  # no GPU here: nothing to compare with


def test_preflight_refuses_before_anything_loads(tmp_path, monkeypatch):
    from rolefleet.app import memory, preflight

    cfg = cfg_for(small_model(tmp_path))
    monkeypatch.setattr(memory, "gpu_capacity", lambda: 1024.0)
    with pytest.raises(ConfigError, match=r"actor on GPU 0: an estimated [\d.]+ GiB .* will not fit"):
        preflight.preflight(cfg, ["actor"], command="serve")


def test_a_config_without_dimensions_names_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match="cannot estimate memory without hidden_size"):
        ModelDims.of_config({"num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="no config.json"):
        ModelDims.read(str(tmp_path))


def test_params_offload_needs_fsdp():
    with pytest.raises(Exception, match="offload=params is FSDP2's CPU offload: it needs sharding=fsdp"):
        parse_config({}, ["actor.offload=params", "actor.sharding=replicate"])


def test_the_plan_command_prints_the_parts_and_fails_when_over(tmp_path, capsys):
    from rolefleet.cli import main

    model = small_model(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{model_name_or_path: {model}}}\ndevices: {{actor: [0]}}\n")
    assert main(["plan", str(config), "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0:" in out and "(fits)" in out and "policy AdamW state (fp32)" in out
    assert main(["plan", str(config), "--gpu-gib", "0.0001"]) == 1
    assert "(over)" in capsys.readouterr().out


def test_the_plan_names_reward_gpus_that_would_idle(tmp_path, capsys):
    from rolefleet.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{model_name_or_path: {small_model(tmp_path)}}}\n"
                      "devices: {actor: [0], reward: [1]}\n")
    assert main(["plan", str(config), "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "GPU 1" not in out  # nothing of the reward's is planned there
    assert "warning: devices.reward: GPUs [1] go to the reward role, but its sources run on the CPU" in out


@pytest.mark.parametrize("shape", ["tiny", "qwen2.5-7b"])
def test_a_reward_models_count_is_the_built_classifiers(shape):
    from transformers import LlamaForSequenceClassification

    config = _llama_config(build_tokenizer(SHAPES[shape].vocab), SHAPES[shape], num_labels=1)
    with torch.device("meta"):
        model = LlamaForSequenceClassification(config)
    assert ModelDims.of_config(config.to_dict()).scorer_params == sum(p.numel() for p in model.parameters())


def reward_cfg(actor_model, reward_model, *overrides):
    return parse_config({"model": {"model_name_or_path": actor_model},
                         "devices": {"actor": [0], "reward": [1]},
                         "reward": {"sources": [{"kind": "function", "function": "exact_match"},
                                                {"kind": "model", "path": reward_model, "name": "rm"}]}},
                        list(overrides))


def test_a_reward_model_on_its_gpu_by_hand(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "r").mkdir()
    cfg = reward_cfg(small_model(tmp_path / "a"), small_model(tmp_path / "r"), "reward.model_max_tokens_per_batch=100")
    gpu = next(g for g in plan(cfg, 80 * GIB) if g.gpu == "1")
    [est] = gpu.estimates
    assert est.role == "reward"
    # weights: embeddings 80 + 2 layers of 592 + final norm 8 + a score head of 8, in bf16
    assert [p.bytes for p in est.held] == [2 * (80 + 2 * 592 + 8 + 8)]
    # a token in a layer: 2 bytes x (3*8 residual, normed, output + 2*8 q and attention output + 2*4 k, v + 4*16 MLP)
    assert [p.bytes for p in est.phases["score"]] == [100 * 2 * (24 + 16 + 8 + 64)]
    assert est.total == pytest.approx((est.held[0].bytes + est.phases["score"][0].bytes) * ALLOCATOR_SLACK
                                      + CUDA_CONTEXT)
    # No reward model, no reward estimate.
    no_model = parse_config({"model": {"model_name_or_path": small_model(tmp_path / "a")},
                             "devices": {"actor": [0], "reward": [1]}}, [])
    assert [g.gpu for g in plan(no_model, 80 * GIB)] == ["0"]


def test_preflight_names_a_reward_model_that_does_not_fit(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "r").mkdir()
    big = small_model(tmp_path / "r", hidden_size=4096, intermediate_size=16384, vocab_size=32000,
                      num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32)
    cfg = reward_cfg(small_model(tmp_path / "a"), big, "reward.model_dtype=float32")
    problems, _ = memory_problems(cfg, ["reward"], 16 * GIB)
    assert len(problems) == 1
    assert problems[0].startswith("reward on GPU 1: an estimated") and "will not fit" in problems[0]
    assert "reward.model_dtype=bfloat16" in problems[0] and "reward.model_max_tokens_per_batch=4096" in problems[0]
    assert memory_problems(cfg, ["actor"], 16 * GIB) == ([], [])  # the actor's GPU is not the problem
