"""The run config: one YAML file, validated by typed pydantic models before anything starts.

`load_config(path, overrides)` applies dotted overrides (`actor.lr=1e-6`, values parsed as YAML)
and raises ConfigError naming the key and what is allowed. Every field is documented here once,
with its default; docs/config.md mirrors this file.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rolefleet.algos import IS_CORRECTIONS, KL_CONTROLLERS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from rolefleet.algos.presets import ALGORITHMS
from rolefleet.algos.registry import Registry

ROLES = ("actor", "reward", "critic", "coordinator")
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


class RunSection(_Section):
    name: str = Field("rolefleet", pattern=r"^[A-Za-z0-9_.-]+$", description="run name (letters, digits, _.-); "
                      "the default output directory is runs/<name>")
    output_dir: Optional[str] = Field(None, description="default runs/<name>")
    seed: int = Field(0, description="seeds model initialisation order, prompt shuffling and sampling")
    max_restarts: int = Field(3, ge=0, description="`rolefleet up` restarts a role process that dies up to this "
                              "many times (the coordinator with run.resume=true), and the coordinator recovers "
                              "from a lost role as often: it reloads the newest checkpoint into every trainer "
                              "role and goes on from there; 0: a lost role ends the run")
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

    cert_file: Optional[str] = Field(None, description="PEM certificate this process presents (as a server, and as "
                                     "a client under mutual TLS); set: TLS on")
    key_file: Optional[str] = Field(None, description="PEM private key of cert_file")
    ca_file: Optional[str] = Field(None, description="PEM CA certificate(s) that clients verify servers with "
                                   "(and servers verify clients with, under mutual TLS); unset: the system's roots")
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

    token_file: Optional[str] = Field(None, description="file whose first line is the run's shared token; every "
                                      "role server then refuses gRPC calls without it (health checks excepted), "
                                      "and so does the HTTP control plane (/healthz excepted)")
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
    dir: Optional[str] = Field(None, description="default <run.output_dir>/checkpoints; the trainer roles "
                               "write their parts there too, so it must be storage they share with the "
                               "coordinator under the same path")

    def root(self, run: RunSection) -> Path:
        return Path(self.dir) if self.dir else run.out / "checkpoints"

    @property
    def periodic(self) -> bool:
        """Checkpoints come during the run, not only at its end."""
        return self.every > 0 or self.every_minutes > 0

    def due(self, step: int, total_steps: int, minutes_since_last: float = 0.0) -> bool:
        return ((self.every > 0 and step % self.every == 0) or (self.at_end and step == total_steps)
                or (self.every_minutes > 0 and minutes_since_last >= self.every_minutes))


class ModelSection(_Section):
    model_name_or_path: Optional[str] = Field(None, description="default for actor and critic models")


def _known_task(name: Optional[str]) -> Optional[str]:
    from rolefleet.tasks import TASKS

    if name is not None and name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return name


class DataSection(_Section):
    task: Optional[str] = Field("addition", description="built-in prompt generator (rolefleet.tasks)")
    path: Optional[str] = Field(None, description="JSONL or Parquet file of prompts (docs/data.md); overrides task")
    format: Optional[Literal["jsonl", "parquet"]] = Field(
        None, description="format of data.path; default: from its extension (.jsonl/.ndjson, .parquet/.pq)")
    prompt_key: str = Field("prompt", min_length=1, description="column of the prompt: text, or chat messages "
                            "(a list of {role, content}); dotted to reach into a nested object")
    answer_key: str = Field("ground_truth", min_length=1, description="column of the ground truth (a string "
                            "or a number; optional); dotted to reach into a nested object")
    extra_keys: Optional[list[str]] = Field(None, description="columns passed to the reward as the record's "
                                            "extra; default: every column but the prompt and answer ones")
    chat_template: Optional[bool] = Field(None, description="render prompts with the tokenizer chat template "
                                          "of the actor's model; default: when the prompts are chat messages")
    max_prompt_tokens: Optional[int] = Field(None, ge=1, description="prompt length limit in tokens, after "
                                             "the chat template; default: none")
    overlong: Literal["filter", "truncate", "error"] = Field(
        "filter", description="prompts over max_prompt_tokens: filter (drop), truncate (cut the start of the "
        "last message), error (refuse the dataset); dropped and cut prompts are counted")
    shuffle: bool = Field(True, description="a new order (by run.seed) every epoch; false: the file's order")
    size: int = Field(4096, ge=1, description="prompts drawn from a built-in task")

    _task = field_validator("task")(lambda cls, v: _known_task(v))

    @model_validator(mode="after")
    def _one_source(self) -> DataSection:
        if not self.task and not self.path:
            raise ValueError("set data.task or data.path")
        if self.path and not Path(self.path).is_file():
            raise ValueError(f"data.path {self.path} is not a file")
        if self.path:
            from rolefleet.tasks.files import file_format

            file_format(self.path, self.format)  # an unknown extension without data.format is an error now
        if self.prompt_key == self.answer_key:
            raise ValueError(f"data.prompt_key and data.answer_key name the same column {self.prompt_key!r}")
        return self


class EvalSection(_Section):
    """Evaluation on held-out prompts during training (docs/config.md, "eval"): through the actor's
    rollout engine and the run's reward sources; it changes no weights, version or step ledger."""

    every: int = Field(0, ge=0, description="steps between evaluations (0: no evaluation at all); when on, "
                       "also before the first step and after the last (before_train, at_end)")
    before_train: bool = Field(True, description="evaluate the starting policy before step 1 (a record of step 0)")
    at_end: bool = Field(True, description="evaluate after the last step")
    task: Optional[str] = Field(None, description="built-in task of the held-out prompts; default (with no "
                                "eval.path): data.task, on a draw disjoint from the training prompts (they are "
                                "left out of training)")
    path: Optional[str] = Field(None, description="JSONL or Parquet file of held-out prompts, read like data.path "
                                "(with data's chat template and token limit); a run on data.path needs one")
    format: Optional[Literal["jsonl", "parquet"]] = Field(None, description="format of eval.path; default: from "
                                                           "its extension")
    prompt_key: Optional[str] = Field(None, min_length=1, description="prompt column of eval.path; default "
                                      "data.prompt_key")
    answer_key: Optional[str] = Field(None, min_length=1, description="ground-truth column; default data.answer_key")
    extra_keys: Optional[list[str]] = Field(None, description="columns passed to the reward; default data.extra_keys")
    max_prompts: int = Field(200, ge=1, description="held-out prompts evaluated (a file's first ones)")
    samples_per_prompt: int = Field(1, ge=1, description="k samples per prompt: pass@k and mean@k "
                                    "(eval/reward/mean over all k); more than 1 needs eval.temperature > 0")
    temperature: float = Field(0.0, ge=0, description="0: greedy; else sampled at this temperature (>= 0.01)")
    max_new_tokens: Optional[int] = Field(None, ge=1, description="default sampling.max_new_tokens")
    pass_threshold: float = Field(1.0, description="a sample passes (pass@k) when its total reward is at least this")
    save_samples: bool = Field(True, description="write every evaluation's samples (prompt, response, reward, finish "
                               "reason, last token id) to <run.output_dir>/eval_samples.jsonl")

    @property
    def enabled(self) -> bool:
        return self.every > 0

    _task = field_validator("task")(lambda cls, v: _known_task(v))

    @model_validator(mode="after")
    def _checks(self) -> EvalSection:
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"eval.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}")
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError(f"eval.samples_per_prompt={self.samples_per_prompt} greedy samples are all alike: set "
                             "eval.temperature > 0 for pass@k, or eval.samples_per_prompt=1")
        if self.path and self.task:
            raise ValueError("set one of eval.path and eval.task")
        if self.path:
            if not Path(self.path).is_file():
                raise ValueError(f"eval.path {self.path} is not a file")
            from rolefleet.tasks.files import file_format

            try:
                file_format(self.path, self.format)
            except ValueError as e:
                raise ValueError(str(e).replace("data.format", "eval.format")) from None
        return self


