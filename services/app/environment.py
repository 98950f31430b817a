"""`rolefleet env`: what a bug report needs to say about this machine: RoleFleet
and the stack's versions, the GPUs and their driver, whether NCCL, flash-attention kernels and vLLM
can run here, the rollout engine `actor.rollout.backend: auto` would pick, and where the installed
versions differ from the tested GPU install's pins (constraints/gpu-h200.txt in a checkout).

Each probe is guarded: a piece that is missing or broken is a value of the report (its error), never
a failed command, since a broken install is what the report is for (torch aside: `rolefleet`'s
config imports it, so a torch that cannot import stops every command before this one). Versions come
from package metadata, without importing the package (transformers and vLLM take seconds to import)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

import rolefleet
from rolefleet.actor import rollout
from rolefleet.app import preflight

# A probe answers its key's value, or several rows (`cuda available` and one per visible GPU).
Probe = Callable[[], "str | dict[str, str]"]

PACKAGES = ("transformers", "tokenizers", "safetensors", "triton", "vllm", "grpcio", "protobuf", "pydantic",
            "accelerate", "peft")
GIB = 1024**3
# The pins of the GPU install that ran on the H200 (README.md, "GPU install"), relative to a checkout.
CONSTRAINTS = Path("constraints") / "gpu-h200.txt"


def package_version(name: str) -> str:
    return installed(name) or "not installed"


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def declared(dist: str, extra: str = "") -> list:
    """The requirements `dist`'s metadata declares on this platform: its own, or with `extra` that
    extra's alone."""
    reqs = [Requirement(line) for line in importlib.metadata.requires(dist) or []]
    if not extra:
        return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
    return [r for r in reqs if r.marker is not None and "extra" in str(r.marker) and r.marker.evaluate({"extra": extra})]


def rolefleet_install() -> str:
    return f"{rolefleet.__version__} ({Path(rolefleet.__file__).parent})"


def python() -> str:
    return f"{platform.python_version()} ({sys.executable})"


def os_platform() -> str:
    # Not platform.platform(): on Linux it runs `uname -p` in a subprocess for the processor name.
    u = os.uname()
    return f"{u.sysname}-{u.release}-{u.machine}"


def torch_version() -> str:
    return torch.__version__


def torch_cuda_build() -> str:
    if torch.version.cuda:
        return torch.version.cuda
    return f"none (a ROCm build: HIP {torch.version.hip})" if torch.version.hip else "none (a CPU build)"


