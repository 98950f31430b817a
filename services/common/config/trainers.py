"""The training sections: train (the step: batch sizes, advantages, the KL penalty, deadlines), the
fields both trainer roles share, and the actor (its losses, its rollout engine and vLLM's knobs)
and the critic.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, NonNegativeInt, field_validator, model_validator

from rolefleet.common.config.base import Endpoint, _algos, _one_of, _Section
from rolefleet.common.config.paths import ExpandedPath


class OverlongSection(_Section):
    """Responses cut at `sampling.max_new_tokens` (algos/long_tail.py)."""

    mode: Literal["none", "filter", "penalty"] = Field(
        "none", description="none: trained as if complete; filter: responses cut at the cap get no gradient in the "
        "policy's update (they still count in their group's statistics); penalty: DAPO's soft overlong punishment "
        "added to the score, 0 up to max_new_tokens - buffer_tokens, falling linearly to -penalty_factor at the cap")
    buffer_tokens: Optional[int] = Field(None, ge=1, description="penalty: the tokens before the cap over which "
                                         "the penalty grows; default a quarter of sampling.max_new_tokens")
    penalty_factor: float = Field(1.0, gt=0, description="penalty: its size at the cap, in reward units")


class DynamicSamplingSection(_Section):
    """DAPO's dynamic sampling (docs/algorithms.md, "The long tail")."""

    enabled: bool = Field(False, description="drop groups whose samples all score the same (zero advantage under "
                          "group normalization) and generate further prompts to refill the step's batch (either pipeline mode)")
    max_batches: int = Field(4, ge=1, description="at most this many batches of train.prompts_per_step prompts "
                             "generated for one step; past it the step trains on the groups it kept (logged "
                             "as dynamic/kept_groups)")
    tolerance: float = Field(1e-6, ge=0, description="scores within this of each other count as equal")


