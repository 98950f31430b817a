"""RoleFleetConfig: every section together, and what spans several of them: defaults filled from
other sections (the models, the algorithm's preset, learning-rate decay lengths) and the checks
that need two sections at once.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from rolefleet.algos.presets import ALGORITHMS
from rolefleet.common.config.base import _Section
from rolefleet.common.config.cluster import CoordinatorSection, DevicesSection, PipelineSection
from rolefleet.common.config.data import DataSection, EvalSection, ModelSection, SamplingSection
from rolefleet.common.config.reward import RewardSection
from rolefleet.common.config.run import CheckpointSection, RunSection, SecuritySection, TrackingSection
from rolefleet.common.config.teacher import TeacherSection
from rolefleet.common.config.trainers import ActorSection, CriticSection, TrainSection

# actor.is_correction where updates may train on an older policy's samples (pipeline.lagged) and
# the config does not say.
ASYNC_IS_CORRECTION = "token_truncate"


class RoleFleetConfig(_Section):
    run: RunSection = Field(default_factory=RunSection)
    algorithm: str = Field("ppo", description=f"the algorithm preset: {' | '.join(ALGORITHMS)}")
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    train: TrainSection = Field(default_factory=TrainSection)
    actor: ActorSection = Field(default_factory=ActorSection)
    critic: CriticSection = Field(default_factory=CriticSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    teacher: TeacherSection = Field(default_factory=TeacherSection, description="the teacher role (on-policy "
                                    "distillation): started where the algorithm or train.distill_coef needs it")
    coordinator: CoordinatorSection = Field(default_factory=CoordinatorSection)
    pipeline: PipelineSection = Field(default_factory=PipelineSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    security: SecuritySection = Field(default_factory=SecuritySection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    devices: DevicesSection = Field(default_factory=lambda: DevicesSection.of("auto"))

    @field_validator("algorithm")
    @classmethod
    def _algorithm(cls, v: str) -> str:
        if v not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {v!r}; valid: {', '.join(ALGORITHMS)}")
        return v

    @model_validator(mode="after")
    def _resolve(self) -> RoleFleetConfig:
        """Fill defaults that depend on other sections (models, the algorithm's preset)."""
        default = self.model.model_name_or_path
        for section in (self.actor, self.critic):
            if section.model_name_or_path is None:
                section.model_name_or_path = default
            if section.trust_remote_code is None:
                section.trust_remote_code = self.model.trust_remote_code
        if self.actor.ref_model_name_or_path is None:
            self.actor.ref_model_name_or_path = self.actor.model_name_or_path
        if self.teacher.trust_remote_code is None:
            self.teacher.trust_remote_code = self.model.trust_remote_code
        if self.actor.model_name_or_path is None:
            raise ValueError("set model.model_name_or_path (or actor.model_name_or_path)")
        preset = ALGORITHMS[self.algorithm]
        if self.train.whiten_advantages is None:
            self.train.whiten_advantages = preset.whiten_advantages
        if self.train.norm_adv_by_std is None:
            self.train.norm_adv_by_std = preset.norm_adv_by_std
        if self.actor.loss_agg_mode is None:
            self.actor.loss_agg_mode = preset.loss_agg_mode
        warmup = self.train.critic_warmup_steps
        if warmup and not preset.uses_critic:
            raise ValueError(f"train.critic_warmup_steps: algorithm {self.algorithm} has no critic")
        if warmup >= self.train.total_steps:
            raise ValueError(f"train.critic_warmup_steps={warmup} leaves no actor step of train.total_steps="
                             f"{self.train.total_steps}")
        for section, updates in ((self.actor, self.train.total_steps - warmup), (self.critic, self.train.total_steps)):
            if section.lr_decay_steps is None:
                section.lr_decay_steps = updates * section.ppo_epochs * section.num_mini_batches
        if self.actor.loss_norm_length is None:
            self.actor.loss_norm_length = self.sampling.max_new_tokens
        if self.pipeline.lagged and "is_correction" not in self.actor.model_fields_set:
            # Samples of an older policy: weigh them by pi_train / pi_rollout (truncated) unless told.
            self.actor.is_correction = ASYNC_IS_CORRECTION
        if self.eval.enabled and self.data.path and not (self.eval.path or self.eval.task):
            raise ValueError("eval.path: evaluation of a run on a prompt file (data.path) needs held-out prompts of "
                             "its own: set eval.path (or eval.task), or eval.every=0")
        rollout = self.actor.rollout
        if self.reward.agent.enabled:
            if self.reward.env.enabled:
                raise ValueError("reward.agent drives its episodes itself (it is their environment): set "
                                 "reward.agent or reward.env, not both")
            self.actor.endpoint.enabled = True  # the agents' way to the policy
            agent = self.reward.agent
            if self.actor.endpoint.agents_at_once is None and not agent.external:
                self.actor.endpoint.agents_at_once = agent.workers * agent.concurrency
            if not self.reward.sources and "function" not in self.reward.model_fields_set:
                self.reward.function = "none"  # the agent's return is the reward; sources may add to it
        if rollout.max_turns > 1 and not (self.reward.env.enabled or self.reward.agent.enabled):
            raise ValueError("actor.rollout.max_turns > 1 needs an environment to answer the turns: set "
                             "reward.env.name (tools, feedback) or reward.env.path, or an agent (reward.agent.path)")
        # The tools environment runs the user tools the model is shown: they are declared once, in data.tools.
        self.reward.env.run_user_tools(self.data.user_tools)
        if rollout.max_total_tokens is None:
            rollout.max_total_tokens = rollout.max_turns * self.sampling.max_new_tokens
        overlong, cap = self.train.overlong, self.episode_cap
        if overlong.buffer_tokens is None:
            overlong.buffer_tokens = max(1, cap // 4)
        if overlong.mode == "penalty" and overlong.buffer_tokens > cap:
            raise ValueError(f"train.overlong.buffer_tokens={overlong.buffer_tokens} is more than the episode's "
                             f"cap of {cap} tokens (sampling.max_new_tokens, or actor.rollout.max_total_tokens "
                             "with max_turns > 1): the penalty's buffer lies before the cap")
        if self.train.dynamic_sampling.enabled:
            if self.train.samples_per_prompt < 2:
                raise ValueError("train.dynamic_sampling compares the samples of a prompt: set "
                                 "train.samples_per_prompt >= 2")
        partial = self.pipeline.partial_rollouts
        if partial.token_budget is None:
            partial.token_budget = max(1, self.sampling.max_new_tokens // 4)
        if partial.enabled:
            if partial.token_budget >= self.sampling.max_new_tokens:
                raise ValueError(f"pipeline.partial_rollouts.token_budget={partial.token_budget} cuts nothing below "
                                 f"sampling.max_new_tokens={self.sampling.max_new_tokens}")
        if self.uses_teacher and not self.teacher.model_name_or_path:
            why = "algorithm distill" if preset.uses_teacher else \
                "train.distill_coef" if self.train.distill_coef else "actor.teacher_kl_coef"
            raise ValueError(f"teacher.model_name_or_path: {why} distils from a teacher: set the teacher model (its "
                             "tokenizer the student's)")
        if self.actor.teacher_kl_coef > 0 and not self.teacher.top_k:
            raise ValueError("teacher.top_k: actor.teacher_kl_coef compares the teacher's and the policy's "
                             "distributions over the teacher's most likely tokens: set how many (e.g. 16)")
        if self.teacher.top_k and not self.actor.teacher_kl_coef > 0:
            raise ValueError(f"actor.teacher_kl_coef: teacher.top_k={self.teacher.top_k} asks the teacher for its "
                             "most likely tokens, which only that loss term reads: set its weight (e.g. 1.0), or "
                             "leave teacher.top_k at 0")
        if preset.uses_teacher and self.train.distill_coef:
            raise ValueError("train.distill_coef weighs the teacher's term beside another algorithm's advantages; "
                             "algorithm distill is that term alone: leave train.distill_coef at 0")
        if preset.supervised:
            self._supervised()
        elif self.actor.policy_loss == "sft":
            raise ValueError(f"actor.policy_loss: sft trains on the data's completions (algorithm sft), not on "
                             f"algorithm {self.algorithm}'s samples")
        if preset.grouped and self.train.samples_per_prompt < 2:
            raise ValueError(f"algorithm {self.algorithm} compares samples of one prompt: "
                             "set train.samples_per_prompt >= 2")
        return self

    def _supervised(self) -> None:
        """`algorithm: sft`: the NLL of the data's completions; nothing of the rollout side applies."""
        if "policy_loss" in self.actor.model_fields_set and self.actor.policy_loss != "sft":
            raise ValueError(f"actor.policy_loss: algorithm sft trains with the sft loss (the completions' NLL), "
                             f"not {self.actor.policy_loss}")
        self.actor.policy_loss = "sft"
        # No reference model is loaded: a KL term (from a base config of RL runs) has nothing to read.
        self.actor.kl_loss_coef = 0.0
        # (reward.env stays: evaluation drives multi-turn episodes through it.)
        for key, on in (("reward.agent", self.reward.agent.enabled),
                        ("train.dynamic_sampling", self.train.dynamic_sampling.enabled),
                        ("pipeline.partial_rollouts", self.pipeline.partial_rollouts.enabled),
                        ("train.distill_coef", self.train.distill_coef > 0),
                        ("actor.teacher_kl_coef", self.actor.teacher_kl_coef > 0)):
            if on:
                raise ValueError(f"{key}: algorithm sft trains on the data's completions, without rollouts")
        extra = self.data.extra_keys
        if extra is not None and self.data.completion_key not in extra:
            self.data.extra_keys = [*extra, self.data.completion_key]  # the completion reaches the record

    @model_validator(mode="after")
    def _nodes_fit(self) -> RoleFleetConfig:
        """A trainer's workers must lay out on its nodes (`trainer/nodes.py`); the reward role is one
        process, on one node."""
        for role in ("actor", "critic"):
            section, gpu_nodes = getattr(self, role), len(self.devices.by_node(role))
            nodes = section.nodes
            if nodes is None:
                continue
            if gpu_nodes and nodes != gpu_nodes:
                raise ValueError(f"{role}.nodes: {nodes}, but devices.{role} names {gpu_nodes} node(s); on GPUs "
                                 "the nodes come from the devices map (leave it unset)")
            workers = section.workers or 1
            if not gpu_nodes and workers % nodes:
                raise ValueError(f"{role}.nodes: {workers} workers ({role}.workers) do not split evenly over "
                                 f"{nodes} nodes; set {role}.workers to a multiple of {role}.nodes")
        reward_nodes = [node for node, _ in self.devices.by_node("reward")]
        if len(reward_nodes) > 1:
            raise ValueError(f"devices.reward: entries on nodes {', '.join(reward_nodes)}: the reward role is one "
                             "process on one node (more reward servers are replicas: reward.replicas)")
        teacher_nodes = [node for node, _ in self.devices.by_node("teacher")]
        if len(teacher_nodes) > 1:
            raise ValueError(f"devices.teacher: entries on nodes {', '.join(teacher_nodes)}: the teacher is one "
                             "process on one node (its GPUs split the model by layers)")
        return self

    @property
    def preset(self):
        return ALGORITHMS[self.algorithm]

    @property
    def uses_teacher(self) -> bool:
        """Whether the run distils from the teacher role (its algorithm, the mixed form, or the top-k term)."""
        return self.preset.uses_teacher or self.train.distill_coef > 0 or self.actor.teacher_kl_coef > 0

    @property
    def episode_cap(self) -> int:
        """The most tokens an episode has after its prompt: one turn's (`sampling.max_new_tokens`),
        or a multi-turn conversation's (`actor.rollout.max_total_tokens`). Overlong shaping measures
        an episode against it (docs/algorithms.md)."""
        rollout = self.actor.rollout
        return rollout.max_total_tokens if rollout.max_turns > 1 else self.sampling.max_new_tokens

    @property
    def one_pass_update(self) -> bool:
        """`actor.old_logprobs: auto` and it can: the actor's update computes each step's old
        logprobs in its own forward, and ComputeLogProbs asks for the reference's alone. A KL
        penalty in the rewards (`train.kl_coef`) needs the policy's logprobs before the advantages."""
        return self.actor.old_logprobs == "auto" and self.train.kl_coef == 0 and self.actor.one_pass_problem() is None

    @property
    def eval_seed(self) -> int:
        """The seed of the held-out draw and of sampled evaluations: `eval.seed`, else `run.seed`."""
        return self.run.seed if self.eval.seed is None else self.eval.seed

    def eval_data(self) -> DataSection:
        """The held-out prompts as a data source: eval's file or task, read and rendered like
        `data` (its chat template and token limit)."""
        d, e = self.data, self.eval
        return DataSection(task=None if e.path else (e.task or d.task), path=e.path, format=e.format, split=e.split,
                           name=e.name or d.name,
                           prompt_key=e.prompt_key or d.prompt_key, answer_key=e.answer_key or d.answer_key,
                           extra_keys=e.extra_keys if e.extra_keys is not None else d.extra_keys,
                           completion_key=d.completion_key,
                           chat_template=d.chat_template, tools=d.tools, max_prompt_tokens=d.max_prompt_tokens,
                           max_example_tokens=d.max_example_tokens, overlong=d.overlong,
                           shuffle=False, size=e.max_prompts)

    def roles(self) -> list[str]:
        """Roles this run starts, in start order (the coordinator last); the critic and the teacher
        only if needed."""
        return ["actor", "reward", *(["critic"] if self.preset.uses_critic else []),
                *(["teacher"] if self.uses_teacher else []), "coordinator"]
