"""The harness of tests/security/test_fuzz_rpcs.py: a role server on a thread of its own for
synchronous hypothesis examples, the checks every answer must pass, and strategies of malformed
requests (tensors, batches, steps, versions, checkpoint paths, raw bytes)."""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from rolefleet.common import codec
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.pb import common_pb2
from tests.helpers import serving

Code = grpc.StatusCode
REFUSALS = {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED, Code.OUT_OF_RANGE,
            Code.NOT_FOUND}
CALL_TIMEOUT_S = 30.0  # no answer within this is a hang
REFUSAL_S = 5.0  # a malformed or oversized request is refused up front, not after the work
MIB = 1 << 20
CLIENT_OPTIONS = [("grpc.max_send_message_length", 64 * MIB), ("grpc.max_receive_message_length", 64 * MIB)]
# Small per-request limits keep the requests past them cheap to build and send (the same checks run
# whatever the limit).
TRAINER_LIMITS = ["max_sequences_per_request=16", "max_tokens_per_request=1024"]
FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- a role server for synchronous examples -------------------------------------------------------

class ServedRole:
    """A role's servicers served by `tests.helpers.serving` on an event loop of their own thread."""

    def __init__(self, role: str, add_servicers: Callable[[grpc.aio.Server], list[str]]):
        self._ready, self._error = threading.Event(), None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(role, add_servicers),),
                                        name=f"{role}-server", daemon=True)
        self._thread.start()
        assert self._ready.wait(60) and self._error is None, self._error
        self.channel = grpc.insecure_channel(self.address, options=CLIENT_OPTIONS)

    async def _serve(self, role: str, add_servicers) -> None:
        self._stop = asyncio.Event()
        try:
            async with serving(role, add_servicers) as address:
                self.address = address
                self._ready.set()
                await self._stop.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc
            self._ready.set()

    def raw(self, path: str, streaming: bool) -> Callable:
        """The method at `path` taking and returning bytes: requests that are no valid message."""
        make = self.channel.unary_stream if streaming else self.channel.unary_unary
        return make(path, request_serializer=None, response_deserializer=None)

    def close(self) -> None:
        self.channel.close()
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if not self._thread.is_alive():
            self._loop.close()


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    replies: list
    seconds: float

    @property
    def ok(self) -> bool:
        return self.code == Code.OK


def call(method: Callable, request: Any, streaming: bool = False, timeout: float = CALL_TIMEOUT_S) -> Outcome:
    start = time.perf_counter()
    try:
        replies = list(method(request, timeout=timeout)) if streaming else [method(request, timeout=timeout)]
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "", [], time.perf_counter() - start)
    return Outcome(Code.OK, "", replies, time.perf_counter() - start)


def check_refused(outcome: Outcome, request_type, what: str) -> None:
    """A clear refusal: an expected code, details, and for a malformed or oversized field its name first."""
    assert outcome.code != Code.DEADLINE_EXCEEDED, f"{what}: no answer before the deadline"
    assert outcome.code in REFUSALS, f"{what}: {outcome.code.name}: {outcome.details}"
    assert outcome.details.strip(), f"{what}: {outcome.code.name} without details"
    assert outcome.seconds < REFUSAL_S, f"{what}: refused only after {outcome.seconds:.1f} s ({outcome.details})"
    if outcome.code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED):
        field = re.match(r"[A-Za-z_]\w*", outcome.details)
        assert field and field.group() in request_type.DESCRIPTOR.fields_by_name, \
            f"{what}: {outcome.details!r} does not start with a field of {request_type.DESCRIPTOR.name}"


def decodes(request_type, data: bytes) -> bool:
    try:
        request_type.FromString(data)
    except DecodeError:
        return False
    return True


@dataclass(frozen=True)
class Relative:
    """A step or version given relative to the role's current one (resolved as the request is sent)."""

    of: str  # "last_step" or "version"
    offset: int