class TrainSection(_Section):
    total_steps: int = Field(20, ge=1, description="training steps of the run (each one policy update)")
    prompts_per_step: int = Field(32, ge=1, description="prompts drawn per step (each sampled "
                                  "samples_per_prompt times)")
    samples_per_prompt: int = Field(1, ge=1, description="n rollouts per prompt (a group)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of the token rewards (GAE, REINFORCE++ returns)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    whiten_advantages: Optional[bool] = Field(None, description="default: the algorithm's")
    norm_adv_by_std: Optional[bool] = Field(None, description="GRPO std scaling; default: the algorithm's")
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference penalty in the token rewards")
    kl_estimator: str = Field("k1", description="estimator of the per-token KL to the reference, for the reward "
                              "penalty and the kl metric: k1 | k2 | k3")
    kl_controller: str = Field("fixed", description="fixed | adaptive (targets kl_target)")
    kl_target: float = Field(0.1, gt=0, description="adaptive controller: per-token KL to track")
    kl_horizon: int = Field(10000, ge=1, description="adaptive controller: samples to close the gap")
    distill_coef: float = Field(0.0, ge=0, description="on-policy distillation beside the algorithm's own "
                                "advantages: each sampled token's advantage gains distill_coef x (log pi_teacher - "
                                "log pi_student) (the teacher role; docs/algorithms.md). algorithm distill is that "
                                "term alone")
    critic_warmup_steps: int = Field(0, ge=0, description="first steps that train only the critic (the actor "
                                     "is not updated), so advantages start from useful values; PPO, sync mode")
    rpc_timeout_s: float = Field(600.0, gt=0, description="deadline of each role call")
    connect_timeout_s: float = Field(300.0, gt=0, description="wait this long for every role to be SERVING")
    overlong: OverlongSection = Field(default_factory=OverlongSection)
    dynamic_sampling: DynamicSamplingSection = Field(default_factory=DynamicSamplingSection)

    _kl = field_validator("kl_estimator")(lambda cls, v: _one_of(_algos().KL_ESTIMATORS, v))
    _ctl = field_validator("kl_controller")(lambda cls, v: _one_of(_algos().KL_CONTROLLERS, v))

    @model_validator(mode="after")
    def _adaptive_needs_a_start(self) -> TrainSection:
        if self.kl_controller == "adaptive" and self.kl_coef == 0:
            raise ValueError("kl_controller adaptive scales kl_coef, which is 0: set train.kl_coef > 0")
        return self


class RendezvousSection(_Section):
    """Where the node processes of a role that spans nodes meet (docs/deploy-kubernetes.md)."""

    host: str = Field("127.0.0.1", description="the role's first node as the other nodes dial it (its rank 0, "
                      "the server process, hosts the rendezvous store there); Helm sets the first pod's DNS name")
    port: int = Field(29500, ge=1, le=65535, description="TCP port of the rendezvous store on the first node "
                      "(torch.distributed's TCPStore, as torchrun's); `rolefleet up` picks a free one")
    timeout_s: float = Field(300.0, gt=0, description="how long the first node waits for the others to join "
                             "(and they for it) before the role ends with an error naming the missing nodes")


class _TrainerSection(Endpoint):
    model_name_or_path: Optional[ExpandedPath] = Field(None, description="the model this trainer starts from; default "
                                                       "model.model_name_or_path")
    trust_remote_code: Optional[bool] = Field(None, description="run the model's own Python files; default "
                                              "model.trust_remote_code")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch per update")
    num_mini_batches: int = Field(1, ge=1, description="optimizer steps per epoch")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping: the global gradient norm's bound")
    # Per-request caps, checked from the declared sizes before anything is decoded or allocated.
    max_sequences_per_request: int = Field(65536, ge=1, description="sequences one request may carry "
                                           "(actor Generate: prompts x n)")
    max_tokens_per_request: int = Field(1 << 20, ge=1, description="prompt + response tokens one "
                                        "ComputeLogProbs / ComputeValues / Update may carry")
    max_tokens_per_micro_batch: int = Field(16384, ge=1, description="padded tokens (rows x longest "
                                            "sequence) per forward; gradients accumulate over a "
                                            "mini-batch's micro-batches")
    lr_warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0 to lr")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="after warm-up")
    lr_decay_steps: Optional[int] = Field(None, ge=1, description="optimizer steps over which linear/cosine "
                                          "decay to min_lr_ratio x lr; default: the run's (total_steps x "
                                          "ppo_epochs x num_mini_batches)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the decayed learning rate, as a fraction of lr")
    gradient_checkpointing: bool = Field(False, description="recompute each layer's activations in the "
                                         "backward: less memory, about a third more compute")
    offload: Literal["none", "optimizer", "params"] = Field(
        "none", description="host memory for the trainer's state on a GPU: optimizer = AdamW's state in host "
        "memory between optimizer steps and the gradients freed after each (the GPU holds them only during the "
        "step); params = weights, gradients and AdamW state in host memory and the optimizer step on the CPU "
        "(FSDP2's CPU offload: each layer's weights visit the GPU for its forward and backward). Slower steps "
        "(docs/memory.md); `rolefleet plan` shows what each saves")
    sequence_packing: bool = Field(False, description="micro-batches as one row of sequences without "
                                   "padding (attention kept inside each sequence by a block mask) instead "
                                   "of right-padded rows")
    packed_attention: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="attention of packed micro-batches: flex = FlexAttention over a block mask built "
        "from the sequence lengths (tiles no sequence spans skipped, no T x T mask; no backward on the CPU); "
        "sdpa = a dense T x T block-diagonal mask over every pair; auto = on CUDA flex for micro-batches of "
        "at least 4096 tokens (where it measured faster) and sdpa below; sdpa off CUDA")
    workers: Optional[int] = Field(None, ge=1, description="worker processes of this role (torch.distributed, "
                                   "data parallel): default one per GPU of its device group; on the CPU, gloo "
                                   "workers")
    nodes: Optional[int] = Field(None, ge=1, description="CPU groups: node processes the workers span, each "
                                 "starting workers / nodes of them (on GPUs the nodes come from devices.<role>'s "
                                 "\"node:i\" entries); >1 forms one group over several machines")
    rendezvous: RendezvousSection = Field(default_factory=RendezvousSection,
                                          description="where a group over several nodes meets")
    sharding: Literal["fsdp", "replicate"] = Field("fsdp", description="how several workers hold the model: "
                                                   "fsdp = parameters, gradients and optimizer state sharded "
                                                   "over the workers (FSDP2; bf16 compute on CUDA); replicate = "
                                                   "a full copy each, gradients all-reduced")
    compile_layers: bool = Field(False, description="torch.compile each decoder layer (one compilation "
                                 "shared by all layers; norms, RoPE and activations fused): faster steps after "
                                 "a compile of tens of seconds per new micro-batch shape family")
    compile_warmup: bool = Field(True, description="with compile_layers: compile at start the graphs of every "
                                 "micro-batch shape family (padded with and without a mask, one row, one response "
                                 "token; packed; each at widths of 8s and not, which CUDA graphs are guarded on) "
                                 "for each pass, so that no step stalls on a compile later; false: each family "
                                 "compiles where a step first meets it")
    compute_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="autocast dtype of forwards and backwards (auto: bfloat16 on CUDA, float32 on "
        "CPU); master weights and optimizer state stay float32")
    profile_updates: list[int] = Field(default_factory=list, description="updates of each worker process to "
                                       "run under torch.profiler (1: its first): a Chrome trace and an op table "
                                       "per rank go to profile_dir")
    profile_dir: ExpandedPath = Field("profiles", description="where profile_updates writes "
                                      "<role>-update<N>-rank<R>.json and .txt")

    @model_validator(mode="after")
    def _params_offload_is_fsdps(self) -> _TrainerSection:
        if self.offload == "params" and self.sharding != "fsdp":
            raise ValueError("offload=params is FSDP2's CPU offload: it needs sharding=fsdp (replicate keeps a "
                             "full copy on each GPU); or offload=optimizer")
        return self


