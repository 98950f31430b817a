"""Where responses end: every id of the checkpoint's stop set (tokenizer eos, the generation
config's eos_token_id list) and of `sampling.stop_token_ids`, in both hf decoding paths; the stop
token is the response's last token and is trained; greedy sampling."""

import pytest
import torch

from rolefleet.actor.decode import sample_next
from rolefleet.actor.types import FinishReason, PolicyTargets, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.modeling import lm_logprobs
from rolefleet.common.stop_tokens import checkpoint_stop_ids, end_of_turn_id, warn_if_turn_runs_on
from tests.actor.test_trainer import make_core

PROMPTS = ["7+7=", "13+4=", "9+5=", "6+5=", "19+19="]
DECODES = ["loop", "generate"]


def stops_at_first_stop_id(samples, stops: set[int]) -> int:
    """Every response ends at its first stop id, the id included (STOP), or runs to the cap
    without one (LENGTH); returns how many ended at a stop id."""
    ended = 0
    for s in samples:
        ids = s.response_ids.tolist()
        assert not stops & set(ids[:-1]), ids  # nothing generated past a stop id
        assert (s.finish_reason == FinishReason.STOP) == (ids[-1] in stops), (ids, s.finish_reason)
        assert len(s.logprobs) == len(ids)  # the stop token has its recorded logprob
        ended += ids[-1] in stops
    return ended


@pytest.mark.parametrize("decode", DECODES)
def test_a_generation_config_with_two_eos_ids_ends_responses_at_either(two_eos_dir, decode):
    path, ids = two_eos_dir
    core = make_core(path, "actor.compute_dtype=float32", f"actor.rollout.decode={decode}")
    eos = core.tokenizer.eos_token_id
    assert core.stop_ids == tuple(sorted({eos, *ids}))
    samples = core.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=4, seed=2))
    stops_at_first_stop_id(samples, {eos, *ids})
    last = {int(s.response_ids[-1]) for s in samples if s.finish_reason == FinishReason.STOP}
    assert last & set(ids), "no response ended at a generation-config eos id"


@pytest.mark.parametrize("decode", DECODES)
def test_request_stop_token_ids_end_responses_too(tiny_model_dir, decode):
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32", f"actor.rollout.decode={decode}")
    one = core.tokenizer.convert_tokens_to_ids("1")
    plain = core.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=4, seed=2))
    assert any(one in s.response_ids[:-1].tolist() for s in plain)  # without it, 1 is mid-answer
    samples = core.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=4, seed=2, stop_token_ids=(one,)))
    assert stops_at_first_stop_id(samples, {one, core.tokenizer.eos_token_id})
    assert any(int(s.response_ids[-1]) == one for s in samples)


def test_the_stop_token_is_trained(tiny_model_dir):
    """A negative advantage on the stop tokens alone lowers their logprobs: they are in the loss."""
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32")
    # Plain SGD: the step follows the gradient (Adam's first step is a sign step of any size).
    core.worker.trainer.optimizer, core.worker.trainer.scheduler = torch.optim.SGD(core.worker.model.parameters(), lr=1.0), None
    samples = [s for s in core.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=2, seed=4))
               if s.finish_reason == FinishReason.STOP]
    assert samples
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    is_stop = torch.cat([torch.arange(len(s.response_ids)) == len(s.response_ids) - 1 for s in samples])
    before = core.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    core.update(1, 0, batch, PolicyTargets(-is_stop.float(), before), 1.0)
    after = core.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    assert (after[is_stop] - before[is_stop]).mean() < -1e-4


@pytest.mark.parametrize("decode", DECODES)
def test_greedy_takes_the_most_likely_token_and_repeats(tiny_model_dir, decode):
    core = make_core(tiny_model_dir, "actor.compute_dtype=float32", f"actor.rollout.decode={decode}")
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    first = core.generate(PROMPTS, greedy)
    assert [s.response_ids.tolist() for s in first] == [s.response_ids.tolist() for s in core.generate(PROMPTS, greedy)]
    batch = SequenceBatch.from_lists([s.prompt_ids for s in first], [s.response_ids for s in first])
    with torch.no_grad():  # every token the argmax of its position; logprobs at temperature 1
        ids, mask = batch.model_inputs()
        logits = core.worker.engine.model(input_ids=ids.to(core.worker.device), attention_mask=mask.to(core.worker.device)).logits.cpu()
        plain, _ = lm_logprobs(core.worker.engine.model, batch, core.worker.device, 1.0, 64, with_entropy=False)
    rows, cols = batch.response_positions()
    assert torch.equal(logits[rows, cols].float().argmax(-1), batch.response_ids)
    plain = plain.cpu()
    assert torch.allclose(torch.cat([s.logprobs for s in first]), plain, atol=1e-5)


def test_greedy_sampler_is_the_argmax_and_draws_no_random_numbers():
    logits = torch.randn(6, 50)
    state = torch.random.get_rng_state()
    tokens, logprobs = sample_next(logits, 1.0, 0, None, greedy=True)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))


class _Tok:
    """A tokenizer stand-in: what the stop-token helpers read."""

    def __init__(self, eos, template=None, specials=("<s>", "</s>", "<|end|>")):
        self.eos_token_id, self.chat_template, self.all_special_tokens = eos, template, list(specials)
        self.unk_token_id, self.added_tokens_decoder = None, {}
        self._ids = {t: i for i, t in enumerate(specials)}

    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<s>{m['role']}\n{m['content']}<|end|>\n" for m in messages)

    def convert_tokens_to_ids(self, token):
        return self._ids[token]

    def convert_ids_to_tokens(self, token_id):
        return list(self._ids)[token_id]


def test_checkpoint_stop_ids_take_the_tokenizer_eos_and_every_generation_config_id():
    class Gen:
        eos_token_id = [7, 2]

    assert checkpoint_stop_ids(_Tok(2), Gen()) == (2, 7)
    Gen.eos_token_id = 9
    assert checkpoint_stop_ids(_Tok(2), Gen()) == (2, 9)
    assert checkpoint_stop_ids(_Tok(None), None) == ()


def test_the_chat_templates_end_of_turn_is_found_and_a_missing_one_warned_about(caplog):
    tok = _Tok(1, template="(any)")
    assert end_of_turn_id(tok) == 2  # <|end|>, written right after the assistant's message
    assert end_of_turn_id(_Tok(1)) is None  # no template
    with caplog.at_level("WARNING"):
        assert warn_if_turn_runs_on(tok, [1], "m") == 2
    assert "<|end|>" in caplog.text and "sampling.stop_token_ids" in caplog.text
    assert warn_if_turn_runs_on(tok, [1, 2], "m") is None
