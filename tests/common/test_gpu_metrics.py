"""The NVML sampler: the GPUs a process was given, their labels from the devices map, the gauges
it sets, and nothing at all where there is no driver (absent, not zero)."""

from types import SimpleNamespace

from prometheus_client import REGISTRY

from rolefleet.common.gpu_metrics import GpuRef, GpuSampler, visible_gpus


def test_visible_gpus_follow_cuda_visible_devices_and_take_labels_from_the_devices_map():
    # `up`: CUDA_VISIBLE_DEVICES names the machine's indices, NVML sees all 8.
    assert visible_gpus("4,5", 8, [4, 5]) == [GpuRef("4", "4"), GpuRef("5", "5")]
    # compose / Kubernetes: the container sees only its GPUs (renumbered from 0), no variable set.
    assert visible_gpus(None, 2, ["node1:6", "node1:7"]) == [GpuRef("0", "node1:6"), GpuRef("1", "node1:7")]
    assert visible_gpus("GPU-aa,GPU-bb", 8, []) == [GpuRef("GPU-aa", "GPU-aa"), GpuRef("GPU-bb", "GPU-bb")]
    assert visible_gpus("", 8, [0]) == []  # told to use no GPU


class FakeNvml:
    def __init__(self, count=8, fail_init=False):
        self.count, self.fail_init = count, fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=10 * handle)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=handle * 2**30, total=141 * 2**30)


def value(name, **labels):
    return REGISTRY.get_sample_value(name, labels)


def test_sampler_sets_each_gpus_gauges_with_role_group_and_gpu_labels(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    sampler = GpuSampler.start_for("critic-test", [6, 7], period_s=60, nvml=FakeNvml())
    try:
        labels = {"role": "critic-test", "group": "6,7"}
        assert value("rolefleet_gpu_utilization_ratio", **labels, gpu="6") == 0.6
        assert value("rolefleet_gpu_utilization_ratio", **labels, gpu="7") == 0.7
        assert value("rolefleet_gpu_memory_used_bytes", **labels, gpu="7") == 7 * 2**30
        assert value("rolefleet_gpu_memory_total_bytes", **labels, gpu="6") == 141 * 2**30
    finally:
        sampler.stop()


def test_no_driver_or_no_gpu_exports_nothing(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert GpuSampler.start_for("reward-test", [], nvml=FakeNvml(fail_init=True)) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert GpuSampler.start_for("reward-test", [], nvml=FakeNvml()) is None
    names = {s.name for m in REGISTRY.collect() for s in m.samples if s.labels.get("role") == "reward-test"}
    assert not any(n.startswith("rolefleet_gpu_") for n in names)
