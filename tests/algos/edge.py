"""Property-based edge-input checks shared by the algos tests.

A `Case` is one registered function with drawn inputs: per-token tensors (whose masked positions the
checks fill with garbage), the mask, which inputs require grad, and a `call` that applies the function.
The checks assert that outputs and gradients are finite, that garbage at masked positions changes
nothing, that an all-masked batch gives a defined result, that empty input is a ValueError naming an
argument, and that half-precision inputs are computed in float32.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Reproducible in CI: derandomized, and no example database carrying failures from run to run.
FAST = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Extreme but finite, as the review asked: log-probs to -1e4, log-ratios to +-1e3, rewards to +-1e6;
# each mixed with a small range so the ordinary (clip) region is hit too.
LOGPROB = st.one_of(st.floats(-5.0, 0.0, width=32), st.floats(-1e4, 0.0, width=32))
LOG_RATIO = st.one_of(st.floats(-2.0, 2.0, width=32), st.floats(-1e3, 1e3, width=32))
REWARD = st.one_of(st.floats(-1.0, 1.0, width=32), st.floats(-1e6, 1e6, width=32))
WEIGHT = st.one_of(st.floats(0.0, 3.0, width=32), st.floats(0.0, 1e6, width=32))
GARBAGE_VALUES = (math.nan, math.inf, -math.inf, 1e30, -1e30)
GARBAGE = st.tuples(*[st.sampled_from(GARBAGE_VALUES)] * 4)  # for masked positions, one per input
FULL = st.sampled_from([torch.float32, torch.float64])  # bf16 is checked against float32 in every case


@dataclass
class Case:
    call: Callable[[dict[str, torch.Tensor]], Any]
    tensors: dict[str, torch.Tensor]       # per-token inputs, shaped like mask
    mask: torch.Tensor                     # bool
    grad: tuple[str, ...] = ()             # inputs that require grad
    elementwise: bool = False              # no mask argument: only unmasked positions are compared
    zero_when_masked: bool = True          # an all-masked batch gives zeros


@st.composite
def masks(draw, max_b: int = 8, max_t: int = 8, all_masked: bool = False) -> torch.Tensor:
    """Right-padded bool [B, T] with ragged rows, including empty rows and single tokens."""
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    lengths = [0] * b if all_masked else draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


def tensor(draw, elements, shape, dtype=torch.float32) -> torch.Tensor:
    n = math.prod(shape)
    values = draw(st.lists(elements, min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)


def group_ids(draw, b: int) -> torch.Tensor:
    """[B] ids forming groups of 1..B responses; odd ids on purpose (unique() must not care)."""
    return torch.tensor(draw(st.lists(st.sampled_from([0, 1, 7, -3, 10**12]), min_size=b, max_size=b)))


def outputs(result: Any) -> list[torch.Tensor]:
    """Every tensor in a result: a tensor, a tuple of them, or (loss, stats dict)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, dict):
        return [x for v in result.values() for x in outputs(v)]
    if isinstance(result, (tuple, list)):
        return [x for v in result for x in outputs(v)]
    return [torch.tensor(result, dtype=torch.float64)]


def run(case: Case, fill: float | tuple[float, ...],
        dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """(outputs, gradients of their sum) with the masked positions of the i-th input set to fill[i]
    (cycling), or all of them to one `fill`."""
    fills = fill if isinstance(fill, tuple) else (fill,)
    leaves = {}
    for i, (name, x) in enumerate(case.tensors.items()):
        x = torch.where(case.mask, x, torch.tensor(fills[i % len(fills)], dtype=x.dtype))
        x = x.to(dtype) if dtype is not None else x
        leaves[name] = x.detach().requires_grad_(name in case.grad)
    outs = outputs(case.call({**leaves, "mask": case.mask}))
    total = sum((_visible(o, case).sum() for o in outs if o.requires_grad), torch.zeros(()))
    grads = {}
    if case.grad:
        got = torch.autograd.grad(total, [leaves[n] for n in case.grad], allow_unused=True)
        grads = {n: torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(case.grad, got)}
    return [o.detach() for o in outs], grads


def _visible(x: torch.Tensor, case: Case) -> torch.Tensor:
    """What the function promises about x: everything, or only unmasked positions for elementwise ones."""
    return x[case.mask] if case.elementwise and x.shape == case.mask.shape else x


def assert_finite(xs: list[torch.Tensor], case: Case, what: str) -> None:
    for x in xs:
        if x.is_floating_point():
            assert torch.isfinite(_visible(x, case)).all(), f"non-finite {what}: {x}"


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], case: Case, what: str) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(_visible(x, case), _visible(y, case)), f"{what}: {x} != {y}"


