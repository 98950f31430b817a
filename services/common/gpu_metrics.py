"""Per-GPU utilization and memory of a role's group, from NVML, sampled in a background thread into
the `rolefleet_gpu_*` gauges (labels role, group, gpu). On a machine without an NVIDIA driver
nothing is exported: the series are absent, not zero, so dashboards and alerts never read a CPU
role as an idle GPU."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rolefleet.common import metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuRef:
    key: str    # how NVML finds it: an index ("3") or a UUID ("GPU-...")
    label: str  # the `gpu` label: the devices map's entry ("3", "node1:3") where it names one


def visible_gpus(visible: Optional[str], nvml_count: int, devices: list[Any]) -> list[GpuRef]:
    """The GPUs this process was given. NVML ignores CUDA_VISIBLE_DEVICES, so it is applied here;
    unset (compose and Kubernetes hand a container only its GPUs), every GPU NVML sees. Labels come
    from the devices map when it lists one entry per GPU, so `up`, compose and Helm label alike."""
    if visible is None:
        keys = [str(i) for i in range(nvml_count)]
    else:
        keys = [k.strip() for k in visible.split(",") if k.strip()]
    labels = [str(d) for d in devices] if len(devices) == len(keys) else keys
    return [GpuRef(k, label) for k, label in zip(keys, labels)]


class GpuSampler(threading.Thread):
    """Every `period_s`, each visible GPU's utilization and memory into the gauges."""

    def __init__(self, role: str, gpus: list[GpuRef], nvml: Any, period_s: float):
        super().__init__(daemon=True, name=f"{role}-gpu-metrics")
        self.role, self.gpus, self.nvml, self.period_s = role, gpus, nvml, period_s
        self.group = ",".join(g.label for g in gpus)
        self.handles = [self._handle(g.key) for g in gpus]
        self.stopped = threading.Event()

    @classmethod
    def start_for(cls, role: str, devices: list[Any], period_s: float = 5.0, nvml: Any = None) -> Optional[GpuSampler]:
        """A started sampler, or None where there is no NVIDIA driver or no GPU for this role."""
        if nvml is None:
            try:
                import pynvml as nvml  # the NVIDIA driver's library: absent or failing on a machine without one
            except ImportError:
                return None
        try:
            nvml.nvmlInit()
            gpus = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), nvml.nvmlDeviceGetCount(), devices)
            if not gpus:
                return None
            sampler = cls(role, gpus, nvml, period_s)
        except Exception as exc:  # noqa: BLE001 - NVMLError and friends: no driver, no metrics
            log.debug("no GPU metrics for %s: %s", role, exc)
            return None
        sampler.sample()  # series exist from the first scrape
        sampler.start()
        return sampler

    def _handle(self, key: str) -> Any:
        if key.startswith(("GPU-", "MIG-")):
            return self.nvml.nvmlDeviceGetHandleByUUID(key)
        return self.nvml.nvmlDeviceGetHandleByIndex(int(key))

    def run(self) -> None:
        while not self.stopped.wait(self.period_s):
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - a failed sample must not kill the role
                log.warning("GPU metrics sample failed: %s", exc)

    def sample(self) -> None:
        for gpu, handle in zip(self.gpus, self.handles):
            labels = (self.role, self.group, gpu.label)
            metrics.GPU_UTILIZATION.labels(*labels).set(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            metrics.GPU_MEMORY_USED.labels(*labels).set(memory.used)
            metrics.GPU_MEMORY_TOTAL.labels(*labels).set(memory.total)
        fragmentation = _allocator_fragmentation()
        if fragmentation is not None:  # the serving process's own GPU: the first it sees
            metrics.GPU_MEMORY_FRAGMENTATION.labels(self.role, self.group, self.gpus[0].label).set(fragmentation)

    def stop(self) -> None:
        self.stopped.set()


def _allocator_fragmentation() -> Optional[float]:
    """(reserved - allocated) / reserved of PyTorch's caching allocator on this process's GPU;
    None before the role has touched CUDA (the sampler must not initialise it)."""
    if not torch.cuda.is_initialized():
        return None
    reserved = torch.cuda.memory_reserved()
    return (reserved - torch.cuda.memory_allocated()) / reserved if reserved else 0.0
