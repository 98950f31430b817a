"""RewardCore in-process: weighted sources, per-sample errors with the fallback, the model kind,
and the checks of the sources' config."""

import math
from pathlib import Path

import pytest
import torch

from rolefleet.common import metrics
from rolefleet.common.config import ConfigError, RewardSection, parse_config
from rolefleet.common.errors import InvalidArgument, LimitExceeded
from rolefleet.reward.core import RewardCore
from rolefleet.reward.functions import REWARD_FUNCTIONS
from rolefleet.reward.sources import check_sources
from rolefleet.reward.types import ScoreItem

USER_FILE = Path(__file__).with_name("user_rewards.py")


def errors_counted(source: str) -> float:
    return metrics.REWARD_ERRORS.labels("reward", source)._value.get()


def test_sources_are_combined_by_weight_with_each_sources_scores():
    core = RewardCore(RewardSection(sources=[
        {"name": "exact", "function": "exact_match", "weight": 1.0},
        {"name": "tagged", "function": "regex", "pattern": "^<a>", "weight": 0.5},
        {"name": "long", "function": "length_penalty", "target": 4, "weight": 2.0},
    ]))
    result = core.score([ScoreItem("p", "<a>", "<a>"), ScoreItem("p", "<a>xxxxx", "y"), ScoreItem("p", "no", "y")])
    assert result.sources["exact"].tolist() == [1.0, 0.0, 0.0]
    assert result.sources["tagged"].tolist() == [1.0, 1.0, 0.0]
    assert result.sources["long"].tolist() == [0.0, -1.0, 0.0]  # 8 characters, twice the target
    assert result.total.tolist() == [1.5, 0.5 - 2.0, 0.0]
    assert list(result.sources) == ["exact", "tagged", "long"]  # config order
    assert result.errors == ["", "", ""] and result.failed == 0
    assert result.total.dtype == torch.float32 and core.scored == 3
    core.close()


@pytest.mark.parametrize(
    "returned, shown",
    [(float("nan"), "returned nan, not a finite float32 number"), (float("inf"), "returned inf, not a finite float32 number"),
     (1e39, "returned 1e+39, not a finite float32 number"), ("1.0", "returned '1.0', not a number"),
     (None, "returned None, not a number"), ([1.0], "returned [1.0], not a number")],
)
def test_a_bad_value_costs_only_that_sample_its_score(monkeypatch, returned, shown):
    def flaky(prompt, response, truth, extra):
        return returned if response == "bad" else 2.0

    monkeypatch.setitem(REWARD_FUNCTIONS._items, "flaky", flaky)
    core = RewardCore(RewardSection(sources=[{"function": "flaky", "weight": 0.5}, {"function": "exact_match"}],
                                    fallback_score=-1.0))
    counted = errors_counted("flaky")
    result = core.score([ScoreItem("p", "ok", "ok"), ScoreItem("p", "bad", "bad"), ScoreItem("p", "ok", "x")])
    assert result.errors == ["", f"flaky: {shown}", ""]
    assert result.sources["flaky"][0] == 2.0 and math.isnan(result.sources["flaky"][1])
    assert result.sources["exact_match"].tolist() == [1.0, 1.0, 0.0]  # the other source still scored it
    # The failed source counts the fallback as its score: 0.5 x -1 + 1 x 1.
    assert result.total.tolist() == [2.0, 0.5, 1.0]
    assert errors_counted("flaky") == counted + 1 and core.scored == 3
    assert core.score([ScoreItem("p", "ok", "ok")]).total.tolist() == [2.0]  # still serving


def test_a_function_that_raises_is_that_samples_error(monkeypatch):
    def broken(prompt, response, truth, extra):
        return 1 / 0 if extra.get("divide") else 1.0

    monkeypatch.setitem(REWARD_FUNCTIONS._items, "broken", broken)
    core = RewardCore(RewardSection(function="broken"))
    result = core.score([ScoreItem("p", "r", "g", {"divide": True}), ScoreItem("p", "r", "g")])
    assert result.errors == ["broken: raised ZeroDivisionError: division by zero", ""]
    assert result.total.tolist() == [0.0, 1.0]  # fallback_score 0


def test_a_weighted_total_beyond_float32_is_an_error(monkeypatch):
    monkeypatch.setitem(REWARD_FUNCTIONS._items, "huge", lambda p, r, t, e: 3e38)
    core = RewardCore(RewardSection(sources=[{"function": "huge", "weight": 10.0}], fallback_score=-1.0))
    result = core.score([ScoreItem("p", "r", "g")])
    assert result.total.tolist() == [-1.0] and "total: the weighted sum 3e+39" in result.errors[0]


def test_malformed_and_oversized_requests_are_still_refused():
    core = RewardCore(RewardSection(max_items_per_request=2, max_item_bytes=32))
    with pytest.raises(InvalidArgument, match="items: no items"):
        core.score([])
    with pytest.raises(LimitExceeded, match="reward.max_items_per_request=2"):
        core.score([ScoreItem("p", "r", "g")] * 3)
    with pytest.raises(LimitExceeded) as err:  # extra counts, as JSON
        core.score([ScoreItem("p", "r", "g"), ScoreItem("p", "r", "g", {"notes": "x" * 40})])
    assert err.value.field == "items[1]" and "reward.max_item_bytes=32" in str(err.value)
    assert core.scored == 0


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    from rolefleet.app.tiny_model import make_tiny_reward_model

    return str(make_tiny_reward_model(tmp_path_factory.mktemp("rm")))


