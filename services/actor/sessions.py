"""Sessions of the actor's OpenAI-compatible endpoint (`actor/openai_api.py`, docs/environments.md,
"Your own agent"): each session is one episode that agent code drives with chat completions.

Token in, token out: a session keeps the token ids of its conversation as they were sampled and
rendered. Its first request's messages are rendered with the chat template (and its tools) once;
every later request must repeat the session's messages, the replies it was given included, and
add new ones (tool results, a user's answer), of which only the new ones are rendered, as the
template writes them after an assistant turn (`TurnRenderer`). Nothing the model sampled is
tokenized again, so the ids trained are the ids sampled, however a tokenizer would merge the text
across a turn's boundary.

What trains is a session's trajectory: the first prompt, then every turn's sampled tokens (with
their rollout logprobs and policy versions) and the rendered messages between turns (masked out of
the loss). The coordinator opens the sessions of a step's samples and closes them for their
trajectories (`OpenSessions` / `CloseSessions`).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rolefleet.actor.turns import MAX_OBSERVATION_MESSAGES, TurnRenderer
from rolefleet.actor.types import AgentTask, FinishReason, Sample, SamplingParams, Trajectory
from rolefleet.common import metrics
from rolefleet.common.errors import FailedPrecondition, InvalidArgument, LimitExceeded, RoleFleetError
from rolefleet.reward.env_tools import ToolCall, parse_tool_calls
from rolefleet.tasks.render import template_shows_tools, with_tools_described

MAX_SESSION_ID_CHARS = 128
TOOLS_SEEN = 64  # tool lists whose rendering by the template is remembered
FIRSTS_SEEN = 4096  # first requests whose rendered ids are remembered (a step's prompts, each asked n times)
EXPIRY_SCAN_S = 1.0


class UnknownSession(RoleFleetError):
    """No open session has this id (never opened, closed, or expired)."""


class Conflict(RoleFleetError):
    """The request does not extend the session's conversation, or the session is busy."""


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int          # open at once
    max_tokens: int            # of one episode after its first prompt (turns and rendered messages)
    max_turns: int             # completions per session
    timeout_s: float           # a session's life from its opening
    agents_at_once: int | None = None  # agents driving sessions at once (pacing only: `pending`)


@dataclass
class Session:
    id: str
    key: str                            # its own bearer secret: agent code holds this, not the run's token
    sampling: SamplingParams            # the run's: what the trainer's recompute and importance weights assume
    opened: float
    tools: list[dict] | None = None
    messages: list[dict] = field(default_factory=list)   # the conversation so far, normalized (`_normal`)
    ids: torch.Tensor | None = None     # int64 [C]: every token of the conversation
    prompt_len: int = 0
    logprobs: list[torch.Tensor] = field(default_factory=list)   # per piece after the prompt
    versions: list[torch.Tensor] = field(default_factory=list)
    own: list[torch.Tensor] = field(default_factory=list)
    turns: int = 0
    finish: FinishReason = FinishReason.LENGTH
    last_text: str = ""
    tool_calls: int = 0
    busy: bool = False
    asks_again: bool = False            # its agent is expected to ask for another completion: its last
                                        # reply called tools (the batcher waits for it)
    task: AgentTask | None = None       # for an agent outside the cluster to claim (reward.agent.external)
    claimed: bool = False
    reward: float | None = None         # what that agent posted
    attempt: str | None = None          # the agent runner's call its requests came from (`begin`)


@dataclass(frozen=True)
class Turn:
    """A request ready to generate: the session's context followed by the new messages' ids."""

    session: Session | None
    context: torch.Tensor               # int64 [C]
    new_from: int                       # where the rendered new messages begin in `context`
    messages: list[dict]                # the request's messages, normalized
    sampling: SamplingParams