class SamplingSection(_Section):
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, description="softmax temperature of the rollouts; "
                               "every recorded and trained logprob is of softmax(logits / temperature)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens holding this "
                         "probability mass (1: off)")
    top_k: int = Field(0, ge=0, description="top-k sampling: the k most likely tokens only (0: off)")
    max_new_tokens: int = Field(16, ge=1, description="response length cap; a response cut there finishes with "
                                "reason LENGTH")
    stop_token_ids: list[int] = Field(default_factory=list, max_length=256, description="token ids that end a "
                                      "response besides the checkpoint's own (its tokenizer's eos and every id of "
                                      "its generation_config.json eos_token_id); the stop token is the response's "
                                      "last token and is trained")

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        negative = [i for i in v if i < 0]
        if negative:
            raise ValueError(f"token ids are >= 0, got {negative}")
        return v


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
                              f"penalty and the kl metric: {' | '.join(KL_ESTIMATORS.names())}")
    kl_controller: str = Field("fixed", description="fixed | adaptive (targets kl_target)")
    kl_target: float = Field(0.1, gt=0, description="adaptive controller: per-token KL to track")
    kl_horizon: int = Field(10000, ge=1, description="adaptive controller: samples to close the gap")
    critic_warmup_steps: int = Field(0, ge=0, description="first steps that train only the critic (the actor "
                                     "is not updated), so advantages start from useful values; PPO, sync mode")
    rpc_timeout_s: float = Field(600.0, gt=0, description="deadline of each role call")
    connect_timeout_s: float = Field(300.0, gt=0, description="wait this long for every role to be SERVING")

    _kl = field_validator("kl_estimator")(lambda cls, v: _one_of(KL_ESTIMATORS, v))
    _ctl = field_validator("kl_controller")(lambda cls, v: _one_of(KL_CONTROLLERS, v))

    @model_validator(mode="after")
    def _adaptive_needs_a_start(self) -> TrainSection:
        if self.kl_controller == "adaptive" and self.kl_coef == 0:
            raise ValueError("kl_controller adaptive scales kl_coef, which is 0: set train.kl_coef > 0")
        return self


