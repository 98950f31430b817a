"""Value model: a transformers backbone loaded from a causal-LM directory plus a scalar head."""

from __future__ import annotations

import torch
from transformers import AutoModel

from rolefleet.common.batch import SequenceBatch
from rolefleet.common.modeling import load_pretrained, response_hidden
from rolefleet.trainer.loading import build_on_meta


class ValueModel(torch.nn.Module):
    def __init__(self, path: str, device: torch.device, on_meta: bool = False, trust_remote_code: bool = False):
        """`on_meta`: the backbone as a skeleton that the trainer's sharding fills (`trainer.loading`),
        where its checkpoint can be read by shard."""
        super().__init__()
        # AutoModel takes the backbone weights of a causal-LM checkpoint and drops its LM head.
        backbone = build_on_meta(AutoModel, path, trust_remote_code) if on_meta else None
        self.backbone = backbone or load_pretrained(AutoModel, path, device, trust_remote_code=trust_remote_code)
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1, device=device)
        # Zero init: values start at 0, so early advantages are the raw returns, not head noise.
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.backbone.config, "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int:
        return self.backbone.get_input_embeddings().num_embeddings

    def forward(self, batch: SequenceBatch, device: torch.device, packed: bool = False,
                attention: str = "sdpa") -> torch.Tensor:
        """V(state before each response token), packed [N] fp32: read at the position that predicts it.
        Callers call the module (not a part of it): sharded, its forward hook gathers the root's weights.
        `attention`: of packed micro-batches (`packed_attention.resolve`)."""
        hidden = response_hidden(self.backbone, batch, device, packed, attention)
        # The scalar head in fp32 even under bf16 autocast (sharded, it is its own fp32 unit): a
        # value rounded to bf16 is off by ~0.4%.
        with torch.autocast(device.type, enabled=False):
            return self.head(hidden.float()).squeeze(-1).clone()  # not a view: FSDP hooks the output
