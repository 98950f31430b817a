"""The teacher role (`teacher/core.py`): the logprobs of the student's sampled tokens under a frozen
model, exactly what the trainers' own pass computes for it; a teacher whose tokenizer is not the
student's refused before it loads, naming the key; bad requests refused without a state change."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import ConfigError, TeacherSection, parse_config
from rolefleet.common.errors import InvalidArgument
from rolefleet.common.modeling import lm_logprobs
from rolefleet.teacher import server
from rolefleet.teacher.client import GrpcTeacherClient
from rolefleet.teacher.core import TeacherCore, TokenizerMismatch
from tests.helpers import serving


def batch_of(vocab: int) -> SequenceBatch:
    torch.manual_seed(0)
    return SequenceBatch.from_lists([torch.randint(3, vocab, (n,)) for n in (4, 9, 2)],
                                    [torch.randint(3, vocab, (n,)) for n in (5, 1, 7)])


@pytest.mark.parametrize("packed", [False, True])
def test_the_teacher_s_logprobs_are_the_model_s_own_over_micro_batches(tiny_model_dir, packed):
    core = TeacherCore(TeacherSection(model_name_or_path=tiny_model_dir, max_tokens_per_micro_batch=12,
                                      sequence_packing=packed), student=tiny_model_dir)
    batch = batch_of(core.vocab_size)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected, _ = lm_logprobs(model, batch, torch.device("cpu"), 0.7, 64, False)
    got = core.compute_logprobs(batch, 0.7)
    torch.testing.assert_close(got.logprobs, expected, atol=1e-5, rtol=1e-5)
    assert got.top is None
    assert not any(p.requires_grad for p in core.model.parameters())  # frozen


@pytest.mark.parametrize("packed", [False, True])
def test_the_teacher_s_top_k_are_the_most_likely_tokens_of_its_full_distribution(tiny_model_dir, packed):
    core = TeacherCore(TeacherSection(model_name_or_path=tiny_model_dir, max_tokens_per_micro_batch=12,
                                      logprob_chunk_tokens=5, sequence_packing=packed), student=tiny_model_dir)
    batch = batch_of(core.vocab_size)
    got = core.compute_logprobs(batch, 0.7, top_k=4)
    # The full distribution at each response position, from the model itself.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    full = []
    with torch.no_grad():
        for prompt, response in zip(batch.prompts(), batch.responses()):
            logits = model(torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1:-1]
            full.append(torch.log_softmax(logits / 0.7, dim=-1))
    full = torch.cat(full)
    expected = full.topk(4, dim=-1)
    assert got.top.ids.dtype == torch.int64 and got.top.ids.shape == (batch.num_response_tokens, 4)
    torch.testing.assert_close(got.top.logprobs, expected.values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.top.logprobs, full.gather(1, got.top.ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logprobs, full.gather(1, batch.response_ids[:, None])[:, 0], atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidArgument, match="top_k"):
        core.compute_logprobs(batch, 0.7, top_k=core.vocab_size + 1)


def test_a_teacher_of_another_tokenizer_is_refused_naming_the_key(tiny_model_dir, chat_model_dir, tmp_path):
    with pytest.raises(TokenizerMismatch, match="teacher.model_name_or_path: the teacher's tokenizer is not the "
                                                "student's"):
        TeacherCore(TeacherSection(model_name_or_path=tiny_model_dir), student=str(chat_model_dir))
    # The same vocabulary with another chat template: refused unless told it is meant.
    other = tmp_path / "templated"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(other)
    with pytest.raises(TokenizerMismatch, match="chat template"):
        TeacherCore(TeacherSection(model_name_or_path=str(other)), student=tiny_model_dir)
    TeacherCore(TeacherSection(model_name_or_path=str(other)), student=tiny_model_dir, check_chat_template=False)


def test_over_grpc_and_bad_requests_change_nothing(tiny_model_dir):
    core = TeacherCore(TeacherSection(model_name_or_path=tiny_model_dir, max_tokens_per_request=40),
                       student=tiny_model_dir)
    batch = batch_of(core.vocab_size)

    async def go():
        async with serving("teacher", lambda s: server.add_to_server(core, s)) as address:
            client = GrpcTeacherClient(address, 30)
            try:
                got = await client.compute_logprobs(batch, 1.0)
                torch.testing.assert_close(got.logprobs, core.compute_logprobs(batch, 1.0).logprobs)
                top, mine = (await client.compute_logprobs(batch, 1.0, top_k=3)).top, core.compute_logprobs(batch, 1.0, 3).top
                assert torch.equal(top.ids, mine.ids) and torch.equal(top.logprobs, mine.logprobs)
                with pytest.raises(InvalidArgument, match="top_k"):
                    await client.compute_logprobs(batch, 1.0, top_k=-1)
                with pytest.raises(InvalidArgument, match="temperature"):
                    await client.compute_logprobs(batch, 0.0)
                too_big = SequenceBatch.from_lists([torch.ones(30, dtype=torch.long)], [torch.ones(20, dtype=torch.long)])
                with pytest.raises(Exception, match="teacher.max_tokens_per_request=40"):
                    await client.compute_logprobs(too_big, 1.0)
                status = await client.status()
                assert status.role == "teacher" and status.requests_served >= 1
            finally:
                await client.close()

    asyncio.run(go())


def test_distillation_config_errors_name_the_key():
    base = {"model": {"model_name_or_path": "m"}}
    with pytest.raises(ConfigError, match="teacher.model_name_or_path: algorithm distill distils from a teacher"):
        parse_config({**base, "algorithm": "distill"})
    with pytest.raises(ConfigError, match="teacher.model_name_or_path: train.distill_coef"):
        parse_config({**base, "algorithm": "grpo", "train": {"samples_per_prompt": 2, "distill_coef": 0.5}})
    with pytest.raises(ConfigError, match="leave train.distill_coef at 0"):
        parse_config({**base, "algorithm": "distill", "teacher": {"model_name_or_path": "t"},
                      "train": {"distill_coef": 0.5}})
    with pytest.raises(ConfigError, match="devices.actor and devices.teacher share GPUs"):
        parse_config({**base, "algorithm": "distill", "teacher": {"model_name_or_path": "t"},
                      "devices": {"actor": [0, 1], "teacher": [1]}})
    with pytest.raises(ConfigError, match="teacher.model_name_or_path: actor.teacher_kl_coef"):
        parse_config({**base, "actor": {"teacher_kl_coef": 1.0}, "teacher": {"top_k": 8}})
    with pytest.raises(ConfigError, match="teacher.top_k: actor.teacher_kl_coef"):
        parse_config({**base, "algorithm": "distill", "teacher": {"model_name_or_path": "t"},
                      "actor": {"teacher_kl_coef": 1.0}})
    with pytest.raises(ConfigError, match="actor.teacher_kl_coef: teacher.top_k=8"):
        parse_config({**base, "algorithm": "distill", "teacher": {"model_name_or_path": "t", "top_k": 8}})
    with pytest.raises(ConfigError, match="teacher.top_k"):
        parse_config({**base, "algorithm": "distill", "teacher": {"model_name_or_path": "t", "top_k": 257},
                      "actor": {"teacher_kl_coef": 1.0}})
    with pytest.raises(ConfigError, match="actor.teacher_kl"):
        parse_config({**base, "actor": {"teacher_kl": "sideways"}})
    topped = parse_config({**base, "algorithm": "grpo", "teacher": {"model_name_or_path": "t", "top_k": 8},
                           "actor": {"teacher_kl_coef": 0.5}, "train": {"samples_per_prompt": 2}})
    assert "teacher" in topped.roles()
    mixed = parse_config({**base, "algorithm": "grpo", "teacher": {"model_name_or_path": "t"},
                          "train": {"samples_per_prompt": 2, "distill_coef": 0.5}})
    assert mixed.roles() == ["actor", "reward", "teacher", "coordinator"]
    assert "teacher" not in parse_config(base).roles()