class Trainer:
    """A trainer role (actor or critic) under fuzzing: its server, stub and last known state."""

    def __init__(self, role: str, core, served: ServedRole, stub, root: Path, update: Callable[[Trainer], Any]):
        """`update(trainer, **changes)`: the role's valid Update request for the next step, changed."""
        self.role, self.core, self.served, self.stub, self.update = role, core, served, stub, update
        self.root = root / "checkpoints"  # the role's checkpoint root (`rolefleet serve`: checkpoint.dir)
        self.outside = root / "elsewhere"
        core.checkpoint_root = str(self.root)
        self.known = self.state()

    def state(self) -> tuple[int, int, str, str]:
        s = self.stub.GetStatus(common_pb2.GetStatusRequest(include_weights_digest=True), timeout=CALL_TIMEOUT_S)
        return s.model_version, s.last_step, s.weights_digest, s.broken

    @property
    def version(self) -> int:
        return self.known[0]

    @property
    def last_step(self) -> int:
        return self.known[1]

    def saved(self) -> str:
        """A real checkpoint for LoadCheckpoint to find (saved again if a fuzzed save replaced the root)."""
        path = self.root / "saved"
        if not (path / "role.json").is_file():
            assert call(self.stub.SaveCheckpoint, common_pb2.SaveCheckpointRequest(step=self.last_step, path=str(path))).ok
        return str(path)

    def resolve(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {k: getattr(self, v.of) + v.offset if isinstance(v, Relative) else v for k, v in fields.items()}

    def check(self, outcome: Outcome, request_type, what: str, mutates: bool = False) -> None:
        """Refused: a clear status and nothing changed. Applied: only a mutating RPC moved the state."""
        now = self.state()
        assert now[3] == "", f"{what} left the {self.role} refusing updates: {now[3]}"
        if not outcome.ok:
            check_refused(outcome, request_type, what)
        if outcome.ok and mutates:
            self.known = now
        assert now == self.known, f"{what} ({outcome.code.name}: {outcome.details}) changed the {self.role}: " \
                                  f"{self.known} -> {now}"

    def assert_unchanged(self, what: str) -> None:
        assert self.state() == self.known, f"{what} changed the {self.role}"

    def assert_still_serves(self) -> None:
        """The next step's valid update is applied after everything the fuzzing sent."""
        before = self.known
        reply = self.stub.Update(self.update(self), timeout=CALL_TIMEOUT_S)
        self.known = self.state()
        assert reply.step == before[1] + 1 and self.known[:2] == (before[0] + 1, before[1] + 1)
        assert self.known[2] != before[2]


# --- strategies -----------------------------------------------------------------------------------

INT64 = st.integers(-2**63, 2**63 - 1)
INT32 = st.integers(-2**31, 2**31 - 1)
NASTY_FLOATS = [0.0, -0.0, -1.0, 1e-45, -1e-45, 1e-30, math.nan, math.inf, -math.inf, -3.4e38]
bad_floats = st.one_of(st.sampled_from(NASTY_FLOATS), st.floats(width=32))
weird_text = st.one_of(st.text(st.characters(codec="utf-8"), max_size=24),
                       st.text("\x00\x7f\n\t \u00e9\u202e\ufeff\ufffd\uffff\U0010ffff\U0001f642+=19", max_size=24))
dtype_names = st.one_of(st.sampled_from([*codec.DTYPES, "", "int128", "FLOAT32", "float32\x00", "torch.float32",
                                         "complex64", "<f4", "object"]), weird_text)
dims = st.one_of(st.integers(-2, 6), INT64, st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1, -2**63]))
garbage_tensors = st.builds(common_pb2.Tensor, dtype=dtype_names, shape=st.lists(dims, max_size=10),
                            data=st.binary(max_size=48))