class _TrainerSection(Endpoint):
    model_name_or_path: Optional[str] = Field(None, description="the model this trainer starts from; default "
                                              "model.model_name_or_path")
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
    sequence_packing: bool = Field(False, description="micro-batches as one row of sequences without "
                                   "padding (attention kept inside each sequence by a block mask) instead "
                                   "of right-padded rows")
    workers: Optional[int] = Field(None, ge=1, description="worker processes of this role (torch.distributed, "
                                   "data parallel): default one per GPU of its device group; on the CPU, gloo "
                                   "workers")
    sharding: Literal["fsdp", "replicate"] = Field("fsdp", description="how several workers hold the model: "
                                                   "fsdp = parameters, gradients and optimizer state sharded "
                                                   "over the workers (FSDP2; bf16 compute on CUDA); replicate = "
                                                   "a full copy each, gradients all-reduced")
    compile_layers: bool = Field(False, description="torch.compile each decoder layer (one compilation "
                                 "shared by all layers; norms, RoPE and activations fused): faster steps after "
                                 "a compile of tens of seconds per new micro-batch shape family")
    compute_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="autocast dtype of forwards and backwards (auto: bfloat16 on CUDA, float32 on "
        "CPU); master weights and optimizer state stay float32")
    profile_updates: list[int] = Field(default_factory=list, description="updates of each worker process to "
                                       "run under torch.profiler (1: its first): a Chrome trace and an op table "
                                       "per rank go to profile_dir")
    profile_dir: str = Field("profiles", description="where profile_updates writes <role>-update<N>-rank<R>.json "
                             "and .txt")


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
                            "stream back as soon as it finishes")
    decode: Literal["auto", "loop", "generate"] = Field(
        "auto", description="decoding of the hf engine: loop (the engine's own KV cache, device sampling, "
        "one CUDA graph per step), generate (transformers' generate), or auto (loop, falling back to "
        "generate for a model whose attention the loop cannot serve)")
    keep_decode_state_mb: int = Field(2048, ge=0, description="hf decode loop: the KV cache, buffers and "
                                      "captured CUDA graph of each batch shape (training, evaluation) stay "
                                      "between calls while all of them take at most this many MiB (a colocated "
                                      "trainer updates around them); beyond it the least recently used go back "
                                      "to the trainer before each update and are built again, graph capture "
                                      "included, at their next call")
    vllm: VllmSection = Field(default_factory=VllmSection)
    workers: Optional[int] = Field(None, ge=1, description="CPU groups: the first N of the actor's workers only "
                                   "generate and the others only train (on GPUs devices.rollout says it)")
    sync_bucket_mb: int = Field(256, ge=1, description="split placement: MiB of weights per broadcast "
                                "from the trainers to the rollout workers (vllm: into its engines)")
    profile_generates: list[int] = Field(default_factory=list, description="generations of each generating "
                                         "worker process to run under torch.profiler (1: its first), as "
                                         "actor.profile_updates: actor-generate<N>-rank<R>.* in actor.profile_dir "
                                         "(vllm: this process's side only, not the engine's own processes)")