def test_a_reward_model_source_combines_with_functions(reward_model):
    from rolefleet.reward.model import RewardModelScorer

    core = RewardCore(RewardSection(sources=[{"kind": "model", "path": reward_model, "weight": 2.0},
                                             {"function": "exact_match"}], model_dtype="float32"))
    items = [ScoreItem("1+1=", "2", "2"), ScoreItem("2+2=", "5", "4"), ScoreItem("", "", "")]
    result = core.score(items)
    expected = RewardModelScorer(reward_model, device=torch.device("cpu")).score(items[:2])
    torch.testing.assert_close(result.sources["model"][:2], expected)
    # Nothing to tokenize fails that sample alone; the batch around it keeps its scores.
    assert math.isnan(result.sources["model"][2]) and result.errors[2].startswith("model: raised InvalidArgument")
    torch.testing.assert_close(result.total[:2], 2 * expected + torch.tensor([1.0, 0.0]))
    assert result.total[2] == 1.0  # fallback 0 for the model, 1 for exact_match
    core.close()


@pytest.mark.procs
def test_user_sources_that_cannot_load_stop_the_start_naming_their_key(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no such helper')\n")
    cfg = RewardSection(user_memory_mb=512, sources=[
        {"function": "exact_match"},
        {"kind": "user", "path": f"{USER_FILE}:nope"},
        {"kind": "user", "path": f"{USER_FILE}:not_callable", "name": "value"},
        {"kind": "user", "path": f"{tmp_path}/missing.py:fn"},
        {"kind": "user", "path": f"{broken}:fn"},
    ])
    with pytest.raises(ConfigError) as err:
        RewardCore(cfg)
    message = str(err.value)
    assert f"reward.sources[1].path: AttributeError: {USER_FILE} defines no 'nope'" in message
    assert f"reward.sources[2].path: TypeError: {USER_FILE}:not_callable is a int, not a function" in message
    assert f"reward.sources[3].path: FileNotFoundError: {tmp_path}/missing.py is not a file" in message
    assert "reward.sources[4].path: ImportError: no such helper" in message


@pytest.mark.procs
def test_a_memory_limit_too_small_for_the_imports_stops_the_start():
    cfg = RewardSection(sources=[{"function": "math"}], user_memory_mb=40)
    # The worker either reports its MemoryError or dies of it first (where the import runs out differs
    # between machines): either way the start stops, naming the sources and the limit.
    with pytest.raises(ConfigError, match=r"reward.sources.*(MemoryError|died).*reward.user_memory_mb=40"):
        RewardCore(cfg)


def test_a_tokenizer_that_does_not_load_stops_the_start():
    cfg = RewardSection(sources=[{"function": "length_penalty", "target": 10, "tokenizer": "/no/such/tokenizer"}])
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].function: length_penalty cannot score an empty "
                                          "sample with its options: raised"):
        RewardCore(cfg)


def test_check_sources_finds_problems_without_running_anything(tmp_path):
    (tmp_path / "ok.py").write_text("import os\n\ndef score(p, r, t, e):\n    os._exit(1)\n\nalias = score\n")
    (tmp_path / "star.py").write_text("from os.path import *\n")
    (tmp_path / "bad.py").write_text("def score(:\n")
    (tmp_path / "pkg").mkdir()
    cfg = parse_config({"model": {"model_name_or_path": "m"}}, [f"reward.sources=[{{function: math}}, "
        f"{{kind: user, path: '{tmp_path}/ok.py:score'}}, {{kind: user, path: '{tmp_path}/ok.py:alias', name: a}}, "
        f"{{kind: user, path: '{tmp_path}/star.py:join'}}, {{kind: user, path: '{tmp_path}/ok.py:other', name: b}}, "
        f"{{kind: user, path: '{tmp_path}/bad.py:score'}}, {{kind: user, path: '{tmp_path}/none.py:f'}}, "
        f"{{kind: user, path: '{tmp_path}/pkg:f'}}, {{kind: user, path: '{USER_FILE}:coroutine'}}, "
        f"{{kind: model, path: '{tmp_path}/rm'}}]"])
    assert check_sources(cfg) == [
        f"reward.sources[4].path: {tmp_path}/ok.py defines no 'other' at its top level",
        f"reward.sources[5].path: {tmp_path}/bad.py is not valid Python (line 1: invalid syntax)",
        f"reward.sources[6].path: {tmp_path}/none.py does not exist",
        f"reward.sources[7].path: {tmp_path}/pkg is a directory",
        f"reward.sources[8].path: {USER_FILE}:coroutine is an async function; reward functions are called as "
        "plain functions",
        f"reward.sources[9].path: model directory {tmp_path}/rm does not exist",
    ]
    assert check_sources(cfg.reward) == check_sources(cfg)  # either the run config or its reward section


def test_every_sources_error_counter_is_exported_at_zero_from_the_start():
    """A healthy run's dashboard shows 0 errors per source, not "no data" (prometheus_client exports
    a labelled series only once its labels were used)."""
    from prometheus_client import REGISTRY

    def exported(source: str) -> float | None:
        return REGISTRY.get_sample_value("rolefleet_reward_errors_total", {"role": "reward", "function": source})

    assert exported("never-made-source") is None
    core = RewardCore(RewardSection(sources=[{"name": "never-made-source", "function": "exact_match"}]))
    assert exported("never-made-source") == 0.0
    core.close()
