"""RL maths as pure tensor functions, looked up by name from the config.

Tensors and scalars in, tensors out; shapes in docstrings; masks honoured; no config objects and no
`.item()` (callers decide when to sync). Padded layout: [B, T] tensors with a bool/0-1 `mask`.
"""

from rolefleet.algos.advantages import ADVANTAGE_ESTIMATORS
from rolefleet.algos.kl import KL_ESTIMATORS
from rolefleet.algos.losses import POLICY_LOSSES, VALUE_LOSSES
from rolefleet.algos.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "POLICY_LOSSES", "VALUE_LOSSES", "Registry"]
