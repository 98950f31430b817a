"""The reward role's section: its sources (built-in functions, user functions, reward models),
their workers' limits, replicas and request caps.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from rolefleet.common.config.app_checks import check_reward_options, known_reward_function, reward_function_names
from rolefleet.common.config.base import Endpoint, _Section
from rolefleet.common.config.paths import ExpandedPath


class EnvSection(_Section):
    """The environment of multi-turn rollouts (`actor.rollout.max_turns` > 1), served by the reward
    role in its own sandbox worker processes (docs/environments.md)."""

    model_config = ConfigDict(extra="forbid")
    name: Optional[Literal["tools", "feedback"]] = Field(None, description="a built-in environment: tools "
                                                         "(runs the model's <tool_call>s: calculator, python), "
                                                         "feedback (a wrong answer is told so and answered again)")
    path: Optional[ExpandedPath] = Field(None, description="a user environment instead: path/to/file.py:function, "
                                         "`step(prompt, messages, ground_truth, extra)` returning a dict")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the built-in "
                                    "(tools: tools, python_timeout_s, max_output_chars; feedback: max_attempts, "
                                    "message)")
    workers: int = Field(2, ge=1, description="worker processes running the environment")
    timeout_s: float = Field(30.0, gt=0, description="deadline of one conversation's turn in a worker; past it "
                             "the worker is killed and replaced, and that conversation ends (counted)")
    memory_mb: int = Field(2048, ge=0, description="address-space limit of each environment worker (RLIMIT_AS); "
                           "0: none")

    @model_validator(mode="after")
    def _one(self) -> EnvSection:
        if self.name and self.path:
            raise ValueError("set reward.env.name (a built-in) or reward.env.path (a user file), not both")
        if self.path:
            file, _, fn = self.path.rpartition(":")
            if not file or not fn.isidentifier():
                raise ValueError(f"reward.env.path {self.path!r} is not of the form path/to/file.py:function")
            if self.options:
                raise ValueError("reward.env.options are for built-in environments")
        if self.name == "tools" and (unknown := set(self.options.get("tools", [])) - {"calculator", "python"}):
            raise ValueError(f"reward.env.options.tools: unknown tool(s) {', '.join(sorted(unknown))}; "
                             "built-in tools: calculator, python")
        return self

    # The user tools of data.tools (path/to/file.py:function), which the `tools` environment runs
    # besides its built-ins: set from the whole config (RoleFleetConfig), not a key of this section,
    # so that they are declared once, where the model is shown them.
    _user_tools: tuple[str, ...] = PrivateAttr(default=())

    @property
    def enabled(self) -> bool:
        return bool(self.name or self.path)

    @property
    def user_tools(self) -> tuple[str, ...]:
        return self._user_tools

    def run_user_tools(self, entries: list[str]) -> EnvSection:
        self._user_tools = tuple(entries)
        return self


class OpenEnvSection(_Section):
    """An OpenEnv environment driving each episode (docs/environments.md, "OpenEnv environments"):
    the model's replies are its actions, its observations the model's next messages, the sum of its
    rewards the episode's reward."""

    model_config = ConfigDict(extra="forbid")
    url: Optional[str] = Field(None, description="a running OpenEnv server (its container, a Space, `uvicorn "
                               "server.app:app`): one WebSocket session per episode; an episode the server has "
                               "no room for waits for one, within reward.agent.timeout_s")
    environment: Optional[ExpandedPath] = Field(None, description="an Environment class run in the agent workers "
                                                "instead, one object per episode: path/to/env.py:Class (a file "
                                                "inside a package is imported as part of it) or package.module:Class")
    action_field: Optional[str] = Field(None, description="the action's field the model's reply text fills; "
                                        "default its only text field")
    observation_field: Optional[str] = Field(None, description="the observation's field shown to the model; "
                                             "default its only text field, else its fields as JSON")
    prompt: Literal["both", "data", "environment"] = Field("both", description="the episode's first message: "
                                                            "the data's prompt followed by the reset "
                                                            "observation (both), or one of them")
    reset: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of reset (seed, task "
                                  "options); a prompt record's own `reset` field adds to them")

    @model_validator(mode="after")
    def _one_source(self) -> OpenEnvSection:
        if bool(self.url) == bool(self.environment):
            raise ValueError("reward.agent.openenv: set url (a running server) or environment (a class run "
                             "in the agent workers), one of them")
        if self.url and not re.match(r"^(https?|wss?)://[^/\s]+", self.url):
            raise ValueError(f"reward.agent.openenv.url {self.url!r} is not an http(s):// or ws(s):// URL")
        if self.environment:
            where, _, name = self.environment.rpartition(":")
            if not where or not name.isidentifier():
                raise ValueError(f"reward.agent.openenv.environment {self.environment!r} is not of the form "
                                 "path/to/env.py:Class or package.module:Class")
        return self

    @property
    def environment_file(self) -> Optional[str]:
        """The file of `environment` where it names one (not a module to import)."""
        where = (self.environment or "").rpartition(":")[0]
        return where if where.endswith(".py") or "/" in where else None


