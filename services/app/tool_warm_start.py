"""A supervised warm start on tool-call conversations (`tool_arithmetic`): what a model that has
never seen the calculator needs before RL can reward it for calling it (docs/environments.md).

Each example is a conversation as a multi-turn rollout holds it: the prompt rendered exactly as
the dataset renders it (the chat template, the tools of `data.tools`), then the assistant turns,
each closed by the template's end-of-turn token, and between them the tool's answer rendered by
the actor's own `TurnRenderer`. Only the assistant turns are trained. A share of the examples
(`tool_share`) calls the calculator; the others answer at once, so the RL run starts from a
policy that sometimes uses the tool and can learn that it pays.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from rolefleet.actor.turns import TurnRenderer
from rolefleet.app.tiny_model import padded_examples
from rolefleet.common.stop_tokens import end_of_turn_id
from rolefleet.tasks import PromptRecord, make_task
from rolefleet.tasks.render import PromptRenderer
from rolefleet.tasks.tools import tool_trace

log = logging.getLogger(__name__)
Example = tuple[list[int], list[bool]]  # token ids, and which of them are trained


def tool_examples(tokenizer: Any, records: list[PromptRecord], tool_share: float, rng: random.Random,
                  tools: tuple[str, ...] = ("calculator",)) -> list[Example]:
    renderer = PromptRenderer(tokenizer, "warm start", chat_template=True, tools=list(tools))
    turns, end = TurnRenderer(tokenizer), end_of_turn_id(tokenizer)
    if end is None:
        raise ValueError("the tokenizer's chat template writes no end-of-turn token: a tool warm start needs one")
    out = []
    for i, record in enumerate(records):
        ids = tokenizer(renderer.render(record.prompt, f"record {i}"))["input_ids"]
        trained = [False] * len(ids)
        trace = tool_trace(record) if rng.random() < tool_share else [{"role": "assistant",
                                                                       "content": record.ground_truth}]
        for message in trace:
            if message["role"] == "assistant":
                part = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [end]
            else:
                part = turns.observation_ids([message], ids[-1], "trace")
            ids += part
            trained += [message["role"] == "assistant"] * len(part)
        out.append((ids, trained))
    return out


def warm_start_on_tools(model: torch.nn.Module, tokenizer: Any, steps: int, seed: int, *, tool_share: float = 1.0,
                        batch_size: int = 64, lr: float = 3e-3, device: torch.device | str = "cpu") -> float:
    """`steps` supervised steps on `tool_arithmetic` conversations; returns the last loss."""
    records = make_task("tool_arithmetic", size=steps * batch_size, seed=seed + 1)
    rng = random.Random(seed)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for _ in range(steps):
        examples = tool_examples(tokenizer, rng.sample(records, min(batch_size, len(records))), tool_share, rng)
        ids, labels, mask = padded_examples(examples, pad)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.device(device).type == "cuda"):
            loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    log.info("tool warm start: %d steps, final loss %.3f", steps, loss.item())
    return loss.item()