# Keys that moved: a config still using one gets the new name, not just "extra inputs are not permitted".
_MOVED_ACTOR_KEYS = {"rollout_batch_size": "actor.rollout.batch_size", "rollout_decode": "actor.rollout.decode",
                     "rollout_cache": "actor.rollout.decode (the decode loop replaced the static cache)"}


CLIP_DEFAULTS = {"ppo_clip": (0.2, 0.2), "gspo": (3e-4, 4e-4)}  # (low, high) per policy loss


class ActorSection(_TrainerSection):
    ref_model_name_or_path: Optional[str] = Field(None, description="default: the actor's model")
    rollout: RolloutSection = Field(default_factory=lambda: RolloutSection())
    max_prompt_bytes: int = Field(1 << 18, ge=1, description="UTF-8 bytes of one Generate prompt, "
                                  "checked before tokenization")
    ref_offload: bool = Field(False, description="keep the reference model in CPU memory between "
                              "ComputeLogProbs calls (frees its GPU memory for training)")
    logprob_chunk_tokens: int = Field(2048, ge=1, description="tokens per LM-head chunk when computing "
                                      "logprobs and entropy (bounds the [tokens, vocab] logits)")
    policy_loss: str = Field("ppo_clip", description=f"the policy loss: {' | '.join(POLICY_LOSSES.names())} "
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
                                   f"{' | '.join(KL_ESTIMATORS.names())}")
    is_correction: str = Field("none", description="rollout/train importance-sampling correction")
    is_threshold: float = Field(2.0, gt=1, description="truncation / masking bound C of the IS weights")
    old_logprobs: Literal["auto", "recompute"] = Field(
        "auto", description="auto: an update of one optimizer step takes the PPO ratio's old logprobs from its "
        "own forward (no ComputeLogProbs pass of the policy) where nothing needs them earlier; recompute: always "
        "a separate pass before the update")

    _loss = field_validator("policy_loss")(lambda cls, v: _one_of(POLICY_LOSSES, v))

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = [f"actor.{k} is now {new}" for k, new in _MOVED_ACTOR_KEYS.items() if k in data]
            if moved:
                raise ValueError("; ".join(moved))
        return data
    _kl = field_validator("kl_loss_estimator")(lambda cls, v: _one_of(KL_ESTIMATORS, v))
    _is = field_validator("is_correction")(lambda cls, v: _one_of(IS_CORRECTIONS, v))

    @field_validator("loss_agg_mode")
    @classmethod
    def _agg(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else _one_of(LOSS_AGGREGATIONS, v)

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

    def one_pass_problem(self) -> Optional[str]:
        """Why an update cannot take its old logprobs from its own forward (the policy before its
        optimizer step, that is, the proximal policy), or None."""
        if self.ppo_epochs * self.num_mini_batches > 1:
            return (f"the update makes {self.ppo_epochs * self.num_mini_batches} optimizer steps (actor.ppo_epochs "
                    "x actor.num_mini_batches), and every one after the first needs the policy before the first")
        if IS_CORRECTIONS.get(self.is_correction).drops_tokens:
            return (f"actor.is_correction={self.is_correction} drops tokens by their old logprobs, which fixes "
                    "the loss's divisor before the first forward")
        return None


class CriticSection(_TrainerSection):
    value_clip: float = Field(0.2, gt=0, description="value clipping range around the old values")


class RewardSection(Endpoint):
    class Source(_Section):
        """One entry of `reward.sources`. Keys other than these are options of a built-in function
        (`pattern` of `format`), checked against that function's keyword-only parameters."""

        model_config = ConfigDict(extra="allow", allow_inf_nan=False)
        name: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description="unique label of the "
                                    "source's scores, errors and metrics; default the function name, the file's "
                                    "stem, or `model`")
        kind: Literal["function", "user", "model"] = Field("function", description="function: a built-in; user: "
                                                           "a function from a Python file; model: a reward model")
        function: Optional[str] = Field(None, description="kind function: the built-in's name")
        path: Optional[str] = Field(None, description="kind user: path/to/file.py:function; kind model: the "
                                    "reward model (a local directory or a hub id)")
        weight: float = Field(1.0, description="the total adds weight x this source's score")
        batched: bool = Field(False, description="kind user: the function takes lists (one per argument) and "
                              "returns a list of scores")

        @model_validator(mode="after")
        def _kind(self) -> RewardSection.Source:
            options = dict(self.model_extra or {})
            if self.kind == "function":
                from rolefleet.reward.functions import REWARD_FUNCTIONS, check_options

                if self.function is None:
                    raise ValueError(f"a function source needs `function`, one of: {', '.join(REWARD_FUNCTIONS.names())}")
                _one_of(REWARD_FUNCTIONS, self.function)
                for key in ("path", "batched"):
                    if key in self.model_fields_set and getattr(self, key):
                        raise ValueError(f"`{key}` is for user sources, not built-in functions")
                self.__pydantic_extra__ = check_options(self.function, options)
            else:
                if options:
                    raise ValueError(f"unknown key(s) {', '.join(sorted(options))}: options are for built-in "
                                     f"functions, not {self.kind} sources")
                if self.function is not None:
                    raise ValueError(f"`function` names a built-in (kind function); a {self.kind} source takes `path`")
                if self.kind == "model" and self.batched:
                    raise ValueError("`batched` is for user sources")
                if not self.path:
                    form = "path/to/file.py:function" if self.kind == "user" else "a model directory or hub id"
                    raise ValueError(f"a {self.kind} source needs `path` ({form})")
                if self.kind == "user":
                    self.user_function()  # the form only: the file is checked where it runs
            if self.name is None:
                self.name = {"function": self.function, "model": "model"}.get(self.kind) or \
                    Path(self.user_function()[0]).stem
                if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
                    raise ValueError(f"set `name`: the default {self.name!r} has characters other than letters, "
                                     "digits and _.-")
            return self

        @property
        def options(self) -> dict[str, Any]:
            """A built-in function's options (keyword arguments), validated."""
            return dict(self.model_extra or {})

        def user_function(self) -> tuple[str, str]:
            """(file, function name) of a user source's `path`."""
            file, _, fn = (self.path or "").rpartition(":")
            if not file or not fn.isidentifier():
                raise ValueError(f"path {self.path!r} is not of the form path/to/file.py:function")
            return file, fn

    function: str = Field("exact_match", description="the built-in reward function (weight 1) when `sources` "
                          "is empty")
    sources: list[Source] = Field(default_factory=list, description="reward sources combined as the sum of "
                                  "weight x score (docs/rewards.md); default [`function`]")
    fallback_score: float = Field(0.0, description="the score a source counts for a sample it failed on")
    user_workers: int = Field(2, ge=1, description="worker processes running user functions (and `math`)")
    user_timeout_s: float = Field(10.0, gt=0, description="deadline of one call in a worker (a whole batch for "
                                  "`batched` sources); past it the worker is killed and replaced")
    user_memory_mb: int = Field(2048, ge=0, description="address-space limit of each worker (RLIMIT_AS); 0: none")
    model_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="reward model compute dtype on a GPU (a CPU computes float32)")
    model_max_tokens_per_batch: int = Field(16384, ge=1, description="reward model: rows x longest row per forward")
    max_items_per_request: int = Field(65536, ge=1, description="samples one Score request may carry")
    max_item_bytes: int = Field(1 << 20, ge=1, description="UTF-8 bytes of one item's prompt + response + "
                                "ground truth + extra (JSON)")
    replicas: list[str] = Field(default_factory=list, description="host:port of several reward servers: the "
                                "coordinator spreads each batch across them (instead of reward.address)")
    restart_wait_s: float = Field(300.0, ge=0, description="a Score call that fails because the reward role (or "
                                  "every replica) went away is repeated once it answers again, for up to this many "
                                  "seconds; the trainers do not roll back (the reward holds no training state); "
                                  "past it the run fails naming this key")
    score_delay_s: float = Field(0.0, ge=0, le=600, description="seconds each Score call waits before "
                                 "scoring: a stand-in for a slower reward (a reward model) in benchmarks and tests")

    @field_validator("function")
    @classmethod
    def _function(cls, v: str) -> str:
        from rolefleet.reward.functions import REWARD_FUNCTIONS, check_options

        _one_of(REWARD_FUNCTIONS, v)
        try:
            check_options(v, {})
        except ValueError as e:
            raise ValueError(f"{e}: list it in reward.sources with its options") from None
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> RewardSection:
        seen: dict[str, int] = {}
        for i, source in enumerate(self.sources):
            if source.name in seen:
                raise ValueError(f"sources[{i}] and sources[{seen[source.name]}] are both named {source.name!r}: "
                                 "give one a `name`")
            seen[source.name] = i
        return self

    def scoring_sources(self) -> list[RewardSection.Source]:
        """`sources`, or the one built-in `function` when there are none."""
        return self.sources or [RewardSection.Source(kind="function", function=self.function)]