class AgentSection(_Section):
    """Agent code driving episodes through the actor's OpenAI-compatible endpoint, run by the reward
    role in its own sandbox worker processes (docs/environments.md, "Your own agent")."""

    model_config = ConfigDict(extra="forbid")
    path: Optional[ExpandedPath] = Field(None, description="path/to/file.py:name: an `async def agent(client, "
                                         "prompt, ground_truth, extra)` given an `openai.AsyncOpenAI` client of "
                                         "its episode's session, returning the episode's reward (a number); or a "
                                         "stateful environment class (reset, step, close) kept for its episode's life")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the agent function, "
                                    "or of the environment class's constructor")
    external: bool = Field(False, description="agents outside the cluster drive the episodes instead: each claims "
                           "one from the actor's endpoint (POST /v1/episodes, the run's token), drives its session "
                           "and posts its reward (POST /v1/episodes/{id}/reward); an episode without a reward "
                           "within timeout_s of its opening fails")
    workers: int = Field(2, ge=1, description="worker processes running agents")
    concurrency: int = Field(64, ge=1, description="episodes one worker runs at once (its agents await the "
                             "endpoint together, so the actor generates their turns in one batch)")
    timeout_s: float = Field(600.0, gt=0, description="deadline of one episode; past it the episode ends with "
                             "an error (counted) and what it generated is not trained")
    memory_mb: int = Field(4096, ge=0, description="address-space limit of each agent worker (RLIMIT_AS); 0: none")
    openenv: Optional[OpenEnvSection] = Field(None, description="an OpenEnv environment drives the episodes "
                                              "instead of agent code of your own")

    @field_validator("path")
    @classmethod
    def _form(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            file, _, fn = v.rpartition(":")
            if not file or not fn.isidentifier():
                raise ValueError(f"reward.agent.path {v!r} is not of the form path/to/file.py:function")
        return v

    @model_validator(mode="after")
    def _one_way(self) -> AgentSection:
        if sum((bool(self.path), self.external, self.openenv is not None)) > 1:
            raise ValueError("reward.agent: set one of path (agent code of yours), external (agents outside the "
                             "cluster) and openenv (an OpenEnv environment): each drives the episodes alone")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.path) or self.external or self.openenv is not None

    @property
    def in_cluster(self) -> bool:
        """Whether the reward role runs the episodes' drivers (agent code, an OpenEnv environment)."""
        return bool(self.path) or self.openenv is not None


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
        path: Optional[ExpandedPath] = Field(None, description="kind user: path/to/file.py:function; kind model: the "
                                             "reward model (a local directory or a hub id)")
        weight: float = Field(1.0, description="the total adds weight x this source's score")
        batched: bool = Field(False, description="kind user: the function takes lists (one per argument) and "
                              "returns a list of scores")

        @model_validator(mode="after")
        def _kind(self) -> RewardSection.Source:
            options = dict(self.model_extra or {})
            if self.kind == "function":
                if self.function is None:
                    raise ValueError(f"a function source needs `function`, one of: {', '.join(reward_function_names())}")
                known_reward_function(self.function)
                for key in ("path", "batched"):
                    if key in self.model_fields_set and getattr(self, key):
                        raise ValueError(f"`{key}` is for user sources, not built-in functions")
                self.__pydantic_extra__ = check_reward_options(self.function, options)
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
    env: EnvSection = Field(default_factory=EnvSection, description="the environment of multi-turn rollouts")
    agent: AgentSection = Field(default_factory=AgentSection, description="agent code driving episodes through "
                                "the actor's OpenAI-compatible endpoint (instead of an environment)")
    score_delay_s: float = Field(0.0, ge=0, le=600, description="seconds each Score call waits before "
                                 "scoring: a stand-in for a slower reward (a reward model) in benchmarks and tests")

    @field_validator("function")
    @classmethod
    def _function(cls, v: str) -> str:
        known_reward_function(v)
        try:
            check_reward_options(v, {})
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
