import numpy as np
import pytest
import torch

from rolefleet.common import codec
from rolefleet.common.errors import InvalidArgument
from rolefleet.common.pb import common_pb2


@pytest.mark.parametrize("dtype", list(codec.DTYPES.values()))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 4)])
def test_round_trip_every_dtype(dtype, shape):
    torch.manual_seed(0)
    if dtype == torch.bool:
        t = torch.rand(shape) > 0.5
    elif dtype.is_floating_point:
        t = (torch.randn(shape) * 100).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, shape, dtype=dtype)
    msg = codec.encode(t)
    back = codec.decode(common_pb2.Tensor.FromString(msg.SerializeToString()), "t")
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_wire_format_is_little_endian_c_order():
    t = torch.tensor([[1, 2], [3, 256]], dtype=torch.int32)
    msg = codec.encode(t.t())  # non-contiguous view: encoded in C order of the logical tensor
    assert msg.dtype == "int32" and list(msg.shape) == [2, 2]
    assert msg.data == np.array([[1, 3], [2, 256]], dtype="<i4").tobytes()


def test_bfloat16_keeps_bits():
    t = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    assert torch.equal(codec.decode(codec.encode(t), "t"), t)


def test_decoded_tensor_is_writable_and_owned():
    msg = codec.encode(torch.arange(4, dtype=torch.float32))
    t = codec.decode(msg, "t")
    t += 1  # would fail on a read-only buffer view
    assert t.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "msg, field",
    [
        (common_pb2.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8), "x.dtype"),
        (common_pb2.Tensor(dtype="", shape=[1], data=b"\0" * 4), "x.dtype"),
        (common_pb2.Tensor(dtype="float32", shape=[3], data=b"\0" * 8), "x.data"),
        (common_pb2.Tensor(dtype="float32", shape=[2, 2], data=b"\0" * 20), "x.data"),
        (common_pb2.Tensor(dtype="int64", shape=[-1], data=b""), "x.shape"),
    ],
)
def test_malformed_tensors_are_rejected_naming_the_field(msg, field):
    with pytest.raises(InvalidArgument) as err:
        codec.decode(msg, "x")
    assert err.value.field == field


def test_decode_as_checks_rank_and_family():
    ints = codec.encode(torch.arange(3))
    with pytest.raises(InvalidArgument, match="expected a float dtype"):
        codec.decode_as(ints, "v", torch.float32, ndim=1)
    with pytest.raises(InvalidArgument, match="expected 2 dimension"):
        codec.decode_as(ints, "v", torch.int64, ndim=2)
    floats = codec.encode(torch.ones(3, dtype=torch.float16))
    assert codec.decode_as(floats, "v", torch.float32, ndim=1).dtype == torch.float32


def test_unsupported_dtype_cannot_be_encoded():
    with pytest.raises(TypeError, match="not supported"):
        codec.encode(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize(
    "shape, text",
    [
        ([0] * 65, "at most 8 are allowed"),        # numpy refuses > 64 dims: was INTERNAL
        ([1] * 9, "at most 8 are allowed"),
        ([0, 2**62], "spans over"),                # zero-size, no bytes, absurd dimension
        ([2**40, 0, 2**40], "spans over"),
        ([0, 2**31, 2**31, 2**31], "spans over"),  # each dimension small enough, their product not
    ],
)
def test_ranks_and_dimensions_past_the_wire_limits_are_refused_before_allocating(shape, text):
    msg = common_pb2.Tensor(dtype="float32", shape=shape, data=b"")
    with pytest.raises(InvalidArgument, match=text) as err:
        codec.decode(msg, "x")
    assert err.value.field == "x.shape"


def test_declared_numel_reads_the_shape_only():
    assert codec.declared_numel(common_pb2.Tensor(dtype="int64", shape=[3, 4], data=b""), "x") == 12
    with pytest.raises(InvalidArgument, match="at most 8"):
        codec.declared_numel(common_pb2.Tensor(dtype="int64", shape=[1] * 9), "x")
