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
