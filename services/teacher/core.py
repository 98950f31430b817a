"""TeacherCore: the teacher role without gRPC. A frozen causal LM computing the logprob of every
token the student sampled, and asked for, its k most likely tokens at each of those positions (its
tokenizer must be the student's: the ids mean the same text), a micro-batch at a time through the
trainers' own logprob pass (`lm_logprobs`, `lm_top_k`: the LM head a chunk of tokens at a time,
never the whole [tokens, vocabulary] logits). One process; on several GPUs (`devices.teacher`) the
model's layers are split over them. Tests drive it in-process; the servicer wraps it."""

from __future__ import annotations

import hashlib
import logging
import threading

import torch
from transformers import AutoModelForCausalLM

from rolefleet.common import metrics, packed_attention
from rolefleet.common.batch import BatchLimits, SequenceBatch
from rolefleet.common.config import RoleFleetConfig, TeacherSection
from rolefleet.common.errors import InvalidArgument
from rolefleet.common.modeling import (
    check_model_path,
    compute_dtype,
    disable_dropout,
    lm_logprobs,
    lm_top_k,
    load_tokenizer,
    pick_device,
)
from rolefleet.common.role_types import RoleStatus
from rolefleet.common.top_k import MAX_TOP_K, TopK
from rolefleet.teacher.types import TeacherLogProbs

log = logging.getLogger(__name__)
ROLE = "teacher"


class TokenizerMismatch(ValueError):
    """The teacher's tokenizer is not the student's: its logprobs would be of other text."""


class TeacherCore:
    def __init__(self, cfg: TeacherSection, student: str | None = None, check_chat_template: bool = True):
        """`student`: the student model's path (actor.model_name_or_path), whose tokenizer the
        teacher's must equal (TokenizerMismatch naming what differs, before the model loads)."""
        self.cfg = cfg
        path = check_model_path(cfg.model_name_or_path)
        remote = bool(cfg.trust_remote_code)
        if student is not None:
            check_same_tokenizer(load_tokenizer(path, remote), load_tokenizer(student, remote), check_chat_template)
        self.device = pick_device()
        dtype = compute_dtype(self.device, cfg.compute_dtype) or torch.float32  # frozen: stored as it computes
        gpus = torch.cuda.device_count() if self.device.type == "cuda" else 0
        # Several GPUs: the layers split over them (a teacher larger than one GPU), the first holding the embeddings.
        placement = {"device_map": "auto" if gpus > 1 else {"": self.device}} if gpus else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=remote, **placement)
        self.model = disable_dropout(model).eval().requires_grad_(False)
        self.attention = packed_attention.resolve(cfg.packed_attention, self.device)
        self.vocab_size = self.model.get_output_embeddings().out_features
        self.limits = BatchLimits.of(ROLE, cfg, getattr(self.model.config, "max_position_embeddings", None))
        self.digest = hashlib.sha256(f"{path}:{dtype}".encode()).hexdigest()[:16]
        self._lock = threading.Lock()  # one forward at a time: concurrent calls would share the GPU's memory

    def compute_logprobs(self, batch: SequenceBatch, temperature: float, top_k: int = 0) -> TeacherLogProbs:
        """log pi_teacher(token) of each response token of `batch` at `temperature`, float32 [N];
        with `top_k`, also the k most likely tokens at each response position and their logprobs."""
        if not temperature > 0:
            raise InvalidArgument("temperature", f"must be > 0, got {temperature}")
        if not 0 <= top_k <= min(MAX_TOP_K, self.vocab_size):
            raise InvalidArgument("top_k", f"must lie in [0, {min(MAX_TOP_K, self.vocab_size)}] (0: the sampled "
                                  f"tokens' logprobs alone), got {top_k}")
        batch.check_limits(self.limits, vocab_size=self.vocab_size)
        cfg = self.cfg

        def one(mb: SequenceBatch) -> tuple[torch.Tensor, ...]:
            if top_k:
                return lm_top_k(self.model, mb, self.device, temperature, cfg.logprob_chunk_tokens, top_k,
                                cfg.sequence_packing, self.attention)
            logprobs, _ = lm_logprobs(self.model, mb, self.device, temperature, cfg.logprob_chunk_tokens, False,
                                      cfg.sequence_packing, attention=self.attention)
            return (logprobs,)

        with self._lock, torch.inference_mode():
            logprobs, *top = batch.map_micro_batches(cfg.max_tokens_per_micro_batch, one, cfg.sequence_packing)
        metrics.TEACHER_TOKENS.inc(batch.num_response_tokens)
        return TeacherLogProbs(logprobs, TopK(ids=top[1], logprobs=top[0]) if top else None)

    def status(self, include_digest: bool = False) -> RoleStatus:
        return RoleStatus(ROLE, weights_digest=self.digest)  # the servicer counts the requests served

    def close(self) -> None:
        pass

    @classmethod
    def from_config(cls, cfg: RoleFleetConfig) -> TeacherCore:
        return cls(cfg.teacher, cfg.actor.model_name_or_path, cfg.teacher.check_chat_template)


def check_same_tokenizer(teacher, student, check_chat_template: bool = True) -> None:
    """TokenizerMismatch naming teacher.model_name_or_path and what differs: the vocabulary (a token
    with another id, or missing), the special tokens, or the chat template."""
    key = "teacher.model_name_or_path"
    mine, theirs = teacher.get_vocab(), student.get_vocab()
    if mine != theirs:
        differs = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise TokenizerMismatch(f"{key}: the teacher's tokenizer is not the student's ({len(mine)} vs {len(theirs)} "
                                f"tokens; e.g. {', '.join(f'{t!r}={i}' for t, i in differs)}): the teacher would "
                                "grade other text than the student sampled. Distil from a teacher of the same "
                                "tokenizer (a model family's larger member)")
    for name in ("eos_token", "bos_token"):
        if getattr(teacher, name, None) != getattr(student, name, None):
            raise TokenizerMismatch(f"{key}: the teacher's {name} is {getattr(teacher, name, None)!r}, the student's "
                                    f"{getattr(student, name, None)!r}")
    if check_chat_template and getattr(teacher, "chat_template", None) != getattr(student, "chat_template", None):
        raise TokenizerMismatch(f"{key}: the teacher's chat template is not the student's, so it grades "
                                "conversations in a format it was not trained on; set "
                                "teacher.check_chat_template=false where that is meant (a base-model teacher)")
