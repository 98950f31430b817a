"""The critic core's micro-batches: the same values and the same update as one forward."""

import pytest
import torch

from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.critic.core import CriticCore

BATCH = SequenceBatch.from_lists([torch.tensor([4, 41, 5, 45]), torch.tensor([6, 45]), torch.tensor([7])],
                                 [torch.tensor([9, 2]), torch.tensor([10, 4, 2]), torch.tensor([3])])


def core(model_dir, budget: int, packing: str = "false") -> CriticCore:
    cfg = parse_config({"model": {"model_name_or_path": model_dir}},
                       [f"critic.max_tokens_per_micro_batch={budget}", "critic.compute_dtype=float32",
                        f"critic.sequence_packing={packing}"])
    c = CriticCore(cfg.critic)
    c.worker.trainer.optimizer, c.worker.trainer.scheduler = torch.optim.SGD(c.worker.model.parameters(), lr=1.0), None  # change = gradient
    return c


@pytest.mark.parametrize("budget, packing", [(1, "false"), (11, "true")])
def test_micro_batched_values_and_updates_match_one_batch(tiny_model_dir, budget, packing):
    """One padded batch against one sequence per micro-batch, or two packed into one row."""
    whole, split = core(tiny_model_dir, 100_000), core(tiny_model_dir, budget, packing)
    assert len(BATCH.micro_batches(budget, packed=packing == "true")) == (3 if packing == "false" else 2)
    returns, old = torch.tensor([1.0, 0.5, -1.0, 2.0, 0.0, 3.0]), torch.zeros(6)
    assert torch.allclose(whole.compute_values(BATCH), split.compute_values(BATCH), atol=1e-6)
    a, b = whole.update(1, BATCH, returns, old), split.update(1, BATCH, returns, old)
    assert abs(a.stats["vf_loss"] - b.stats["vf_loss"]) < 1e-6 and abs(a.stats["vf_grad_norm"] - b.stats["vf_grad_norm"]) < 1e-5
    for (name, p), q in zip(whole.worker.model.named_parameters(), split.worker.model.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name
    assert torch.allclose(whole.compute_values(BATCH), split.compute_values(BATCH), atol=1e-5)
