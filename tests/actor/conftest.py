"""Fixtures of the actor tests."""

import json
import shutil

import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def two_eos_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a generation config that lists two eos ids, neither the tokenizer's eos:
    the digits 1 and 4, which most of its answers to "7+7=", "9+5=", "13+4=" contain. (dir, ids)"""
    out = tmp_path_factory.mktemp("two-eos") / "model"
    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = [tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("4")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids, "bos_token_id": tok.bos_token_id}))
    return str(out), ids
