"""`actor.lora`: only the adapters train and hold optimizer state, the reference is the base model
with them switched off, the engines take the merged weights of the adapted layers alone,
checkpoints hold the adapters and resume them, and export merges them into the base model."""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from rolefleet.actor.core import ActorCore
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import ConfigError, parse_config
from rolefleet.common.modeling import lm_logprobs
from rolefleet.export import ExportError, export_checkpoint
from rolefleet.trainer.lora import ADAPTER_CONFIG, merged_shapes

LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = ["1+2=", "3+4=", "5+6="]


def config(model_dir, **lora):
    return parse_config({"model": {"model_name_or_path": str(model_dir)},
                         "actor": {"compute_dtype": "float32", "lr": 1e-2, "kl_loss_coef": 0.1,
                                   "max_tokens_per_micro_batch": 20, "lora": {"rank": 4, **lora}}}, [])


def rollout(core, seed=3):
    samples = core.generate(PROMPTS, SamplingParams(max_new_tokens=5, n=2, seed=seed))
    return SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])


def trained(core, steps=2):
    """`steps` updates on one batch; returns the batch and its logprobs (policy and reference) before."""
    batch = rollout(core)
    before = core.compute_logprobs(batch, 1.0, include_reference=True)
    targets = PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens), before.logprobs, before.ref_logprobs)
    for step in range(1, steps + 1):
        core.update(step, step - 1, batch, targets, 1.0)
    return batch, before


def test_only_the_adapters_train_and_the_reference_is_the_base_model(tiny_model_dir):
    core = ActorCore(config(tiny_model_dir).actor)
    trainer, model = core.worker.trainer, core.worker.model
    assert core.worker.ref_model is None  # no second copy of the model
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == \
        {id(p) for n, p in model.named_parameters() if n in adapters}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if n not in adapters}

    batch, before = trained(core)
    after = core.compute_logprobs(batch, 1.0, include_reference=True)
    assert torch.equal(before.logprobs, before.ref_logprobs)  # B starts at zero: the policy is the base
    assert (after.logprobs - before.logprobs).abs().max() > 1e-2
    assert torch.equal(after.ref_logprobs, before.ref_logprobs)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    # The reference is the base model itself: what a plain actor of the same model computes.
    plain = ActorCore(parse_config({"model": {"model_name_or_path": tiny_model_dir},
                                    "actor": {"compute_dtype": "float32"}}, []).actor)
    assert torch.allclose(plain.compute_logprobs(batch, 1.0, include_reference=True).ref_logprobs,
                          after.ref_logprobs, atol=1e-6)


def test_the_engine_takes_the_merged_weights_of_the_adapted_layers_alone(tiny_model_dir):
    core = ActorCore(config(tiny_model_dir).actor)
    engine = core.worker.engine
    loaded = []
    load = engine.load_weights
    engine.load_weights = lambda named: load([loaded.append(name) or (name, t) for name, t in named])
    trained(core)
    names = [name for name, _ in merged_shapes(core.worker.model_config, core.cfg.lora)]
    assert loaded == names + names  # once per update, in the order a split sync's receivers expect
    assert {n.split(".")[-2] for n in names} == set(LAYERS) and not any("embed" in n for n in names)
    # Sampled from the new weights: the engine's logprobs are the trainer's of the same tokens.
    samples = core.generate(PROMPTS, SamplingParams(max_new_tokens=5, n=2, seed=9))
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    recomputed = core.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    assert torch.allclose(torch.cat([torch.as_tensor(s.logprobs) for s in samples]), recomputed, atol=1e-5)


def test_a_checkpoint_holds_the_adapters_and_resumes_them(tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, target_modules=["q_proj", "v_proj"])
    core = ActorCore(cfg.actor)
    batch, _ = trained(core)
    core.save_checkpoint(2, str(tmp_path / "actor"))
    import torch.distributed.checkpoint as dcp

    keys = [k for k in dcp.FileSystemReader(str(tmp_path / "actor" / "weights")).read_metadata().state_dict_metadata
            if k.startswith("model.")]
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    assert all(".q_proj." in k or ".v_proj." in k for k in keys)
    adapter = json.loads((tmp_path / "actor" / "hf" / ADAPTER_CONFIG).read_text())
    assert adapter["r"] == 4 and adapter["base_model_name_or_path"] == str(tiny_model_dir)

    resumed = ActorCore(cfg.actor)
    resumed.load_checkpoint(str(tmp_path / "actor"))
    assert resumed.digest() == core.digest()
    lp = core.compute_logprobs(batch, 1.0, include_reference=True)
    assert torch.equal(lp.logprobs, resumed.compute_logprobs(batch, 1.0, include_reference=True).logprobs)
    # ... and the optimizer's state: the next update moves both alike.
    targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs, lp.ref_logprobs)
    one_more = [c.update(3, 2, batch, targets, 1.0).stats["loss"] for c in (core, resumed)]
    assert one_more[0] == pytest.approx(one_more[1], abs=1e-7)


