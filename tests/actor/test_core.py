"""ActorCore driven in-process: rollouts, logprob recomputation, PPO updates, idempotency."""

import time

import pytest
import torch

from rolefleet.actor.core import ActorCore
from rolefleet.actor.types import FinishReason, PolicyTargets, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.errors import FailedPrecondition, InvalidArgument


@pytest.fixture(scope="module")
def core(tiny_model_dir):
    from rolefleet.common.config import parse_config

    # float32 compute on any device: these tests check that both engines give the same numbers (the
    # bf16 drift on CUDA is tests/actor/test_gpu.py's).
    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir}, "actor": {"lr": 1e-2, "compute_dtype": "float32"}})
    return ActorCore(cfg.actor, seed=0)


def rollout(core, n=2, seed=1):
    samples = core.generate(["1+2=", "13+4="], SamplingParams(max_new_tokens=4, n=n, seed=seed))
    return samples, SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])


def test_generate_n_samples_per_prompt_with_logprobs(core):
    samples, _ = rollout(core, n=3)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, i) for p in range(2) for i in range(3)]
    for s in samples:
        assert 1 <= len(s.response_ids) <= 4
        assert s.logprobs.shape == s.response_ids.shape and torch.all(s.logprobs <= 0)
        assert s.policy_version == core.policy_version
        eos = core.tokenizer.eos_token_id
        if s.finish_reason == FinishReason.STOP:
            assert s.response_ids[-1] == eos and eos not in s.response_ids[:-1]
        else:
            assert len(s.response_ids) == 4 and eos not in s.response_ids
        assert s.response_text == core.tokenizer.decode(s.response_ids, skip_special_tokens=True)


def test_seeded_generation_is_reproducible(core):
    a, _ = rollout(core, seed=7)
    b, _ = rollout(core, seed=7)
    assert all(torch.equal(x.response_ids, y.response_ids) for x, y in zip(a, b))


def test_training_engine_recomputes_rollout_logprobs(core):
    samples, batch = rollout(core)
    lp = core.compute_logprobs(batch, temperature=1.0, include_reference=True)
    rollout_lp = torch.cat([s.logprobs for s in samples])
    assert torch.allclose(lp.logprobs, rollout_lp, atol=1e-4)
    assert lp.ref_logprobs is not None and lp.entropy.shape == lp.logprobs.shape


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.3, 5, 0.9)])
def test_rollout_and_training_logprobs_agree_at_any_temperature(core, temperature, top_k, top_p):
    samples = core.generate(["1+2=", "13+4="], SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                                              max_new_tokens=4, n=3, seed=5))
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    train = core.compute_logprobs(batch, temperature=temperature, include_reference=False).logprobs
    assert torch.allclose(train, torch.cat([s.logprobs for s in samples]), atol=1e-4)
    at_one = core.compute_logprobs(batch, temperature=1.0, include_reference=False).logprobs
    assert not torch.allclose(train, at_one)


def test_update_changes_weights_bumps_version_and_is_idempotent(core):
    samples, batch = rollout(core)
    old = core.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    digest, version = core.digest(), core.policy_version
    advantages = torch.linspace(-1, 1, batch.num_response_tokens)
    step = core.ledger.last_step + 1
    targets = PolicyTargets(advantages, old)
    result = core.update(step, version, batch, targets, 1.0)
    assert result.model_version == version + 1 == core.policy_version
    assert core.digest() != digest
    assert {"pg_loss", "pg_clipfrac", "ppo_kl", "grad_norm"} <= set(result.stats)
    assert "entropy" not in result.stats  # a loss term only with actor.entropy_coef > 0
    # The rollout engine shares the module: its next samples carry the new version.
    assert rollout(core)[0][0].policy_version == version + 1
    # A repeat of the applied step replays the result and changes nothing.
    digest_after = core.digest()
    assert core.update(step, version, batch, targets, 1.0) == result
    assert core.digest() == digest_after and core.policy_version == version + 1
    # Only the next step is applied: a jump (e.g. a step id of 2**63 - 1) would make the actor
    # refuse every later step of the run, so it is refused and changes nothing.
    for jump in (step + 2, 2**63 - 1):
        with pytest.raises(FailedPrecondition, match=f"expects step {step + 1} next"):
            core.update(jump, version + 1, batch, targets, 1.0)
    assert core.digest() == digest_after and core.ledger.last_step == step
    assert core.update(step + 1, version + 1, batch, targets, 1.0).model_version == version + 2