class CoordinatorSection(Endpoint):
    # One thread: the coordinator's tensor work (targets, checks) is small, and on a node shared with
    # the role processes a pool of torch threads per core stalls on every op (docs/benchmarks.md,
    # "The coordinator's CPU threads": 0.3-0.4 s a step at 16 threads against 0.02 s at 1).
    num_threads: Optional[int] = Field(1, ge=1, description="torch CPU threads of the coordinator")
    http_enabled: bool = Field(True, description="serve the HTTP control plane (FastAPI: status, steps, roles, "
                               "pause, resume, stop; OpenAPI at /openapi.json)")
    http_host: str = Field("127.0.0.1", description="interface the HTTP control plane binds (loopback unless set)")
    http_port: int = Field(0, ge=0, le=65535, description="HTTP control plane port; 0 picks a free one")


ASYNC_IS_CORRECTION = "token_truncate"


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


class PipelineSection(_Section):
    """How the coordinator schedules the stages (docs/architecture.md, "The asynchronous pipeline")."""

    mode: Literal["sync", "async"] = Field("sync", description="sync: one step's phases one after another; "
                                           "async: later batches generate while earlier ones are scored "
                                           "and trained on")
    max_staleness: int = Field(1, ge=0, description="async: a batch is trained on only while the actor's "
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
    retries: int = Field(2, ge=0, description="async: repeats of a role call that failed transiently "
                         "(UNAVAILABLE, a deadline), with backoff; every call is safe to repeat")

    @property
    def lagged(self) -> bool:
        """Whether updates may train on samples of an older policy."""
        return self.mode == "async" and self.max_staleness > 0

    @property
    def staleness_bound(self) -> int:
        """Versions a trained batch may lag the actor by (sync: none)."""
        return self.max_staleness if self.mode == "async" else 0


DeviceList = list[Union[int, str]]


class DevicesSection(_Section):
    """GPU groups, as in verl guides: ints are local GPU indices, "node:i" names another node."""

    actor: DeviceList = Field(default_factory=list, description="the actor's GPUs (one worker each); empty: CPU")
    reward: DeviceList = Field(default_factory=list, description="the reward's GPUs (a reward model); empty: CPU")
    critic: DeviceList = Field(default_factory=list, description="the critic's GPUs (one worker each); empty: CPU")
    rollout: DeviceList = Field(default_factory=list, description="subset of the actor's GPUs")
    colocate: list[list[Literal["actor", "reward", "critic"]]] = Field(
        default_factory=list, description="sets of roles that share GPUs on purpose, e.g. [[actor, critic]]; "
        "groups that overlap otherwise are a config error")

    @field_validator("actor", "reward", "critic", "rollout")
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
        roles = ("actor", "reward", "critic")
        for i, a in enumerate(roles):
            for b in roles[i + 1:]:
                shared = [d for d in getattr(self, a) if str(d) in map(str, getattr(self, b))]
                if shared and not any(a in group and b in group for group in self.colocate):
                    raise ValueError(f"devices.{a} and devices.{b} share GPUs {shared}: declare it with "
                                     f"devices.colocate: [[{a}, {b}]] (or give them separate GPUs)")
        return self

    def local_indices(self, role: str) -> list[int]:
        """GPU indices for CUDA_VISIBLE_DEVICES on this node; 'node:i' entries keep their index."""
        return [split_device(d)[1] for d in getattr(self, role)]


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
    coordinator: CoordinatorSection = Field(default_factory=CoordinatorSection)
    pipeline: PipelineSection = Field(default_factory=PipelineSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    security: SecuritySection = Field(default_factory=SecuritySection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    devices: DevicesSection = Field(default_factory=DevicesSection)

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
        if self.actor.ref_model_name_or_path is None:
            self.actor.ref_model_name_or_path = self.actor.model_name_or_path
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
        if warmup and self.pipeline.mode == "async":
            raise ValueError("train.critic_warmup_steps needs pipeline.mode sync (async generation waits for "
                             "actor updates the warm-up withholds)")
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
        if preset.grouped and self.train.samples_per_prompt < 2:
            raise ValueError(f"algorithm {self.algorithm} compares samples of one prompt: "
                             "set train.samples_per_prompt >= 2")
        return self

    @property
    def preset(self):
        return ALGORITHMS[self.algorithm]

    @property
    def one_pass_update(self) -> bool:
        """`actor.old_logprobs: auto` and it can: the actor's update computes each step's old
        logprobs in its own forward, and ComputeLogProbs asks for the reference's alone. A KL
        penalty in the rewards (`train.kl_coef`) needs the policy's logprobs before the advantages."""
        return self.actor.old_logprobs == "auto" and self.train.kl_coef == 0 and self.actor.one_pass_problem() is None

    def eval_data(self) -> DataSection:
        """The held-out prompts as a data source: eval's file or task, read and rendered like
        `data` (its chat template and token limit)."""
        d, e = self.data, self.eval
        return DataSection(task=None if e.path else (e.task or d.task), path=e.path, format=e.format,
                           prompt_key=e.prompt_key or d.prompt_key, answer_key=e.answer_key or d.answer_key,
                           extra_keys=e.extra_keys if e.extra_keys is not None else d.extra_keys,
                           chat_template=d.chat_template, max_prompt_tokens=d.max_prompt_tokens, overlong=d.overlong,
                           shuffle=False, size=e.max_prompts)

    def roles(self) -> list[str]:
        """Roles this run starts, in start order (the coordinator last); the critic only if needed."""
        return ["actor", "reward", *(["critic"] if self.preset.uses_critic else []), "coordinator"]


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (so 1e-6, true, [0, 1] work)."""
    key, sep, text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r} is not of the form dotted.key=value")
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = _override_value(override, text)


def _override_value(override: str, text: str) -> Any:
    if not text.strip():
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        # Quote a value that is meant as a string: run.name="'{x}'".
        raise ConfigError(f"override {override!r}: the value {text!r} is not valid YAML "
                          f"({_yaml_problem(e)})") from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """The YAML error without its source excerpt (which would repeat the override)."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return problem
    where = f"column {mark.column + 1}" if mark.line == 0 else f"line {mark.line + 1}, column {mark.column + 1}"
    return f"{problem} at {where}"


def _describe(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        key = ".".join(str(p) for p in e["loc"]) or "config"
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        elif isinstance(e.get("input"), dict):
            lines.append(f"{key}: {message}")
        else:
            lines.append(f"{key}: {message} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_config(raw: dict[str, Any], overrides: list[str] = ()) -> RoleFleetConfig:
    raw = yaml.safe_load(yaml.safe_dump(raw)) or {}  # deep copy; the caller's dict stays as it was
    for override in overrides:
        apply_override(raw, override)
    try:
        return RoleFleetConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> RoleFleetConfig:
    path = Path(path)
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (run, actor, ...)")
    return parse_config(raw, overrides)


def _read_yaml(path: Path) -> Any:
    """The parsed file, or a ConfigError naming it: missing, a directory, unreadable, not UTF-8,
    not YAML."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                          f"offset {e.start})") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None


def dump_config(config: RoleFleetConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