def cudnn() -> str:
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None:
        return "not in this torch build"
    # cuDNN 9 numbers its versions major*10000 + minor*100 + patch; cuDNN 8 major*1000 + ...
    major, rest = divmod(version, 10000 if version >= 10000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def visible_devices() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"


def cuda_devices() -> dict[str, str]:
    """`cuda available`, and a row per GPU this process sees: its name, memory and compute capability."""
    if not torch.version.cuda:
        return {"cuda available": "no (torch is not a CUDA build)"}
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return {"cuda available": "no" + visible_devices()}
    count = torch.cuda.device_count()
    rows = {"cuda available": f"yes, {count} GPU{'s' if count != 1 else ''} visible" + visible_devices()}
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        rows[f"gpu {i}"] = f"{p.name}, {p.total_memory / GIB:.1f} GiB, sm_{p.major}{p.minor}"
    return rows


def nvidia_driver() -> str:
    """The driver through NVML (nvidia-ml-py): absent or failing is a machine without the driver."""
    try:
        import pynvml  # per probe: a package absent or broken is this row's value, not a failed report

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, ...
        return f"no NVIDIA driver ({error(exc)})"
    try:
        version, cuda, count = (pynvml.nvmlSystemGetDriverVersion(), pynvml.nvmlSystemGetCudaDriverVersion(),
                                pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
    version = version.decode() if isinstance(version, bytes) else version
    return (f"{version} (supports CUDA up to {cuda // 1000}.{cuda % 1000 // 10}; "
            f"{count} GPU{'s' if count != 1 else ''} on this machine)")


def nccl() -> str:
    if not (dist.is_available() and dist.is_nccl_available()):
        return "not in this torch build"
    version = ".".join(str(part) for part in torch.cuda.nccl.version())
    return version if preflight.gpu_count() > 0 else f"{version}, not usable: no CUDA GPU"


def flash_sdp() -> str:
    """Whether torch's scaled-dot-product attention can take its flash kernel on GPU 0."""
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    if not built:
        return "not in this torch build"
    if not torch.backends.cuda.flash_sdp_enabled():
        return "disabled (torch.backends.cuda.enable_flash_sdp(False))"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "enabled, not usable: no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(0)
    if major < 8:
        return f"enabled, not usable: GPU 0 is sm_{major}{minor}, the flash kernels need sm_80 or newer"
    return f"usable (GPU 0 is sm_{major}{minor})"


def flash_attn() -> str:
    if importlib.util.find_spec("flash_attn") is None:
        return "not installed"
    import flash_attn  # optional: an extension of its own, and importing it loads its CUDA kernels

    return f"{flash_attn.__version__} (imports)"


def vllm_usable() -> str:
    """Whether the installed vLLM can generate here, from metadata (importing it takes seconds): the
    torch release its kernels were built against and a CUDA GPU decide; a release outside RoleFleet's
    `vllm` extra's range, or other requirements it declares at other versions, make it untested.
    Requirements that are absent are not counted: the tested install leaves vLLM's unused kernel
    packages out on purpose (constraints/gpu-h200.txt)."""
    version = installed("vllm")
    if version is None:
        return "not installed (README.md, GPU install)"
    problems, untested = [], []
    for r in declared("vllm"):
        if (have := installed(r.name)) is not None and not r.specifier.contains(have, prereleases=True):
            (problems if r.name == "torch" else untested).append(f"it needs {r.name}{r.specifier}, this is {have}")
    if preflight.gpu_count() == 0:
        problems.append("no CUDA GPU")
    ranges = [r.specifier for r in declared("rolefleet", extra="vllm") if r.name == "vllm"]
    if ranges and not ranges[0].contains(version, prereleases=True):
        untested.insert(0, f"outside rolefleet's vllm{ranges[0]}")
    if problems:
        return f"{version}, not usable: " + "; ".join(problems + untested)
    return f"{version}, usable" + (", untested: " + "; ".join(untested) if untested else "")


def rollout_engine() -> str:
    """What `actor.rollout.backend: auto` picks for an actor of one process that sees this
    process's GPUs: the decision the actor itself makes (`actor/rollout.py`), and why."""
    has_gpu, installed = preflight.gpu_count() > 0, rollout.vllm_installed()
    if rollout.choose_backend("auto", has_gpu, installed) == "vllm":
        return "vllm (vllm is installed and a CUDA GPU is visible)"
    why = rollout.backend_problem("vllm", has_gpu, installed)
    return f"hf ({why.removesuffix(', or set actor.rollout.backend=hf')})"


def checkout_constraints() -> Path | None:
    """The pins file of the checkout this rolefleet runs from; an install from a wheel has none."""
    path = Path(rolefleet.__file__).resolve().parent.parent / CONSTRAINTS
    return path if path.is_file() else None


def read_pins(text: str) -> dict[str, str]:
    """A constraints file's `name==version` lines by canonical name (comments and blank lines skipped)."""
    pins = {}
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            req = Requirement(line)
            specs = list(req.specifier)
            if len(specs) != 1 or specs[0].operator != "==":  # a range would pin nothing
                raise ValueError(f"{line!r}: a pin is name==version")
            pins[canonicalize_name(req.name)] = specs[0].version
    return pins


def pin_differences(path: Path | None = None) -> dict[str, str]:
    """A summary row, then a row per installed package whose version differs from its pin; the pins
    that are not installed share one row (on a CPU machine, vLLM and the CUDA libraries)."""
    path = path or checkout_constraints()
    if path is None:
        return {"tested pins": f"not compared: no checkout beside this rolefleet (its {CONSTRAINTS})"}
    pins = read_pins(path.read_text())
    rows, absent = {}, []
    for name, pinned in pins.items():
        have = installed(name)
        if have is None:
            absent.append(name)
        elif not SpecifierSet(f"=={pinned}").contains(have, prereleases=True):  # 2.11.0+cu130 is 2.11.0
            rows[f"pin {name}"] = f"{have} installed, pinned {pinned}"
    summary = f"{CONSTRAINTS}: " + (f"all {len(pins)} installed as pinned" if not rows and not absent else
                                     f"{len(rows)} of {len(pins)} differ" + (" (a row each below)" if rows else ""))
    if absent:
        summary += f"; {len(absent)} not installed: {', '.join(absent)}"
    return {"tested pins": summary, **rows}


PROBES: tuple[tuple[str, Probe], ...] = (
    ("rolefleet", rolefleet_install),
    ("python", python),
    ("platform", os_platform),
    ("torch", torch_version),
    ("torch cuda build", torch_cuda_build),
    ("cudnn", cudnn),
    *((name, partial(package_version, name)) for name in PACKAGES),
    ("cuda available", cuda_devices),
    ("nvidia driver", nvidia_driver),
    ("nccl", nccl),
    ("flash sdp (torch)", flash_sdp),
    ("flash_attn", flash_attn),
    ("vllm usable", vllm_usable),
    ("rollout engine (auto)", rollout_engine),
    ("tested pins", pin_differences),
)


def error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def report(probes: tuple[tuple[str, Probe], ...] = PROBES) -> dict[str, str]:
    """Every probe's rows, in the probes' order; a probe that raises is its error."""
    rows: dict[str, str] = {}
    for key, probe in probes:
        try:
            value = probe()
        except Exception as exc:  # noqa: BLE001 - a broken piece is what the report is for
            value = f"error: {error(exc)}"
        rows.update(value if isinstance(value, dict) else {key: value})
    return rows


def as_text(rows: dict[str, str]) -> str:
    width = max(len(key) for key in rows) + 1
    return "\n".join(f"{key + ':':<{width}} {value}" for key, value in rows.items())


def as_json(rows: dict[str, str]) -> str:
    return json.dumps(rows, indent=2)
