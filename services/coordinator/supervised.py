"""Supervised fine-tuning (`algorithm: sft`): the run's steps when the targets are the data's
completions (`tasks/supervised.py`) instead of the policy's samples. Each step:

1. the step's examples: the next `train.prompts_per_step` records of the data, in the run's order
   (the same position a checkpoint saves and a resumed run continues from);
2. actor.Update with the `sft` policy loss (the completions' token-mean NLL; the trainer's
   micro-batching, packing, LoRA, offload and accumulation as in RL);
3. the step's record (`sft/*`, `actor/*`, timing), with an evaluation when due: the held-out
   completions' NLL (`eval/sft_loss`, when the held-out records have completions) and the
   generation evaluation of RL runs (`eval/*`, through the reward role);
4. a checkpoint when due, else a snapshot, as in RL (`checkpoints.py`).

No rollouts, rewards, values or advantages: the reward role serves evaluation alone, and the
actor moves trained weights into its rollout engine only when an evaluation samples
(`ActorSection.publishes_on_update`); see docs/algorithms.md "Supervised fine-tuning".
"""

from __future__ import annotations

import logging
import time

import torch

from rolefleet.actor.types import PolicyTargets
from rolefleet.common import metrics
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import RoleFleetConfig
from rolefleet.common.model_paths import max_positions
from rolefleet.coordinator.busy import BusyClock
from rolefleet.coordinator.calls import Retries, Roles
from rolefleet.coordinator.checkpoints import Checkpointer
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.episodes import EpisodeStage
from rolefleet.coordinator.evaluation import Evaluator
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.saved_state import CoordinatorState
from rolefleet.coordinator.state import RunStatus
from rolefleet.tasks import DataError
from rolefleet.tasks.render import load_tokenizer
from rolefleet.tasks.supervised import Example, Fitted, examples, fit

log = logging.getLogger(__name__)


def supervised_examples(cfg: RoleFleetConfig, dataset: PromptDataset, key: str = "data") -> list[Example]:
    """`dataset`'s records as examples, in its record order (all tokenized at the start: a record
    without a completion is refused before the first step, naming it)."""
    tokenizer = dataset.tokenizer or load_tokenizer(cfg.actor.model_name_or_path, f"{key}.completion_key",
                                                    bool(cfg.actor.trust_remote_code))
    section = cfg.data if key == "data" else cfg.eval_data()
    return examples(tokenizer, dataset.records, dataset.chat, section.completion_key, not section.path,
                    dataset.source, key, dataset.renderer if dataset.chat else None)


def fitted(cfg: RoleFleetConfig, dataset: PromptDataset, made: list[Example]) -> Fitted:
    """`made` (`dataset`'s examples) within the length limit: `data.max_example_tokens`, at most the
    model's positions; longer ones as `data.overlong` says (error: refused before the first step,
    naming the example)."""
    d = cfg.data
    positions = max_positions(cfg.actor.model_name_or_path)
    limits = [(n, f"data.max_example_tokens={n}") for n in (d.max_example_tokens,) if n is not None]
    limits += [(positions, f"the {positions} positions of model {cfg.actor.model_name_or_path}")] if positions else []
    limit, named = min(limits) if limits else (None, "")
    result = fit(made, limit, d.overlong, named, dataset.source)
    if result.filtered or result.truncated:  # what the run trains on changed: a warning, never silence
        log.warning("data: %s: %d examples longer than %s dropped, %d cut at their completion's end (data.overlong=%s)",
                    dataset.source, result.filtered, named, result.truncated, d.overlong)
    return result


def as_batch(chosen: list[Example]) -> SequenceBatch:
    return SequenceBatch.from_lists([e.prompt_ids for e in chosen], [e.response_ids for e in chosen],
                                    [e.loss_mask for e in chosen])


def trained_tokens(batch: SequenceBatch) -> int:
    return int(batch.loss_mask.sum()) if batch.loss_mask is not None else int(batch.response_lengths.sum())


async def held_out_loss(actor, batch: SequenceBatch) -> dict[str, float]:
    """The policy's token-mean NLL of the held-out completions' trained tokens."""
    logprobs = (await actor.compute_logprobs(batch, 1.0, include_reference=False)).logprobs
    mask = batch.loss_mask if batch.loss_mask is not None else torch.ones_like(logprobs, dtype=torch.bool)
    return {"eval/sft_loss": float(-logprobs[mask].mean()), "eval/sft_tokens": float(mask.sum())}


