"""OpenEnv environments (`reward.agent.openenv`; docs/environments.md, "OpenEnv environments") as
stateful environments of the agent workers (`stateful.py` drives them; this module runs there).

An episode is one OpenEnv session: a WebSocket session of a running server (`url`: the
environment's container, a Space, `uvicorn server.app:app`) through OpenEnv's own client, or an
object of the Environment class (`environment`) made in the worker, on a thread of its own so that
a slow `step` holds up no other episode. Each of the model's replies is an action (its text in the
action's text field), each observation the model's next user message (its text field, or its
fields as JSON), and the episode's reward the sum of the observations' rewards; `done` ends it, as
do the session's limits (actor.rollout.max_turns, max_total_tokens).

Subclass `OpenEnvEpisode` (and name the subclass in reward.agent.path, its options the section's
keys) where an environment's actions or observations need more than a text field: override
`action(message)` or `observation_text(observation)`.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import sys
import typing
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Optional

SECTION = "reward.agent.openenv"
# The fields every observation has, which OpenEnv's serialization moves out of `observation`.
_BASE_FIELDS = {"done", "reward", "metadata"}
_CAPACITY = "CAPACITY_REACHED"  # the server's answer when all its sessions are taken
_WAIT_S = (0.05, 2.0)           # first and longest wait before asking such a server again


class OpenEnvEpisode:
    """One episode of an OpenEnv environment, for `stateful.drive`."""

    _specs: ClassVar[dict[str, _Spec]] = {}   # per worker process, by the options' JSON
    # Per environment class that does not isolate its objects: (the event loop, its lock). Each
    # batch of episodes runs in an event loop of its own (`sandbox_worker.call_agents`).
    _exclusive: ClassVar[dict[type, tuple[Any, asyncio.Lock]]] = {}

    def __init__(self, *, url: Optional[str] = None, environment: Optional[str] = None,
                 action_field: Optional[str] = None, observation_field: Optional[str] = None,
                 prompt: str = "both", reset: Optional[dict] = None):
        self.options = dict(url=url, environment=environment, action_field=action_field,
                            observation_field=observation_field)
        self.prompt_from, self.reset_options = prompt, dict(reset or {})
        self.session: Optional[_Local | _Remote] = None
        self.spec: Optional[_Spec] = None

    @classmethod
    def prepare(cls, **options: Any) -> None:
        """Called once per worker as it loads: a class in `environment` is imported and its action's
        fields checked now, so that a wrong key fails the role's start, not each episode. A server
        (`url`) may not be up yet: its schema is read by the first episode."""
        try:
            import openenv.core  # noqa: F401
        except ImportError as e:
            raise ImportError(f"{SECTION} needs the openenv package: pip install 'rolefleet[openenv]' (an image: "
                              f"--build-arg EXTRAS=openenv, with vllm where it has it) ({e})") from None

        if options.get("environment"):
            cls._spec_of(options)

    @classmethod
    def _spec_of(cls, options: dict) -> _Spec:
        key = json.dumps({k: options.get(k) for k in ("url", "environment", "action_field", "observation_field")},
                         sort_keys=True)
        if key not in cls._specs:
            cls._specs[key] = _Spec.of(options)
        return cls._specs[key]

    # -- the stateful environment's methods ---------------------------------------------------------

    async def reset(self, prompt: Any, ground_truth: str, extra: dict) -> list[dict]:
        self.spec = await asyncio.to_thread(self._spec_of, self.options)
        kwargs = {**self.reset_options, **(extra.get("reset") if isinstance(extra.get("reset"), dict) else {})}
        self.session = _Local(self.spec) if self.spec.env_class else _Remote(self.options["url"])
        result = await self.session.reset(kwargs)
        text = self.observation_text(result["observation"])
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.prompt_from == "environment":
            return [{"role": "user", "content": text}]
        if self.prompt_from == "both" and text:
            if messages and messages[-1].get("role") == "user" and isinstance(messages[-1].get("content"), str):
                # One user message, not two in a row: some chat templates refuse those.
                messages[-1]["content"] = f"{messages[-1]['content']}\n\n{text}"
            else:
                messages.append({"role": "user", "content": text})
        return messages

    async def step(self, message: dict) -> dict:
        result = await self.session.step(self.action(message))
        observation = result["observation"]
        # An empty text field (an echo of an empty reply) still continues the conversation: with
        # the observation's fields, as they are.
        text = self.observation_text(observation) or (json.dumps(observation, default=str, sort_keys=True)
                                                      if observation else "")
        return {"observation": text or None, "done": bool(result["done"]), "reward": result["reward"]}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # -- the two conversions a subclass may replace -------------------------------------------------

    def action(self, message: dict) -> dict:
        """The action (its fields as a dict) of the model's reply, an OpenAI assistant message."""
        return {self.spec.action_field: message.get("content") or ""}

    def observation_text(self, observation: dict) -> str:
        """The model's next message of an observation (its fields but done, reward and metadata)."""
        if (field := self.spec.observation_field) is not None:
            if field not in observation:
                raise ValueError(f"{SECTION}.observation_field: the observation has no field {field!r} "
                                 f"(its fields: {', '.join(sorted(observation)) or 'none'})")
            value = observation[field]
            return value if isinstance(value, str) else json.dumps(value, default=str)
        return json.dumps(observation, default=str, sort_keys=True) if observation else ""