class SessionStore:
    """The open sessions and their conversations; thread-safe (requests arrive on the endpoint's
    loop, opening and closing on the gRPC server's)."""

    def __init__(self, tokenizer: Any, limits: SessionLimits, max_positions: int | None):
        self.tokenizer, self.limits, self.max_positions = tokenizer, limits, max_positions
        self.turns = TurnRenderer(tokenizer)
        # Whether the template renders `tools=`, by the tools' JSON: an agent sends the same tools
        # with every episode, and asking the template costs two renderings (~0.3 ms a session).
        self._shows_tools: dict[str, bool] = {}
        # A first request's ids by its messages and tools: the samples of a prompt open with the same
        # request, and its rendering (the template, then the tokenizer: ~0.4 ms) runs on the
        # endpoint's loop while the rest of the step's agents wait to be read.
        self._firsts: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._expired_at = float("-inf")

    def __len__(self) -> int:
        return len(self._sessions)

    def pending(self) -> int:
        """Open sessions whose agents are expected to ask for a completion and have none in flight:
        a last reply that called tools (within `max_turns`), an agent outside the cluster that
        claimed its session and has not asked yet, and of the sessions no agent has asked in yet
        as many as `agents_at_once` leaves room for beside the agents at work (those with a
        request in flight or a tool to answer): agents run so many at a time, and a later part's
        would be waited for in vain. A guess that only paces the batcher: a session it misses is
        served as any request, one it waits for in vain costs a bounded wait."""
        asks = fresh = working = 0
        with self._lock:  # one pass: asked every batch window, over up to max_sessions sessions
            for s in self._sessions.values():
                if s.busy or s.asks_again:
                    working += 1
                if s.busy:
                    continue
                if s.asks_again or (s.claimed and s.ids is None):
                    asks += 1
                elif s.ids is None and s.task is None:
                    fresh += 1
        at_once = self.limits.agents_at_once
        return asks + (min(fresh, max(0, at_once - working)) if at_once else 0)

    # --- opened and closed by the coordinator ---------------------------------------------------

    def open(self, ids: list[str], sampling: SamplingParams, tasks: list[AgentTask] | None = None) -> list[str]:
        """New sessions (an id that is open already starts over: a retried step repeats its ids);
        their keys, in order. `tasks` (one per id): the sessions wait to be claimed by agents
        outside the cluster (`claim`)."""
        if tasks and len(tasks) != len(ids):
            raise InvalidArgument("tasks", f"{len(tasks)} tasks for {len(ids)} sessions: give one per session, or none")
        for i, sid in enumerate(ids):
            if not sid or len(sid) > MAX_SESSION_ID_CHARS or not sid.replace("-", "").replace("_", "").isalnum():
                raise InvalidArgument(f"session_ids[{i}]", f"must be 1-{MAX_SESSION_ID_CHARS} letters, digits, - or _")
        if len(set(ids)) != len(ids):
            raise InvalidArgument("session_ids", "ids repeat")
        sampling.validate()
        with self._lock:
            self._expire()
            fresh = len(set(ids) - set(self._sessions))
            if len(self._sessions) + fresh > self.limits.max_sessions:
                raise LimitExceeded("session_ids", f"{len(self._sessions)} open sessions and {fresh} more exceed "
                                    f"actor.endpoint.max_sessions={self.limits.max_sessions}")
            now = time.monotonic()
            for k, sid in enumerate(ids):
                self._sessions.pop(sid, None)  # a reopened id goes to the back of the claim order
                self._sessions[sid] = Session(sid, secrets.token_urlsafe(24), sampling, now,
                                              task=tasks[k] if tasks else None)
            metrics.ENDPOINT_SESSIONS.labels("actor").set(len(self._sessions))
            return [self._sessions[sid].key for sid in ids]

    def close(self, ids: list[str]) -> list[Trajectory]:
        """The sessions' trajectories; each session is gone afterwards (an unknown id: a trajectory
        with no turns saying so)."""
        with self._lock:
            sessions = [self._sessions.pop(sid, None) for sid in ids]
            metrics.ENDPOINT_SESSIONS.labels("actor").set(len(self._sessions))
        return [_trajectory(s) if s is not None else _empty(sid, "no such session (never opened, or expired: "
                                                            "actor.endpoint.session_timeout_s)")
                for sid, s in zip(ids, sessions)]

    # --- requests of the endpoint ----------------------------------------------------------------

    def session(self, sid: str, key: str | None) -> Session:
        """The open session `sid`; `key`: the bearer the request presented (None: the run's token)."""
        with self._lock:
            self._expire()
            s = self._sessions.get(sid)
        if s is None:
            raise UnknownSession(f"no open session {sid!r}")
        if key is not None and not secrets.compare_digest(key, s.key):
            raise UnknownSession(f"no open session {sid!r} for this key")
        return s

    def claim(self) -> Session | None:
        """The longest-waiting unclaimed session with a task, now claimed; None when none waits."""
        with self._lock:
            self._expire()
            s = next((s for s in self._sessions.values() if s.task is not None and not s.claimed), None)
            if s is not None:
                s.claimed = True
            return s

    def post_reward(self, s: Session, reward: float) -> None:
        """The episode's reward, from the agent outside the cluster that drove it (once)."""
        with self._lock:
            if s.reward is not None:
                raise Conflict(f"session {s.id!r} has its reward already ({s.reward})")
            s.reward = float(reward)

    def rewards(self, ids: list[str]) -> list[float | None]:
        """The posted reward of each session (None: not posted, or no such session)."""
        with self._lock:
            return [s.reward if (s := self._sessions.get(sid)) is not None else None for sid in ids]

    def reset(self, s: Session) -> None:
        """The session back to no conversation (its agent starts the episode again: a retried call)."""
        with self._lock:
            self._restart(s, None)

    def _restart(self, s: Session, attempt: str | None) -> None:
        if s.busy:
            raise Conflict(f"session {s.id!r} has a request in flight")
        fresh = Session(s.id, s.key, s.sampling, s.opened, task=s.task, claimed=s.claimed, attempt=attempt)
        s.__dict__.update(fresh.__dict__)

    def begin(self, s: Session | None, messages: list[dict], tools: list[dict] | None, max_tokens: int | None,
              sampling: SamplingParams, attempt: str | None = None) -> Turn:
        """A request's context: checked, its new messages rendered; the session is busy until
        `record` or `release`. `sampling`: the request's (a session samples with its own).
        `attempt`: the call of the agent runner's that sent it (its header); a request of another
        call than the session's earlier ones starts the episode over (the reward role repeated the
        call, its agents begin again), one without leaves the session as it is."""
        messages = [_normal(m, f"messages[{i}]") for i, m in enumerate(messages)]
        if not messages:
            raise InvalidArgument("messages", "at least one message")
        if messages[-1]["role"] == "assistant":
            raise InvalidArgument(f"messages[{len(messages) - 1}]", "the last message is the assistant's: "
                                  "a completion answers a user, system or tool message")
        if s is None:  # no session: the request's own sampling, nothing recorded
            context = self._first(messages, tools)
            return Turn(None, context, 0, messages, self._sized(sampling, max_tokens, len(context), 0))
        with self._lock:
            if attempt is not None and attempt != s.attempt:
                self._restart(s, attempt)
            if s.busy:
                raise Conflict(f"session {s.id!r} has a request in flight: a session is one conversation, "
                               "its completions one after another")
            if s.turns >= self.limits.max_turns:
                raise LimitExceeded("session", f"{s.turns} completions reach actor.rollout.max_turns="
                                    f"{self.limits.max_turns}")
            s.busy = True
        try:
            if s.ids is None:
                context, new_from, s.tools = self._first(messages, tools), 0, tools
            else:
                new = self._new_messages(s, messages, tools)
                rendered = self.turns.observation_ids(new, int(s.ids[-1]), "messages")
                context, new_from = torch.cat([s.ids, torch.tensor(rendered, dtype=torch.int64)]), len(s.ids)
            used = len(context) - (s.prompt_len if s.ids is not None else len(context))
            return Turn(s, context, new_from, messages, self._sized(s.sampling, max_tokens, len(context), used))
        except BaseException:
            s.busy = False
            raise

    def record(self, turn: Turn, piece: Sample, reply: dict) -> None:
        """The completion `piece` (sampled after `turn.context`) and the reply it was given."""
        s = turn.session
        if s is None:
            return
        with self._lock:
            if s.ids is None:
                s.prompt_len = len(turn.context)
            else:
                n = len(turn.context) - turn.new_from
                s.logprobs.append(torch.zeros(n))
                s.versions.append(torch.full((n,), piece.policy_version, dtype=torch.int64))
                s.own.append(torch.zeros(n, dtype=torch.bool))
            k = len(piece.response_ids)
            s.ids = torch.cat([turn.context, piece.response_ids.to(torch.int64)])
            s.logprobs.append(piece.logprobs.float())
            s.versions.append(torch.full((k,), piece.policy_version, dtype=torch.int64))
            s.own.append(torch.ones(k, dtype=torch.bool))
            s.messages = [*turn.messages, _normal(reply, "reply")]
            s.tool_calls += len(reply.get("tool_calls") or ())
            s.turns, s.finish, s.last_text, s.busy = s.turns + 1, piece.finish_reason, piece.response_text, False
            s.asks_again = bool(reply.get("tool_calls")) and s.turns < self.limits.max_turns

    def release(self, turn: Turn) -> None:
        """A request that failed after `begin`: the session is as it was."""
        if turn.session is not None:
            turn.session.busy = False

    # --- helpers --------------------------------------------------------------------------------

    def _template_shows(self, tools: list[dict]) -> bool:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._shows_tools:
            if len(self._shows_tools) >= TOOLS_SEEN:
                self._shows_tools.clear()
            self._shows_tools[key] = template_shows_tools(self.tokenizer, tools)
        return self._shows_tools[key]

    def _first(self, messages: list[dict], tools: list[dict] | None) -> torch.Tensor:
        """The first request's messages (and tools) rendered with the chat template, tokenized once
        (the same request again: a copy of the ids of the first time)."""
        key = json.dumps([messages, tools], sort_keys=True)
        with self._lock:
            if (ids := self._firsts.get(key)) is not None:
                self._firsts.move_to_end(key)
                return ids.clone()
        ids = self._render_first(messages, tools)
        with self._lock:
            self._firsts[key] = ids
            if len(self._firsts) > FIRSTS_SEEN:
                self._firsts.popitem(last=False)
        return ids.clone()

    def _render_first(self, messages: list[dict], tools: list[dict] | None) -> torch.Tensor:
        if not getattr(self.tokenizer, "chat_template", None):
            raise FailedPrecondition("the actor's tokenizer has no chat template: chat completions render "
                                     "messages with it (serve a model that has one)")
        kwargs: dict[str, Any] = {}
        if tools and self._template_shows(tools):
            kwargs["tools"] = tools
        elif tools:
            messages = with_tools_described(messages, tools)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a template raises whatever its author chose
            raise InvalidArgument("messages", f"the chat template refused them: {exc}") from None
        # The template writes any special tokens it wants (a BOS among them): none added here.
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise InvalidArgument("messages", "render to no tokens")
        return torch.tensor(ids, dtype=torch.int64)

    def _new_messages(self, s: Session, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """What `messages` add to the session's conversation; Conflict when they do not extend it."""
        if (tools or None) != (s.tools or None):
            raise Conflict("tools differ from the session's first request (they are part of its rendered prompt)")
        for i, (had, has) in enumerate(zip(s.messages, messages)):
            if had != has:
                raise Conflict(f"messages[{i}] differs from the session's conversation: a request repeats the "
                               "session's messages, the replies it was given included, and adds new ones")
        if len(messages) <= len(s.messages):
            raise Conflict(f"{len(messages)} messages add nothing to the session's {len(s.messages)}")
        new = messages[len(s.messages):]
        if len(new) > MAX_OBSERVATION_MESSAGES:
            raise InvalidArgument("messages", f"{len(new)} new messages, at most {MAX_OBSERVATION_MESSAGES}")
        return [_for_template(m) for m in new]

    def _sized(self, sampling: SamplingParams, wanted: int | None, context: int, used: int) -> SamplingParams:
        """`sampling` generating at most `wanted` tokens (and its own max_new_tokens), within the
        episode's tokens after its prompt (`used` so far) and the model's positions; LimitExceeded
        when there is no room for one."""
        room = min(sampling.max_new_tokens, self.limits.max_tokens - used, wanted or sampling.max_new_tokens)
        if self.max_positions is not None:
            room = min(room, self.max_positions - context)
        if room < 1:
            raise LimitExceeded("messages", f"the conversation ({context} tokens, {used} after its prompt) leaves no "
                                f"room under actor.rollout.max_total_tokens={self.limits.max_tokens} or the "
                                "model's positions")
        return replace(sampling, max_new_tokens=room)

    def _expire(self) -> None:
        """Drop sessions past their life (caller holds the lock), at most once a second: every
        request asks, and a scan of thousands of sessions per request would cost a step's turns."""
        now = time.monotonic()
        if now - self._expired_at < EXPIRY_SCAN_S:
            return
        self._expired_at, limit = now, now - self.limits.timeout_s
        for sid in [sid for sid, s in self._sessions.items() if s.opened < limit]:
            del self._sessions[sid]


def reply_message(text: str, parse_tools: bool) -> tuple[dict, list[ToolCall]]:
    """The assistant message a completion answers with: its text, and the tool calls it wrote
    (`<tool_call>` blocks, as function calls of the OpenAI form) when `parse_tools`."""
    calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)] if parse_tools else []
    if not calls:
        return {"role": "assistant", "content": text}, []
    content = text.split("<tool_call>", 1)[0].strip()
    tool_calls = [{"id": f"call_{secrets.token_hex(8)}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, calls


def _normal(message: Any, where: str) -> dict:
    """A message as sessions compare it: role, content as text, and the tool-call fields."""
    if not isinstance(message, dict):
        raise InvalidArgument(where, "must be an object with a role")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise InvalidArgument(f"{where}.role", "required (a string)")
    if isinstance(content, list):  # content parts: their text
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise InvalidArgument(f"{where}.content", "only text parts are supported")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise InvalidArgument(f"{where}.content", "must be a string, a list of text parts, or null")
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if calls := message.get("tool_calls"):
        if not isinstance(calls, list):
            raise InvalidArgument(f"{where}.tool_calls", "must be a list")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidArgument(where, "must be {type: function, function: {name, arguments}}")
    arguments = fn.get("arguments", "{}")
    try:  # compared by value: a client may re-serialize the arguments with other spacing
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass
    return {"name": fn["name"], "arguments": arguments}


def _for_template(message: dict) -> dict:
    """A new message as the chat template takes it."""
    return {k: v for k, v in message.items() if k != "tool_calls"}


def _trajectory(s: Session) -> Trajectory:
    if s.ids is None:
        return _empty(s.id, "the agent asked for no completion")
    return Trajectory(s.id, s.ids[:s.prompt_len], s.ids[s.prompt_len:], torch.cat(s.logprobs), torch.cat(s.versions),
                      torch.cat(s.own), s.finish, s.turns, s.last_text, tool_calls=s.tool_calls)


def _empty(sid: str, why: str) -> Trajectory:
    none = torch.zeros(0, dtype=torch.int64)
    return Trajectory(sid, none, none, torch.zeros(0), none, torch.zeros(0, dtype=torch.bool), FinishReason.LENGTH,
                      0, "", why)
