"""The training engine: token-budget micro-batches with gradient accumulation and the chunked LM
head give the same numbers as one forward over the whole batch."""

import pytest
import torch

from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.modeling import head_logprobs, token_logprobs
from tests.actor.test_trainer import make_core, rollout


def params(core) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in core.worker.model.named_parameters()}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("packed", [False, True])
def test_micro_batches_give_the_update_of_one_batch(tiny_model_dir, agg, packed):
    """One padded batch against micro-batches: each sequence its own (a 1-token budget), or several
    packed into one row without padding (attention kept inside each sequence): same weights after
    the step, with the IS correction dropping tokens and the entropy and KL terms on."""
    common = ["actor.compute_dtype=float32", "actor.lr=1e-2", f"actor.loss_agg_mode={agg}", "actor.is_correction=token_mask",
              "actor.is_threshold=1.5", "actor.entropy_coef=0.01", "actor.kl_loss_coef=0.1"]
    whole = make_core(tiny_model_dir, *common, "actor.max_tokens_per_micro_batch=100000",
                      "actor.sequence_packing=false")
    split = make_core(tiny_model_dir, *common, f"actor.max_tokens_per_micro_batch={30 if packed else 1}",
                      f"actor.sequence_packing={str(packed).lower()}")
    for core in (whole, split):  # plain SGD: the weight change is the gradient (Adam would amplify noise)
        core.worker.trainer.optimizer, core.worker.trainer.scheduler = torch.optim.SGD(core.worker.model.parameters(), lr=1.0), None
    _, batch, lp = rollout(whole)
    n = batch.num_response_tokens
    rollout_lp = (lp.logprobs + torch.linspace(-0.6, 0.6, n)).clamp(max=0)  # some leave [1/1.5, 1.5]
    targets = PolicyTargets(torch.linspace(-1, 1, n), lp.logprobs, lp.ref_logprobs, rollout_lp)
    a = whole.update(1, 0, batch, targets, 1.0)
    b = split.update(1, 0, batch, targets, 1.0)
    groups = batch.micro_batches(30, packed=True) if packed else batch.micro_batches(1)
    assert 1 < len(groups) < len(batch) if packed else len(groups) == len(batch) > 1
    for name, p in params(whole).items():
        assert torch.allclose(p, params(split)[name], atol=1e-5), name
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "kl_loss", "is_masked_frac"):
        assert a.stats[key] == pytest.approx(b.stats[key], rel=1e-4, abs=1e-6), key
    assert 0 < a.stats["is_masked_frac"] < 1


@pytest.mark.parametrize("packed", ["false", "true"])
def test_micro_batched_logprobs_match_one_forward(tiny_model_dir, packed):
    whole = make_core(tiny_model_dir, "actor.compute_dtype=float32", "actor.max_tokens_per_micro_batch=100000",
                      "actor.logprob_chunk_tokens=100000", "actor.sequence_packing=false")
    split = make_core(tiny_model_dir, "actor.compute_dtype=float32", "actor.max_tokens_per_micro_batch=20",
                      "actor.logprob_chunk_tokens=3", f"actor.sequence_packing={packed}")
    _, batch, _ = rollout(whole)
    a = whole.compute_logprobs(batch, 0.7, include_reference=True)
    b = split.compute_logprobs(batch, 0.7, include_reference=True)
    for x, y in ((a.logprobs, b.logprobs), (a.ref_logprobs, b.ref_logprobs), (a.entropy, b.entropy)):
        assert torch.allclose(x, y, atol=1e-5)


def test_chunked_head_matches_full_logits_with_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(11, 16, requires_grad=True)
    targets = torch.randint(0, 50, (11,))
    logp, entropy = head_logprobs(hidden, head, targets, 0.8, chunk_tokens=4, with_entropy=True)
    (logp.sum() + entropy.sum()).backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    logits = head(hidden) / 0.8
    full = token_logprobs(logits, targets, 1.0)
    full_entropy = -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)
    (full.sum() + full_entropy.sum()).backward()
    assert torch.allclose(logp, full, atol=1e-6) and torch.allclose(entropy, full_entropy, atol=1e-5)
    assert torch.allclose(grad, hidden.grad, atol=1e-5)


def test_micro_batches_cover_every_row_once_within_the_budget():
    lengths = [3, 9, 4, 4, 12, 1, 7]
    batch = SequenceBatch.from_lists([torch.ones(n, dtype=torch.int64) for n in lengths],
                                     [torch.ones(1, dtype=torch.int64)] * len(lengths))
    groups = batch.micro_batches(20)
    assert sorted(i for g in groups for i in g.tolist()) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] + 1 for i in g.tolist())
        assert len(g) == 1 or len(g) * longest <= 20
    assert [g.tolist() for g in batch.micro_batches(5)][0] == [4]  # 13 tokens > budget: alone


