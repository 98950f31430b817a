"""The hf engine's decode loop (engine-owned KV cache, device sampling): the sampler's maths, and
tokens and logprobs that agree with a plain forward over the same sequences."""

import logging

import pytest
import torch
from prometheus_client import REGISTRY

from rolefleet.actor import decode
from rolefleet.actor.decode import UnsupportedModel, sample_next
from rolefleet.actor.types import FinishReason, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.modeling import compiled, lm_logprobs
from tests.actor.test_trainer import make_core

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def draws(top_k: int, top_p: float | None, temperature: float = 1.0, n: int = 20000, sample=sample_next) -> torch.Tensor:
    torch.manual_seed(0)
    tokens, _ = sample(LOGITS.expand(n, -1), temperature, top_k, top_p)
    return torch.bincount(tokens, minlength=LOGITS.shape[1]).float() / n


def test_sampling_follows_the_tempered_softmax():
    freq = draws(0, None, temperature=0.7)
    assert torch.allclose(freq, torch.softmax(LOGITS[0] / 0.7, -1), atol=0.015)


def test_top_k_and_top_p_truncate_and_renormalise():
    assert (draws(2, None)[2:] == 0).all()
    assert torch.allclose(draws(2, None)[:2], torch.softmax(LOGITS[0, :2], -1), atol=0.015)
    probs = torch.softmax(LOGITS[0], -1)  # 0.55, 0.20, 0.12, ...: a 0.7 nucleus is the top two
    nucleus = draws(0, 0.7)
    assert (nucleus[2:] == 0).all() and torch.allclose(nucleus[:2], probs[:2] / probs[:2].sum(), atol=0.015)
    assert (draws(0, 0.01)[1:] == 0).all()  # the top token always stays
    assert (draws(3, 0.99)[3:] == 0).all()  # top-k first, then the nucleus of what is left


def test_recorded_logprob_is_the_untruncated_tempered_one():
    torch.manual_seed(0)
    tokens, logprobs = sample_next(LOGITS.expand(64, -1), 0.5, 2, 0.9)
    expected = torch.log_softmax(LOGITS[0] / 0.5, -1)[tokens]
    assert torch.allclose(logprobs, expected, atol=1e-6)


@pytest.mark.procs
def test_the_compiled_sampler_draws_from_the_same_distribution():
    """`compile_layers`: the decode loop samples through `sample_next` compiled, whose noise comes
    from other kernels; its draws follow the same truncated, tempered softmax and it records the
    same logprobs."""
    probs = torch.softmax(LOGITS[0] / 0.7, -1)
    assert torch.allclose(draws(0, None, 0.7, sample=compiled(sample_next)), probs, atol=0.015)
    truncated = draws(3, 0.7, sample=compiled(sample_next))  # top-3, then a 0.7 nucleus of those: the top two
    top = torch.softmax(LOGITS[0, :2], -1)
    assert (truncated[2:] == 0).all() and torch.allclose(truncated[:2], top, atol=0.015)
    torch.manual_seed(0)
    tokens, logprobs = compiled(sample_next)(LOGITS.expand(64, -1), torch.tensor([0.5]), 2, torch.tensor([0.9]))
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS[0] / 0.5, -1)[tokens], atol=1e-6)


def test_compile_layers_puts_the_compiled_sampler_and_head_maths_in_the_engine_and_trainer(tiny_model_dir):
    """The config's switch reaches both: the decode loop samples through the compiled sampler, and
    the trainer's and the reference's logprob passes compile the LM head's maths."""
    eager = make_core(tiny_model_dir)
    assert eager.worker.engine._loop.sample is sample_next and not eager.worker.trainer.policy.compile_head
    core = make_core(tiny_model_dir, "actor.compile_layers=true", "actor.compile_warmup=false")
    assert core.worker.engine._loop.sample is compiled(sample_next)
    assert core.worker.trainer.policy.compile_head and core.worker.trainer.reference.compile_head


