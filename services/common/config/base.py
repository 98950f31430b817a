"""What every section builds on: ConfigError, the section base class (unknown keys, inf and NaN
refused), Endpoint (the server fields every role shares), and the small helpers and limits that
role code imports with the sections (device entries, the host to dial, the temperature floor).
"""

from __future__ import annotations

import re
import struct
from typing import TYPE_CHECKING, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from rolefleet.algos.registry import Registry


ROLES = ("actor", "reward", "critic", "teacher", "coordinator")
# Logits are divided by the temperature: below this the sampling distribution is one-hot in bf16 and
# fp32 alike, logprob ratios blow up, and a subnormal value would divide by ~0 (NaN logprobs).
MIN_TEMPERATURE = 1e-2
# The same floor as requests carry it (a float32 field): 0.01 arrives as 0.0099999998 and must pass.
MIN_WIRE_TEMPERATURE = struct.unpack("<f", struct.pack("<f", MIN_TEMPERATURE))[0]
_DEVICE = re.compile(r"^(?:(?P<node>[A-Za-z0-9_.-]+):)?(?P<gpu>\d+)$")


class ConfigError(ValueError):
    """A config, override or preflight problem; the CLI prints it and exits with code 2."""


def split_device(entry: Union[int, str]) -> tuple[Optional[str], int]:
    """(node, GPU index) of a validated `devices.*` entry; node is None for a local index."""
    match = _DEVICE.match(str(entry))
    return match.group("node"), int(match.group("gpu"))


def _algos() -> Any:
    """The RL maths' registries (`rolefleet.algos`), imported when a validator first checks a name in
    them: they load torch, which the config module itself, and the commands that import it without
    validating a run's config (`rolefleet status`, `scale`, `certs`, `--help`), do without."""
    import rolefleet.algos

    return rolefleet.algos


def _one_of(registry: Registry, value: str) -> str:
    if value not in registry:
        raise ValueError(f"unknown {registry.kind} {value!r}; valid: {', '.join(registry.names())}")
    return value


def dial_host(host: str) -> str:
    """The host to dial for a server bound to `host` (a wildcard bind is reachable on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


class _Section(BaseModel):
    # inf and NaN are never meaningful settings (an infinite learning rate, a NaN clip range).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Endpoint(_Section):
    host: str = Field("127.0.0.1", description="interface the gRPC server binds")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")
    address: Optional[str] = Field(None, description="host:port clients dial; default host:port")
    num_threads: Optional[int] = Field(None, ge=1, description="torch CPU threads; default torch's on the CPU, "
                                       "1 in a process that drives a GPU")

    def dial_address(self, role: str) -> str:
        if self.address:
            return self.address
        if self.port == 0:
            raise ConfigError(f"set {role}.address (or a fixed {role}.port): the server "
                              "picks its port at start (port 0), so it cannot be dialled from the config")
        return f"{dial_host(self.host)}:{self.port}"
