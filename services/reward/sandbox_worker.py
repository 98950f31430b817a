"""One reward worker process: `python -m rolefleet.reward.sandbox_worker FD` (started by
rolefleet.reward.sandbox, never by hand).

It imports the reward functions it is given (user files, and built-ins such as `math` that must be
killable), then answers calls over the connection FD until the server closes it. It runs under an
address-space limit, so it imports the standard library only (no torch, no RoleFleet config; of
RoleFleet, only the standard-library `common/orphans.py` and `reward/stateful.py`): what it maps
before the limit is set
counts against it too.

Protocol (pickled tuples over a multiprocessing Connection; each request gets its reply):
  server -> worker  {"memory_mb": int, "targets": {key: (kind, where, attr, options)}}
  worker -> server  ("ok", None)                   limits set, nothing imported yet
  server -> worker  ("load", key, None)            ("ok", load error or None) back
                    ("each", key, rows)            one ("ok", outcome) back per row, as each finishes
                    ("batch", key, rows)           one ("ok", [outcome per row] or why none) back
                    ("step", key, rows)            an environment's turn: one ("ok", step dict or why
                                                   none) back per row, as each finishes
                    ("agents", key, (rows, s, tls))
                                                   agent episodes run at once, each within s seconds
                                                   (tls: their clients' files, or None):
                                                   one ("ok", [outcome per row]) back
  worker -> server  ("fatal", message)             instead of a reply; the worker exits (MemoryError)
A row is (prompt, response, ground_truth, extra); an outcome is a float score or a str saying why
the row has none. An environment's row is (prompt, messages, ground_truth, extra) and its outcome a
dict checked by `as_step` (or a str saying why there is none). An agent's row is (base_url, key,
prompt, ground_truth, extra) and its outcome the episode's reward (or why there is none). Targets load on request, so a worker that replaces a crashed one loads only what
the next call needs.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import resource
import secrets
import ssl
import sys
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from numbers import Real
from pathlib import Path
from typing import Any, Union

from rolefleet.common.orphans import exit_with_parent
from rolefleet.reward.stateful import drive, is_environment

Outcome = Union[float, str]
# Scores travel as float32: a larger magnitude would arrive as inf.
FLOAT32_MAX = 3.4028234663852886e38
_MESSAGE_CHARS = 300


def one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS - 3] + "..."


def as_score(value: Any) -> Outcome:
    """`value` as a score, or why it is none. bool is a Real, and a fine 0/1 score; strings, None,
    tensors and lists are not."""
    if not isinstance(value, Real):
        return f"returned {one_line(repr(value))}, not a number"
    score = float(value)
    if not math.isfinite(score) or abs(score) > FLOAT32_MAX:
        return f"returned {score!r}, not a finite float32 number"
    return score


def load(kind: str, where: str, attr: str) -> Callable:
    """The function `attr` of a module (`kind` "module": a dotted name; "file": a .py path)."""
    if kind == "module":  # a built-in; it may prepare itself before the first deadline runs
        module = importlib.import_module(where)
        if callable(warm_up := getattr(module, "warm_up", None)):
            warm_up()
    else:
        path = Path(where)
        if not path.is_file():
            raise FileNotFoundError(f"{where} is not a file")
        name = f"rolefleet_user_reward_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
        module = sys.modules.get(name)  # two sources from one file: it runs once
        if module is None:
            # Its directory first on the path, so the file can import the helpers beside it.
            sys.path.insert(0, str(path.parent))
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
    if not hasattr(module, attr):
        raise AttributeError(f"{where} defines no {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"{where}:{attr} is a {type(fn).__name__}, not a function")
    return fn


class _Fatal(Exception):
    """The worker must not go on (its memory may be held by what the function left behind)."""


_MEMORY_KEY = ["reward.user_memory_mb"]  # the config key of the limit, named in errors (set by `serve`)


def _raised(exc: BaseException, memory_mb: int) -> str:
    if isinstance(exc, MemoryError):
        raise _Fatal(f"ran out of memory (MemoryError, over {_MEMORY_KEY[0]}={memory_mb})")
    message = f"raised {type(exc).__name__}: {exc}"
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:  # a wrapper's reason (a TLS failure under
        root = root.__cause__                                        # "Connection error.") says what went wrong
    if root is not exc:
        message += f" (from {type(root).__name__}: {root})"
    return one_line(message)


def call_each(fn: Callable, options: dict, row: tuple, memory_mb: int) -> Outcome:
    try:
        return as_score(fn(*row, **options))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the function's failure is this row's outcome
        return _raised(exc, memory_mb)


def call_batch(fn: Callable, options: dict, rows: list[tuple], memory_mb: int) -> Union[list[Outcome], str]:
    """A batched function takes the columns as lists and returns one value per row."""
    try:
        values = fn(*(list(column) for column in zip(*rows)), **options)
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        return _raised(exc, memory_mb)
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        return f"returned {one_line(repr(values))}, not a list of scores"
    if len(values) != len(rows):
        return f"returned {len(values)} values for {len(rows)} samples"
    return [as_score(v) for v in values]


_STEP_KEYS = {"observation", "done", "reward", "tool_calls", "tool_errors", "tool_timeouts"}
_MAX_OBSERVATION_CHARS = 1 << 20


def as_step(value: Any) -> Union[dict, str]:
    """An environment's answer as a plain dict (observation: a list of {role, content} messages,
    done, reward: float or None, the tool counts), or why it is malformed."""
    if not isinstance(value, dict):
        return f"returned {one_line(repr(value))}, not a dict with observation and done"
    if unknown := sorted(str(k) for k in set(value) - _STEP_KEYS):
        return f"returned unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_STEP_KEYS))}"
    done = value.get("done")
    if not isinstance(done, bool):
        return f"returned done={one_line(repr(done))}, not a bool"
    observation = value.get("observation")
    if isinstance(observation, str):
        observation = [{"role": "user", "content": observation}]
    if observation is None:
        observation = []
    if not isinstance(observation, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in observation):
        return "returned an observation that is not a str or a list of {role: str, content: str} messages"
    if not done and not observation:
        return "returned done=False with no observation to continue with"
    if sum(len(m["content"]) for m in observation) > _MAX_OBSERVATION_CHARS:
        return f"returned an observation longer than {_MAX_OBSERVATION_CHARS} characters"
    reward = value.get("reward")
    if reward is not None:
        reward = as_score(reward)
        if isinstance(reward, str):
            return f"reward: {reward}"
    counts = {}
    for key in ("tool_calls", "tool_errors", "tool_timeouts"):
        count = value.get(key, 0)
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 2**31:
            return f"returned {key}={one_line(repr(count))}, not a count"
        counts[key] = count
    return {"observation": [{"role": m["role"], "content": m["content"]} for m in observation], "done": done,
            "reward": reward, **counts}


def call_step(fn: Callable, options: dict, row: tuple, memory_mb: int) -> Union[dict, str]:
    try:
        return as_step(fn(*row, **options))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the environment's failure is this row's outcome
        return _raised(exc, memory_mb)


def call_agents(fn: Callable, options: dict, rows: list[tuple], timeout_s: float, memory_mb: int,
                tls: dict[str, str] | None = None) -> list[Outcome]:
    """Agent episodes, all at once in this worker's loop (they spend their time awaiting the
    endpoint, which batches their turns): each gets an `openai.AsyncOpenAI` client of its session.
    `fn` is the user's agent, or a stateful environment class that `stateful.drive` runs. `tls`:
    the files the clients verify the endpoint with and present to it (`agents.client_tls`)."""
    environment = is_environment(fn)
    if not environment and not inspect.iscoroutinefunction(fn):
        return [f"reward.agent.path must name an `async def` agent or an environment class with reset and step "
                f"(got {type(fn).__name__})"] * len(rows)
    # Imported here, in agent workers alone: the reward functions' workers never need them.
    import openai

    from rolefleet.reward.batching import batching_transport, openai_http_library

    client_class = openai.DefaultAsyncHttpxClient  # over the HTTP library this openai version uses
    http_library = openai_http_library()

    # This call's mark on each request: a repeated call of the same episodes (the role restarted)
    # starts each session over at its first request, with no request of its own to reset it.
    attempt = {"X-Episode-Attempt": secrets.token_hex(8)}

    async def episode(row: tuple, http: Any) -> Outcome:
        base_url, key, prompt, ground_truth, extra = row
        # No retries: the endpoint's refusals (409, 429) are final, and an actor that is gone fails the step.
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=timeout_s, http_client=http,
                                    default_headers=attempt)
        try:
            run = drive(fn, options, client, prompt, ground_truth, extra, as_step) if environment \
                else fn(client, prompt, ground_truth, extra, **options)
            return as_score(await asyncio.wait_for(run, timeout_s))
        except asyncio.TimeoutError:
            return f"timed out after {timeout_s:g} s (reward.agent.timeout_s)"
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the agent's failure is this episode's outcome
            return _raised(exc, memory_mb)

    class Shared(client_class):
        """One connection pool for every episode's client: a client of its own costs each episode
        ~20 ms of this loop (its transport, its TLS context) before it asks for anything. An agent
        that closes its client (`async with client:`) leaves the pool to the others."""

        async def aclose(self) -> None:
            pass

        async def close_pool(self) -> None:
            await super().aclose()

    async def every() -> list[Outcome]:
        # A turn's requests of this worker's agents go out as one (reward/batching.py).
        connections = http_library.AsyncHTTPTransport(
            verify=_tls_context(http_library, tls),
            limits=http_library.Limits(max_connections=None, max_keepalive_connections=None))
        if tls and tls.get("server_name"):
            connections = _named_server(http_library, connections, tls["server_name"])
        http = Shared(transport=batching_transport(http_library, connections), timeout=timeout_s)
        try:
            return list(await asyncio.gather(*(episode(row, http) for row in rows)))
        finally:
            await http.close_pool()

    return asyncio.run(every())


_TLS: dict[tuple, Any] = {}


def _tls_context(http_library: Any, tls: dict[str, str] | None) -> Any:
    """The clients' TLS context, made once a worker for each setting (~20 ms of the loop each time,
    before a step's first request goes out): the run's CA (and, under mutual TLS, the reward role's
    certificate) where the run has TLS on, else the HTTP library's default."""
    key = tuple(sorted((k, v) for k, v in (tls or {}).items() if k != "server_name"))
    if key not in _TLS:
        if tls:
            context = ssl.create_default_context(cafile=tls.get("cafile"))
            if tls.get("certfile"):
                context.load_cert_chain(tls["certfile"], tls.get("keyfile"))
        else:
            context = http_library.create_ssl_context()
        _TLS[key] = context
    return _TLS[key]