class VllmSection(_Section):
    """Knobs of the vllm rollout backend, passed to vLLM's engine (its docs say more)."""

    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="fraction of the GPU's memory "
                                          "vLLM may take for weights and KV cache (the trainer shares the GPU)")
    max_num_seqs: Optional[int] = Field(None, ge=1, description="sequences scheduled at once; default vLLM's")
    max_num_batched_tokens: Optional[int] = Field(None, ge=1, description="tokens per engine step; "
                                                  "default vLLM's")
    max_model_len: Optional[int] = Field(None, ge=1, description="context length the KV cache is sized "
                                         "for; default the model's")
    enforce_eager: bool = Field(False, description="no CUDA graphs / torch.compile (faster start, slower decode)")
    enable_prefix_caching: bool = Field(True, description="share KV blocks of common prompt prefixes "
                                        "(the n samples of a prompt); reset after every weight load")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine when the actor generates apart "
                                      "from training (devices.rollout): the rollout GPUs form engines of this "
                                      "many, each tensor parallel; several engines share a request's prompts")
    sleep_level: Literal[0, 1, 2] = Field(2, description="what vLLM releases while the trainer runs on its "
                                          "GPU: 2 = KV cache and weights freed (the trainer's new weights are "
                                          "loaded on wake); 1 = KV cache freed, weights kept in CPU memory and "
                                          "copied back on wake; 0 = no sleep")


