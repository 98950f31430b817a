"""What each `algorithm:` name means: its advantage estimator, whether it needs a critic, and the
defaults it brings. Plain data; the maths lives in the registries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmPreset:
    estimator: str                 # name in ADVANTAGE_ESTIMATORS
    uses_critic: bool
    whiten_advantages: bool        # default of train.whiten_advantages
    loss_agg_mode: str             # default of actor.loss_agg_mode
    norm_adv_by_std: bool = True   # default of train.norm_adv_by_std (group estimators)
    grouped: bool = False          # needs several samples per prompt
    uses_teacher: bool = False     # needs the teacher role's logprobs (on-policy distillation)
    supervised: bool = False       # trains on the data's completions, not on samples (`coordinator/supervised.py`)


ALGORITHMS: dict[str, AlgorithmPreset] = {
    "ppo": AlgorithmPreset("gae", uses_critic=True, whiten_advantages=True, loss_agg_mode="token-mean"),
    "grpo": AlgorithmPreset("grpo", uses_critic=False, whiten_advantages=False, loss_agg_mode="token-mean",
                            grouped=True),
    # Dr. GRPO: no std scaling of the advantage, and a constant loss normaliser (no length bias).
    "drgrpo": AlgorithmPreset("grpo", uses_critic=False, whiten_advantages=False,
                              loss_agg_mode="seq-mean-token-sum-norm", norm_adv_by_std=False, grouped=True),
    "rloo": AlgorithmPreset("rloo", uses_critic=False, whiten_advantages=False, loss_agg_mode="token-mean",
                            grouped=True),
    "reinforce_pp": AlgorithmPreset("reinforce_pp", uses_critic=False, whiten_advantages=False,
                                    loss_agg_mode="token-mean"),
    # On-policy distillation: the student samples, the teacher grades every sampled token (`distill`).
    "distill": AlgorithmPreset("distill", uses_critic=False, whiten_advantages=False, loss_agg_mode="token-mean",
                               uses_teacher=True),
    # Supervised fine-tuning: the data's completions are the targets (no rollouts, rewards or advantages).
    "sft": AlgorithmPreset("none", uses_critic=False, whiten_advantages=False, loss_agg_mode="token-mean",
                           supervised=True),
    "reinforce_pp_baseline": AlgorithmPreset("reinforce_pp_baseline", uses_critic=False, whiten_advantages=False,
                                             loss_agg_mode="token-mean", grouped=True),
}
