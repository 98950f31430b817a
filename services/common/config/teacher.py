"""The teacher role's section: a frozen model grading the student's samples, token by token, for
on-policy distillation (`algorithm: distill`, or `train.distill_coef` beside another algorithm;
docs/algorithms.md, "On-policy distillation")."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, Field

from rolefleet.common.config.base import Endpoint
from rolefleet.common.config.paths import ExpandedPath

# The most tokens a position the teacher answers with (teacher.top_k): 3 KiB a token on the wire (int64
# ids, float32 logprobs); the KL term's tail holds the rest of the vocabulary.
MAX_TOP_K = 256


class TeacherSection(Endpoint):
    model_config = ConfigDict(extra="forbid")
    model_name_or_path: Optional[ExpandedPath] = Field(None, description="the teacher model (a local directory or "
                                                       "a hub id); its tokenizer must be the student's")
    trust_remote_code: Optional[bool] = Field(None, description="run the model's own Python files; default "
                                              "model.trust_remote_code")
    max_sequences_per_request: int = Field(65536, ge=1, description="sequences one ComputeLogProbs may carry")
    max_tokens_per_request: int = Field(1 << 20, ge=1, description="prompt + response tokens one "
                                        "ComputeLogProbs may carry")
    max_tokens_per_micro_batch: int = Field(16384, ge=1, description="tokens per forward (rows x longest "
                                            "sequence, or their sum with sequence_packing)")
    logprob_chunk_tokens: int = Field(2048, ge=1, description="tokens per LM-head chunk (the vocabulary's "
                                      "logits of that many tokens at a time)")
    sequence_packing: bool = Field(False, description="micro-batches as one row of sequences without padding")
    packed_attention: Literal["auto", "sdpa", "flex"] = Field("auto", description="as actor.packed_attention")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="the teacher's k most likely tokens at each sampled position "
                       "that actor.teacher_kl_coef's term reads (0: only the sampled tokens' logprobs)")
    check_chat_template: bool = Field(True, description="refuse a teacher whose chat template is not the "
                                      "student's (the vocabularies must match regardless)")
    compute_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="dtype of the teacher's weights and forwards (auto: bfloat16 on CUDA, float32 on "
        "the CPU); the logprobs are float32")