class RolloutSection(_Section):
    backend: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="rollout engine: vllm, hf (transformers), or auto (vllm where it is installed "
        "and a GPU is visible, else hf)")
    batch_size: int = Field(256, ge=1, description="sequences per engine call; each call's samples "
                            "stream back as soon as it finishes (the hf decode loop runs a call as the next row "
                            "bucket that holds it: 8, 12, 16, 24, 32, 48, ..., a power of two or half again)")
    decode: Literal["auto", "loop", "generate"] = Field(
        "auto", description="decoding of the hf engine: loop (the engine's own KV cache, device sampling, "
        "one CUDA graph per step), generate (transformers' generate), or auto (loop, falling back to "
        "generate for a model whose attention the loop cannot serve)")
    keep_decode_state_mb: Union[Literal["auto"], NonNegativeInt] = Field(
        "auto", description="hf decode loop: the KV cache, buffers and captured CUDA graphs of each batch shape "
        "(a training turn's, an evaluation's) stay between calls, so the next call of that shape replays its "
        "graph at once; beyond the budget the least recently used go back to the allocator (before each "
        "update: a colocated trainer reuses them) and are built again, capture included, at their next call. "
        "auto: as much as fits beside what the process holds and what its updates add (measured), within 90% "
        "of the memory it could hold; 2048 MiB until an update has been measured. A number: at most this many "
        "MiB (0: none kept)")
    compact: bool = Field(True, description="hf decode loop: once the rows still decoding fit in half of a "
                          "batch, they go on as a smaller batch (a power of two, at least 8 rows) over the same "
                          "KV cache, so rows that finished stop costing compute while the longest ones run on")
    vllm: VllmSection = Field(default_factory=VllmSection)
    workers: Optional[int] = Field(None, ge=1, description="CPU groups: the first N of the actor's workers only "
                                   "generate and the others only train (on GPUs devices.rollout says it)")
    sync_bucket_mb: int = Field(256, ge=1, description="split placement: MiB of weights per broadcast "
                                "from the trainers to the rollout workers (vllm: into its engines)")
    max_turns: int = Field(1, ge=1, le=64, description="assistant turns per sample: above 1, each turn is "
                           "answered by the environment (reward.env: tool results, its messages) and the "
                           "conversation continues until the environment says done, a turn hits "
                           "sampling.max_new_tokens, or the limits (docs/environments.md)")
    max_total_tokens: Optional[int] = Field(None, ge=1, description="multi-turn: response tokens of a "
                                            "whole conversation (the model's turns and the observations between "
                                            "them); each turn's budget is what is left; default max_turns x "
                                            "sampling.max_new_tokens")
    profile_generates: list[int] = Field(default_factory=list, description="generations of each generating "
                                         "worker process to run under torch.profiler (1: its first), as "
                                         "actor.profile_updates: actor-generate<N>-rank<R>.* in actor.profile_dir "
                                         "(vllm: this process's side only, not the engine's own processes)")


# Keys that moved: a config still using one gets the new name, not just "extra inputs are not permitted".
_MOVED_ACTOR_KEYS = {"rollout_batch_size": "actor.rollout.batch_size", "rollout_decode": "actor.rollout.decode",
                     "rollout_cache": "actor.rollout.decode (the decode loop replaced the static cache)"}


class LoraSection(_Section):
    """LoRA adapters (peft) instead of full-parameter training (docs/memory.md, "LoRA")."""

    rank: int = Field(0, ge=0, description="the adapters' rank r; 0 (the default): no adapters, every "
                      "parameter trains")
    alpha: float = Field(32.0, gt=0, description="the adapters' scale: their update is B A x alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input while training "
                           "(nonzero makes the first PPO ratio of an update differ from 1)")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="the layers that get adapters: all-linear (every linear layer but the LM "
        "head) or module names, e.g. [q_proj, k_proj, v_proj, o_proj]")

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, v):
        if isinstance(v, list) and (not v or not all(isinstance(m, str) and m for m in v)):
            raise ValueError("target_modules must be all-linear or a non-empty list of module names")
        return v

    @property
    def enabled(self) -> bool:
        return self.rank > 0


CLIP_DEFAULTS = {"ppo_clip": (0.2, 0.2), "gspo": (3e-4, 4e-4), "sft": (0.0, 0.0)}  # (low, high) per policy loss


