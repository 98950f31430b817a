"""Built-in reward functions: right, wrong and malformed answers, and their options."""

import pytest
import yaml

from rolefleet.common.config import ConfigError, dump_config, parse_config
from rolefleet.reward.functions import REWARD_FUNCTIONS, check_options
from rolefleet.reward.math_answers import extract_answer, gold_answer


def call(name, response, truth="", extra=None, **options):
    return REWARD_FUNCTIONS.get(name)("p", response, truth, extra or {}, **options)


@pytest.mark.parametrize(
    "name, response, truth, expected",
    [
        ("exact_match", "12", "12", 1.0),
        ("exact_match", " 12 ", "12", 1.0),
        ("exact_match", "121", "12", 0.0),
        ("exact_match", "", "12", 0.0),
        ("numeric_match", "it is 12.0!", "12", 1.0),
        ("numeric_match", "no number", "12", 0.0),
        ("numeric_match", "12", "not a number", 0.0),
    ],
)
def test_exact_and_numeric_match(name, response, truth, expected):
    assert call(name, response, truth) == expected


@pytest.mark.parametrize(
    "response, truth",
    [
        # Equal only as mathematics: string or float comparison gets these wrong.
        ("The answer is 0.5", "1/2"),
        ("so x = \\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{1/2}", "\\frac{1}{2}"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{x^2+1}", "1+x^2"),
        # GSM8K: the ground truth is a whole solution ending in #### 42.
        ("\\boxed{42}", "She has 40 + 2 = 42 apples.\n#### 42"),
        ("Adding: 40 + 2 = 42.\n#### 42", "Work...\n#### 42"),
        ("\\boxed{1,000}", "#### 1000"),
        ("first 7, then 12, so 42", "42"),  # the last number
        ("\\boxed{42} is it; 41 was a guess", "42"),  # a box beats a later number
        ("\\boxed{42}\n#### 41", "42"),  # and a later ####
        ("\\boxed{\\boxed{3}+0}", "3"),  # nested braces
        ("the box \\boxed{7} then \\boxed{42}", "\\boxed{42}"),  # the last box
    ],
)
def test_math_right_answers(response, truth):
    assert call("math", response, truth) == 1.0


@pytest.mark.parametrize(
    "response, truth",
    [
        ("\\boxed{41}", "#### 42"),
        ("0.51", "1/2"),
        ("\\boxed{41}\n#### 42", "42"),  # the box wins over ####
        ("I do not know", "42"),  # no answer at all
        ("", "42"),
        ("\\boxed{", "42"),  # a box cut off: no number either
        ("\\boxed{}", "42"),
        ("\\boxed{\\text{banana}}", "42"),
    ],
)
def test_math_wrong_or_missing_answers_score_zero(response, truth):
    assert call("math", response, truth) == 0.0


@pytest.mark.parametrize("truth", ["", "   ", "#### ", "\\boxed{}"])
def test_math_ground_truth_without_an_answer_is_an_error(truth):
    with pytest.raises(ValueError, match="holds no answer"):
        call("math", "\\boxed{1}", truth)


def test_answer_extraction_order():
    assert extract_answer("x \\boxed{1} y #### 2 z 3") == "1"
    assert extract_answer("x #### 2 z 3\nmore 4") == "2 z 3"
    assert extract_answer("1,234 and then -5.5.") == "-5.5"
    assert extract_answer("12,345 apples") == "12345"
    assert extract_answer("nothing") is None
    assert gold_answer("steps\n#### 18") == "18"
    assert gold_answer("\\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert gold_answer(" 7 ") == "7"


def test_regex_and_format():
    assert call("regex", "the answer: 42", pattern=r"answer:\s*\d+") == 1.0
    assert call("regex", "the ANSWER: 42", pattern=r"answer:") == 0.0
    assert call("regex", "the ANSWER: 42", pattern=r"answer:", ignore_case=True) == 1.0
    think = r"<think>.*</think>\s*<answer>.*</answer>"
    assert call("format", "<think>a\nb</think>\n<answer>4</answer>\n", pattern=think) == 1.0
    assert call("format", "<answer>4</answer>", pattern=think) == 0.0
    assert call("format", "<think>a</think><answer>4</answer> and more", pattern=think) == 0.0  # whole response


def test_length_penalty_in_characters_and_tokens(tmp_path):
    assert call("length_penalty", "x" * 10, target=10) == 0.0
    assert call("length_penalty", "x" * 5, target=10) == 0.0
    assert call("length_penalty", "x" * 15, target=10) == -0.5
    assert call("length_penalty", "x" * 30, target=10) == -2.0
    from rolefleet.app.tiny_model import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)  # one token per character
    assert call("length_penalty", "ab" * 10, target=10, tokenizer=str(tmp_path)) == -1.0


def test_options_are_checked_against_the_functions_keyword_parameters():
    assert check_options("format", {"pattern": "a+"}) == {"pattern": "a+"}
    assert check_options("length_penalty", {"target": "12"}) == {"target": 12, "tokenizer": None}
    with pytest.raises(ValueError, match="function format needs the option 'pattern'"):
        check_options("format", {})
    with pytest.raises(ValueError, match=r"function regex has no option 'patern' \(its options: pattern, ignore_case\)"):
        check_options("regex", {"patern": "x"})
    with pytest.raises(ValueError, match="option pattern: not a regular expression"):
        check_options("format", {"pattern": "(unclosed"})
    with pytest.raises(ValueError, match="option target: Input should be greater than or equal to 1"):
        check_options("length_penalty", {"target": 0})
    with pytest.raises(ValueError, match="function exact_match has no option 'pattern'"):
        check_options("exact_match", {"pattern": "x"})


BASE = {"model": {"model_name_or_path": "some/model"}}


def test_sources_in_the_config():
    cfg = parse_config(BASE, ["reward.sources=[{function: math}, {function: format, pattern: 'a.*', weight: 0.2},"
                              " {kind: user, path: 'rewards/mine.py:score', batched: true}, {kind: model, path: rm}]"])
    names = [s.name for s in cfg.reward.sources]
    assert names == ["math", "format", "mine", "model"]  # defaults: function, file stem, "model"
    assert cfg.reward.sources[1].options == {"pattern": "a.*"} and cfg.reward.sources[1].weight == 0.2
    assert cfg.reward.sources[2].user_function() == ("rewards/mine.py", "score")
    # Without sources, `function` is the one source.
    [only] = parse_config(BASE, ["reward.function=numeric_match"]).reward.scoring_sources()
    assert (only.name, only.kind, only.function, only.weight) == ("numeric_match", "function", "numeric_match", 1.0)
    # The config written for role processes reads back the same (options included).
    assert parse_config(yaml.safe_load(dump_config(cfg))).reward == cfg.reward


@pytest.mark.parametrize(
    "override, message",
    [
        ("sources=[{function: math}, {function: math}]", "sources[1] and sources[0] are both named 'math': give one a `name`"),
        ("sources=[{function: fuzzy}]", "reward.sources.0: unknown reward function 'fuzzy'; valid: exact_match, format"),
        ("sources=[{function: format}]", "reward.sources.0: function format needs the option 'pattern'"),
        ("function=format", "reward.function: function format needs the option 'pattern': list it in reward.sources"),
        ("sources=[{kind: user, path: mine.py}]", "path 'mine.py' is not of the form path/to/file.py:function"),
        ("sources=[{kind: user, path: 'mine.py:f', pattern: x}]", "unknown key(s) pattern: options are for built-in"),
        ("sources=[{kind: user, function: math, path: 'a.py:f'}]", "`function` names a built-in (kind function)"),
        ("sources=[{kind: model}]", "a model source needs `path`"),
        ("sources=[{function: math, batched: true}]", "`batched` is for user sources"),
        ("sources=[{kind: plugin}]", "reward.sources.0.kind: Input should be 'function', 'user' or 'model'"),
        ("sources=[{function: math, weight: .inf}]", "reward.sources.0.weight"),
        ("sources=[{function: math, name: 'a/b'}]", "reward.sources.0.name: String should match pattern"),
        ("sources=[{kind: user, path: 'my rewards.py:f'}]", "set `name`: the default 'my rewards' has characters"),
    ],
)
def test_source_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        parse_config(BASE, [f"reward.{override}"])
    assert message in str(err.value)
