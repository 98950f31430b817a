"""The run config: one YAML file, validated by typed pydantic models before anything starts.

`load_config(path, overrides)` applies dotted overrides (`actor.lr=1e-6`, values parsed as YAML)
and raises ConfigError naming the key and what is allowed. Every field is documented once, with its
default, in the module of its section; docs/config.md mirrors them:

    base.py        ConfigError, the section base, Endpoint (each role's host, port...), shared helpers
    paths.py       ExpandedPath: the type of every path key (`~` and $VARIABLES expanded)
    run.py         run, security (and its tls), checkpoint, tracking
    data.py        model, data, eval, sampling
    trainers.py    train, actor (and its rollout, rollout.vllm), critic
    reward.py      reward (and its sources)
    cluster.py     coordinator, pipeline, devices
    root.py        RoleFleetConfig: the sections together, with the defaults and checks spanning several
    loading.py     YAML and overrides in (parse_config, load_config, overridden), YAML out (dump_config)
    app_checks.py  the checks that need rolefleet.tasks and rolefleet.reward, imported when they run

Import from `rolefleet.common.config`: the modules are its layout, not its interface.
"""

from rolefleet.common.config.base import (
    MIN_TEMPERATURE,
    MIN_WIRE_TEMPERATURE,
    ROLES,
    ConfigError,
    Endpoint,
    dial_host,
    split_device,
)
from rolefleet.common.config.cluster import CoordinatorSection, DeviceList, DevicesSection, PipelineSection
from rolefleet.common.config.data import DataSection, EvalSection, ModelSection, SamplingSection
from rolefleet.common.config.loading import apply_override, dump_config, load_config, overridden, parse_config
from rolefleet.common.config.paths import ExpandedPath, expand_path
from rolefleet.common.config.reward import RewardSection
from rolefleet.common.config.root import ASYNC_IS_CORRECTION, RoleFleetConfig
from rolefleet.common.config.run import (
    TRACKING_BACKENDS,
    CheckpointSection,
    RunSection,
    SecuritySection,
    TlsSection,
    TrackingSection,
)
from rolefleet.common.config.teacher import TeacherSection
from rolefleet.common.config.trainers import (
    CLIP_DEFAULTS,
    ActorSection,
    CriticSection,
    RolloutSection,
    TrainSection,
    VllmSection,
)

__all__ = [
    "ASYNC_IS_CORRECTION", "CLIP_DEFAULTS", "MIN_TEMPERATURE", "MIN_WIRE_TEMPERATURE", "ROLES", "TRACKING_BACKENDS",
    "ActorSection", "CheckpointSection", "ConfigError", "CoordinatorSection", "CriticSection", "DataSection",
    "DeviceList", "DevicesSection", "Endpoint", "EvalSection", "ExpandedPath", "ModelSection", "PipelineSection",
    "RewardSection", "RoleFleetConfig", "RolloutSection", "RunSection", "SamplingSection", "SecuritySection",
    "TeacherSection", "TlsSection", "TrackingSection", "TrainSection", "VllmSection",
    "apply_override", "dial_host", "dump_config", "expand_path", "load_config", "overridden", "parse_config",
    "split_device",
]
