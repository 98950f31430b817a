"""RL maths as pure tensor functions, looked up by name from the config.

Tensors and scalars in, tensors out; shapes in docstrings; masks honoured; no config objects and no
`.item()` (callers decide when to sync). Layout: right-padded [B, T] tensors with a 0/1 `mask`.
"""

from rolefleet.algos.advantages import ADVANTAGE_ESTIMATORS, discounted_returns
from rolefleet.algos.aggregation import LOSS_AGGREGATIONS, aggregate, aggregation_weight
from rolefleet.algos.evaluation import pass_at_k
from rolefleet.algos.is_correction import IS_CORRECTIONS, logprob_mismatch
from rolefleet.algos.kl import KL_CONTROLLERS, KL_ESTIMATORS, TEACHER_KL
from rolefleet.algos.long_tail import OVERLONG, informative_groups
from rolefleet.algos.losses import POLICY_LOSSES, VALUE_LOSSES, entropy_from_logits
from rolefleet.algos.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS", "IS_CORRECTIONS", "KL_CONTROLLERS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS",
    "OVERLONG", "POLICY_LOSSES", "TEACHER_KL", "VALUE_LOSSES", "Registry", "aggregate", "aggregation_weight", "discounted_returns", "entropy_from_logits",
    "informative_groups", "logprob_mismatch", "pass_at_k",
]
