"""`rolefleet import-gguf`: the real test model's GGUF file as a model directory that every role
loads through the one model-loading path, with the chat template's end of turn as its stop token."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rolefleet.cli import main
from rolefleet.common.model_paths import model_problem
from rolefleet.common.modeling import load_causal_lm, load_tokenizer
from rolefleet.common.stop_tokens import checkpoint_stop_ids, end_of_turn_id
from rolefleet.gguf_import import GgufImportError, _settle_end_of_turn, import_gguf, packaged_gguf

pytestmark = pytest.mark.real_model


def test_the_imported_directory_loads_as_a_checkpoint_and_stops_at_the_end_of_a_turn(real_model_dir):
    tokenizer = load_tokenizer(real_model_dir)
    model = load_causal_lm(real_model_dir, torch.device("cpu"))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tokenizer) == im_end
    assert tokenizer.eos_token == "<|im_end|>"
    assert im_end in checkpoint_stop_ids(tokenizer, model.generation_config)
    assert model.config.model_type == "llama" and sum(p.numel() for p in model.parameters()) > 100e6


def test_the_weights_are_the_gguf_files_dequantized(real_model_dir):
    gguf = packaged_gguf()
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    imported = load_causal_lm(real_model_dir, torch.device("cpu"))
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 216, 33, 34, 1232, 216, 35, 37, 47]])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, imported(ids).logits)


def test_a_tokenizer_eos_that_is_not_the_end_of_turn_is_replaced(real_model_dir):
    """transformers 5.17 reads SmolLM2's GGUF tokenizer with eos <|im_start|>: the import settles it."""
    tokenizer = load_tokenizer(real_model_dir)
    model = load_causal_lm(real_model_dir, torch.device("cpu"))
    tokenizer.eos_token = "<|im_start|>"
    notes = _settle_end_of_turn(tokenizer, model)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in notes[0]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in checkpoint_stop_ids(tokenizer, model.generation_config)


def test_bad_input_is_refused_naming_it(tmp_path, real_model_dir, capsys):
    with pytest.raises(GgufImportError, match="does not exist"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GgufImportError, match="cannot read .*junk.gguf as a GGUF"):
        import_gguf(junk, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["import-gguf", str(packaged_gguf()), real_model_dir]) == 2  # a non-empty OUT
    assert "not empty" in capsys.readouterr().err
    assert "rolefleet import-gguf" in model_problem(str(junk))  # given as a model path


def test_the_generation_config_names_every_stop_id(real_model_dir):
    saved = json.loads(open(f"{real_model_dir}/generation_config.json").read())
    ids = saved["eos_token_id"] if isinstance(saved["eos_token_id"], list) else [saved["eos_token_id"]]
    assert 2 in ids  # <|im_end|>: the config's eos and the template's end of turn
