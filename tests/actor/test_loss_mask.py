"""The loss mask of multi-turn samples: observation tokens are read as context and never trained on.
An update whose targets differ only on masked tokens lands on the same weights (and one that
ignored the mask would not); the mask travels packed on the wire and is checked like the tokens;
advantages, KL and metrics reduce over the model's tokens alone."""

from __future__ import annotations

import pytest
import torch

from rolefleet.actor.core import ActorCore
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import TrainSection
from rolefleet.common.errors import InvalidArgument
from rolefleet.coordinator.targets import step_targets

pytestmark = pytest.mark.multiturn


def multi_turn_batch(actor: ActorCore) -> SequenceBatch:
    """Two 8-token responses whose middle is an 'observation' (3 masked tokens each)."""
    samples = actor.generate(["1+2=", "7+7="], SamplingParams(max_new_tokens=8, seed=3))
    responses = [torch.cat([s.response_ids, torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])])[:8] for s in samples]
    mask = torch.tensor([True, True, False, False, False, True, True, True])
    return SequenceBatch.from_lists([s.prompt_ids for s in samples], responses, [mask, mask.clone()])


def updated_digest(make_config, batch: SequenceBatch, advantages: torch.Tensor) -> str:
    # Two epochs of two mini-batches: after the first step the ratio moves off 1, so any gradient
    # through a masked token would change the later steps too.
    cfg = make_config("actor.ppo_epochs=2", "actor.num_mini_batches=2", "actor.lr=1e-2")
    actor = ActorCore(cfg.actor)
    lp = actor.compute_logprobs(batch, 1.0, include_reference=True)
    actor.update(1, 0, batch, PolicyTargets(advantages, lp.logprobs, lp.ref_logprobs), 1.0)
    return actor.digest()


def test_masked_tokens_get_no_gradient(make_config):
    cfg = make_config()
    batch = multi_turn_batch(ActorCore(cfg.actor))
    own = batch.loss_mask
    base = torch.linspace(-1.0, 1.0, batch.num_response_tokens)
    elsewhere = torch.where(own, base, torch.full_like(base, 50.0))  # differs on masked tokens only
    assert updated_digest(make_config, batch, base) == updated_digest(make_config, batch, elsewhere)
    # The same update with the mask dropped trains on those tokens: the weights differ.
    unmasked = SequenceBatch(batch.prompt_ids, batch.prompt_lengths, batch.response_ids, batch.response_lengths)
    assert updated_digest(make_config, unmasked, base) != updated_digest(make_config, unmasked, elsewhere)


def test_the_mask_travels_packed_and_survives_selection():
    mask = [torch.tensor([True, False, True]), None]
    batch = SequenceBatch.from_lists([torch.tensor([1, 2]), torch.tensor([3])],
                                     [torch.tensor([4, 5, 6]), torch.tensor([7, 8])], mask)
    assert batch.loss_mask.tolist() == [True, False, True, True, True]
    back = SequenceBatch.from_proto(batch.to_proto())
    assert torch.equal(back.loss_mask, batch.loss_mask)
    assert batch.select([1, 0]).loss_mask.tolist() == [True, True, True, False, True]
    assert batch.train_mask().tolist() == [[True, False, True], [True, True, False]]
    # No observation anywhere: no mask at all, so single-turn batches are as they were.
    plain = SequenceBatch.from_lists([torch.tensor([1])], [torch.tensor([2])], [None])
    assert plain.loss_mask is None and plain.to_proto().HasField("loss_mask") is False


@pytest.mark.parametrize("tensor, problem", [
    (torch.tensor([1, 0]), "bool [3]"),                          # one entry short
    (torch.tensor([1, 2, 0]), "0 or 1"),
    (torch.tensor([[1, 0, 1]]), "1 dimension"),
    (torch.tensor([1.0, 0.0, 1.0]), "dtype"),
])
def test_a_bad_mask_is_invalid_argument_naming_it(tensor, problem):
    from rolefleet.common import codec

    msg = SequenceBatch.from_lists([torch.tensor([1])], [torch.tensor([4, 5, 6])]).to_proto()
    msg.loss_mask.CopyFrom(codec.encode(tensor))
    with pytest.raises(InvalidArgument) as e:
        SequenceBatch.from_proto(msg)
    assert "batch.loss_mask" in str(e.value) and problem in str(e.value)


