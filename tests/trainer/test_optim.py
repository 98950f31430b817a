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



def test_a_host_resident_module_visits_the_device_and_keeps_its_host_copy():
    from rolefleet.trainer.host_memory import HostResident

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head often is
    model.register_buffer("freq", torch.arange(3.0))
    x = torch.tensor([1, 5, 2])
    before = model(x).detach().clone()
    resident = HostResident(model, pin=False)
    assert resident.host_bytes == 1 << 28  # one slab holds the tied weight once and the buffer
    host_ptrs = [t.data_ptr() for t in (*model.parameters(), *model.buffers())]
    with resident.visit(torch.device("cpu")):
        assert torch.equal(model(x), before)
    # After a visit the module holds its host tensors again (on a GPU the visit's copies are dropped).
    assert [t.data_ptr() for t in (*model.parameters(), *model.buffers())] == host_ptrs
    assert model[1].weight is model[0].weight and torch.equal(model.freq, torch.arange(3.0))


def test_an_offloaded_reference_gives_the_logprobs_of_a_resident_one(tiny_model_dir):
    from rolefleet.actor.core import ActorCore
    from rolefleet.actor.types import SamplingParams
    from rolefleet.common.batch import SequenceBatch
    from rolefleet.common.config import parse_config

    def reference_logprobs(ref_offload):
        cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir},
                            "actor": {"compute_dtype": "float32", "ref_offload": ref_offload}}, [])
        core = ActorCore(cfg.actor)
        samples = core.generate(["1+2=", "3+4="], SamplingParams(max_new_tokens=5, n=2, seed=3))
        batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        return core, core.compute_logprobs(batch, 1.0, include_reference=True).ref_logprobs

    _, resident = reference_logprobs(False)
    core, offloaded = reference_logprobs(True)
    assert torch.equal(offloaded, resident)
    ref = core.worker.trainer.ref_model
    assert all(p.device.type == "cpu" for p in ref.parameters())  # between uses, in host memory
    if torch.cuda.is_available():
        assert all(p.is_pinned() for p in ref.parameters())
