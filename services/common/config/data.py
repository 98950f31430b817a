"""What the run learns from and how it samples: the model, the training prompts (data), the
held-out prompts (eval) and the rollouts' sampling.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from rolefleet.common.config.app_checks import check_source, check_tools, known_task
from rolefleet.common.config.base import MIN_TEMPERATURE, _Section
from rolefleet.common.config.paths import ExpandedPath

# What a prompt source is (docs/data.md): a file, a `datasets` save_to_disk directory, a hub dataset id.
SourceFormat = Literal["jsonl", "json", "parquet", "datasets", "hub"]


class ModelSection(_Section):
    model_name_or_path: Optional[ExpandedPath] = Field(None, description="default for actor and critic models")
    trust_remote_code: bool = Field(False, description="run the Python files a model directory or hub repository "
                                    "ships (architectures transformers lacks) in the actor, the critic and the "
                                    "coordinator's tokenizer (docs/security.md); default for actor and critic")


class DataSection(_Section):
    task: Optional[str] = Field("addition", description="built-in prompt generator (rolefleet.tasks)")
    path: Optional[ExpandedPath] = Field(None, description="prompts (docs/data.md): a JSONL, JSON or Parquet file, "
                                         "a `datasets` save_to_disk directory, or a hub dataset id; overrides task")
    format: Optional[SourceFormat] = Field(
        None, description="format of data.path; default: from its extension (.jsonl/.ndjson, .json, .parquet/.pq), "
        "datasets for a save_to_disk directory, hub for an id that names nothing here")
    split: str = Field("train", min_length=1, description="split of a save_to_disk DatasetDict or a hub dataset "
                       "(files and a saved Dataset are one split)")
    name: Optional[str] = Field(None, min_length=1, description="configuration of a hub dataset (load_dataset's "
                                "name: main for openai/gsm8k)")
    prompt_key: str = Field("prompt", min_length=1, description="column of the prompt: text, or chat messages "
                            "(a list of {role, content}); dotted to reach into a nested object")
    answer_key: str = Field("ground_truth", min_length=1, description="column of the ground truth (a string "
                            "or a number; optional); dotted to reach into a nested object")
    extra_keys: Optional[list[str]] = Field(None, description="columns passed to the reward as the record's "
                                            "extra; default: every column but the prompt and answer ones")
    completion_key: str = Field("completion", min_length=1, description="algorithm sft: column of the "
                                "completion trained after the prompt (text); without it, a chat prompt's "
                                "assistant messages are trained, and a built-in task's ground truth")
    chat_template: Optional[bool] = Field(None, description="render prompts with the tokenizer chat template "
                                          "of the actor's model; default: when the prompts are chat messages")
    tools: list[ExpandedPath] = Field(default_factory=list, description="tools shown to the model, passed as "
                                      "`tools=` to the chat template: built-ins (calculator, python) and functions "
                                      "of your own, path/to/file.py:function (their schema from the signature and "
                                      "docstring; run by reward.env.name=tools in the reward role's sandbox); "
                                      "docs/environments.md")
    max_prompt_tokens: Optional[int] = Field(None, ge=1, description="prompt length limit in tokens, after "
                                             "the chat template; default: none")
    max_example_tokens: Optional[int] = Field(None, ge=2, description="algorithm sft: an example's prompt + "
                                              "completion tokens at most; default (and at most): the model's "
                                              "positions")
    overlong: Literal["filter", "truncate", "error"] = Field(
        "filter", description="prompts over max_prompt_tokens: filter (drop), truncate (cut the start of the "
        "last message), error (refuse the dataset); sft examples over max_example_tokens: filter (drop), "
        "truncate (cut the completion's end), error; dropped and cut ones are counted")
    shuffle: bool = Field(True, description="a new order (by run.seed) every epoch; false: the file's order")
    size: int = Field(4096, ge=1, description="prompts drawn from a built-in task")

    _task = field_validator("task")(lambda cls, v: known_task(v))

    @property
    def user_tools(self) -> list[str]:
        """The entries of `tools` that are functions of the user's (path/to/file.py:function)."""
        return [t for t in self.tools if ":" in t]

    @model_validator(mode="after")
    def _one_source(self) -> DataSection:
        if not self.task and not self.path:
            raise ValueError("set data.task or data.path")
        if self.path:
            check_source(self.path, self.format, self.split, "data")  # before any role loads a model
        check_tools(self.tools, "data.tools")  # the files read, not run: a schema is built from the source
        if self.tools and self.chat_template is False:
            raise ValueError("data.tools are rendered by the chat template: data.chat_template must not be false")
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
    path: Optional[ExpandedPath] = Field(None, description="held-out prompts, any source data.path takes, read like "
                                         "it (with data's chat template and token limit); a run on data.path "
                                         "needs one")
    format: Optional[SourceFormat] = Field(None, description="format of eval.path; default: told from it as "
                                               "data.format is from data.path")
    split: str = Field("test", min_length=1, description="split of a save_to_disk DatasetDict or a hub dataset")
    name: Optional[str] = Field(None, min_length=1, description="configuration of a hub dataset; default data.name")
    prompt_key: Optional[str] = Field(None, min_length=1, description="prompt column of eval.path; default "
                                      "data.prompt_key")
    answer_key: Optional[str] = Field(None, min_length=1, description="ground-truth column; default data.answer_key")
    extra_keys: Optional[list[str]] = Field(None, description="columns passed to the reward; default data.extra_keys")
    max_prompts: int = Field(200, ge=1, description="held-out prompts evaluated (a file's first ones)")
    seed: Optional[int] = Field(None, description="the seed of a task's held-out draw and of sampled evaluations; "
                                "default run.seed (runs of several seeds compare on one held-out set when "
                                "this is fixed)")
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

    _task = field_validator("task")(lambda cls, v: known_task(v))

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
            check_source(self.path, self.format, self.split, "eval")
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