class _Spec:
    """What the adapter knows of an environment: its class (in-process) and which fields carry text."""

    def __init__(self, env_class: Optional[type], action_class: Optional[type], action_field: str,
                 observation_field: Optional[str]):
        self.env_class, self.action_class = env_class, action_class
        self.action_field, self.observation_field = action_field, observation_field

    @classmethod
    def of(cls, options: dict) -> _Spec:
        if options.get("environment"):
            env_class = _load_class(options["environment"])
            action_class, observation_class = _io_classes(env_class)
            schemas = {"action": action_class.model_json_schema(),
                       "observation": observation_class.model_json_schema() if observation_class else None}
        else:
            env_class = action_class = None
            schemas = _server_schemas(options["url"])
        action_field = options.get("action_field") or _only_text_field(schemas["action"], "action", "action_field")
        if action_field not in schemas["action"].get("properties", {}):
            raise ValueError(f"{SECTION}.action_field: the action has no field {action_field!r} (its fields: "
                             f"{', '.join(_fields(schemas['action'])) or 'none'})")
        observation_field = options.get("observation_field")
        if observation_field is None and schemas["observation"] is not None:
            observation_field = _only_text_field(schemas["observation"], "observation", None)
        return cls(env_class, action_class, action_field, observation_field)


class _Local:
    """An Environment object of this worker, every call of it on one thread of its own (an
    environment may hold what only its creating thread can use: a SQLite connection, a browser)."""

    def __init__(self, spec: _Spec):
        self.spec = spec
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="openenv")
        self.env: Any = None
        self.lock: Optional[asyncio.Lock] = None

    async def _call(self, fn, *args, **kwargs) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.thread, lambda: fn(*args, **kwargs))

    async def reset(self, kwargs: dict) -> dict:
        cls = self.spec.env_class
        if not getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
            # An environment that does not isolate its objects (OpenEnv's own flag): one episode at a
            # time in this worker.
            loop = asyncio.get_running_loop()
            held = OpenEnvEpisode._exclusive.get(cls)
            if held is None or held[0] is not loop:
                held = OpenEnvEpisode._exclusive[cls] = (loop, asyncio.Lock())
            self.lock = held[1]
            await self.lock.acquire()
        self.env = await self._call(cls)
        return await self._observe("reset", **_accepted(self.env.reset, kwargs))

    async def step(self, action: dict) -> dict:
        from openenv.core.env_server.serialization import deserialize_action

        return await self._observe("step", deserialize_action(action, self.spec.action_class))

    async def _observe(self, method: str, *args: Any, **kwargs: Any) -> dict:
        """`method` (reset, step) as OpenEnv's server calls it: its async form where the class has its
        own, else the plain one on the episode's thread; the observation serialized as the server does."""
        from openenv.core.env_server.serialization import serialize_observation

        own_async = getattr(type(self.env), f"{method}_async", None) is not _base(f"{method}_async")
        observation = await (getattr(self.env, f"{method}_async")(*args, **kwargs) if own_async
                             else self._call(getattr(self.env, method), *args, **kwargs))
        return serialize_observation(observation)

    async def close(self) -> None:
        try:
            if self.env is not None and callable(close := getattr(self.env, "close", None)):
                await self._call(close)
        finally:
            self.thread.shutdown(wait=False)
            if self.lock is not None:
                self.lock.release()


