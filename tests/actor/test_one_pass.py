"""A one-pass update (`actor.old_logprobs: auto`, one optimizer step): no old logprobs sent, the
update's own forward supplies them. It must move the weights exactly as an update given old
logprobs from a separate ComputeLogProbs pass, and answer the logprobs and entropy that pass
would have given, in the batch's token order."""

import pytest
import torch

from rolefleet.actor.core import ActorCore
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.actor.worker import ActorWorker
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.errors import InvalidArgument
from rolefleet.trainer.workers import WorkerGroup

pytestmark = pytest.mark.timeout(240)
# Micro-batches of a few rows each, a KL term and a truncating IS correction: every part of the loss.
ACTOR = {"compute_dtype": "float32", "lr": 1e-2, "num_threads": 1, "max_tokens_per_micro_batch": 24,
         "kl_loss_coef": 0.1, "is_correction": "token_truncate", "is_threshold": 1.5}


def core_and_batch(model_dir, workers=1, **actor):
    cfg = parse_config({"model": {"model_name_or_path": model_dir}, "actor": {**ACTOR, **actor}}, [])
    core = ActorCore(cfg.actor)
    samples = core.generate(["1+2=", "13+4=", "7+7=", "9+1=", "11+11="], SamplingParams(max_new_tokens=5, n=2, seed=3))
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    # Rollout logprobs off by up to +-0.5 from the trainer's: some IS weights truncated at 1.5.
    rollout = (torch.cat([s.logprobs for s in samples]) + torch.linspace(-0.5, 0.5, batch.num_response_tokens)).clamp(max=0)
    return cfg, core, batch, rollout


def targets(batch, lp, rollout, old=True):
    return PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens), lp.logprobs if old else None,
                         lp.ref_logprobs, rollout)


def test_one_pass_moves_the_weights_as_a_separate_pass_does_and_answers_its_logprobs(tiny_model_dir):
    cfg, recomputed, batch, rollout = core_and_batch(tiny_model_dir)
    lp = recomputed.compute_logprobs(batch, 1.0, include_reference=True)
    two_pass = recomputed.update(1, 0, batch, targets(batch, lp, rollout), 1.0)
    assert two_pass.logprobs is None  # old logprobs sent: nothing to answer

    one = ActorCore(cfg.actor)
    ref_only = one.compute_logprobs(batch, 1.0, include_reference=True, reference_only=True)
    assert ref_only.logprobs is None and ref_only.entropy is None
    assert torch.equal(ref_only.ref_logprobs, lp.ref_logprobs)
    one_pass = one.update(1, 0, batch, targets(batch, ref_only, rollout, old=False), 1.0)

    # The logprobs and entropy of the policy before the step, in the batch's token order (the
    # mini-batch's rows were shuffled), stamped with that policy's version.
    assert one_pass.logprobs.policy_version == 0 and one_pass.model_version == 1
    assert torch.allclose(one_pass.logprobs.logprobs, lp.logprobs, atol=1e-5)
    assert torch.allclose(one_pass.logprobs.entropy, lp.entropy, atol=1e-5)
    # The same step: the same statistics, the same new weights.
    for key in ("loss", "pg_loss", "kl_loss", "grad_norm", "is_weight_mean", "is_masked_frac", "pg_clipfrac"):
        assert one_pass.stats[key] == pytest.approx(two_pass.stats[key], rel=1e-4, abs=1e-6), key
    assert abs(one_pass.stats["is_weight_mean"] - 1.0) > 0.01  # the IS weights were in play
    after_two = recomputed.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    after_one = one.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    assert (after_two - lp.logprobs).abs().max() > 1e-2
    assert torch.allclose(after_one, after_two, atol=1e-5)
    # A replay of the step (a retried call) answers the same logprobs.
    again = one.update(1, 0, batch, targets(batch, ref_only, rollout, old=False), 1.0)
    assert again.stats == one_pass.stats and torch.equal(again.logprobs.logprobs, one_pass.logprobs.logprobs)


@pytest.mark.parametrize("actor, problem", [
    ({"ppo_epochs": 2}, "the update makes 2 optimizer steps"),
    ({"num_mini_batches": 3}, "the update makes 3 optimizer steps"),
    ({"is_correction": "seq_mask"}, "actor.is_correction=seq_mask drops tokens"),
])
def test_an_update_that_needs_old_logprobs_refuses_to_go_without_and_changes_nothing(tiny_model_dir, actor, problem):
    _, core, batch, rollout = core_and_batch(tiny_model_dir, **actor)
    lp = core.compute_logprobs(batch, 1.0, include_reference=True)
    digest = core.digest()
    with pytest.raises(InvalidArgument, match=f"old_logprobs: required: {problem}"):
        core.update(1, 0, batch, targets(batch, lp, rollout, old=False), 1.0)
    assert core.digest() == digest and core.policy_version == 0 and core.ledger.last_step == 0


def test_asking_for_nothing_is_refused(tiny_model_dir):
    _, core, batch, _ = core_and_batch(tiny_model_dir)
    with pytest.raises(InvalidArgument, match="include_reference"):
        core.compute_logprobs(batch, 1.0, include_reference=False, reference_only=True)


@pytest.mark.procs
@pytest.mark.parametrize("sharding", ["fsdp", "replicate"])
def test_two_workers_answer_the_one_pass_logprobs_of_one(tiny_model_dir, sharding):
    """Each rank computes its share of the micro-batches; every rank's part comes back, in order.
    (One process's steps first: ranks are process-wide once the group exists.)"""
    cfg, single, batch, rollout = core_and_batch(tiny_model_dir, workers=2, sharding=sharding)
    ref = single.compute_logprobs(batch, 1.0, include_reference=True, reference_only=True)
    one = single.update(1, 0, batch, targets(batch, ref, rollout, old=False), 1.0)
    # And a next step with old logprobs sent: its mini-batch-wide IS statistics counted once.
    lp = single.compute_logprobs(batch, 1.0, include_reference=True)
    one_next = single.update(2, 1, batch, targets(batch, lp, rollout), 1.0)
    group = WorkerGroup.start("actor", 2, cfg.model_dump(mode="json"), ActorWorker.from_config)
    try:
        double = ActorCore(cfg.actor, group=group)
        two = double.update(1, 0, batch, targets(batch, ref, rollout, old=False), 1.0)
        assert torch.allclose(two.logprobs.logprobs, one.logprobs.logprobs, atol=2e-4)
        assert torch.allclose(two.logprobs.entropy, one.logprobs.entropy, atol=2e-4)
        for key in ("loss", "grad_norm", "is_weight_mean", "is_masked_frac"):
            assert two.stats[key] == pytest.approx(one.stats[key], rel=1e-4, abs=1e-6), key
        two_next = double.update(2, 1, batch, targets(batch, lp, rollout), 1.0)
        for key in ("loss", "is_weight_mean", "is_masked_frac"):
            assert two_next.stats[key] == pytest.approx(one_next.stats[key], rel=1e-3, abs=1e-5), key
    finally:
        group.stop()