def test_stale_policy_version_is_a_failed_precondition(core):
    _, batch = rollout(core)
    old = core.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    digest = core.digest()
    with pytest.raises(FailedPrecondition, match="policy version"):
        core.update(core.ledger.last_step + 1, core.policy_version - 1 if core.policy_version else 99, batch,
                    PolicyTargets(torch.zeros_like(old), old), 1.0)
    assert core.digest() == digest


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda c: c.generate([], SamplingParams()), "prompts"),
        (lambda c: c.generate([""], SamplingParams()), "prompts[0]"),
        (lambda c: c.generate(["1+1="], SamplingParams(temperature=-1)), "sampling.temperature"),
        (lambda c: c.generate(["1+1="], SamplingParams(temperature=0.001)), "sampling.temperature"),
        (lambda c: c.generate(["1+1="], SamplingParams(stop_token_ids=(3, -1))), "sampling.stop_token_ids[1]"),
        (lambda c: c.generate(["1+1="], SamplingParams(stop_token_ids=(c.vocab_size,))), "sampling.stop_token_ids[0]"),
        (lambda c: c.generate(["1+1="], SamplingParams(stop_token_ids=tuple(range(300)))), "sampling.stop_token_ids"),
        (lambda c: c.generate(["1+1="], SamplingParams(top_p=0)), "sampling.top_p"),
        (lambda c: c.generate(["1+1="], SamplingParams(n=0)), "sampling.n"),
        (lambda c: c.generate(["1+1="], SamplingParams(max_new_tokens=125)), "sampling.max_new_tokens"),
        (lambda c: c.generate(["1+1="], SamplingParams(temperature=1e-45)), "sampling.temperature"),
        (lambda c: c.generate(["1+1="], SamplingParams(temperature=float("nan"))), "sampling.temperature"),
        (lambda c: c.generate(["1+1="], SamplingParams(top_p=float("nan"))), "sampling.top_p"),
    ],
)
def test_bad_generate_input_names_the_field(core, call, field):
    with pytest.raises(InvalidArgument) as err:
        call(core)
    assert err.value.field == field


def test_step_ids_start_at_one(core):
    _, batch = rollout(core)
    ones = torch.ones(batch.num_response_tokens)
    with pytest.raises(InvalidArgument) as err:  # 0 is what a client that forgot the field sends
        core.update(0, core.policy_version, batch, PolicyTargets(ones, -ones), 1.0)
    assert err.value.field == "step"


def test_request_limits_are_checked_before_any_work(core):
    from rolefleet.common.errors import LimitExceeded

    started = time.perf_counter()
    with pytest.raises(LimitExceeded, match="actor.max_prompt_bytes=262144") as err:
        core.generate(["1+1=", "7" * 10_000_000], SamplingParams())  # refused before tokenizing 10 MB
    assert err.value.field == "prompts[1]" and time.perf_counter() - started < 1.0
    with pytest.raises(LimitExceeded, match="actor.max_sequences_per_request=65536") as err:
        core.generate(["1+1="] * 2, SamplingParams(n=40_000))
    assert err.value.field == "sampling.n"


def test_positions_and_subnormal_temperatures_are_refused_before_the_model_runs(core):
    digest = core.digest()
    limit = core.max_positions
    long = SequenceBatch.from_lists([torch.full((limit,), 4)], [torch.tensor([5])])
    with pytest.raises(InvalidArgument, match=f"exceeds the model's {limit} positions"):
        core.compute_logprobs(long, 1.0, include_reference=False)
    _, batch = rollout(core)
    ones = torch.ones(batch.num_response_tokens)
    for temperature in (1e-45, float("nan"), float("inf"), -1.0):
        with pytest.raises(InvalidArgument, match="temperature: must be finite and >= 0.01"):
            core.compute_logprobs(batch, temperature, include_reference=False)
        with pytest.raises(InvalidArgument, match="temperature"):
            core.update(core.ledger.last_step + 1, core.policy_version, batch, PolicyTargets(ones, -ones),
                        temperature)
    assert core.digest() == digest


def test_samples_carry_run_unique_group_and_sample_ids(core):
    from rolefleet.actor.types import SAMPLES_PER_GROUP_LIMIT
    from rolefleet.common.errors import InvalidArgument

    samples = core.generate(["1+2=", "13+4="], SamplingParams(max_new_tokens=2, n=3, seed=1), first_group_id=10)
    assert [(s.group_id, s.sample_id) for s in samples] == [
        (10 + p, (10 + p) * SAMPLES_PER_GROUP_LIMIT + i) for p in range(2) for i in range(3)]
    with pytest.raises(InvalidArgument, match="first_group_id"):
        core.generate(["1+2="], SamplingParams(max_new_tokens=2), first_group_id=-1)
    with pytest.raises(InvalidArgument, match="sampling.n"):
        core.generate(["1+2="], SamplingParams(max_new_tokens=2, n=SAMPLES_PER_GROUP_LIMIT))


def test_the_rollout_lock_is_let_go_once_the_engine_has_made_the_last_sample(tiny_model_dir):
    """A streamed request holds the engine between its chunks; once the last chunk is made, a weight
    sync or the next request need not wait for the caller to send it. A request dropped midway
    lets go too."""
    from tests.actor.test_trainer import make_core

    core = make_core(tiny_model_dir, "actor.rollout.batch_size=2")
    lock = core._rollout_lock
    chunks = core.generate_chunks(["1+2=", "13+4="], SamplingParams(max_new_tokens=3, n=2, seed=0))
    assert len(next(chunks)) == 2 and lock.locked()
    assert len(next(chunks)) == 2 and not lock.locked()
    assert next(chunks, None) is None and not lock.locked()
    dropped = core.generate_chunks(["1+2=", "13+4="], SamplingParams(max_new_tokens=3, n=2, seed=0))
    next(dropped)
    assert lock.locked()
    dropped.close()
    assert not lock.locked()