class _Remote:
    """A WebSocket session of a running OpenEnv server, through OpenEnv's generic client."""

    def __init__(self, url: str):
        self.url = url
        self.client: Any = None

    async def reset(self, kwargs: dict) -> dict:
        from openenv.core.generic_client import GenericEnvClient

        wait = _WAIT_S[0]
        while True:  # the episode's deadline (reward.agent.timeout_s) bounds the waiting
            self.client = GenericEnvClient(self.url)
            try:
                return _as_dict(await self.client.reset(**kwargs))
            except RuntimeError as e:
                if _CAPACITY not in str(e):
                    raise
            await self.client.close()
            await asyncio.sleep(wait)
            wait = min(2 * wait, _WAIT_S[1])

    async def step(self, action: dict) -> dict:
        return _as_dict(await self.client.step(action))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


def _as_dict(result: Any) -> dict:
    return {"observation": result.observation or {}, "reward": result.reward, "done": result.done}


def _base(name: str) -> Any:
    from openenv.core.env_server.interfaces import Environment

    return getattr(Environment, name)


def _accepted(fn: Any, kwargs: dict) -> dict:
    """The reset options `fn` takes (all of them where it takes **kwargs), as OpenEnv's server passes them."""
    parameters = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in parameters}


def _load_class(spec: str) -> type:
    """`path/to/env.py:Class` or `package.module:Class`. A file inside a package (a directory with
    __init__.py, as `openenv init` writes them) is imported as a module of its package, so that its
    relative imports (`from ..models import ...`) work."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") or "/" in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{SECTION}.environment: {where} is not a file")
        root, parts = path.parent, [path.stem]
        while (root / "__init__.py").is_file():
            parts.insert(0, root.name)
            root = root.parent
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        module = importlib.import_module(".".join(parts))
    else:
        module = importlib.import_module(where)
    cls = getattr(module, name, None)
    if not inspect.isclass(cls) or not callable(getattr(cls, "step", None)):
        raise TypeError(f"{SECTION}.environment: {spec} is not an environment class (reset, step)")
    return cls


def _io_classes(env_class: type) -> tuple[type, Optional[type]]:
    """The environment's Action class (what `step` takes) and Observation class (what it returns),
    from `step`'s annotations or the class's Environment[Action, Observation, State] base."""
    from openenv.core.env_server.types import Action, Observation

    hints: dict = {}
    try:
        hints = typing.get_type_hints(env_class.step)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: the base's arguments may
        pass
    action, observation = hints.get("action"), hints.get("return")
    for base in getattr(env_class, "__orig_bases__", ()):
        args = typing.get_args(base)
        if len(args) >= 2:
            action, observation = action or args[0], observation or args[1]
    if not (inspect.isclass(action) and issubclass(action, Action) and action is not Action):
        raise TypeError(f"{SECTION}.environment: {env_class.__name__}.step names no Action class of its own "
                        "(annotate its action parameter, or subclass Environment[YourAction, YourObservation, State])")
    if not (inspect.isclass(observation) and issubclass(observation, Observation)):
        observation = None
    return action, observation


def _server_schemas(url: str) -> dict:
    """The server's action and observation schemas (its GET /schema)."""
    scheme, _, rest = url.partition("://")
    address = f"{ {'ws': 'http', 'wss': 'https'}.get(scheme, scheme)}://{rest.rstrip('/')}/schema"
    try:
        with urllib.request.urlopen(address, timeout=30) as answer:  # noqa: S310 - the config's own URL
            schemas = json.load(answer)
    except Exception as e:  # noqa: BLE001 - the episode fails naming the key; the next one asks again
        raise ConnectionError(f"{SECTION}.url: GET {address} failed: {e}") from None
    return {"action": schemas.get("action") or {}, "observation": schemas.get("observation")}


def _fields(schema: dict) -> list[str]:
    return sorted(set(schema.get("properties", {})) - _BASE_FIELDS)


def _only_text_field(schema: dict, what: str, key: Optional[str]) -> Optional[str]:
    """The schema's one string field (the base fields aside); None (observations: shown as JSON) or
    an error naming `key` where there are none or several."""
    properties = schema.get("properties", {})
    text = [f for f in _fields(schema) if _is_text(properties[f])]
    if len(text) == 1:
        return text[0]
    if key is None:
        return None
    raise ValueError(f"{SECTION}.{key}: the {what} ({schema.get('title', '?')}) has "
                     f"{'no text field' if not text else 'text fields ' + ', '.join(text)} among its fields "
                     f"({', '.join(_fields(schema)) or 'none'}): name the one the model's reply fills")


def _is_text(prop: dict) -> bool:
    if prop.get("type") == "string":
        return True
    # Optional[str]: anyOf string and null.
    return any(p.get("type") == "string" for p in prop.get("anyOf", ())) and \
        all(p.get("type") in ("string", "null") for p in prop.get("anyOf", ()))