def test_export_merges_the_adapters_into_the_base_model(tiny_model_dir, tmp_path):
    core = ActorCore(config(tiny_model_dir).actor)
    batch, _ = trained(core)
    core.save_checkpoint(2, str(tmp_path / "actor"))
    out = export_checkpoint(tmp_path / "actor", tmp_path / "merged", "float32", adapter_out=tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    trained_lp = core.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    with torch.no_grad():
        assert torch.allclose(lm_logprobs(merged, batch, torch.device("cpu"), 1.0, 2048, False, False)[0],
                              trained_lp, atol=1e-5)
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter")
        assert torch.allclose(lm_logprobs(adapter.get_base_model(), batch, torch.device("cpu"), 1.0, 2048, False,
                                          False)[0], trained_lp, atol=1e-5)
    # It generates what the trained actor generates (greedy).
    greedy = core.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    for prompt, sample in zip(PROMPTS, greedy):
        ids = torch.tensor([list(sample.prompt_ids)])
        tokens = merged.generate(ids, max_new_tokens=len(sample.response_ids), do_sample=False)[0, ids.shape[1]:]
        assert tokens.tolist() == list(sample.response_ids), prompt


def test_export_refuses_what_does_not_match(tiny_model_dir, tmp_path):
    core = ActorCore(config(tiny_model_dir).actor)
    core.save_checkpoint(0, str(tmp_path / "actor"))
    other = make_tiny_model(tmp_path / "other", hidden=32)
    with pytest.raises(ExportError, match="not the one the adapters were trained on: hidden_size 32"):
        export_checkpoint(tmp_path / "actor", tmp_path / "out", base=str(other))
    with pytest.raises(ExportError, match="base model .*missing.* cannot be read"):
        export_checkpoint(tmp_path / "actor", tmp_path / "out", base=str(tmp_path / "missing"))
    assert not (tmp_path / "out").exists()
    plain = ActorCore(parse_config({"model": {"model_name_or_path": tiny_model_dir}}, []).actor)
    plain.save_checkpoint(0, str(tmp_path / "full"))
    with pytest.raises(ExportError, match="holds full weights, not LoRA adapters"):
        export_checkpoint(tmp_path / "full", tmp_path / "out", adapter_out=tmp_path / "adapter")


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="target_modules"):
        parse_config({"actor": {"lora": {"rank": 8, "target_modules": []}}}, [])
    with pytest.raises(ConfigError, match="rank"):
        parse_config({"actor": {"lora": {"rank": -1}}}, [])
    assert not parse_config({"model": {"model_name_or_path": "m"}}, []).actor.lora.enabled  # full-parameter training unless asked


@pytest.mark.procs
@pytest.mark.timeout(240)
@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="a split actor on CUDA needs a GPU for each rank")
def test_a_split_actor_broadcasts_the_merged_layers_to_its_rollout_worker(tiny_model_dir):
    """Rank 0 generates, rank 1 trains the adapters: after an update the rollout worker samples from
    the merged weights (its logprobs are the trainer's of the same tokens), which it received in the
    order its own skeleton of the model gave."""
    from rolefleet.actor.placement import rollout_ranks
    from rolefleet.actor.worker import ActorWorker
    from rolefleet.trainer.workers import WorkerGroup

    cfg = parse_config({"model": {"model_name_or_path": str(tiny_model_dir)},
                        "actor": {"compute_dtype": "float32", "lr": 1e-2, "num_threads": 1, "workers": 2,
                                  "rollout": {"workers": 1}, "lora": {"rank": 4}}}, [])
    group = WorkerGroup.start("actor", 2, cfg.model_dump(mode="json"), ActorWorker.from_config)
    try:
        core = ActorCore(cfg.actor, rollout_ranks=rollout_ranks(cfg), group=group)
        assert core.worker.trainer is None  # rank 0: the rollout worker
        batch = rollout(core)
        lp = core.compute_logprobs(batch, 1.0, include_reference=True)
        core.update(1, 0, batch, PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens), lp.logprobs), 1.0)
        samples = core.generate(PROMPTS, SamplingParams(max_new_tokens=5, n=2, seed=9))
        assert all(s.policy_version == 1 for s in samples)
        fresh = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        recomputed = core.compute_logprobs(fresh, 1.0, include_reference=True)
        sampled = torch.cat([torch.as_tensor(s.logprobs) for s in samples])
        assert torch.allclose(sampled, recomputed.logprobs, atol=1e-5)
        assert (sampled - recomputed.ref_logprobs).abs().max() > 1e-2  # and not the base model's
    finally:
        group.stop()


def test_lora_beside_a_vllm_engine_that_drops_its_weights_is_refused():
    model = {"model": {"model_name_or_path": "m"}}
    with pytest.raises(ConfigError, match="actor.rollout.vllm.sleep_level to 1"):
        parse_config(model, ["actor.lora.rank=8", "actor.rollout.backend=vllm"])  # sleep level 2 by default
    parse_config(model, ["actor.lora.rank=8", "actor.rollout.backend=vllm", "actor.rollout.vllm.sleep_level=1"])
    parse_config(model, ["actor.lora.rank=8", "actor.rollout.backend=vllm", "actor.rollout.workers=1"])  # apart
    cfg = parse_config(model, ["actor.lora.rank=8"]).actor  # auto: the worker asks once it has chosen vLLM
    assert "sleep_level" in cfg.lora_engine_problem("vllm", split=False)
    assert cfg.lora_engine_problem("hf", split=False) is None
