"""Choosing the rollout backend, and the errors when `vllm` is asked for where it cannot run."""

import pytest

from rolefleet.actor.rollout import choose_backend
from rolefleet.actor.rollout_vllm import truncation_refused
from rolefleet.actor.types import SamplingParams
from rolefleet.app.preflight import check_rollout_backend
from rolefleet.common.config import ConfigError, parse_config
from rolefleet.common.errors import InvalidArgument
from tests.actor.test_trainer import make_core


@pytest.mark.parametrize("setting, gpu, installed, chosen", [
    ("auto", True, True, "vllm"), ("auto", True, False, "hf"), ("auto", False, True, "hf"),
    ("auto", False, False, "hf"), ("hf", True, True, "hf"), ("vllm", True, True, "vllm"),
])
def test_auto_takes_vllm_only_where_it_can_run(setting, gpu, installed, chosen):
    assert choose_backend(setting, gpu, installed) == chosen


def test_vllm_where_it_cannot_run_names_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"actor\.rollout\.backend: vllm is not installed .*README\.md's GPU install"):
        choose_backend("vllm", True, False)
    with pytest.raises(ValueError, match=r"actor\.rollout\.backend: vllm needs a CUDA GPU"):
        choose_backend("vllm", False, True)


def test_the_actor_refuses_to_start_with_vllm_where_it_is_not_installed(tiny_model_dir, monkeypatch):
    """A clear error, not an ImportError from deep inside (on any machine: a GPU machine with vLLM
    installed is told it is not)."""
    monkeypatch.setattr("rolefleet.actor.worker.vllm_installed", lambda: False)
    with pytest.raises(ValueError, match=r"actor\.rollout\.backend: vllm is not installed"):
        make_core(tiny_model_dir, "actor.rollout.backend=vllm")


def config(tiny_model_dir, *overrides):
    return parse_config({"model": {"model_name_or_path": tiny_model_dir}}, list(overrides))


def test_preflight_reports_vllm_problems(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("rolefleet.actor.rollout.vllm_installed", lambda: False)  # whatever this machine has
    cfg = config(tiny_model_dir, "actor.rollout.backend=vllm")
    [problem] = check_rollout_backend(cfg, ["actor"], "up")
    assert problem.startswith("actor.rollout.backend: vllm")
    assert check_rollout_backend(cfg, ["reward"], "up") == []  # not this process's role
    # vLLM installed and a GPU: truncating sampling cannot keep the logprob convention.
    monkeypatch.setattr("rolefleet.actor.rollout.vllm_installed", lambda: True)
    cfg = config(tiny_model_dir, "sampling.top_p=0.9", "devices.actor=[0]")
    [problem] = check_rollout_backend(cfg, ["actor"], "up")
    assert problem.startswith("sampling.top_p: the vllm rollout backend (auto chose it")
    assert check_rollout_backend(config(tiny_model_dir, "devices.actor=[0]"), ["actor"], "up") == []
    assert check_rollout_backend(config(tiny_model_dir, "sampling.top_p=0.9", "devices.actor=[0]",
                                        "actor.rollout.backend=hf"), ["actor"], "up") == []


def test_truncating_requests_are_refused_by_the_vllm_backend():
    truncation_refused(SamplingParams(temperature=0.7))
    with pytest.raises(InvalidArgument, match="sampling.top_p"):
        truncation_refused(SamplingParams(top_p=0.9))
    with pytest.raises(InvalidArgument, match="sampling.top_k"):
        truncation_refused(SamplingParams(top_k=5))


@pytest.mark.parametrize("old, new", [("rollout_batch_size=8", "actor.rollout.batch_size"),
                                      ("rollout_decode=loop", "actor.rollout.decode"),
                                      ("rollout_cache=static", "actor.rollout.decode")])
def test_moved_keys_name_their_new_place(tiny_model_dir, old, new):
    with pytest.raises(ConfigError, match=new.replace(".", r"\.")):
        config(tiny_model_dir, f"actor.{old}")
