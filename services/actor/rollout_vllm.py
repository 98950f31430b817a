"""The `vllm` rollout engine: vLLM's offline engine, driven from the actor process.

Two ways to run it:

- **In this process** (an actor of one worker): the engine core runs here
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one GPU: vLLM's single-process executor), so a weight load
  is a direct call on its model with the trainer's GPU tensors: no serialisation, no IPC, no second
  copy.
- **In processes of its own** (`gpus`: a split actor's rollout worker, `actor/placement.py`): the
  actor group's torch.distributed world is not vLLM's to take, so the engine core and its workers
  start in their own processes on the given GPUs (tensor parallel over several), and the new
  weights arrive from the trainer over vLLM's NCCL weight transfer (`vllm_sync.py`).

Token ids go in and come out (vLLM's tokenizer is never loaded; texts are decoded with the actor's
own tokenizer, as the hf engine does).

Logprobs: vLLM's `processed_logprobs` mode reports log softmax of the logits after temperature
*and* top-k / top-p truncation (renormalised over the kept tokens). Without truncation that is
exactly the project's convention (docs/algorithms.md); with it, no vLLM mode gives the untruncated
tempered logprob, so requests with top-k or top-p are refused here rather than recorded under
another distribution (the hf engine serves them).

Sleep: while the trainer runs on the same GPU, vLLM frees its KV cache and offloads (level 1) or
drops (level 2) its weights; `load_weights` wakes the weights first, `wake` the rest. An engine on
GPUs of its own never sleeps.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rolefleet.actor.rollout import RolloutEngine, derived_seed
from rolefleet.actor.types import FinishReason, Sample, SamplingParams
from rolefleet.common.config import ActorSection
from rolefleet.common.errors import InvalidArgument, LimitExceeded
from rolefleet.common.stop_tokens import merged
from rolefleet.trainer.sharding import full_named_parameters

log = logging.getLogger(__name__)


def truncation_refused(sampling: SamplingParams) -> None:
    if sampling.top_k > 0 or sampling.top_p < 1.0:
        field = "sampling.top_k" if sampling.top_k > 0 else "sampling.top_p"
        raise InvalidArgument(field, "the vllm rollout backend cannot record the untruncated logprob the "
                              "project's convention needs when top-k or top-p truncates; turn truncation off "
                              "or set actor.rollout.backend=hf")


class VllmRolloutEngine(RolloutEngine):
    name = "vllm"

    def __init__(self, policy: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase, cfg: ActorSection,
                 model_path: str, stop_ids: tuple[int, ...], seed: int = 0, gpus: list[str] | None = None):
        """`stop_ids`: the checkpoint's own (`stop_tokens.checkpoint_stop_ids`): vLLM's tokenizer is
        not loaded and its generation defaults are off, so it knows no eos but these. `gpus`: run
        the engine in processes of its own on these GPUs (CUDA_VISIBLE_DEVICES entries), tensor
        parallel over them; None: in this process, on its GPU."""
        from vllm import LLM  # optional dependency: vllm (the vllm extra)

        v = cfg.rollout.vllm
        extra = {k: getattr(v, k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")
                 if getattr(v, k) is not None}
        self.remote = gpus is not None
        if self.remote:
            from vllm.config import WeightTransferConfig  # optional dependency: vllm

            extra.update(tensor_parallel_size=len(gpus), weight_transfer_config=WeightTransferConfig(backend="nccl"))
        self.max_model_len = v.max_model_len
        self.sleep_level = 0 if self.remote else v.sleep_level  # on GPUs of its own: nothing to make room for
        with _engine_environment(gpus):
            self.llm = LLM(
                model=model_path, dtype="float32" if cfg.compute_dtype == "float32" else "bfloat16", seed=seed,
                skip_tokenizer_init=True, trust_remote_code=bool(cfg.trust_remote_code),
                gpu_memory_utilization=v.gpu_memory_utilization, enforce_eager=v.enforce_eager,
                enable_prefix_caching=v.enable_prefix_caching, enable_sleep_mode=self.sleep_level > 0,
                logprobs_mode="processed_logprobs",
                # The checkpoint's sampling defaults (a repetition penalty, say) would reshape the
                # distribution behind the recorded logprobs: only the request's parameters apply.
                generation_config="vllm", **extra,
            )
        self.policy = policy
        self.stop_ids = stop_ids
        self.tokenizer = tokenizer
        self.cfg = cfg
        self._asleep = False           # KV cache (and weights) released
        self._weights_awake = True     # weight memory mapped on the GPU
        self._weights_current = True   # ... and holding the trainer's weights

    # --- weights and memory -------------------------------------------------------------------------
    # The flags are pessimistic (set before the call they describe): after a failure midway, the
    # next `wake` wakes everything and reloads the trainer's weights rather than sample from a
    # paused or half-restored engine.

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.remote:
            raise RuntimeError("an engine in processes of its own takes weights from the trainer over NCCL "
                               "(join_weight_transfer, receive_weights)")
        if not self._weights_awake:
            self._wake_tags(["weights"])
            self._weights_awake = True
        weights = [(name, tensor.detach()) for name, tensor in named]
        # vLLM's own loader maps checkpoint names onto its fused layers (q/k/v, gate/up) and casts
        # to its dtype. In-process engine: the callable runs here, on the trainer's GPU tensors.
        self._weights_current = False
        self.llm.collective_rpc(lambda worker: worker.get_model().load_weights(iter(weights)))
        self._weights_current = True

    def join_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's NCCL communicator (`vllm_sync.init_info`); blocks until all have."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def receive_weights(self, update_info: dict) -> None:
        """Load the weights the trainer broadcasts now (`vllm_sync.update_info`), bucket by bucket."""
        self._weights_current = False
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": update_info})
        self.llm.finish_weight_update()
        self._weights_current = True

    def close(self) -> None:
        """Stop the engine's own processes (an engine in this process has none)."""
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if self.remote and engine_core is not None:
            engine_core.shutdown()

    def sleep(self) -> None:
        if self.sleep_level > 0 and not self._asleep:
            self._asleep, self._weights_awake, self._weights_current = True, False, self.sleep_level == 1
            self.llm.sleep(level=self.sleep_level)

    def wake(self) -> None:
        if not self._asleep:
            return
        if not self._weights_awake:
            self._wake_tags(["weights"])
            self._weights_awake = True
        if not self._weights_current:  # dropped (level 2) or a load failed: the trainer's are current
            if self.policy is None:
                raise RuntimeError("the engine lost its weights and has no trainer beside it to reload them from")
            self.load_weights(full_named_parameters(self.policy))
        self._wake_tags(["kv_cache"])
        self._asleep = False

    def _wake_tags(self, tags: list[str]) -> None:
        # vLLM maps physical memory back in: what the trainer freed must leave torch's cache first.
        torch.cuda.empty_cache()
        self.llm.wake_up(tags=tags)

    def reset_cache(self) -> None:
        if not self._asleep:  # sleeping (level >= 1) already dropped the prefix cache with the KV cache
            self.llm.reset_prefix_cache()

    # --- generation ----------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams,
                 policy_version: int) -> Iterator[list[Sample]]:
        """n samples per prompt (vLLM's parallel sampling shares the prompt's KV blocks), prompt-major,
        `rollout.batch_size` sequences per engine call."""
        import vllm  # optional dependency: vllm

        truncation_refused(sampling)
        longest = max(len(p) for p in prompt_ids) + sampling.max_new_tokens
        if self.max_model_len is not None and longest > self.max_model_len:
            raise LimitExceeded("sampling.max_new_tokens", f"a prompt of {longest - sampling.max_new_tokens} tokens "
                                f"+ {sampling.max_new_tokens} new exceeds actor.rollout.vllm.max_model_len="
                                f"{self.max_model_len}")
        self.wake()
        stops = list(merged(self.stop_ids, sampling.stop_token_ids))
        per_call = max(1, self.cfg.rollout.batch_size // sampling.n)
        for start in range(0, len(prompt_ids), per_call):
            chunk = range(start, min(start + per_call, len(prompt_ids)))
            params = [vllm.SamplingParams(
                # temperature 0 is vLLM's greedy too. A stop id is kept as the output's last token
                # (vLLM leaves only stop *strings* out), as the hf engine keeps it.
                n=sampling.n, temperature=sampling.temperature, max_tokens=sampling.max_new_tokens,
                stop_token_ids=stops, logprobs=0, detokenize=False,
                # vLLM seeds child i of a request with seed + i: prompts far apart keep streams apart.
                seed=None if sampling.seed < 0 else derived_seed(sampling.seed, p * sampling.n),
            ) for p in chunk]
            outputs = self.llm.generate([vllm.TokensPrompt(prompt_token_ids=prompt_ids[p].tolist()) for p in chunk],
                                        params, use_tqdm=False)
            yield [self._sample(p, prompt_ids[p], completion, policy_version)
                   for p, out in zip(chunk, outputs) for completion in sorted(out.outputs, key=lambda c: c.index)]

    def _sample(self, prompt_index: int, prompt: torch.Tensor, completion, policy_version: int) -> Sample:
        tokens = list(completion.token_ids)
        logprobs = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        response = torch.tensor(tokens, dtype=torch.int64)
        reason = FinishReason.STOP if completion.finish_reason == "stop" else FinishReason.LENGTH
        return Sample(prompt_index=prompt_index, sample_index=completion.index, prompt_ids=prompt,
                      response_ids=response, logprobs=torch.tensor(logprobs, dtype=torch.float32),
                      finish_reason=reason, policy_version=policy_version,
                      response_text=self.tokenizer.decode(response, skip_special_tokens=True))


@contextlib.contextmanager
def _engine_environment(gpus: list[str] | None):
    """The environment vLLM reads while it starts the engine. In this process: no engine core
    process (for good: the process holds one engine). In processes of its own: spawned (this
    process has CUDA state, which a fork cannot carry), seeing only the engine's GPUs; this
    process's own devices are fixed already, and the variables are restored afterwards."""
    if gpus is None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        yield
        return
    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
              "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