def sequences(samples):
    return SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 0.9)])
def test_decode_logprobs_match_a_plain_forward(tiny_model_dir, top_k, top_p):
    """Prompts of different lengths (left-padded in the cache), some responses stopping early."""
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32")
    assert core.worker.engine._loop is not None
    samples = core.generate(["1+2=", "13+4=", "7+7=", "19+19="],
                            SamplingParams(max_new_tokens=6, n=3, seed=5, temperature=0.8, top_k=top_k, top_p=top_p))
    batch = sequences(samples)
    with torch.no_grad():
        plain, _ = lm_logprobs(core.worker.engine.model, batch, core.worker.device, 0.8, 64, with_entropy=False)
    plain = plain.cpu()  # the engine's device (these tests also run on a GPU)
    assert torch.allclose(torch.cat([s.logprobs for s in samples]), plain, atol=1e-5)
    eos = core.tokenizer.eos_token_id
    for s in samples:  # a stop token ends its response; nothing after it
        assert (s.response_ids[:-1] != eos).all()
        assert (s.finish_reason == FinishReason.STOP) == (int(s.response_ids[-1]) == eos)
    assert any(s.finish_reason == FinishReason.STOP for s in samples)  # the warm-started model answers


def test_same_seed_same_samples_and_batches_draw_independently(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32", "actor.rollout.batch_size=4")
    sampling = SamplingParams(max_new_tokens=5, n=4, seed=3, temperature=2.0)
    first = [s.response_ids.tolist() for s in core.generate(["5+5="] * 2, sampling)]
    again = [s.response_ids.tolist() for s in core.generate(["5+5="] * 2, sampling)]
    assert first == again
    assert first[:4] != first[4:]  # the second forward batch is not the first one's noise again


def test_generate_fallback_gives_the_same_contract(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32", "actor.rollout.decode=generate")
    assert core.worker.engine._loop is None
    samples = core.generate(["1+2=", "13+4="], SamplingParams(max_new_tokens=5, n=2, seed=1, top_k=5))
    with torch.no_grad():
        plain, _ = lm_logprobs(core.worker.engine.model, sequences(samples), core.worker.device, 1.0, 64, with_entropy=False)
    plain = plain.cpu()
    assert torch.allclose(torch.cat([s.logprobs for s in samples]), plain, atol=1e-5)


def test_auto_falls_back_to_generate_for_a_model_the_loop_cannot_serve(tiny_model_dir, caplog, monkeypatch):
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32")

    def unsupported(*args, **kwargs):
        raise UnsupportedModel("LlamaAttention uses attention options the cache attention lacks: ['softcap']")

    monkeypatch.setattr(core.worker.engine._loop, "run", unsupported)
    engine_metric = REGISTRY.get_sample_value
    assert core.status().engine == "hf" and engine_metric("rolefleet_rollout_engine", {"role": "actor", "engine": "hf"}) == 1
    with caplog.at_level(logging.WARNING):
        samples = core.generate(["1+2="], SamplingParams(max_new_tokens=4, n=2, seed=1))
    assert len(samples) == 2 and core.worker.engine._loop is None
    assert "falling back to transformers' generate" in caplog.text and "softcap" in caplog.text
    # The engine that generates now is said: in the role's status (rolefleet status, /v1/roles) and the metric.
    assert core.status().engine == "hf (transformers generate)"
    assert engine_metric("rolefleet_rollout_engine", {"role": "actor", "engine": "hf (transformers generate)"}) == 1
    assert engine_metric("rolefleet_rollout_engine", {"role": "actor", "engine": "hf"}) == 0
    strict = make_core(tiny_model_dir, "actor.compute_dtype=float32", "actor.rollout.decode=loop")
    monkeypatch.setattr(strict.worker.engine._loop, "run", unsupported)
    with pytest.raises(UnsupportedModel):
        strict.generate(["1+2="], SamplingParams(max_new_tokens=4))


def test_sleep_frees_a_cache_over_the_limit_and_the_next_call_rebuilds_it(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32", "actor.rollout.keep_decode_state_mb=0",
                     "actor.rollout.batch_size=2")
    sampling = SamplingParams(max_new_tokens=4, n=2, seed=2)
    loop = core.worker.engine._loop
    built = []
    prepare = loop._prepare
    loop._prepare = lambda *args: built.append(prepare(*args)) or built[-1]
    before = [s.response_ids.tolist() for s in core.generate(["3+4=", "5+6=", "7+1="], sampling)]
    # Three batches of two of one shape: built once, kept for the whole call whatever the budget.
    assert len(built) == 3 and len(set(map(id, built))) == 1
    assert len(loop._states) == 1 and loop.held_bytes() > 0
    core.worker.engine.sleep()
    assert not core.worker.engine._loop._states and core.worker.engine._loop.held_bytes() == 0
    assert [s.response_ids.tolist() for s in core.generate(["3+4=", "5+6=", "7+1="], sampling)] == before


def test_small_caches_stay_through_sleep_one_per_shape_and_decode_with_the_new_weights(tiny_model_dir):
    """Kept state (and on a GPU its captured graph) reads the engine's parameters, which the weight
    sync refreshes in place: after new weights, it samples exactly what a freshly built loop does.
    A training batch and an evaluation batch (greedy, another size) each keep their own."""
    kept = make_core(tiny_model_dir, "actor.compute_dtype=float32")
    fresh = make_core(tiny_model_dir, "actor.compute_dtype=float32", "actor.rollout.keep_decode_state_mb=0")
    train = SamplingParams(max_new_tokens=6, n=4, seed=7, temperature=1.5)
    evaluate = SamplingParams(max_new_tokens=6, n=1, temperature=0.0)
    prompts = ["3+4=", "12+9="]

    def both(core):
        return ([s.response_ids.tolist() for s in core.generate(prompts, train)],
                [s.response_ids.tolist() for s in core.generate(prompts * 3, evaluate)])

    assert both(kept) == both(fresh)
    states = dict(kept.worker.engine._loop._states)
    assert len(states) == 2
    for core in (kept, fresh):
        core.worker.engine.sleep()
        torch.manual_seed(0)
        core.worker.engine.load_weights((name, p + 0.05 * torch.randn_like(p)) for name, p in core.worker.engine.model.named_parameters())
    assert kept.worker.engine._loop._states == states and not fresh.worker.engine._loop._states
    assert both(kept) == both(fresh)
    # Nothing was built again: the same buffers for each shape.
    assert all(kept.worker.engine._loop._states[shape] is buf for shape, buf in states.items())


def test_the_least_recently_used_shape_goes_first_when_over_the_budget(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32")
    loop = core.worker.engine._loop
    for prompts in (["3+4="] * 8, ["3+4="] * 12, ["3+4="] * 16):  # three row buckets: three shapes
        core.generate(prompts, SamplingParams(max_new_tokens=4, seed=1))
    first, second, third = loop._states
    loop._states.move_to_end(first)  # used again most recently
    loop.trim(loop.held_bytes() - 1)
    assert list(loop._states) == [third, first]
    loop.trim(0)
    assert not loop._states


def test_trim_to_nothing_drops_every_shape_whatever_their_accounting(tiny_model_dir):
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32")
    loop = core.worker.engine._loop
    for prompts in (["3+4="], ["3+4="] * 2):
        core.generate(prompts, SamplingParams(max_new_tokens=4, seed=1))
    next(iter(loop._states.values())).graph_pool_bytes = -(2**40)  # a pool measured wrong, as once on CUDA
    loop.trim(0)
    assert not loop._states


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_many_batch_shapes_keep_at_most_the_budget_and_trimming_frees_their_memory(tiny_model_dir):
    """An agent's endpoint calls come in every batch size: each new shape captures a graph (whose
    pool is measured after the capture's own emptying of the cache), and the kept shapes stay within
    `keep_decode_state_mb`; trimmed, their memory is free again."""
    core = make_core(tiny_model_dir, "actor.rollout.keep_decode_state_mb=1")
    loop = core.worker.engine._loop

    def allocated_after_trimming() -> int:
        loop.trim(0)
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    # After one shape: what a first capture leaves for good (the model's own lazily made buffers).
    core.generate(["3+4="] * 2, SamplingParams(max_new_tokens=8, seed=0))
    before = allocated_after_trimming()
    for rows in (1, 7, 30, 3, 64, 17, 5, 40):
        core.generate(["3+4="] * rows, SamplingParams(max_new_tokens=8, seed=rows))
        assert all(buf.graph_pool_bytes >= 0 for buf in loop._states.values())
        assert len(loop._states) <= 2  # the newest, and older ones only within the budget
    assert allocated_after_trimming() - before < 8 * 2**20


@pytest.mark.parametrize("layer_types", [["full_attention", "conv"], ["full_attention", "linear_attention"]])
def test_layers_the_cache_does_not_serve_are_refused_not_sampled_wrong(tiny_model_dir, layer_types):
    """A hybrid model's convolution or linear-attention layers would decode without their state:
    the loop says it cannot serve the model (`auto` then falls back to generate, see above)."""
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32", "actor.rollout.decode=loop")
    core.worker.engine.model.config.layer_types = layer_types
    with pytest.raises(UnsupportedModel, match="layer types"):
        core.generate(["1+2="], SamplingParams(max_new_tokens=3, n=2, seed=1))


def test_a_layer_that_bypasses_the_cache_is_detected(tiny_model_dir, monkeypatch):
    from rolefleet.actor import decode

    core = make_core(tiny_model_dir, "actor.compute_dtype=float32", "actor.rollout.decode=loop")
    real = decode.KVCache.write

    def skip_layer_one(self, layer, key, value):  # as if layer 1 kept its own state
        out = real(self, layer, key, value)
        self.keys.pop(1, None)
        return out

    monkeypatch.setattr(decode.KVCache, "write", skip_layer_one)
    with pytest.raises(UnsupportedModel, match="layers used the engine's cache"):
        core.generate(["1+2="], SamplingParams(max_new_tokens=3))


# Eight prompts x 4 samples = 32 rows; greedy, the last-but-one prompt's rows run to the cap while
# the others stop within 3 tokens: the loop goes on with 16 rows, then 8 (COMPACT_FLOOR).
RAGGED = ["3+4=", "12+9=", "7+7=", "19+19=", "5+", "=", "1", "+=+"]


@pytest.fixture
def check_every_step(monkeypatch):
    """The finished flags looked at every step on a GPU too (as on the CPU), so the batches the
    rows move through are the same on both."""
    monkeypatch.setattr(decode, "CHECK_EVERY", 1)


def test_compaction_moves_the_rows_still_decoding_and_samples_what_the_full_batch_does(tiny_model_dir,
                                                                                     check_every_step):
    compact = make_core(tiny_model_dir, "actor.compute_dtype=float32")
    full = make_core(tiny_model_dir, "actor.compute_dtype=float32", "actor.rollout.compact=false")
    greedy = SamplingParams(max_new_tokens=24, n=4, temperature=0.0)
    moved, kept = compact.generate(RAGGED, greedy), full.generate(RAGGED, greedy)
    (root,) = compact.worker.engine._loop._states.values()
    assert sorted(root.compacted) == [8, 16]
    assert not next(iter(full.worker.engine._loop._states.values())).compacted
    lengths = [len(s.response_ids) for s in moved]
    assert max(lengths) == 24 and sorted(lengths)[-5] <= 3  # a long tail of four rows
    # Greedy: the same tokens whichever batch each row decoded in, and the same logprobs.
    assert [s.response_ids.tolist() for s in moved] == [s.response_ids.tolist() for s in kept]
    assert [s.finish_reason for s in moved] == [s.finish_reason for s in kept]
    assert torch.allclose(torch.cat([s.logprobs for s in moved]), torch.cat([s.logprobs for s in kept]), atol=1e-5)
    # The smaller batches' buffers are counted with the batch they came from, not their cache again.
    child = root.compacted[16]
    assert child.shares_cache and child.cache.keys[0].data_ptr() == root.cache.keys[0].data_ptr()
    assert root.held_bytes() == (sum(t.numel() * t.element_size() for t in
                                     [*root.cache.keys.values(), *root.cache.values.values(),
                                      root.out_tokens, root.out_logprobs])
                                 + root.graph_pool_bytes + sum(c.held_bytes() for c in root.compacted.values()))


def test_sampled_rows_after_compaction_keep_logprobs_of_a_plain_forward_and_seeds_repeat(tiny_model_dir,
                                                                                        check_every_step):
    """Sampling at temperature 1 (rows of one prompt end at different steps); the second call
    reuses the smaller batches the first one built (on a GPU, their captured graphs)."""
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32")
    sampling = SamplingParams(max_new_tokens=24, n=4, seed=11, temperature=1.0)
    first = core.generate(RAGGED, sampling)
    (root,) = core.worker.engine._loop._states.values()
    assert root.compacted
    with torch.no_grad():
        plain, _ = lm_logprobs(core.worker.engine.model, sequences(first), core.worker.device, 1.0, 64,
                               with_entropy=False)
    assert torch.allclose(torch.cat([s.logprobs for s in first]), plain.cpu(), atol=1e-5)
    eos = core.tokenizer.eos_token_id
    for s in first:
        assert (s.response_ids[:-1] != eos).all()
        assert (s.finish_reason == FinishReason.STOP) == (int(s.response_ids[-1]) == eos)
    built = dict(root.compacted)
    again = core.generate(RAGGED, sampling)
    assert [s.response_ids.tolist() for s in again] == [s.response_ids.tolist() for s in first]
    assert all(root.compacted[rows] is buf for rows, buf in built.items())
    fresh = make_core(tiny_model_dir, "actor.compute_dtype=float32")
    assert [s.response_ids.tolist() for s in fresh.generate(RAGGED, sampling)] == [s.response_ids.tolist() for s in first]


def test_row_buckets_are_powers_of_two_and_half_again():
    assert [decode.bucket_rows(n) for n in (1, 8, 9, 13, 17, 25, 100, 129, 200, 256, 257)] == \
        [8, 8, 12, 16, 24, 32, 128, 192, 256, 256, 384]
    assert all(n <= decode.bucket_rows(n) < 1.5 * n for n in range(9, 2000))


def test_calls_of_nearby_sizes_share_one_shape_and_fillers_change_no_sequence(tiny_model_dir):
    """An agent's endpoint calls come in every size: 10 and 11 sequences decode as one 12-row shape
    whose fillers are never returned, and each sequence decodes as it does in a full batch."""
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32")
    loop = core.worker.engine._loop
    prompts = [f"{a}+{b}=" for a, b in zip(range(1, 13), range(7, 19))]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    full = [s.response_ids.tolist() for s in core.generate(prompts, greedy)]  # 12: no fillers
    ten = core.generate(prompts[:10], greedy)
    eleven = core.generate(prompts[:11], greedy)
    assert len(loop._states) == 1 and loop.built == 1
    assert (len(ten), len(eleven)) == (10, 11)
    assert [s.response_ids.tolist() for s in ten] == full[:10]
    assert [s.response_ids.tolist() for s in eleven] == full[:11]
    with torch.no_grad():
        plain, _ = lm_logprobs(core.worker.engine.model, sequences(ten), core.worker.device, 1.0, 64,
                               with_entropy=False)
    assert torch.allclose(torch.cat([s.logprobs for s in ten]), plain.cpu(), atol=1e-5)