# Declared sizes far past any limit, with next to no bytes: refused before anything is allocated.
huge_tensors = st.builds(common_pb2.Tensor, dtype=st.sampled_from(list(codec.DTYPES)), data=st.binary(max_size=16),
                         shape=st.sampled_from([[2**40], [2**20, 2**20], [0, 2**62], [2**62, 0], [2**31 + 1],
                                                [1] * 9, [0] * 65, [2**63 - 1]]))


@st.composite
def wellformed_tensors(draw, max_rank: int = 2) -> common_pb2.Tensor:
    """Bytes that match shape and dtype (they decode), of any dtype and rank: wrong for the field."""
    dtype = draw(st.sampled_from(list(codec.DTYPES)))
    shape = draw(st.lists(st.integers(0, 4), max_size=max_rank))
    itemsize = torch.empty((), dtype=torch.int16 if dtype == "bfloat16" else codec.DTYPES[dtype]).element_size()
    size = math.prod(shape) * itemsize
    return common_pb2.Tensor(dtype=dtype, shape=shape, data=draw(st.binary(min_size=size, max_size=size)))


bad_tensors = st.one_of(garbage_tensors, huge_tensors, wellformed_tensors())


@st.composite
def nonfinite_per_token(draw, n: int = 2) -> common_pb2.Tensor:
    """Per-token floats of the right shape with a NaN, an infinity or a value out of its range."""
    values = draw(st.lists(st.floats(width=32), min_size=n, max_size=n))
    values[draw(st.integers(0, n - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf, 3.4e38, 1e7, 1.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    return codec.encode(torch.tensor(values, dtype=torch.float64).to(dtype))


# In range but extreme (a PPO ratio of e^1e5, targets of 1e6): applied, and the role must stay usable.
extreme_per_token = st.lists(st.sampled_from([-1e6, -1e5, -88.0, 0.0, 1e-3, 1e6]), min_size=2, max_size=2).map(
    lambda values: codec.encode(torch.tensor(values)))
bad_per_token = st.one_of(bad_tensors, nonfinite_per_token(), extreme_per_token)
GOOD_BATCH = SequenceBatch.from_lists([torch.tensor([4, 41])], [torch.tensor([5, 2])])  # 2 response tokens


def ids(values: list[int]) -> common_pb2.Tensor:
    return codec.encode(torch.tensor(values, dtype=torch.int64))


@st.composite
def ragged_batches(draw) -> common_pb2.SequenceBatch:
    """Decodable int64 tensors whose lengths, sums and ids disagree, or run past the vocabulary."""
    tokens, lengths = st.lists(st.one_of(st.integers(0, 60), INT64), max_size=6), st.lists(
        st.one_of(st.integers(-1, 3), INT64), max_size=3)
    return common_pb2.SequenceBatch(prompt_ids=ids(draw(tokens)), prompt_lengths=ids(draw(lengths)),
                                    response_ids=ids(draw(tokens)), response_lengths=ids(draw(lengths)))


@st.composite
def one_part_broken(draw) -> common_pb2.SequenceBatch:
    batch = GOOD_BATCH.to_proto()
    part = draw(st.sampled_from(["prompt_ids", "prompt_lengths", "response_ids", "response_lengths"]))
    getattr(batch, part).CopyFrom(draw(bad_tensors))
    return batch


SPECIAL_BATCHES = [
    SequenceBatch.from_lists([torch.full((200,), 4)], [torch.tensor([5])]).to_proto(),  # past the 128 positions
    SequenceBatch.from_lists([torch.tensor([4])] * 17, [torch.tensor([5])] * 17).to_proto(),  # past 16 sequences
    SequenceBatch.from_lists([torch.full((1000,), 4)], [torch.full((30,), 5)]).to_proto(),  # past 1024 tokens
    common_pb2.SequenceBatch(),  # unset
]
bad_batches = st.one_of(one_part_broken(), ragged_batches(), st.sampled_from(SPECIAL_BATCHES),
                        st.builds(common_pb2.SequenceBatch, prompt_ids=bad_tensors, prompt_lengths=bad_tensors,
                                  response_ids=bad_tensors, response_lengths=bad_tensors))
bad_steps = st.one_of(st.sampled_from([0, -1, -2**63, 2**63 - 1, Relative("last_step", 0), Relative("last_step", 2),
                                       Relative("last_step", -1)]), INT64)
bad_versions = st.one_of(st.sampled_from([-1, -2**63, 2**63 - 1, Relative("version", 1), Relative("version", -1)]),
                         INT64)


def broken_parts(parts: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict[str, Any]]:
    """One to three of `parts`, each with a value drawn from its strategy."""
    return st.lists(st.sampled_from(sorted(parts)), min_size=1, max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: parts[name] for name in names}))


def checkpoint_paths(trainer: Trainer) -> st.SearchStrategy[str]:
    """Empty, NUL, relative, escaping, outside the root, too long, random: and new directories under it."""
    root, outside = trainer.root, trainer.outside
    name = st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=40).filter(
        lambda s: s not in (".", ".."))
    return st.one_of(
        st.sampled_from(["", "\x00", "x", "./x", "../x", "..", "../..", "/", "~/x", str(root / "a\x00b"),
                         str(root) + "\x00", str(root / ".."), str(root / ".." / "elsewhere" / "x"), str(outside),
                         str(root), "relative/\x00"]),
        name.map(lambda s: str(root / s)),
        st.lists(name, min_size=2, max_size=3).map(lambda parts: str(root.joinpath(*parts))),
        name.map(lambda s: str(outside / s)),
        name,  # relative: the server's working directory, outside the root
        st.integers(256, 600).map(lambda k: str(root / ("x" * k))),  # past NAME_MAX
        weird_text,
    )