def test_the_rollout_engine_owns_its_weights_and_samples_from_the_new_ones_after_an_update(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.lr=1e-2", "actor.compute_dtype=float32")
    assert core.worker.engine.model is not core.worker.model  # its own copy, not the trainer's module
    _, batch, lp = rollout(core)
    engine_before = core.worker.engine._logprobs(batch, 1.0)
    assert torch.allclose(engine_before, lp.logprobs, atol=1e-5)  # same weights, same convention
    result = core.update(1, 0, batch, PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens),
                                                    lp.logprobs), 1.0)
    assert result.stats["weight_sync_s"] >= 0
    trained = core.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    assert not torch.allclose(trained, lp.logprobs, atol=1e-3)  # the update moved the policy
    assert torch.allclose(core.worker.engine._logprobs(batch, 1.0), trained, atol=1e-5)  # and the engine with it
    samples = core.generate(["1+2="], SamplingParams(max_new_tokens=3, seed=1))
    assert samples[0].policy_version == 1


def test_a_failed_weight_sync_blocks_the_role_instead_of_reapplying_the_step(tiny_model_dir):
    from rolefleet.common.errors import FailedPrecondition

    core = make_core(tiny_model_dir)
    _, batch, lp = rollout(core)

    def broken(named):
        raise RuntimeError("CUDA out of memory")

    core.worker.engine.load_weights = broken
    targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs)
    with pytest.raises(FailedPrecondition, match="moving the new weights into the rollout engine failed"):
        core.update(1, 0, batch, targets, 1.0)
    with pytest.raises(FailedPrecondition, match="refuses updates until restarted"):
        core.update(1, 0, batch, targets, 1.0)
    assert "rollout engine" in core.ledger.broken


@pytest.mark.parametrize("schedule, expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 1.0, 0.55, 0.1]),                 # warm-up 2, decay to 0.1 by step 4
    ("cosine", [0.5, 1.0, 1.0, 0.55, 0.1]),
])
def test_lr_schedule(schedule, expected):
    from rolefleet.trainer.optim import lr_factor

    got = [lr_factor(step, warmup=2, decay_steps=4, schedule=schedule, min_ratio=0.1) for step in range(5)]
    assert got == pytest.approx(expected)


def test_the_schedule_and_gradient_checkpointing_reach_the_trainer(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.lr=1e-2", "actor.lr_warmup_steps=4", "actor.gradient_checkpointing=true",
                     "actor.ref_offload=true")
    assert any(getattr(m, "gradient_checkpointing", False) for m in core.worker.model.modules())
    _, batch, lp = rollout(core)
    targets = PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens), lp.logprobs)
    lrs = [core.update(step, step - 1, batch, targets, 1.0).stats["lr"] for step in (1, 2)]
    assert lrs == pytest.approx([1e-2 / 4, 2e-2 / 4])  # linear warm-up, one optimizer step per update


def test_lr_decay_defaults_to_the_run_length():
    from rolefleet.common.config import parse_config

    cfg = parse_config({"model": {"model_name_or_path": "m"}}, ["train.total_steps=50", "actor.ppo_epochs=2",
                                                                 "actor.num_mini_batches=4"])
    assert cfg.actor.lr_decay_steps == 400 and cfg.critic.lr_decay_steps == 50


def test_the_engine_copy_casts_parameters_only_and_keeps_ties(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rolefleet.actor.rollout_hf import _engine_copy

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    copy = _engine_copy(policy, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy.parameters())
    # RoPE frequencies and other buffers keep their precision (bf16 would be radians off at long positions).
    assert {n: b.dtype for n, b in copy.named_buffers()} == {n: b.dtype for n, b in policy.named_buffers()}
    assert copy.get_output_embeddings().weight is copy.get_input_embeddings().weight  # tied, as the policy
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # the policy is untouched


def test_checkpoint_generation_defaults_do_not_reshape_sampling(tiny_model_dir):
    """A checkpoint may ship sampling defaults (Qwen2.5-Instruct: repetition_penalty 1.05); they
    would change the distribution the recorded logprobs claim to describe."""
    from rolefleet.actor.rollout_hf import HFRolloutEngine

    core = make_core(tiny_model_dir)
    core.worker.model.generation_config.repetition_penalty = 1.5
    core.worker.model.generation_config.top_k = 3
    engine = HFRolloutEngine(core.worker.model, core.tokenizer, core.worker.device, core.cfg, None, core.stop_ids)
    assert engine.model.generation_config.repetition_penalty in (None, 1.0)
    assert engine.model.generation_config.top_k in (None, 50)  # transformers' own default, overridden per call


def test_packed_micro_batches_count_real_tokens():
    lengths = [3, 9, 4, 4, 12, 1, 7]
    batch = SequenceBatch.from_lists([torch.ones(n, dtype=torch.int64) for n in lengths],
                                     [torch.ones(1, dtype=torch.int64)] * len(lengths))
    groups = batch.micro_batches(25, packed=True)
    assert sorted(i for g in groups for i in g.tolist()) == list(range(len(lengths)))
    assert all(len(g) == 1 or sum(lengths[i] + 1 for i in g.tolist()) <= 25 for g in groups)
    assert len(groups) < len(batch.micro_batches(25))  # padding no longer counts against the budget


def test_weight_buckets_hold_consecutive_parameters_up_to_the_budget():
    from rolefleet.actor.weight_sync import plan_buckets

    assert plan_buckets([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert plan_buckets([3], 100) == [[0]]
    assert plan_buckets([], 8) == []
