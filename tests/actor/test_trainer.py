"""The actor's loss assembly and update safety: what reaches the pure loss functions, how the IS
mask, entropy bonus and KL term enter the objective, and that failed updates change nothing."""

import asyncio

import pytest
import torch

from rolefleet.actor.client import InProcessActorClient
from rolefleet.actor.core import ActorCore
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.errors import FailedPrecondition

ONE_STEP = ["actor.ppo_epochs=1", "actor.num_mini_batches=1"]


def make_core(model_dir, *overrides, ref=None):
    raw = {"model": {"model_name_or_path": model_dir}}
    if ref is not None:
        raw["actor"] = {"ref_model_name_or_path": ref}
    return ActorCore(parse_config(raw, list(overrides)).actor)


def rollout(core):
    samples = core.generate(["1+2=", "13+4=", "7+7="], SamplingParams(max_new_tokens=4, n=2, seed=11))
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    return samples, batch, core.compute_logprobs(batch, 1.0, include_reference=True)


def test_config_reaches_the_policy_loss(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.clip_ratio=0.1", "actor.clip_ratio_high=0.3", "actor.dual_clip=4",
                     "actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_norm_length=9")
    seen = []
    real = core.worker.trainer.policy_loss

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    core.worker.trainer.policy_loss = spy
    _, batch, lp = rollout(core)
    core.update(1, 0, batch, PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs), 1.0)
    assert seen and all(kw["clip_low"] == 0.1 and kw["clip_high"] == 0.3 and kw["dual_clip"] == 4 and
                        kw["agg"] == "seq-mean-token-sum-norm" and kw["norm_length"] == 9 for kw in seen)


