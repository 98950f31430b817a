import dataclasses

from transformers import AutoConfig, AutoTokenizer

from rolefleet.app import tiny_model
from rolefleet.app.shapes import SHAPES


def test_a_real_shape_is_built_with_its_vocabulary_and_dimensions(tmp_path, monkeypatch):
    """The qwen2-0.5b preset, scaled down to 2 layers of width 64 to stay fast: the tokenizer is
    padded to the full 151,936 entries and the config carries the shape."""
    small = dataclasses.replace(SHAPES["qwen2-0.5b"], hidden=64, intermediate=128, heads=4)
    monkeypatch.setitem(SHAPES, "small-qwen", small)
    out = tiny_model.make_tiny_model(tmp_path / "m", shape="small-qwen", layers=2)
    config = AutoConfig.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert config.vocab_size == len(tokenizer) == 151936
    assert (config.num_hidden_layers, config.num_key_value_heads, config.max_position_embeddings,
            config.attention_bias) == (2, 2, 32768, True)
    assert tokenizer.decode(tokenizer("12+3=")["input_ids"]) == "12+3="


def test_the_real_presets_have_the_published_dimensions():
    q = SHAPES["qwen2-0.5b"]
    assert (q.hidden, q.layers, q.heads, q.kv_heads, q.intermediate, q.vocab) == (896, 24, 14, 2, 4864, 151936)