def test_advantages_skip_observations_as_if_the_turns_were_contiguous():
    """GAE over a two-turn response equals GAE over its model tokens alone; observation tokens get
    0 advantage and no KL."""
    train = TrainSection(gamma=0.9, lam=0.8, whiten_advantages=False, norm_adv_by_std=True)
    mask = torch.tensor([True, True, False, False, True])
    multi = SequenceBatch.from_lists([torch.tensor([1])], [torch.tensor([2, 3, 4, 5, 6])], [mask])
    single = SequenceBatch.from_lists([torch.tensor([1])], [torch.tensor([2, 3, 6])])
    values = torch.tensor([0.1, 0.2, 9.0, 9.0, 0.3])
    logprobs, ref = torch.tensor([-1.0, -1.0, -0.1, -0.1, -1.0]), torch.tensor([-1.5, -0.5, -3.0, -3.0, -1.0])
    got = step_targets("gae", multi, torch.tensor([1.0]), values, logprobs, ref, torch.tensor([0]), 0.1, train)
    want = step_targets("gae", single, torch.tensor([1.0]), values[mask], logprobs[mask], ref[mask],
                        torch.tensor([0]), 0.1, train)
    torch.testing.assert_close(got.advantages[mask], want.advantages)
    torch.testing.assert_close(got.returns[mask], want.returns)
    assert got.advantages[~mask].tolist() == [0.0, 0.0] and got.kl[~mask].tolist() == [0.0, 0.0]


def test_single_turn_targets_are_unchanged_by_the_reordering():
    """The estimators see each row's own tokens first; for a single-turn batch that is the identity."""
    train = TrainSection(gamma=1.0, lam=0.95, whiten_advantages=True, norm_adv_by_std=True)
    batch = SequenceBatch.from_lists([torch.tensor([1]), torch.tensor([2])], [torch.tensor([3, 4, 5]), torch.tensor([6])])
    values, lp, ref = torch.randn(4), -torch.rand(4), -torch.rand(4)
    got = step_targets("gae", batch, torch.tensor([1.0, 0.0]), values, lp, ref, torch.tensor([0, 1]), 0.05, train)
    # The reference: the estimator on the padded layout directly.
    from rolefleet.algos import ADVANTAGE_ESTIMATORS
    from rolefleet.algos.functional import masked_whiten
    rewards = batch.pad_responses(-0.05 * (lp - ref))
    rewards[torch.arange(2), batch.response_lengths - 1] += torch.tensor([1.0, 0.0])
    adv, ret = ADVANTAGE_ESTIMATORS.call("gae", token_rewards=rewards, values=batch.pad_responses(values),
                                         mask=batch.response_mask(), group_ids=None, gamma=1.0, lam=0.95,
                                         norm_by_std=True)
    assert torch.equal(got.advantages, batch.pack_responses(masked_whiten(adv, batch.response_mask())))
    assert torch.equal(got.returns, batch.pack_responses(ret))


def test_a_mask_declaring_more_entries_than_tokens_is_refused_before_it_is_decoded():
    from rolefleet.common import codec
    from rolefleet.common.batch import BatchLimits

    msg = SequenceBatch.from_lists([torch.tensor([1])], [torch.tensor([4, 5, 6])]).to_proto()
    msg.loss_mask.CopyFrom(codec.encode(torch.ones(3, dtype=torch.bool)))
    msg.loss_mask.shape[0] = 1 << 40  # the bytes stay 3: only a check of the declared size catches it first
    with pytest.raises(InvalidArgument, match=r"batch.loss_mask.*declares 1099511627776 entries for 3"):
        SequenceBatch.from_proto(msg, limits=BatchLimits("actor", max_sequences=8, max_tokens=64))
