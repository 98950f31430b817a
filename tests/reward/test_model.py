import pytest
import torch

from rolefleet.app.tiny_model import TINY_CHAT_TEMPLATE, make_tiny_reward_model
from rolefleet.common.errors import InvalidArgument
from rolefleet.reward.model import RewardModelScorer
from rolefleet.reward.types import ScoreItem

CPU = torch.device("cpu")


def items(n: int = 12) -> list[ScoreItem]:
    """Prompts and responses of varied lengths, so batches pad and the length sort reorders."""
    return [ScoreItem(f"{i}+{i * 7}=", str(i * 8) * (1 + (i * 5) % 7), "") for i in range(n)]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> str:
    return str(make_tiny_reward_model(tmp_path_factory.mktemp("rm")))


def one_by_one(scorer: RewardModelScorer, batch: list[ScoreItem]) -> torch.Tensor:
    return torch.cat([scorer.score([item]) for item in batch])


def test_batched_scores_equal_one_by_one_in_item_order(rm_dir):
    scorer = RewardModelScorer(rm_dir, device=CPU)
    batch = items()
    scores = scorer.score(batch)
    assert scores.dtype == torch.float32 and scores.shape == (len(batch),)
    assert scores.unique().numel() == len(batch)  # distinct: a mix-up of rows would show
    torch.testing.assert_close(scores, one_by_one(scorer, batch), atol=1e-5, rtol=0)
    # The length sort inside must not leak out: a permuted batch gives the permuted scores.
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(0)).tolist()
    torch.testing.assert_close(scorer.score([batch[i] for i in perm]), scores[perm], atol=1e-5, rtol=0)


def test_small_token_budget_splits_into_several_batches(rm_dir):
    batch = items()
    whole = RewardModelScorer(rm_dir, device=CPU).score(batch)
    scorer = RewardModelScorer(rm_dir, max_tokens_per_batch=40, device=CPU)
    lengths = [len(scorer.encode(item)) for item in batch]
    plan = scorer.plan(lengths)
    assert len(plan) > 2
    assert sorted(i for rows in plan for i in rows) == list(range(len(batch)))
    for rows in plan:  # within the budget, unless a row alone is over it
        assert len(rows) == 1 or len(rows) * max(lengths[i] for i in rows) <= 40
    torch.testing.assert_close(scorer.score(batch), whole, atol=1e-5, rtol=0)
    assert scorer.batches == len(plan)


def test_two_label_model_is_refused_naming_the_path(tmp_path):
    path = str(make_tiny_reward_model(tmp_path / "classifier", num_labels=2))
    with pytest.raises(ValueError, match=f"reward model {path}: .*num_labels=2"):
        RewardModelScorer(path, device=CPU)


def test_checkpoint_without_reward_head_is_refused(tmp_path):
    from transformers import LlamaForCausalLM

    rm = RewardModelScorer(str(make_tiny_reward_model(tmp_path / "rm")), device=CPU)
    config = rm.model.config
    config.architectures = None
    LlamaForCausalLM(config).save_pretrained(tmp_path / "lm")  # num_labels=1 in its config, no head weights
    rm.tokenizer.save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match="lacks weights.*score"):
        RewardModelScorer(str(tmp_path / "lm"), device=CPU)


def test_model_without_pad_token_pads_with_eos_and_reads_the_last_token(tmp_path):
    scorer = RewardModelScorer(str(make_tiny_reward_model(tmp_path / "rm", pad_token=False)), device=CPU)
    assert scorer.tokenizer.pad_token is None and scorer.pad_id == scorer.tokenizer.eos_token_id
    batch = [*items(6), ScoreItem("1+1=", "2</s>", ""), ScoreItem("1+1=", "2", "")]
    scores = scorer.score(batch)
    torch.testing.assert_close(scores, one_by_one(scorer, batch), atol=1e-5, rtol=0)
    # A response that ends with EOS (the pad stand-in) is read at its EOS, not one token early
    # (which would give exactly the score without it: the model is causal).
    assert abs(scores[-2] - scores[-1]) > 1e-4


def test_chat_template_formats_user_and_assistant_turns(tmp_path):
    templated = RewardModelScorer(str(make_tiny_reward_model(tmp_path / "a", chat_template=TINY_CHAT_TEMPLATE)),
                                  device=CPU)
    plain = RewardModelScorer(str(make_tiny_reward_model(tmp_path / "b")), device=CPU)  # same seed: same weights
    batch = items(4)
    formatted = [ScoreItem(f"u:{i.prompt}.a:{i.response}.", "", "") for i in batch]
    torch.testing.assert_close(templated.score(batch), plain.score(formatted), atol=1e-5, rtol=0)


def test_long_input_keeps_first_token_and_tail_and_is_counted(tmp_path):
    scorer = RewardModelScorer(str(make_tiny_reward_model(tmp_path / "rm", positions=16)), device=CPU)
    assert scorer.max_tokens == 16
    long = ScoreItem("b" + "a" * 9, "0123456789", "")  # 20 tokens, one per character
    cut = ScoreItem("b" + "a" * 5, "0123456789", "")  # its first token + its last 15
    scores = scorer.score([long, cut])
    assert scorer.truncated == 1
    torch.testing.assert_close(scores[0], scores[1], atol=1e-5, rtol=0)


def test_empty_sample_is_refused_naming_it(rm_dir):
    scorer = RewardModelScorer(rm_dir, device=CPU)
    with pytest.raises(InvalidArgument, match=r"items\[1\]"):
        scorer.score([ScoreItem("1+1=", "2", ""), ScoreItem("", "", "")])


@pytest.mark.gpu
def test_bf16_on_gpu_is_close_to_fp32(rm_dir):
    batch = items()
    reference = RewardModelScorer(rm_dir, device=CPU).score(batch)
    scores = RewardModelScorer(rm_dir, dtype="bfloat16", device=torch.device("cuda", 0)).score(batch)
    assert scores.device.type == "cpu" and scores.dtype == torch.float32
    torch.testing.assert_close(scores, reference, atol=0.05, rtol=0.05)
