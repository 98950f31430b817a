import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rolefleet.common.modeling import decoder_layers, disable_dropout


def test_disable_dropout_makes_train_mode_deterministic():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=20, n_positions=8,
                                       resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5))
    ids = torch.arange(8)[None] % 20
    model.train()
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout is on
    disable_dropout(model).train()
    assert torch.equal(model(ids).logits, model(ids).logits)
    assert model.config.attn_pdrop == 0.0


def test_decoder_layers_are_found_after_fsdp_swapped_their_class():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50))
    layers = decoder_layers(model)
    assert len(layers) == 2
    for layer in layers:  # what fully_shard does to a module it shards
        layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    assert decoder_layers(model) == layers


def test_a_metric_entropy_is_computed_once_per_chunk_without_a_graph(monkeypatch):
    """`entropy_grad=False`: the entropy of every chunk, as with a graph, but none in the backward's
    recomputation of the checkpointed chunks, and the gradient of the logprobs unchanged."""
    from rolefleet.common import modeling

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)
    hidden, targets = torch.randn(10, 8), torch.randint(0, 50, (10,))
    calls = []
    real = modeling._entropy
    monkeypatch.setattr(modeling, "_entropy", lambda logits: calls.append(len(logits)) or real(logits))

    def grads(entropy_grad: bool):
        head.zero_grad()
        calls.clear()
        logprobs, entropy = modeling.head_logprobs(hidden, head, targets, 0.7, 4, True, entropy_grad)
        logprobs.sum().backward()
        return entropy, head.weight.grad.clone(), list(calls)

    with_graph, grad_a, calls_a = grads(True)
    metric, grad_b, calls_b = grads(False)
    assert torch.allclose(metric, with_graph.detach()) and not metric.requires_grad
    assert torch.allclose(grad_a, grad_b)
    assert sorted(calls_a) == [2, 2, 4, 4, 4, 4]  # a graph: each chunk's entropy again in the backward
    assert calls_b == [4, 4, 2]           # a metric: once per chunk


@pytest.mark.procs
@pytest.mark.parametrize("with_entropy, entropy_grad", [(True, True), (True, False), (False, True)])
def test_compiled_token_stats_give_the_eager_values_and_gradients(with_entropy, entropy_grad, monkeypatch):
    """`compile_layers`: each chunk's logprobs and entropy through `token_stats` compiled, in the
    checkpointed chunks of a training forward and without a graph: the same numbers and gradients."""
    from rolefleet.common import modeling

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden, targets = torch.randn(10, 8, requires_grad=True), torch.randint(0, 50, (10,))
    made, real = [], modeling.compiled
    monkeypatch.setattr(modeling, "compiled", lambda fn: made.append(fn) or real(fn))

    def run(compile: bool):
        head.zero_grad()
        hidden.grad = None
        logprobs, entropy = modeling.head_logprobs(hidden, head, targets, 0.7, 4, with_entropy, entropy_grad, compile)
        loss = logprobs.sum() + (entropy.sum() if with_entropy and entropy_grad else 0)
        loss.backward()
        with torch.no_grad():
            plain = modeling.head_logprobs(hidden, head, targets, 0.7, 4, True, compile=compile)
        return logprobs.detach(), entropy, head.weight.grad.clone(), hidden.grad.clone(), *plain

    eager_run = run(False)
    assert made == []
    compiled_run = run(True)
    assert set(made) == {modeling.token_stats}  # the compiled path ran, not the eager one again
    for eager, compiled in zip(eager_run, compiled_run):
        if eager is None:
            assert compiled is None
        else:
            torch.testing.assert_close(compiled, eager.detach())


@pytest.mark.procs
def test_a_compiled_function_takes_any_row_count_without_recompiling():
    """`compiled`: the rows of a chunk or a decode batch change from call to call (a ragged last
    chunk, a smaller batch). The first graph is already shape-generic in them, so a new count runs
    it instead of compiling another mid-run; the other dimensions stay specialized. (A single row
    is a shape of its own to dynamo, as everywhere in torch.compile.)"""
    from torch._dynamo.utils import counters

    from rolefleet.common.modeling import compiled

    def stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)

    fn = compiled(stats)
    counters.clear()
    for rows in (8, 5, 13, 2):
        logits, targets = torch.randn(rows, 50), torch.randint(0, 50, (rows,))
        torch.testing.assert_close(fn(logits, targets), stats(logits, targets))
    assert counters["stats"]["unique_graphs"] == 1
    fn(torch.randn(4, 60), torch.randint(0, 60, (4,)))  # a new vocabulary: a graph of its own
    assert counters["stats"]["unique_graphs"] == 2