# --- raw bytes: not the method's message, or it with unknown fields ------------------------------

@dataclass(frozen=True)
class Method:
    service: str
    name: str
    request_type: Any
    valid: Callable[[Any], Any]  # the role under test -> a valid request
    streaming: bool = False
    mutates: bool = False

    @property
    def path(self) -> str:
        return f"/rolefleet.v1.{self.service}/{self.name}"


def trainer_methods(service: str, update_type, update: Callable, extra: list[Method]) -> list[Method]:
    return [*extra,
            Method(service, "Update", update_type, update, mutates=True),
            Method(service, "GetStatus", common_pb2.GetStatusRequest,
                   lambda t: common_pb2.GetStatusRequest(include_weights_digest=True)),
            Method(service, "SaveCheckpoint", common_pb2.SaveCheckpointRequest,
                   lambda t: common_pb2.SaveCheckpointRequest(step=t.last_step, path=str(t.root / "raw"))),
            Method(service, "LoadCheckpoint", common_pb2.LoadCheckpointRequest,
                   lambda t: common_pb2.LoadCheckpointRequest(path=t.saved()), mutates=True)]


UNDECODABLE = [b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08", b"\x0a\x05ab", b"\x07", b"\x80",
               b"\x0a\x02\xc3\x28", b"\x12\x02\xc3\x28", b"\x0a\x04\x0a\x02\xc3\x28", b"\x00\x01"]
garbage = st.one_of(
    st.tuples(st.just("bytes"), st.one_of(st.binary(max_size=64), st.sampled_from(UNDECODABLE))),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("unknown"), st.integers(1000, 2**29 - 1), st.binary(max_size=16)),
)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def garbled(valid: bytes, recipe: tuple) -> bytes:
    kind, *args = recipe
    if kind == "bytes":
        return args[0]
    if kind == "truncate":
        return valid[:int(len(valid) * args[0])]
    if kind == "flip":
        if not valid:
            return bytes([args[1]])
        i = int(len(valid) * args[0])
        return valid[:i] + bytes([valid[i] ^ args[1]]) + valid[i + 1:]
    if kind == "append":
        return valid + args[0]
    number, payload = args  # a well-formed field the message does not have
    return valid + varint(number << 3 | 2) + varint(len(payload)) + payload