def test_is_mask_removes_tokens_from_the_loss(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.is_correction=token_mask", "actor.is_threshold=2", *ONE_STEP)
    _, batch, lp = rollout(core)
    n0 = int(batch.response_lengths[0])
    rollout_lp = lp.logprobs.clone()
    rollout_lp[:n0] -= 5.0  # pi_old / pi_rollout = e^5 on response 0: masked
    adv = torch.ones(batch.num_response_tokens)
    adv[:n0] = 100.0
    result = core.update(1, 0, batch, PolicyTargets(adv, lp.logprobs, rollout_logprobs=rollout_lp), 1.0)
    # One on-policy step: ratio 1, so the token-mean loss is -mean(A) over the kept tokens = -1.
    assert result.stats["pg_loss"] == pytest.approx(-1.0, abs=1e-4)
    assert result.stats["is_masked_frac"] == pytest.approx(n0 / batch.num_response_tokens)


def test_entropy_bonus_lowers_the_objective(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.entropy_coef=0.5", *ONE_STEP)
    _, batch, lp = rollout(core)
    result = core.update(1, 0, batch, PolicyTargets(torch.zeros(batch.num_response_tokens), lp.logprobs), 1.0)
    assert result.stats["entropy"] > 0
    assert result.stats["loss"] == pytest.approx(-0.5 * result.stats["entropy"], rel=1e-5)


def test_kl_loss_raises_the_objective_and_pulls_toward_the_reference(tiny_model_dir, tmp_path):
    other = make_tiny_model(tmp_path / "ref", task="addition", warm_start_steps=5, seed=3)
    core = make_core(tiny_model_dir, "actor.kl_loss_coef=2.0", "actor.lr=1e-4", *ONE_STEP, ref=str(other))
    _, batch, lp = rollout(core)
    zeros = torch.zeros(batch.num_response_tokens)
    result = core.update(1, 0, batch, PolicyTargets(zeros, lp.logprobs, lp.ref_logprobs), 1.0)
    assert result.stats["kl_loss"] > 0
    assert result.stats["loss"] == pytest.approx(2.0 * result.stats["kl_loss"], rel=1e-5)
    after = core.compute_logprobs(batch, 1.0, include_reference=True)
    kl_before = (torch.exp(lp.ref_logprobs - lp.logprobs) - 1 - (lp.ref_logprobs - lp.logprobs)).mean()
    kl_after = (torch.exp(after.ref_logprobs - after.logprobs) - 1 - (after.ref_logprobs - after.logprobs)).mean()
    assert kl_after < kl_before


def test_the_teacher_kl_term_pulls_the_policy_toward_the_teacher_s_most_likely_tokens(tiny_model_dir, tmp_path):
    from rolefleet.algos import TEACHER_KL
    from rolefleet.common.config import TeacherSection
    from rolefleet.common.errors import InvalidArgument
    from rolefleet.teacher.core import TeacherCore

    other = make_tiny_model(tmp_path / "teacher", task="addition", warm_start_steps=30, seed=3)
    teacher = TeacherCore(TeacherSection(model_name_or_path=str(other)), student=tiny_model_dir)
    core = make_core(tiny_model_dir, "actor.teacher_kl_coef=2.0", "actor.lr=2e-3", f"teacher.model_name_or_path={other}",
                     "teacher.top_k=4", *ONE_STEP)
    _, batch, lp = rollout(core)
    top = teacher.compute_logprobs(batch, 1.0, top_k=4).top
    zeros = torch.zeros(batch.num_response_tokens)
    digest = core.digest()
    with pytest.raises(InvalidArgument, match="actor.teacher_kl_coef > 0") as err:
        core.update(1, 0, batch, PolicyTargets(zeros, lp.logprobs), 1.0)
    assert err.value.field == "teacher_top_ids" and core.digest() == digest and core.policy_version == 0
    trainer = core.worker.trainer

    def policy_top():  # the policy's logprobs of the sampled tokens, then of the teacher's top 4
        with torch.no_grad():
            packed, _ = trainer.forward(trainer.policy, batch, 1.0, with_entropy=False, also=top.ids)
        return packed

    def kl_now():  # the forward KL over the teacher's 4 tokens and the rest, per token
        return TEACHER_KL.get("forward")(top.logprobs, policy_top()[:, 1:]).mean().item()

    before, seen = kl_now(), []
    for step in range(1, 6):
        old = core.compute_logprobs(batch, 1.0, include_reference=False).logprobs
        result = core.update(step, step - 1, batch, PolicyTargets(zeros, old, teacher_top=top), 1.0)
        # Zero advantages: the loss is the teacher's term alone, weighed by its coefficient.
        assert result.stats["loss"] == pytest.approx(2.0 * result.stats["teacher_kl"], rel=1e-5)
        seen.append(result.stats["teacher_kl"])
    assert seen[-1] < 0.8 * seen[0], seen
    assert kl_now() < 0.7 * before
    # The sampled tokens' logprobs beside the top k are the policy's own.
    torch.testing.assert_close(policy_top()[:, 0], core.compute_logprobs(batch, 1.0, include_reference=False).logprobs,
                               atol=1e-5, rtol=1e-5)


def test_absurd_targets_are_refused_before_the_first_optimizer_step(tiny_model_dir):
    from rolefleet.common.errors import InvalidArgument

    core = make_core(tiny_model_dir)
    _, batch, lp = rollout(core)
    digest = core.digest()
    n = batch.num_response_tokens
    for targets, field in ((PolicyTargets(torch.full((n,), 3e38), lp.logprobs), "advantages"),
                           (PolicyTargets(torch.ones(n), lp.logprobs + 5.0), "old_logprobs"),
                           (PolicyTargets(torch.ones(n), torch.full((n,), -3e38)), "old_logprobs"),
                           (PolicyTargets(torch.ones(n), lp.logprobs, rollout_logprobs=-lp.logprobs),
                            "rollout_logprobs")):
        with pytest.raises(InvalidArgument, match="values must lie in") as err:
            core.update(1, 0, batch, targets, 1.0)
        assert err.value.field == field
    assert core.digest() == digest and core.policy_version == 0 and core.ledger.last_step == 0


def test_non_finite_gradient_changes_nothing(tiny_model_dir):
    core = make_core(tiny_model_dir)
    _, batch, lp = rollout(core)
    digest = core.digest()
    real = core.worker.trainer.policy_loss

    def overflowing(*args, **kwargs):  # a loss that overflows (diverged model, extreme numerics)
        loss, stats = real(*args, **kwargs)
        return loss * float("inf"), stats

    core.worker.trainer.policy_loss = overflowing
    with pytest.raises(FailedPrecondition, match="non-finite gradient"):
        core.update(1, 0, batch, PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs), 1.0)
    assert core.digest() == digest and core.policy_version == 0 and core.ledger.last_step == 0
    core.worker.trainer.policy_loss = real
    # The same step with sane targets is then applied normally.
    core.update(1, 0, batch, PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs), 1.0)
    assert core.policy_version == 1


def test_a_partly_applied_update_blocks_further_updates(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.num_mini_batches=2")
    _, batch, lp = rollout(core)
    real, calls = core.worker.trainer._step, []

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory")
        return real(*args, **kwargs)

    core.worker.trainer._step = failing_second
    targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs)
    with pytest.raises(FailedPrecondition, match="after 1 of 2 optimizer steps"):
        core.update(1, 0, batch, targets, 1.0)
    core.worker.trainer._step = real
    with pytest.raises(FailedPrecondition, match="refuses updates until restarted"):
        core.update(1, 0, batch, targets, 1.0)  # a retry must not apply the first mini-batch twice
    assert core.policy_version == 0
    status = asyncio.run(InProcessActorClient(core).status())
    assert "after 1 of 2 optimizer steps" in status.broken  # visible to operators and the coordinator