class EndpointSection(_Section):
    """The actor's OpenAI-compatible Chat Completions endpoint (docs/environments.md, "Your own
    agent"): agent code drives its episodes' sessions through it. On whenever reward.agent is set."""

    enabled: bool = Field(False, description="serve the endpoint (set by reward.agent)")
    host: str = Field("127.0.0.1", description="interface the endpoint binds (loopback unless set)")
    port: int = Field(0, ge=0, le=65535, description="its port; 0 picks a free one")
    url: Optional[str] = Field(None, description="the base URL agents dial (http://actor:8300 in compose); "
                               "default http://host:port, which `rolefleet up` fills in")
    max_sessions: int = Field(8192, ge=1, description="sessions open at once (a step's samples, and those of "
                              "the steps async mode generates ahead)")
    agents_at_once: Optional[int] = Field(None, ge=1, description="how many agents drive sessions at once: "
                                          "the batcher waits for the first requests of that many fresh "
                                          "sessions (default reward.agent.workers x reward.agent.concurrency "
                                          "with agents in the reward role; none with agents outside the cluster)")
    session_timeout_s: float = Field(3600.0, gt=0, description="a session's life from its opening; past it "
                                     "its requests are answered 404 and its episode is not trained")
    batch_window_ms: float = Field(5.0, ge=0, le=1000, description="an idle engine's next call waits while "
                                   "requests keep arriving, this long after the last (at most a hundred times this, or until "
                                   "actor.max_sequences_per_request wait), and past quiet "
                                   "windows for sessions yet to ask (agents running tools; no longer than the last "
                                   "engine call took), so that the turns agents send together are generated "
                                   "together; 0: no wait")
    max_new_tokens: int = Field(1024, ge=1, description="completion tokens of a request outside any session "
                                "(a session's turn is bounded by sampling.max_new_tokens and "
                                "actor.rollout.max_total_tokens)")


