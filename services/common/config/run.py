"""The run-wide sections: the run itself (name, seed, restarts, resume), security (token, TLS,
per-client limits), checkpoints and experiment tracking.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from rolefleet.common.config.base import _Section
from rolefleet.common.config.paths import ExpandedPath


class RunSection(_Section):
    name: str = Field("rolefleet", pattern=r"^[A-Za-z0-9_.-]+$", description="run name (letters, digits, _.-); "
                      "the default output directory is runs/<name>")
    output_dir: Optional[ExpandedPath] = Field(None, description="default runs/<name>")
    seed: int = Field(0, description="seeds model initialisation order, prompt shuffling and sampling")
    max_restarts: int = Field(3, ge=0, description="`rolefleet up` restarts a role process that dies up to this "
                              "many times (the coordinator with run.resume=true), and the coordinator recovers "
                              "from a lost role as often: it reloads the newest checkpoint into every trainer "
                              "role and goes on from there; 0: a lost role ends the run")
    startup_timeout_s: Optional[float] = Field(None, gt=0, description="seconds `rolefleet up` gives each role "
                                               "to load its models and serve; default 300 plus 5 a GB of the "
                                               "weights the role loads (bf16): about 5 minutes for a 135M model, "
                                               "half an hour for a 70B policy and its reference")
    call_trace: bool = Field(False, description="write every role call the coordinator makes, with its start and "
                             "end, to <output_dir>/calls.trace.json (Chrome trace event format: open it in "
                             "Perfetto or chrome://tracing) to see which role waits for which")
    resume: bool = Field(False, description="continue from the newest complete checkpoint of this run "
                         "(checkpoint.dir): roles load it, the data order, RNG streams, policy version and "
                         "KL controller carry on; no checkpoint yet: start from step 1")

    @property
    def out(self) -> Path:
        return Path(self.output_dir or f"runs/{self.name}")


class TlsSection(_Section):
    """TLS of every gRPC channel and of the HTTP control plane (docs/security.md). `{role}` in a path
    is replaced by the process's role (actor, reward, critic, coordinator; `client` for `rolefleet up`
    and the CLI), so each role presents its own certificate from `rolefleet certs`."""

    cert_file: Optional[ExpandedPath] = Field(None, description="PEM certificate this process presents (as a "
                                              "server, and as a client under mutual TLS); set: TLS on")
    key_file: Optional[ExpandedPath] = Field(None, description="PEM private key of cert_file")
    ca_file: Optional[ExpandedPath] = Field(None, description="PEM CA certificate(s) that clients verify servers "
                                            "with (and servers verify clients with, under mutual TLS); unset: the "
                                            "system's roots")
    mutual: bool = Field(False, description="mutual TLS: servers refuse a client without a certificate signed by "
                         "ca_file")
    server_name: Optional[str] = Field(None, description="name clients check in server certificates instead of the "
                                       "host they dial (dialling by an IP address the certificates do not name)")

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    @model_validator(mode="after")
    def _complete(self) -> TlsSection:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("security.tls.cert_file and security.tls.key_file are set together")
        if self.mutual and not (self.enabled and self.ca_file):
            raise ValueError("security.tls.mutual needs security.tls.cert_file, key_file and ca_file")
        if not self.enabled and self.ca_file is not None:
            raise ValueError("security.tls.ca_file is set but TLS is off: set security.tls.cert_file and key_file")
        return self

    def paths(self, role: str) -> dict[str, Optional[str]]:
        """The files of `role` (placeholders filled), by key."""
        return {key: value.replace("{role}", role) if value else None
                for key, value in (("cert_file", self.cert_file), ("key_file", self.key_file),
                                   ("ca_file", self.ca_file))}


class SecuritySection(_Section):
    """Authentication, transport security and per-client limits of the role servers (docs/security.md)."""

    token_file: Optional[ExpandedPath] = Field(None, description="file whose first line is the run's shared token; "
                                               "every role server then refuses gRPC calls without it (health checks "
                                               "excepted), and so does the HTTP control plane (/healthz excepted)")
    token_env: Optional[str] = Field("ROLEFLEET_TOKEN", description="environment variable holding the token "
                                     "when no token_file is given; with neither, `rolefleet up` makes a token for the "
                                     "run and a server bound beyond loopback refuses to start")
    tls: TlsSection = Field(default_factory=TlsSection)
    allow_unauthenticated: bool = Field(False, description="let a role server bound beyond loopback start "
                                        "without a token or mutual TLS, and `rolefleet up` run without making "
                                        "a token: for a network that only trusted callers reach")
    max_calls_per_client: int = Field(128, ge=1, description="calls one client host may have in flight at a role "
                                      "server; more are refused with RESOURCE_EXHAUSTED (health checks excepted)")
    max_message_mb: int = Field(512, ge=1, le=2047, description="largest gRPC message a role server accepts or "
                                "sends, in MiB; a larger one is refused with RESOURCE_EXHAUSTED (one step's "
                                "batch must fit)")


class SnapshotSection(_Section):
    """Per-step snapshots of the trainers, what a lost trainer resumes from (docs/checkpoints.md,
    "Snapshots")."""

    enabled: bool = Field(True, description="after every step, the trainers' state (weights, optimizer, scheduler, "
                          "RNG, ledger) and the coordinator's to snapshot.dir, so that a lost actor or critic costs "
                          "at most the step in flight; the previous snapshot stays until the new one is complete")
    dir: Optional[ExpandedPath] = Field(None, description="default /dev/shm/rolefleet/<run.name>-<a hash of "
                                        "run.output_dir> (memory: it outlives a role's process, not the machine) "
                                        "where /dev/shm exists, else <run.output_dir>/snapshots; each role writes "
                                        "its part under this path on its own machine (compose and the chart mount "
                                        "a memory-backed volume there)")

    def root(self, run: RunSection) -> Path:
        if self.dir:
            return Path(self.dir)
        shm = Path("/dev/shm")
        if not shm.is_dir():
            return run.out / "snapshots"
        # Two runs of one name (other output directories) must not share, or clear, each other's; the
        # path as the config gives it, so that every role (whatever its working directory) agrees.
        tag = hashlib.sha256(str(run.out).encode()).hexdigest()[:8]
        return shm / "rolefleet" / f"{run.name}-{tag}"


class CheckpointSection(_Section):
    """Checkpoints of the run (docs/checkpoints.md)."""

    every: int = Field(0, ge=0, description="steps between checkpoints (0: none by step count)")
    every_minutes: float = Field(30.0, ge=0, description="a checkpoint after the first step that ends this many "
                                 "minutes after the previous one (or the run's start); 0: none by time. With "
                                 "either on and run.max_restarts > 0, the run also saves the checkpoint of step 0, "
                                 "so a lost actor or critic is always recoverable")
    at_end: bool = Field(True, description="also save after the last step (and when a run is stopped)")
    keep: int = Field(3, ge=1, description="complete checkpoints kept; older ones are removed after a new "
                      "one is complete")
    dir: Optional[ExpandedPath] = Field(None, description="default <run.output_dir>/checkpoints; the trainer roles "
                                        "write their parts there too, so it must be storage they share with the "
                                        "coordinator under the same path")

    snapshot: SnapshotSection = Field(default_factory=SnapshotSection)

    def root(self, run: RunSection) -> Path:
        return Path(self.dir) if self.dir else run.out / "checkpoints"

    @property
    def periodic(self) -> bool:
        """Checkpoints come during the run, not only at its end."""
        return self.every > 0 or self.every_minutes > 0

    def due(self, step: int, total_steps: int, minutes_since_last: float = 0.0) -> bool:
        return ((self.every > 0 and step % self.every == 0) or (self.at_end and step == total_steps)
                or (self.every_minutes > 0 and minutes_since_last >= self.every_minutes))

TRACKING_BACKENDS = ("tensorboard", "wandb", "mlflow")


class TrackingSection(_Section):
    backends: list[Literal[TRACKING_BACKENDS]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["tensorboard"],
        description="where step records go besides metrics.jsonl (always written): tensorboard, wandb, mlflow")
    project: str = Field("rolefleet", min_length=1, description="W&B project and MLflow experiment name")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="offline: no network, the run is kept under the run directory for `wandb sync`")
    mlflow_tracking_uri: Optional[str] = Field(
        None, description="MLflow tracking URI (a server, a database); default a SQLite file in the run directory")

    @field_validator("backends")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"a backend is listed twice: {v}")
        return v
