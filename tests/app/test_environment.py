"""`rolefleet --version` and `rolefleet env`: the report a bug needs, every key in text and JSON, a
probe that breaks shown as its error, and the rollout engine named by the actor's own decision."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rolefleet
from rolefleet import cli
from rolefleet.actor import rollout
from rolefleet.app import environment, preflight

# The keys every machine reports, in order (a GPU machine adds a `gpu N` row per visible GPU).
KEYS = ["rolefleet", "python", "platform", "torch", "torch cuda build", "cudnn", "transformers", "vllm", "grpcio",
        "protobuf", "pydantic", "accelerate", "peft", "cuda available", "nvidia driver", "nccl",
        "flash sdp (torch)", "flash_attn", "rollout engine (auto)"]


def env_rows(capsys, *flags: str) -> dict[str, str]:
    """`rolefleet env` in this process: exit 0, and its `key: value` lines as a dict."""
    assert cli.main(["env", *flags]) == 0
    out = capsys.readouterr().out
    if "--json" in flags:
        return json.loads(out)
    rows = dict(line.split(": ", 1) for line in out.splitlines())
    return {key.rstrip(): value.strip() for key, value in rows.items()}


def test_version_is_the_packages(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"rolefleet {importlib.metadata.version('rolefleet')}\n"
    assert rolefleet.__version__ == importlib.metadata.version("rolefleet")


def test_env_prints_every_key_aligned(capsys):
    assert cli.main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = [line.split(":", 1)[0] for line in lines]
    assert [k for k in keys if not k.startswith("gpu ")] == KEYS
    assert len({len(line) - len(line.split(":", 1)[1].lstrip()) for line in lines}) == 1, lines  # one column
    rows = env_rows(capsys)
    assert rows["rolefleet"] == f"{rolefleet.__version__} ({Path(rolefleet.__file__).parent})"
    assert rows["python"].startswith(platform.python_version()) and sys.executable in rows["python"]
    assert rows["torch"] == torch.__version__
    assert rows["peft"] == importlib.metadata.version("peft")


def test_json_has_the_same_keys_and_values(capsys):
    assert env_rows(capsys, "--json") == env_rows(capsys)


def test_a_missing_driver_and_a_broken_probe_are_values_not_failures(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py absent: `import pynvml` raises

    def broken():
        raise OSError("no platform here")

    monkeypatch.setattr(platform, "platform", broken)
    rows = env_rows(capsys)
    assert rows["nvidia driver"].startswith("no NVIDIA driver (ModuleNotFoundError: ")
    assert "pynvml" in rows["nvidia driver"]
    assert rows["platform"] == "error: OSError: no platform here"
    assert [k for k in rows if not k.startswith("gpu ")] == KEYS  # the probes after them still ran


def test_the_engine_is_the_actors_own_choice_with_its_reason(capsys, monkeypatch):
    # This CPU machine as it is: the actor's decision on what it has.
    has_gpu, installed = preflight.gpu_count() > 0, rollout.vllm_installed()
    expected = rollout.choose_backend("auto", has_gpu, installed)
    engine = env_rows(capsys)["rollout engine (auto)"]
    assert engine.startswith(f"{expected} (") and engine.endswith(")")
    if expected == "hf":  # and why not vllm, in the actor's own words
        assert rollout.backend_problem("vllm", has_gpu, installed).startswith(engine[len("hf ("):-1])

    monkeypatch.setattr(preflight, "gpu_count", lambda: 0)
    monkeypatch.setattr(rollout, "vllm_installed", lambda: False)
    assert env_rows(capsys)["rollout engine (auto)"] == (
        "hf (vllm is not installed in this environment: install it with `pip install 'rolefleet[vllm]'`)")
    monkeypatch.setattr(rollout, "vllm_installed", lambda: True)
    assert env_rows(capsys)["rollout engine (auto)"] == (
        "hf (vllm needs a CUDA GPU and the actor has none: give it devices.actor)")
    monkeypatch.setattr(preflight, "gpu_count", lambda: 1)
    assert env_rows(capsys)["rollout engine (auto)"] == "vllm (vllm is installed and a CUDA GPU is visible)"


def test_versions_come_from_package_metadata():
    assert environment.package_version("pydantic") == importlib.metadata.version("pydantic")
    assert environment.package_version("no-such-package-rolefleet") == "not installed"


@pytest.mark.parametrize(("version", "text"), [(90100, "9.1.0"), (91002, "9.10.2"), (8902, "8.9.2")])
def test_cudnn_versions_read_as_releases(monkeypatch, version, text):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: version)
    assert environment.cudnn() == text


class Nvml:
    """nvidia-ml-py on a machine of two GPUs and driver 580.159.04."""

    shut_down = False

    def nvmlInit(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return b"580.159.04"  # older nvidia-ml-py releases answer bytes

    def nvmlSystemGetCudaDriverVersion(self):
        return 13000

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlShutdown(self):
        self.shut_down = True


def test_the_driver_through_nvml(monkeypatch):
    nvml = Nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert environment.nvidia_driver() == "580.159.04 (supports CUDA up to 13.0; 2 GPUs on this machine)"
    assert nvml.shut_down


def test_each_visible_gpu_and_whether_flash_kernels_run_on_it(monkeypatch):
    gpus = [SimpleNamespace(name="NVIDIA H200", total_memory=143771 * 2**20, major=9, minor=0),
            SimpleNamespace(name="Tesla T4", total_memory=15 * 2**30, major=7, minor=5)]
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[i])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (gpus[i].major, gpus[i].minor))
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert environment.cuda_devices() == {"cuda available": "yes, 2 GPUs visible (CUDA_VISIBLE_DEVICES='0,1')",
                                          "gpu 0": "NVIDIA H200, 140.4 GiB, sm_90",
                                          "gpu 1": "Tesla T4, 15.0 GiB, sm_75"}
    assert environment.flash_sdp() == "usable (GPU 0 is sm_90)"
    gpus.reverse()
    assert environment.flash_sdp() == "enabled, not usable: GPU 0 is sm_75, the flash kernels need sm_80 or newer"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert environment.cuda_devices() == {"cuda available": "no (CUDA_VISIBLE_DEVICES='0,1')"}