class ActorSection(_TrainerSection):
    ref_model_name_or_path: Optional[ExpandedPath] = Field(None, description="default: the actor's model")
    lora: LoraSection = Field(default_factory=lambda: LoraSection(), description="low-rank adapters: only "
                              "they train; the reference is the model with them switched off")
    rollout: RolloutSection = Field(default_factory=lambda: RolloutSection())
    endpoint: EndpointSection = Field(default_factory=lambda: EndpointSection())
    max_prompt_bytes: int = Field(1 << 18, ge=1, description="UTF-8 bytes of one Generate prompt, "
                                  "checked before tokenization")
    ref_offload: bool = Field(False, description="keep the reference model in CPU memory between "
                              "ComputeLogProbs calls (frees its GPU memory for training)")
    logprob_chunk_tokens: int = Field(2048, ge=1, description="tokens per LM-head chunk when computing "
                                      "logprobs and entropy (bounds the [tokens, vocab] logits)")
    policy_loss: str = Field("ppo_clip", description="the policy loss: gspo | ppo_clip | sft "
                             "(gspo: the sequence-level ratio)")
    clip_ratio: Optional[float] = Field(None, gt=0, description="lower clip epsilon (and upper unless set); "
                                        "default: the policy loss's")
    clip_ratio_high: Optional[float] = Field(None, gt=0, description="upper clip epsilon (clip-higher)")
    dual_clip: Optional[float] = Field(None, gt=1, description="dual-clip bound c for negative advantages")
    loss_agg_mode: Optional[str] = Field(None, description="default: the algorithm's")
    loss_norm_length: Optional[int] = Field(None, ge=1, description="seq-mean-token-sum-norm divisor; "
                                            "default sampling.max_new_tokens")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus in the policy loss")
    kl_loss_coef: float = Field(0.0, ge=0, description="KL-to-reference term in the policy loss")
    kl_loss_estimator: str = Field("k3", description="estimator of the kl_loss_coef term: "
                                   "k1 | k2 | k3")
    teacher_kl_coef: float = Field(0.0, ge=0, description="on-policy distillation's supervised term in the policy "
                                   "loss: the KL between the teacher's and the policy's distributions over the "
                                   "teacher's teacher.top_k most likely tokens (and the rest as one) at every "
                                   "sampled position; starts the teacher role")
    teacher_kl: str = Field("forward", description="direction of the teacher_kl_coef term: "
                            "forward | reverse (forward: KL(teacher || policy), mode-covering)")
    is_correction: str = Field("none", description="rollout/train importance-sampling correction")
    is_threshold: float = Field(2.0, gt=1, description="truncation / masking bound C of the IS weights")
    old_logprobs: Literal["auto", "recompute"] = Field(
        "auto", description="auto: an update of one optimizer step takes the PPO ratio's old logprobs from its "
        "own forward (no ComputeLogProbs pass of the policy) where nothing needs them earlier; recompute: always "
        "a separate pass before the update")

    _loss = field_validator("policy_loss")(lambda cls, v: _one_of(_algos().POLICY_LOSSES, v))

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = [f"actor.{k} is now {new}" for k, new in _MOVED_ACTOR_KEYS.items() if k in data]
            if moved:
                raise ValueError("; ".join(moved))
        return data
    _kl = field_validator("kl_loss_estimator")(lambda cls, v: _one_of(_algos().KL_ESTIMATORS, v))
    _is = field_validator("is_correction")(lambda cls, v: _one_of(_algos().IS_CORRECTIONS, v))
    _teacher_kl = field_validator("teacher_kl")(lambda cls, v: _one_of(_algos().TEACHER_KL, v))

    @field_validator("loss_agg_mode")
    @classmethod
    def _agg(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else _one_of(_algos().LOSS_AGGREGATIONS, v)

    @model_validator(mode="after")
    def _clip_defaults(self) -> ActorSection:
        if self.policy_loss == "gspo" and self.dual_clip is not None:
            raise ValueError("dual_clip is not defined for policy_loss gspo")
        if self.clip_ratio is None:
            # A sequence-level ratio is a geometric mean and barely moves: GSPO clips far tighter.
            low, high = CLIP_DEFAULTS[self.policy_loss]
            self.clip_ratio = low
            self.clip_ratio_high = self.clip_ratio_high if self.clip_ratio_high is not None else high
        elif self.clip_ratio_high is None:
            self.clip_ratio_high = self.clip_ratio
        return self

    @property
    def reference_is_the_policy(self) -> bool:
        """With adapters on the actor's own model, the reference is that model with them switched
        off: no copy of its own."""
        return self.lora.enabled and self.ref_model_name_or_path == self.model_name_or_path

    @property
    def supervised(self) -> bool:
        """The policy loss trains toward given tokens (`sft`, algorithm sft), not on samples: it reads
        no old logprobs and no reference, and nothing samples from the engine between updates."""
        return self.policy_loss == "sft"

    @property
    def holds_reference(self) -> bool:
        """Whether the actor holds a reference model of its own: not when it is the policy with its
        adapters off, nor for a supervised loss (nothing reads one)."""
        return not self.reference_is_the_policy and not self.supervised

    def lora_engine_problem(self, backend: str, split: bool) -> Optional[str]:
        """Why adapters cannot train beside this rollout engine, or None. A weight sync sends the
        adapted layers alone; vLLM beside the trainer at sleep level 2 drops every weight while the
        trainer runs, and the rest would be lost."""
        if self.lora.enabled and backend == "vllm" and not split and self.rollout.vllm.sleep_level == 2:
            return ("actor.lora sends the adapted layers alone after an update, and vLLM at "
                    "actor.rollout.vllm.sleep_level 2 drops all its weights while the trainer runs beside it: "
                    "set actor.rollout.vllm.sleep_level to 1 (weights kept in host memory) or 0")
        return None

    @model_validator(mode="after")
    def _lora_beside_vllm(self) -> ActorSection:
        if (problem := self.lora_engine_problem(self.rollout.backend, split=self.rollout.workers is not None)):
            raise ValueError(problem)
        return self

    @property
    def publishes_on_update(self) -> bool:
        """Whether each update's weights go into the rollout engines at once (RL samples from them
        next); with the sft loss only when a generation (an evaluation) asks for them."""
        return not self.supervised

    def one_pass_problem(self) -> Optional[str]:
        """Why an update cannot take its old logprobs from its own forward (the policy before its
        optimizer step, that is, the proximal policy), or None. A supervised loss reads none."""
        if self.supervised:
            return None
        if self.ppo_epochs * self.num_mini_batches > 1:
            return (f"the update makes {self.ppo_epochs * self.num_mini_batches} optimizer steps (actor.ppo_epochs "
                    "x actor.num_mini_batches), and every one after the first needs the policy before the first")
        if _algos().IS_CORRECTIONS.get(self.is_correction).drops_tokens:
            return (f"actor.is_correction={self.is_correction} drops tokens by their old logprobs, which fixes "
                    "the loss's divisor before the first forward")
        return None


class CriticSection(_TrainerSection):
    value_clip: float = Field(0.2, gt=0, description="value clipping range around the old values")
    lora: LoraSection = Field(default_factory=lambda: LoraSection(), description="low-rank adapters in the "
                              "value model's backbone: they and the value head train, the backbone stays frozen")
