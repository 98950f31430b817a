"""Where the roles run and how the coordinator drives them: the coordinator's server and HTTP
control plane, the pipeline's schedule (sync or async, staleness) and the GPU groups (devices).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, PrivateAttr, field_validator, model_serializer, model_validator

from rolefleet.common.config.base import _DEVICE, Endpoint, _Section, split_device


class CoordinatorSection(Endpoint):
    # One thread: the coordinator's tensor work (targets, checks) is small, and on a node shared with
    # the role processes a pool of torch threads per core stalls on every op (docs/benchmarks.md,
    # "The coordinator's CPU threads": 0.3-0.4 s a step at 16 threads against 0.02 s at 1).
    num_threads: Optional[int] = Field(1, ge=1, description="torch CPU threads of the coordinator")
    http_enabled: bool = Field(True, description="serve the HTTP control plane (FastAPI: status, steps, roles, "
                               "pause, resume, stop; OpenAPI at /openapi.json)")
    http_host: str = Field("127.0.0.1", description="interface the HTTP control plane binds (loopback unless set)")
    http_port: int = Field(0, ge=0, le=65535, description="HTTP control plane port; 0 picks a free one")


class PartialRolloutsSection(_Section):
    """Partial rollouts (docs/algorithms.md, "The long tail"; the rollout source, `coordinator/source.py`)."""

    enabled: bool = Field(False, description="sync mode: a step generates at most token_budget tokens of each "
                          "response; responses cut there are carried into the next step and generated on by its "
                          "policy (their tokens keep the rollout logprobs and policy versions that made them), and "
                          "each step trains on the groups whose responses have all finished. A response begun at "
                          "step j generates to its end at step j + pipeline.max_staleness at the latest")
    token_budget: Optional[int] = Field(None, ge=1, description="tokens each response generates per step; "
                                        "default a quarter of sampling.max_new_tokens")


class PipelineSection(_Section):
    """How the coordinator schedules the stages (docs/architecture.md, "The asynchronous pipeline")."""

    mode: Literal["sync", "async"] = Field("sync", description="sync: one step's phases one after another; "
                                           "async: later batches generate while earlier ones are scored "
                                           "and trained on")
    max_staleness: int = Field(1, ge=0, description="async (and sync with partial_rollouts): a batch is trained "
                               "on only while the actor's "
                               "version is at most this many updates past the version that generated "
                               "its oldest sample (0: on-policy, still streaming)")
    queue_capacity: int = Field(2, ge=1, description="async: batches each stage queue holds")
    backpressure_threshold: float = Field(0.7, gt=0, le=1, description="async: generation pauses while the "
                                          "batches waiting downstream fill more than this fraction of their "
                                          "queues' capacity")
    on_stale: Literal["regenerate", "drop"] = Field("regenerate", description="async: a batch that aged past "
                                                    "max_staleness (a retried stage, say) is counted, logged "
                                                    "and generated again, or dropped (the step trains on the "
                                                    "next batch)")
    order: Literal["exact", "eager"] = Field("exact", description="async: exact = each update waits until the "
                                             "batches the bound lets precede it are generated, so every batch "
                                             "lags by exactly max_staleness and runs repeat for a fixed seed; "
                                             "eager = updates never wait for generation (on a split actor the "
                                             "next batch generates while this one trains), lags vary with "
                                             "timing within the bound")
    partial_rollouts: PartialRolloutsSection = Field(default_factory=PartialRolloutsSection)
    retries: int = Field(2, ge=0, description="repeats of a role call that failed transiently (UNAVAILABLE, "
                         "a deadline), with backoff, in both modes; every call is safe to repeat. A trainer's "
                         "call is repeated only once it holds the run's updates: a restarted one is waited for "
                         "(train.connect_timeout_s) and loaded alone from the snapshot of the run's step, else "
                         "the run recovers from its newest snapshot or checkpoint")

    @property
    def lagged(self) -> bool:
        """Whether updates may train on samples of an older policy (async mode, partial rollouts)."""
        return (self.mode == "async" or self.partial_rollouts.enabled) and self.max_staleness > 0

    @property
    def staleness_bound(self) -> int:
        """Versions a trained batch may lag the actor by (sync: none, unless responses are carried)."""
        return self.max_staleness if self.mode == "async" or self.partial_rollouts.enabled else 0


DeviceList = list[Union[int, str]]


DEVICE_WORDS = ("auto", "cpu")


class DevicesSection(_Section):
    """GPU groups, as in verl guides: ints are local GPU indices, "node:i" names another node.

    The section also takes a word in place of the map: `auto` (the default: `rolefleet up` chooses
    a map from the GPUs of its machine, `app/placement.py`, and saves it in the run's config) or
    `cpu` (every role on the CPU: the map without groups). A map that is given is used as it is; an
    unresolved `auto` has no groups, so whatever reads it without choosing first sees the CPU, and
    must say so (`auto` tells it apart)."""

    _auto: bool = PrivateAttr(False)

    actor: DeviceList = Field(default_factory=list, description="the actor's GPUs (one worker each); empty: CPU")
    reward: DeviceList = Field(default_factory=list, description="the reward's GPUs (a reward model); empty: CPU")
    critic: DeviceList = Field(default_factory=list, description="the critic's GPUs (one worker each); empty: CPU")
    teacher: DeviceList = Field(default_factory=list, description="the teacher's GPUs (one process; a model too "
                                "big for one GPU is split over them by layers); empty: CPU")
    rollout: DeviceList = Field(default_factory=list, description="subset of the actor's GPUs")
    colocate: list[list[Literal["actor", "reward", "critic", "teacher"]]] = Field(
        default_factory=list, description="sets of roles that share GPUs on purpose, e.g. [[actor, critic]]; "
        "groups that overlap otherwise are a config error")

    @model_validator(mode="wrap")
    @classmethod
    def _word(cls, data, handler):
        if data is not None and not isinstance(data, str):
            return handler(data)
        word = "auto" if data is None else data  # `devices:` with nothing after it is left unset
        if word not in DEVICE_WORDS:
            raise ValueError(f"{word!r} is not a devices map nor one of its words: auto (up chooses from this "
                             "machine's GPUs), cpu (no GPU)")
        section = handler({})
        section._auto = word == "auto"
        return section

    @model_serializer(mode="wrap")
    def _as_word(self, handler):
        # Saved and passed on (the run's config.yaml, the worker ranks) as written: a map chosen for
        # `auto` is saved as that map, so restarts and `serve` see the choice, not the word.
        if self._auto:
            return "auto"
        return "cpu" if self.is_cpu and not self.colocate else handler(self)

    @classmethod
    def of(cls, value) -> DevicesSection:
        """The section from its YAML value: a word or a map."""
        return cls.model_validate(value)

    @property
    def auto(self) -> bool:
        """`devices: auto` not yet resolved into a map."""
        return self._auto

    @property
    def is_cpu(self) -> bool:
        """No role has a GPU (`devices: cpu`, or an unresolved `auto`)."""
        return not (self.actor or self.reward or self.critic or self.teacher)

    @field_validator("actor", "reward", "critic", "teacher", "rollout")
    @classmethod
    def _entries(cls, value: DeviceList) -> DeviceList:
        for entry in value:
            if isinstance(entry, int) and entry < 0:
                raise ValueError(f"GPU index {entry} is negative")
            if isinstance(entry, str) and not _DEVICE.match(entry):
                raise ValueError(f"{entry!r} is not a GPU index or 'node:index'")
        if len(set(map(str, value))) != len(value):
            raise ValueError(f"duplicate GPUs in {value}")
        return value

    @field_validator("actor", "reward", "critic", "teacher", "rollout")
    @classmethod
    def _nodes_together(cls, value: DeviceList) -> DeviceList:
        """Ranks are numbered in entry order, node by node: a node's entries must form one run, and
        local indices cannot be told apart from one node's ("node:i") in the same group."""
        nodes = [split_device(d)[0] for d in value]
        if None in nodes and any(n is not None for n in nodes):
            raise ValueError(f"{value} mixes local GPU indices with 'node:index' entries: name every GPU's node, "
                             "or none")
        seen: list = []
        for node in nodes:
            if node in seen and seen[-1] != node:
                raise ValueError(f"the GPUs of node {node!r} are not listed together in {value}: list each node's "
                                 "GPUs in one run (ranks are numbered node by node)")
            if node not in seen:
                seen.append(node)
        return value

    @model_validator(mode="after")
    def _rollout_subset(self) -> DevicesSection:
        extra = [d for d in self.rollout if d not in self.actor]
        if extra:
            raise ValueError(f"rollout GPUs {extra} are not in the actor's group {self.actor}")
        return self

    @model_validator(mode="after")
    def _overlaps_declared(self) -> DevicesSection:
        """Two roles on one GPU split its memory and time: fine when meant (one-GPU runs), a slip
        otherwise (a typo in an 8-GPU map). Overlaps must be listed in `colocate`."""
        roles = ("actor", "reward", "critic", "teacher")
        for i, a in enumerate(roles):
            for b in roles[i + 1:]:
                shared = [d for d in getattr(self, a) if str(d) in map(str, getattr(self, b))]
                if shared and not any(a in group and b in group for group in self.colocate):
                    raise ValueError(f"devices.{a} and devices.{b} share GPUs {shared}: declare it with "
                                     f"devices.colocate: [[{a}, {b}]] (or give them separate GPUs)")
        return self

    def by_node(self, role: str) -> list[tuple[Optional[str], list[int]]]:
        """`role`'s GPUs by node in the order the nodes first appear: [(node, its GPU indices)];
        one (None, indices) for local indices, [] for none."""
        nodes: dict[Optional[str], list[int]] = {}
        for node, index in map(split_device, getattr(self, role)):
            nodes.setdefault(node, []).append(index)
        return list(nodes.items())

    def local_indices(self, role: str) -> list[int]:
        """GPU indices for CUDA_VISIBLE_DEVICES on this node; 'node:i' entries keep their index."""
        return [split_device(d)[1] for d in getattr(self, role)]
