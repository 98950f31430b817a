"""`rolefleet --version` and `rolefleet env`: the report a bug needs, every key in text and JSON, a
probe that breaks shown as its error, the rollout engine named by the actor's own decision, whether
vLLM can run, and where the installed versions differ from the tested GPU install's pins."""

from __future__ import annotations

import importlib.metadata
import json
import os
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

# The keys every machine reports, in order (a GPU machine adds a `gpu N` row per visible GPU, and a
# `pin NAME` row follows `tested pins` for each installed package at another version than its pin).
KEYS = ["rolefleet", "python", "platform", "torch", "torch cuda build", "cudnn", "transformers", "tokenizers",
        "safetensors", "triton", "vllm", "grpcio", "protobuf", "pydantic", "accelerate", "peft", "cuda available",
        "nvidia driver", "nccl", "flash sdp (torch)", "flash_attn", "vllm usable", "rollout engine (auto)",
        "tested pins"]


def fixed_keys(rows) -> list[str]:
    return [k for k in rows if not k.startswith(("gpu ", "pin "))]


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
    assert fixed_keys(keys) == KEYS
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

    monkeypatch.setattr(os, "uname", broken)
    rows = env_rows(capsys)
    assert rows["nvidia driver"].startswith("no NVIDIA driver (ModuleNotFoundError: ")
    assert "pynvml" in rows["nvidia driver"]
    assert rows["platform"] == "error: OSError: no platform here"
    assert fixed_keys(rows) == KEYS  # the probes after them still ran


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
        "hf (vllm is not installed in this environment: install it as README.md's GPU install section says)")
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


def test_nccl_is_usable_only_with_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    monkeypatch.setattr(preflight, "gpu_count", lambda: 0)
    assert environment.nccl() == "2.28.9, not usable: no CUDA GPU"
    monkeypatch.setattr(preflight, "gpu_count", lambda: 8)
    assert environment.nccl() == "2.28.9"


# --- whether vLLM can run, from metadata faked as an install would have it ----------------------

VLLM_REQUIRES = ["torch==2.11.0", "fastapi[standard]<0.137.0,>=0.133.0", "nvidia-cutlass-dsl[cu13]==4.6.0",
                 'six>=1.16.0; python_version > "3.9"', 'tensorizer==2.10.1; extra == "tensorizer"']
ROLEFLEET_REQUIRES = ["torch>=2.7", "transformers<6,>=4.56", 'vllm<0.27,>=0.26; extra == "vllm"',
                      'pytest>=8; extra == "dev"']


def fake_install(monkeypatch, versions: dict[str, str], gpus: int = 1):
    """This process sees `versions` installed, vLLM and RoleFleet declaring what their metadata would."""
    monkeypatch.setattr(environment, "installed", versions.get)
    requires = {"vllm": VLLM_REQUIRES, "rolefleet": ROLEFLEET_REQUIRES}
    monkeypatch.setattr(importlib.metadata, "requires", requires.get)
    monkeypatch.setattr(preflight, "gpu_count", lambda: gpus)


def test_declared_requirements_are_a_distributions_own_or_one_extras():
    own = [str(r) for r in environment.declared("rolefleet")]
    assert any(r.startswith("torch") for r in own) and not any(r.startswith(("vllm", "pytest")) for r in own)
    assert [r.name for r in environment.declared("rolefleet", extra="vllm")] == ["vllm"]


def test_vllm_as_the_tested_install_has_it_is_usable(monkeypatch):
    # The tested install leaves vLLM's kernel packages (nvidia-cutlass-dsl) out: not held against it.
    fake_install(monkeypatch, {"vllm": "0.26.0", "torch": "2.11.0+cu130", "fastapi": "0.136.3", "six": "1.17.0"})
    assert environment.vllm_usable() == "0.26.0, usable"


