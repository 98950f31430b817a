"""Prometheus metrics every role exports (all prefixed `rolefleet_`, labelled by `role`).

Defined once here so names and labels stay consistent across roles; docs/metrics.md lists them.
Each role process serves them on its own `metrics_port` at /metrics.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RPC_SECONDS = Histogram(
    "rolefleet_rpc_duration_seconds",
    "Server-side duration of a role RPC",
    ["role", "method", "code"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
RPC_RECEIVED_BYTES = Counter("rolefleet_rpc_received_bytes", "Request bytes received", ["role", "method"])
RPC_SENT_BYTES = Counter("rolefleet_rpc_sent_bytes", "Response bytes sent", ["role", "method"])
HEALTH = Gauge("rolefleet_health", "1 while the role is SERVING, 0 otherwise", ["role"])
MODEL_VERSION = Gauge("rolefleet_model_version", "Policy (actor) or value-model (critic) version", ["role"])
ROLLOUT_ENGINE = Gauge("rolefleet_rollout_engine", "1 for the rollout engine the actor generates with (label "
                       "engine: vllm, hf, hf (transformers generate)), 0 for one it no longer does", ["role", "engine"])
TOKENS_GENERATED = Counter("rolefleet_tokens_generated", "Response tokens generated", ["role"])
ROLLOUT_SECONDS = Histogram(
    "rolefleet_rollout_latency_seconds",
    "Latency of one rollout batch, request to last sample",
    ["role"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
WEIGHT_SYNC_SECONDS = Histogram(
    "rolefleet_weight_sync_seconds",
    "Time to move the trainer's new weights into the rollout engine after an update",
    ["role"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TEACHER_TOKENS = Counter("rolefleet_teacher_tokens", "Sampled tokens the teacher role computed logprobs of")
SAMPLES_SCORED = Counter("rolefleet_samples_scored", "Samples scored by the reward role", ["role"])
REWARD_ERRORS = Counter("rolefleet_reward_errors", "Samples a reward source could not score (an exception, a "
                        "timeout, a crashed worker, a non-number, NaN or inf): they got reward.fallback_score",
                        ["role", "function"])
ENDPOINT_REQUESTS = Counter("rolefleet_endpoint_requests", "Chat completion requests of the actor's "
                            "OpenAI-compatible endpoint, by HTTP status", ["role", "status"])
ENDPOINT_SESSIONS = Gauge("rolefleet_endpoint_sessions", "Sessions (agent-driven episodes) open on the actor's "
                          "endpoint", ["role"])
STAGE_SECONDS = Counter(
    "rolefleet_stage_busy_seconds", "Time the coordinator spent in each step phase", ["role", "stage"]
)
TRAIN_STEPS = Counter("rolefleet_train_steps", "Training steps applied", ["role"])
COMPILED_GRAPHS = Counter("rolefleet_compiled_graphs", "Graphs torch.compile made in a trainer role (its first "
                          "update's, then any recompile for a new shape or mode)", ["role"])
PIPELINE_QUEUE_DEPTH = Gauge("rolefleet_pipeline_queue_depth", "Rollout batches waiting between stages of the "
                             "async pipeline", ["role", "queue"])
PIPELINE_STALE_SAMPLES = Counter("rolefleet_pipeline_stale_samples", "Samples that aged past "
                                 "pipeline.max_staleness before training (then regenerated or dropped)", ["role"])

# Per GPU of the role's group, from NVML (sampled in the background by rolefleet.common.gpu_metrics);
# `group` is the role's GPUs as CUDA_VISIBLE_DEVICES names them ("0,1,2,3"), `gpu` one physical
# index. Never exported on a machine without NVIDIA GPUs (absent, not zero).
GPU_LABELS = ["role", "group", "gpu"]
GPU_UTILIZATION = Gauge("rolefleet_gpu_utilization_ratio", "Share of the last sample period a kernel ran on "
                        "the GPU (NVML)", GPU_LABELS)
GPU_MEMORY_USED = Gauge("rolefleet_gpu_memory_used_bytes", "GPU memory in use by every process (NVML)", GPU_LABELS)
GPU_MEMORY_TOTAL = Gauge("rolefleet_gpu_memory_total_bytes", "GPU memory installed (NVML)", GPU_LABELS)
GPU_MEMORY_FRAGMENTATION = Gauge(
    "rolefleet_gpu_memory_fragmentation_ratio", "Share of the memory the role's PyTorch allocator reserved "
    "that holds no tensor (reserved - allocated) / reserved, on the GPU of the serving process", GPU_LABELS)
