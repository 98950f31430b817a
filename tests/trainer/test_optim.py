"""The optimizer step of `offload: optimizer`: chunk by chunk, it applies what one step applies."""

import pytest
import torch

from rolefleet.trainer.host_memory import ALIGN, PinnedSlabs
from rolefleet.trainer.optim import HostOptimizerState, _chunks, apply_gradients


def model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)


def train(chunk_bytes=None, steps=3):
    model, optimizer = model_and_optimizer()
    offload = None if chunk_bytes is None else HostOptimizerState(optimizer, chunk_bytes)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        apply_gradients(model, optimizer, 1.0, loss, step=offload and offload.step)
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


@pytest.mark.parametrize("chunk_bytes", [8, 8 * 30, 1 << 30])  # each parameter alone; a few together; all at once
def test_a_chunked_step_applies_what_one_step_applies(chunk_bytes):
    whole, whole_opt = train()
    chunked, chunked_opt = train(chunk_bytes)
    for a, b in zip(whole.parameters(), chunked.parameters()):
        assert torch.equal(a, b)
    # Every parameter took each step once (AdamW's step count is per parameter).
    assert all(float(state["step"]) == 3 for state in chunked_opt.state.values())
    assert len(chunked_opt.state) == len(whole_opt.state) == 6


def test_chunks_are_consecutive_and_bounded():
    params = [torch.empty(n) for n in (3, 4, 10, 1, 1)]
    chunks = _chunks(params, 8)
    assert [[p.numel() for p in c] for c in chunks] == [[3, 4], [10], [1, 1]]
    assert [p for c in chunks for p in c] == params


def test_a_parameter_without_a_gradient_keeps_its_state():
    model, optimizer = model_and_optimizer()
    offload = HostOptimizerState(optimizer, 8)
    model(torch.randn(2, 6)).sum().backward()
    model[2].weight.grad = None  # e.g. a layer this step's loss did not reach
    offload.step()
    assert model[2].weight not in optimizer.state
    assert all(p.grad is None for p in model.parameters())  # applied gradients are freed as the step goes


def test_pinned_slabs_lay_tensors_back_to_back_in_one_power_of_two_size():
    slabs = PinnedSlabs(largest_bytes=3 << 27, pin=False)  # 384 MiB: slabs of 512 MiB
    assert slabs.slab_bytes == 1 << 29
    a = slabs.empty((1 << 26,), torch.float32)  # 256 MiB
    b = slabs.empty((3, 5), torch.float32)
    c = slabs.empty((), torch.float32)  # a step count
    assert slabs.reserved_bytes == 1 << 29  # all three in the first slab (torch's allocator: 3 blocks, 256 MiB + 2 tiny)
    assert b.data_ptr() - a.data_ptr() == 1 << 28 and (c.data_ptr() - b.data_ptr()) % ALIGN == 0
    d = slabs.empty((3 << 25,), torch.float32)  # 384 MiB: past the first slab's end
    assert slabs.reserved_bytes == 2 << 29 and d.shape == (3 << 25,)
    a.fill_(1.0), b.fill_(2.0), c.fill_(3.0), d.fill_(4.0)  # views of their own bytes: none overwrites another
    assert a.min() == 1.0 and b.min() == b.max() == 2.0 and c == 3.0 and d.max() == 4.0
    with pytest.raises(ValueError, match="larger than the slabs"):
        slabs.empty((1 << 28,), torch.float32)