def check_garbage_ignored(case: Case, garbage: tuple[float, ...]) -> None:
    """Finite outputs and gradients, unchanged by garbage at masked positions (a different kind in each
    input: finite garbage in one can keep another's NaN on a live path)."""
    clean_out, clean_grad = run(case, 0.0)
    assert_finite(clean_out, case, "output")
    assert_finite(list(clean_grad.values()), case, "gradient")
    dirty_out, dirty_grad = run(case, garbage)
    assert_finite(list(dirty_grad.values()), case, "gradient with garbage in padding")
    assert_same(clean_out, dirty_out, case, "garbage in padding changed an output")
    assert_same(list(clean_grad.values()), list(dirty_grad.values()), case, "garbage changed a gradient")


def check_all_masked(case: Case) -> None:
    """Finite result and zero gradients when no position is masked in (zeros unless the case says not)."""
    assert not case.mask.any()
    outs, grads = run(case, math.nan)
    assert_finite(outs, case, "output of an all-masked batch")
    for name, g in grads.items():
        assert torch.equal(_visible(g, case), torch.zeros_like(_visible(g, case))), f"gradient into {name}: {g}"
    if case.zero_when_masked and not case.elementwise:
        for o in outs:
            assert not o.is_floating_point() or torch.all(o == 0), f"all-masked batch gave {o}"


def check_half_upcast(case: Case) -> None:
    """bf16 inputs give float32 outputs equal to those from the same values given as float32."""
    half_out, half_grad = run(case, 0.0, torch.bfloat16)
    exact = {n: x.to(torch.bfloat16).float() for n, x in case.tensors.items()}
    single_out, _ = run(Case(**{**case.__dict__, "tensors": exact}), 0.0)
    for h in half_out:
        assert not h.is_floating_point() or h.dtype == torch.float32, f"bf16 input gave a {h.dtype} output"
    assert_same(half_out, single_out, case, "bf16 input differs from the same values in float32")
    assert_finite(list(half_grad.values()), case, "gradient into bf16 input")


def check_bad_shapes_rejected(fn: Callable, case: Case) -> None:
    """An empty batch (B = 0 or T = 0) and an argument one column too wide are ValueErrors naming a
    parameter of fn."""
    inputs = {**case.tensors, "mask": case.mask}
    _expect_named_error(fn, case, {n: x[:0] for n, x in inputs.items()}, "is empty")
    _expect_named_error(fn, case, {n: x[..., :0] for n, x in inputs.items()}, "is empty")
    for name in inputs.keys() & inspect.signature(fn).parameters.keys():
        wide = torch.cat([inputs[name], inputs[name][..., :1]], dim=-1)
        _expect_named_error(fn, case, {**inputs, name: wide}, "has shape")


def _expect_named_error(fn: Callable, case: Case, inputs: dict[str, torch.Tensor], what: str) -> None:
    with pytest.raises(ValueError, match=what) as info:
        case.call(inputs)
    named = str(info.value).split(" ", 1)[0]
    assert named in inspect.signature(fn).parameters, f"{info.value!r} names no parameter of {fn.__name__}"


def check_case(fn: Callable, case: Case, garbage: tuple[float, ...], dtype: torch.dtype) -> None:
    """Every check on one drawn case, its inputs given in `dtype`."""
    case.tensors = {n: x.to(dtype) for n, x in case.tensors.items()}
    check_garbage_ignored(case, garbage)
    check_half_upcast(case)
    check_bad_shapes_rejected(fn, case)


def covered(table: dict[str, Any], names: list[str]) -> None:
    """Fails when a function is registered without a case here (or a case outlives its function)."""
    assert sorted(table) == sorted(names)