def _named_server(http_library: Any, inner: Any, server_name: str) -> Any:
    """`inner` checking `server_name` in the endpoint's certificate (and sending it as the TLS server
    name) instead of the host of the URL: the run's certificates may name the actor by a name its
    dialled address is not (`security.tls.server_name`). Every request carries it, the batches the
    transport above makes too, so the pool's one connection per endpoint is always made with it."""

    class NamedServer(http_library.AsyncBaseTransport):
        async def handle_async_request(self, request: Any) -> Any:
            request.extensions["sni_hostname"] = server_name  # the HTTP library's documented extension
            return await inner.handle_async_request(request)

        async def aclose(self) -> None:
            await inner.aclose()

    return NamedServer()


def _limit_memory(memory_mb: int) -> None:
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # A crashing user function must not leave gigabytes of core files behind.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def serve(conn: Connection) -> int:
    init = conn.recv()
    memory_mb, targets = init["memory_mb"], init["targets"]
    _MEMORY_KEY[0] = init.get("memory_key", _MEMORY_KEY[0])
    exit_with_parent(3, "reward sandbox worker")  # one stuck in a function outlives a killed server
    _limit_memory(memory_mb)
    conn.send(("ok", None))
    functions: dict[str, tuple[Callable, dict]] = {}
    while True:
        try:
            op, key, rows = conn.recv()
        except EOFError:  # the server closed the pool
            return 0
        try:
            if op == "load":
                conn.send(("ok", _load_target(functions, key, targets[key], memory_mb)))
            elif op == "agents":
                fn, options = functions[key]
                agent_rows, timeout_s, tls = rows
                conn.send(("ok", call_agents(fn, options, agent_rows, timeout_s, memory_mb, tls)))
            elif op == "batch":
                fn, options = functions[key]  # the server loads a target before it calls it
                conn.send(("ok", call_batch(fn, options, rows, memory_mb)))
            else:
                fn, options = functions[key]
                call = call_step if op == "step" else call_each
                for row in rows:
                    conn.send(("ok", call(fn, options, row, memory_mb)))
        except _Fatal as fatal:
            conn.send(("fatal", str(fatal)))
            return 1


def _load_target(functions: dict, key: str, target: tuple, memory_mb: int) -> str | None:
    kind, where, attr, options = target
    try:
        fn = load(kind, where, attr)
        if kind == "module" and callable(prepare := getattr(fn, "prepare", None)):
            prepare(**options)  # a built-in that loads what its options name (the tools environment's user tools)
        functions[key] = (fn, options)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported to the server, which names the source
        error = one_line(f"{type(exc).__name__}: {exc}")
        # The address-space limit shows as a MemoryError, or as a shared library that cannot be mapped.
        if isinstance(exc, MemoryError) or "failed to map" in error or "Cannot allocate memory" in error:
            error += f" (over {_MEMORY_KEY[0]}={memory_mb}?)"
        return error
    return None


if __name__ == "__main__":
    sys.exit(serve(Connection(int(sys.argv[1]))))
