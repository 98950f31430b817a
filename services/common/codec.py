"""torch.Tensor <-> rolefleet.v1.Tensor (dtype name, shape, little-endian C-order bytes).

Decoding validates everything a peer could get wrong (unknown dtype, a rank or dimension past the
wire limits, negative dims, byte length that does not match shape x itemsize) before anything is
allocated, and names the offending field, so servers answer INVALID_ARGUMENT instead of crashing on
a reshape.
"""

from __future__ import annotations

import sys
from math import prod

import numpy as np
import torch

from rolefleet.common.errors import InvalidArgument
from rolefleet.common.pb import common_pb2

# Wire names. bfloat16 has no numpy dtype, so it travels as its raw 16-bit pattern.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
# Nothing RoleFleet sends has more than 2 dimensions; numpy refuses more than 64 and torch
# overflows its strides on huge dimensions of zero-size tensors, so both are bounded up front.
MAX_RANK = 8
# No tensor can hold more elements than a message can carry (512 MiB of 1-byte items). A zero-size
# tensor holds no bytes, so its other dimensions are bounded the same way: their product, not each
# one (numpy refuses [0, 2^31, 2^31, 2^31] as "too big" although it has no element).
MAX_ELEMENTS = 1 << 31
_LITTLE = sys.byteorder == "little"


def encode(tensor: torch.Tensor) -> common_pb2.Tensor:
    if tensor.dtype not in _NAMES:
        raise TypeError(f"dtype {tensor.dtype} is not supported on the wire; use one of {sorted(DTYPES)}")
    t = tensor.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        array = t.view(torch.int16).numpy()
    else:
        array = t.numpy()
    if not _LITTLE:
        array = array.astype(array.dtype.newbyteorder("<"))
    return common_pb2.Tensor(dtype=_NAMES[t.dtype], shape=list(t.shape), data=array.tobytes())


def declared_numel(msg: common_pb2.Tensor, field: str) -> int:
    """Elements the message claims to hold, read from its shape alone (nothing decoded)."""
    if len(msg.shape) > MAX_RANK:
        raise InvalidArgument(f"{field}.shape", f"{len(msg.shape)} dimensions; at most {MAX_RANK} are allowed")
    return prod(max(d, 0) for d in msg.shape)


def decode(msg: common_pb2.Tensor, field: str) -> torch.Tensor:
    """Decode `msg`; `field` names it in errors (e.g. "batch.response_ids")."""
    if msg.dtype not in DTYPES:
        raise InvalidArgument(f"{field}.dtype", f"unknown dtype {msg.dtype!r}; allowed: {', '.join(DTYPES)}")
    if len(msg.shape) > MAX_RANK:
        raise InvalidArgument(f"{field}.shape", f"{len(msg.shape)} dimensions; at most {MAX_RANK} are allowed")
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}.shape", f"negative dimension in {list(shape)}")
    if prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise InvalidArgument(f"{field}.shape", f"{list(shape)} spans over {MAX_ELEMENTS} elements "
                              "(counting zero dimensions as 1)")
    dtype = DTYPES[msg.dtype]
    wire = torch.int16 if dtype == torch.bfloat16 else dtype
    itemsize = torch.empty((), dtype=wire).element_size()
    expected = prod(shape) * itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(
            f"{field}.data",
            f"{len(msg.data)} bytes do not match shape {list(shape)} of {msg.dtype} ({expected} bytes)",
        )
    np_dtype = np.dtype(str(wire).removeprefix("torch.")).newbyteorder("<")
    array = np.frombuffer(msg.data, dtype=np_dtype).reshape(shape)
    # frombuffer views read-only protobuf memory; copy so callers own a writable tensor.
    tensor = torch.from_numpy(array.astype(np_dtype.newbyteorder("="), copy=True))
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def decode_as(msg: common_pb2.Tensor, field: str, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """Decode and require a dtype family and rank: float fields accept any float dtype, integer
    fields any integer dtype, bool fields bool alone."""
    tensor = decode(msg, field)
    if tensor.dim() != ndim:
        raise InvalidArgument(f"{field}.shape", f"expected {ndim} dimension(s), got shape {list(tensor.shape)}")
    if dtype.is_floating_point:
        if not tensor.dtype.is_floating_point:
            raise InvalidArgument(f"{field}.dtype", f"expected a float dtype, got {msg.dtype}")
        return tensor.to(dtype)
    if dtype == torch.bool:
        if tensor.dtype != torch.bool:
            raise InvalidArgument(f"{field}.dtype", f"expected bool, got {msg.dtype}")
        return tensor
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise InvalidArgument(f"{field}.dtype", f"expected an integer dtype, got {msg.dtype}")
    return tensor.to(dtype)