def test_vllm_over_another_torch_or_without_a_gpu_is_not_usable(monkeypatch):
    fake_install(monkeypatch, {"vllm": "0.26.0", "torch": "2.13.0+cpu", "fastapi": "0.136.3"}, gpus=0)
    assert environment.vllm_usable() == ("0.26.0, not usable: it needs torch==2.11.0, this is 2.13.0+cpu; "
                                         "no CUDA GPU")
    fake_install(monkeypatch, {"vllm": "0.26.0", "torch": "2.11.0", "fastapi": "0.136.3"}, gpus=0)
    assert environment.vllm_usable() == "0.26.0, not usable: no CUDA GPU"
    fake_install(monkeypatch, {"torch": "2.11.0"})
    assert environment.vllm_usable() == "not installed (README.md, GPU install)"


def test_vllm_outside_the_extras_range_or_its_own_requirements_is_untested(monkeypatch):
    fake_install(monkeypatch, {"vllm": "0.27.1", "torch": "2.11.0", "fastapi": "0.165.0"})
    assert environment.vllm_usable() == ("0.27.1, usable, untested: outside rolefleet's vllm<0.27,>=0.26; "
                                         "it needs fastapi<0.137.0,>=0.133.0, this is 0.165.0")


# --- the tested GPU install's pins ------------------------------------------------------------------

PINS = """\
# a header
torch==2.11.0
Typing_Extensions==4.16.0
numpy==2.4.6  # why it is not the machine's

vllm==0.26.0
"""


def test_pins_are_read_by_canonical_name_and_must_be_exact(tmp_path):
    assert environment.read_pins(PINS) == {"torch": "2.11.0", "typing-extensions": "4.16.0", "numpy": "2.4.6",
                                           "vllm": "0.26.0"}
    for line in ("torch>=2.11", "torch==2.11.0,<3", "torch"):
        with pytest.raises(ValueError, match="a pin is name==version"):
            environment.read_pins(line)


def test_a_row_per_installed_package_off_its_pin_and_one_for_the_absent(monkeypatch, tmp_path):
    pins = tmp_path / "gpu-h200.txt"
    pins.write_text(PINS)
    # A local version label is the same release (2.11.0+cu130 is PyPI's 2.11.0 as torch reports it).
    monkeypatch.setattr(environment, "installed",
                        {"torch": "2.11.0+cu130", "typing-extensions": "4.16.0", "numpy": "2.5.2"}.get)
    assert environment.pin_differences(pins) == {
        "tested pins": "constraints/gpu-h200.txt: 1 of 4 differ (a row each below); 1 not installed: vllm",
        "pin numpy": "2.5.2 installed, pinned 2.4.6"}
    monkeypatch.setattr(environment, "installed", {"torch": "2.11.0", "typing-extensions": "4.16.0",
                                                   "numpy": "2.4.6", "vllm": "0.26.0"}.get)
    assert environment.pin_differences(pins) == {"tested pins": "constraints/gpu-h200.txt: all 4 installed as pinned"}
    monkeypatch.setattr(environment, "checkout_constraints", lambda: None)
    assert environment.pin_differences() == {
        "tested pins": "not compared: no checkout beside this rolefleet (its constraints/gpu-h200.txt)"}


def test_env_compares_this_checkouts_pins_a_row_per_difference(capsys, monkeypatch):
    path = environment.checkout_constraints()
    assert path == Path(rolefleet.__file__).resolve().parent.parent / "constraints" / "gpu-h200.txt"
    pinned = environment.read_pins(path.read_text())
    monkeypatch.setattr(environment, "installed", {**pinned, "torch": "2.13.0+cpu", "vllm": None}.get)
    rows = env_rows(capsys)
    assert rows["tested pins"] == (f"constraints/gpu-h200.txt: 1 of {len(pinned)} differ (a row each below); "
                                   "1 not installed: vllm")
    differences = [(k, v) for k, v in rows.items() if k.startswith("pin ")]
    assert differences == [("pin torch", "2.13.0+cpu installed, pinned 2.11.0")]