class SupervisedSteps:
    """The run's examples, held-out examples and evaluator, the coordinator state, and the steps."""

    def __init__(self, cfg: RoleFleetConfig, roles: Roles, logger: RunLogger, status: RunStatus, clock: BusyClock,
                 checkpointer: Checkpointer, resumed: CoordinatorState | None = None):
        self.cfg, self.logger, self.status, self.clock, self.checkpointer = cfg, logger, status, clock, checkpointer
        self.state = resumed or CoordinatorState(step=0, kl_coef=0.0)
        self.saved = self.state.step
        self.dataset = PromptDataset.for_run(cfg)
        kept = fitted(cfg, self.dataset, supervised_examples(cfg, self.dataset))
        if not kept.examples:
            raise DataError(f"data.max_example_tokens: every one of the {len(self.dataset.records)} examples of "
                            f"{self.dataset.source} is too long (data.overlong={cfg.data.overlong})")
        self.dataset.narrow(kept.kept, kept.filtered, kept.truncated)
        if self.state.data is not None:  # a position among the records kept
            self.dataset.load_state_dict(self.state.data)
        self.examples = kept.examples
        self.index = {id(r): i for i, r in enumerate(self.dataset.records)}
        self.evaluator = Evaluator.for_run(cfg, self.dataset)
        self.held_out: SequenceBatch | None = None
        if self.evaluator is not None:
            held_out_data = PromptDataset.for_eval(cfg)
            try:
                made = supervised_examples(cfg, held_out_data, "eval")
            except DataError:
                made = []  # held-out prompts without completions: the generation evaluation alone
            # Fitted as the training examples are (data.overlong=error refuses a long one here too).
            held_out = fitted(cfg, held_out_data, made).examples if made else []
            self.held_out = as_batch(held_out) if held_out else None
        self.retries = Retries(cfg.pipeline.retries, self.state, 0,
                               lambda name, step, since: checkpointer.restore_role(getattr(roles, name), name, step,
                                                                                   since),
                               wait_s=cfg.train.connect_timeout_s, stateless_wait_s=cfg.reward.restart_wait_s,
                               stopping=lambda: self.status.stop_requested)
        self.roles = self.retries.wrap(roles)
        self.episodes = EpisodeStage(cfg, self.roles.actor, self.roles.reward)

    async def run(self) -> None:
        await self._evaluate(0)
        for step in range(self.state.step + 1, self.cfg.train.total_steps + 1):
            await self.status.wait_resumed()
            if self.status.stop_requested:
                break
            await self.step(step)
        await self.checkpointer.settle()
        if self.status.stop_requested and self.state.step > self.saved and self.cfg.checkpoint.at_end:
            await self.checkpointer.save(self.roles, self._saved_state(None), self.state.step)
            self.saved = self.state.step

    async def step(self, step: int) -> None:
        start = time.perf_counter()
        # 1. The step's examples: the data's next batch of records.
        records = self.dataset.next_batch(self.cfg.train.prompts_per_step)
        batch = as_batch([self.examples[self.index[id(r)]] for r in records])
        tokens = trained_tokens(batch)
        # 2. The update: every trained token a target of weight 1 (the sft loss reads no old logprobs).
        targets = PolicyTargets(advantages=torch.ones(int(batch.response_lengths.sum())), old_logprobs=None)
        result = await self.roles.actor.update(step, step - 1, batch, targets, 1.0)
        update_s = time.perf_counter() - start
        metrics.STAGE_SECONDS.labels("coordinator", "update").inc(update_s)
        self.state.step = step
        step_s = time.perf_counter() - start
        # 3. The record, with an evaluation when due (after the step's time).
        record = {"step": step, "policy_version": result.model_version,
                  "sft/loss": result.stats.get("nll", result.stats.get("loss")), "sft/tokens": float(tokens),
                  "sft/examples": float(len(batch)), "data/epoch": float(self.dataset.epoch),
                  **{f"actor/{k}": v for k, v in result.stats.items()},
                  "timing/update_s": update_s, "timing/step_s": step_s, "throughput/tokens_per_s": tokens / step_s}
        if step == 1:
            record.update(self.dataset.stats)  # what the load kept, filtered and truncated
        record.update(await self._evaluate(step))
        record.update(self.clock.fractions(), **self.checkpointer.take_recovery())

        # 4. Kept, then recorded (a checkpoint when due, else a snapshot: `Checkpointer.keep`).
        def log(kept: dict[str, float]) -> None:
            record.update(kept)
            self.logger.log(record)
            self.status.record_step(record, result.model_version)

        if await self.checkpointer.keep(self.roles, step, lambda: self._saved_state(record), lambda s: s.step, log):
            self.saved = step

    def _saved_state(self, record: dict | None) -> CoordinatorState:
        self.state.data, self.state.record = self.dataset.state_dict(), record
        return self.state

    async def _evaluate(self, step: int) -> dict[str, float]:
        """The held-out NLL and the generation evaluation when due after `step` (0: before the
        first, as its own record)."""
        if self.evaluator is None or not self.evaluator.due(step):
            return {}
        if step == 0 and (self.state.step > 0 or any(r["step"] == 0 for r in self.logger.records)):
            return {}
        out = await held_out_loss(self.roles.actor, self.held_out) if self.held_out is not None else {}
        if self.cfg.reward.sources or self.cfg.reward.function != "none":
            records = self.evaluator.records

            async def generate(prompts, sampling, first_group_id=0):
                return await self.episodes.generate(records, sampling, first_group_id)

            out.update(await self.evaluator.run(step, generate, self.roles.reward.score))
        if step == 0:
            record = {"step": 0, "policy_version": 0, **out}
            self.logger.log_eval(record)
            self.status.record_eval(record)
        return out