def test_a_failure_inside_the_first_optimizer_step_blocks_further_updates(tiny_model_dir):
    core = make_core(tiny_model_dir)
    _, batch, lp = rollout(core)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")  # Adam may have moved some parameters already

    core.worker.trainer.optimizer.step = out_of_memory
    targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs)
    with pytest.raises(FailedPrecondition, match="optimizer step failed midway"):
        core.update(1, 0, batch, targets, 1.0)
    with pytest.raises(FailedPrecondition, match="refuses updates until restarted"):
        core.update(1, 0, batch, targets, 1.0)


def test_a_replayed_step_must_come_from_the_same_policy_version(tiny_model_dir):
    core = make_core(tiny_model_dir)
    _, batch, lp = rollout(core)
    targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs)
    first = core.update(1, 0, batch, targets, 1.0)
    assert core.update(1, 0, batch, targets, 1.0) == first  # a retry
    with pytest.raises(FailedPrecondition, match="already applied to a batch of policy version 0, not 1"):
        core.update(1, 1, batch, targets, 1.0)  # another run reusing step id 1


def test_update_takes_a_batch_within_the_staleness_bound_and_names_the_oldest_version_beyond(tiny_model_dir):
    """Async mode: the batch's oldest sample may lag the actor by pipeline.max_staleness versions."""
    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir}}, ["actor.lr=1e-3"])
    core = ActorCore(cfg.actor, max_staleness=1)
    _, batch, lp = rollout(core)
    targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs)
    core.update(1, 0, batch, targets, 1.0)
    assert core.update(2, 0, batch, targets, 1.0).model_version == 2  # one behind: within the bound
    digest = core.digest()
    with pytest.raises(FailedPrecondition, match="oldest sample is from policy version 0, 2 behind the actor's 2: "
                                                 r"more than pipeline.max_staleness=1"):
        core.update(3, 0, batch, targets, 1.0)
    with pytest.raises(FailedPrecondition, match="claims policy version 3; actor is only at 2"):
        core.update(3, 3, batch, targets, 1.0)
    assert core.digest() == digest and core.ledger.last_step == 2  # refusals changed nothing


def test_an_update_counts_the_graphs_torch_compile_made_since_the_last_one(tiny_model_dir, caplog):
    """Each update's `compiled_graphs` statistic, and the Prometheus counter, say how many graphs
    torch.compile made in the trainer's process since the update before it (the counting itself:
    tests/common/test_profiling.py); one that made some after the first update is logged."""
    from prometheus_client import REGISTRY

    def counted() -> float:
        return REGISTRY.get_sample_value("rolefleet_compiled_graphs_total", {"role": "actor"}) or 0.0

    core = make_core(tiny_model_dir, *ONE_STEP)
    _, batch, lp = rollout(core)
    targets = PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens), lp.logprobs)
    assert core.update(1, 0, batch, targets, 1.0).stats["compiled_graphs"] == 0  # eager
    before = counted()
    core.worker.new_graphs.seen -= 2  # as if a new shape had compiled two graphs since
    with caplog.at_level("INFO", logger="rolefleet.trainer.profiling"):
        assert core.update(2, 1, batch, targets, 1.0).stats["compiled_graphs"] == 2
    assert counted() == before + 2
    assert "made 2 graph(s) in 0.0 s since the last update" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_with_compile_warmup_no_micro_batch_shape_compiles_after_the_start(tiny_model_dir, packed):
    """`actor.compile_warmup`: every shape family a micro-batch takes (padded with padding, one row,
    rows of one length, a single response token; packed) has its graphs before the first step: the
    updates (with the teacher's KL term) and logprob passes of ragged batches compile nothing more."""
    from rolefleet.common.top_k import TopK
    from rolefleet.trainer.profiling import compiled_graphs

    # With the teacher's KL term too: its passes gather k more tokens a position (a k the actor is not told).
    core = make_core(tiny_model_dir, "actor.compile_layers=true", "actor.compile_warmup=true",
                     f"actor.sequence_packing={str(packed).lower()}", "actor.teacher_kl_coef=0.5", "teacher.top_k=5",
                     f"teacher.model_name_or_path={tiny_model_dir}", *ONE_STEP)
    made = compiled_graphs()
    assert made > 0  # the warm-up's
    torch.manual_seed(0)
    for step, shapes in enumerate([[(8, 30), (8, 21), (12, 17)], [(10, 5)], [(3, 1), (3, 1)], [(10, 40)] * 4,
                                   [(7, 64), (2, 2), (9, 3)], [(1, 1)]], start=1):
        batch = SequenceBatch.from_lists([torch.randint(3, 30, (p,)) for p, _ in shapes],
                                         [torch.randint(3, 30, (r,)) for _, r in shapes])
        lp = core.compute_logprobs(batch, 1.0, include_reference=True)
        n = batch.num_response_tokens
        top = TopK(torch.randint(3, 30, (n, 5)), torch.log_softmax(torch.randn(n, 6), -1)[:, :5])
        core.update(step, step - 1, batch, PolicyTargets(torch.randn(n), lp.logprobs, teacher_top=top), 1.0)
        assert compiled_graphs() == made, (step, shapes)
