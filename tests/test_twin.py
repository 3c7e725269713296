"""`jfa.kernels.twin.torch_twin`: a `@triton.jit` function's own source run on torch tensors.

The references and host schedules run the kernels' definitions (masks, tile counts, a fork's score
modification) through their twins, so the shim must give what Triton gives for every name it offers:
the functions of `tl` and `tl.math`, the dtypes and `x.to(dtype)`, `tl.load` of a `TwinPointer`, calls
of other jit functions, `tl.constexpr` globals; and a name it does not offer must fail loudly, naming
it, rather than compute something else. Everything here runs on the CPU without compiling.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from jfa.kernels import masks
from jfa.kernels.masks import visible
from jfa.kernels.twin import TwinPointer, torch_twin

SHIFT: tl.constexpr = tl.constexpr(3)  # a compile-time global, as the kernel modules define them
PLAIN_GLOBAL = 0.5  # a plain Python global, passed through as it is
INTERPRETER_TIMEOUT_S = 120


@triton.jit
def _unary(x):
    return (tl.exp(x), tl.exp2(x), tl.log(x), tl.log2(x), tl.sqrt(x), tl.rsqrt(x), tl.sigmoid(x), tl.sin(x),
            tl.cos(x), tl.erf(x), tl.floor(x), tl.ceil(x), tl.abs(x))


@triton.jit
def _math_namespace(x):
    return (tl.math.exp(x), tl.math.exp2(x), tl.math.log(x), tl.math.log2(x), tl.math.sqrt(x), tl.math.rsqrt(x),
            tl.math.sin(x), tl.math.cos(x), tl.math.erf(x), tl.math.floor(x), tl.math.ceil(x), tl.math.abs(x))


UNARY_TORCH = (torch.exp, torch.exp2, torch.log, torch.log2, torch.sqrt, torch.rsqrt, torch.sigmoid, torch.sin,
               torch.cos, torch.erf, torch.floor, torch.ceil, torch.abs)
MATH_TORCH = (torch.exp, torch.exp2, torch.log, torch.log2, torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.erf,
              torch.floor, torch.ceil, torch.abs)


@triton.jit
def _binary(x, y, z):
    return tl.minimum(x, y), tl.maximum(x, y), tl.where(x > y, x, y), tl.fma(x, y, z), tl.math.fma(x, y, z)


@triton.jit
def _cdiv(x, y):
    return tl.cdiv(x, y)


@triton.jit
def _floor_division(x, y):
    return x // y


@triton.jit
def _constructors(N: tl.constexpr):
    return tl.full([2, N], 1.5, tl.float32), tl.zeros([N], tl.int32), tl.arange(0, N)


@triton.jit
def _static_sum(x, N: tl.constexpr):
    total = x * 0
    for i in tl.static_range(N):
        total += x + i
    return total


@triton.jit
def _casts(x):
    return (x.to(tl.int32), x.to(tl.int64), x.to(tl.float16), x.to(tl.bfloat16), x.to(tl.float64),
            (x > 0).to(tl.int1), x.to(tl.uint8), x.to(tl.int8), x.to(tl.int16))


@triton.jit
def _load(pointer, index):
    return tl.load(pointer + index)


@triton.jit
def _load_from_params(head, params):
    return tl.load(params[0] + head) * params[1]


@triton.jit
def _inner(x, y):
    return x * y + SHIFT


@triton.jit
def _outer(x):
    return _inner(x, 2) + 1


@triton.jit
def _calls_a_kernel_building_block(q_idx, k_idx, q_len, kv_len):
    return visible(q_idx, k_idx, q_len, kv_len, 0, True, False)


@triton.jit
def _calls_a_building_block_through_its_module(q_idx, k_idx, q_len, kv_len):
    return masks.visible(q_idx, k_idx, q_len, kv_len, 0, True, False)


@triton.jit
def _globals(x):
    return x + SHIFT, x * PLAIN_GLOBAL


@triton.jit
def _program_id(x):
    return x + tl.program_id(0)


@triton.jit
def _dot(x, y):
    return tl.dot(x, y)


@triton.jit
def _softcap(score, cap):
    return cap * (2 * tl.sigmoid(2 * score / cap) - 1)


# ---- the shim's functions -------------------------------------------------------------------------------

def test_unary_functions_are_torchs():
    x = torch.linspace(0.25, 4.0, 11, dtype=torch.float64)
    for got, torch_fn in zip(torch_twin(_unary)(x), UNARY_TORCH, strict=True):
        torch.testing.assert_close(got, torch_fn(x), msg=torch_fn.__name__)


def test_math_namespace_functions_are_torchs():
    x = torch.linspace(0.25, 4.0, 11, dtype=torch.float64)
    for got, torch_fn in zip(torch_twin(_math_namespace)(x), MATH_TORCH, strict=True):
        torch.testing.assert_close(got, torch_fn(x), msg=torch_fn.__name__)


def test_unary_functions_take_python_numbers():
    """A Python number becomes a tensor of the default float dtype, as a scalar is a float in Triton."""
    exp2, sqrt = torch_twin(_unary)(4)[1], torch_twin(_unary)(4)[4]
    assert torch.is_tensor(exp2) and exp2.dtype == torch.get_default_dtype()
    assert exp2.item() == 16.0 and sqrt.item() == 2.0


def test_binary_functions_broadcast_and_mix_tensors_with_numbers():
    x = torch.tensor([[1.0], [5.0]])
    y = torch.tensor([2.0, 3.0, 4.0])
    minimum, maximum, where, fma, math_fma = torch_twin(_binary)(x, y, 1.0)
    assert torch.equal(minimum, torch.minimum(x, y)) and torch.equal(maximum, torch.maximum(x, y))
    assert torch.equal(where, torch.where(x > y, x, y))
    assert torch.equal(fma, x * y + 1.0) and torch.equal(math_fma, fma)
    minimum, maximum, *_ = torch_twin(_binary)(7, torch.tensor([3, 9]), 0)  # a number against a tensor
    assert minimum.tolist() == [3, 7] and maximum.tolist() == [7, 9]
    minimum, maximum, *_ = torch_twin(_binary)(2, 5, 0)  # two numbers: a tensor all the same
    assert torch.is_tensor(minimum) and (minimum.item(), maximum.item()) == (2, 5)


def test_cdiv_rounds_up():
    lengths = torch.arange(0, 300)
    assert torch.equal(torch_twin(_cdiv)(lengths, 64), (lengths + 63) // 64)
    assert torch_twin(_cdiv)(129, 64) == math.ceil(129 / 64)


def test_integer_division_of_negative_values_floors():
    """The one difference the module states: torch's `//` floors where Triton's truncates toward zero,
    so a twin must only divide non-negative integers where it is to agree with the kernel."""
    assert torch_twin(_floor_division)(torch.tensor(-7), 2).item() == -4  # Triton: -3
    assert torch_twin(_floor_division)(torch.tensor(7), 2).item() == 3


def test_full_zeros_and_arange_make_tritons_shapes_and_dtypes():
    full, zeros, arange = torch_twin(_constructors)(4)
    assert full.shape == (2, 4) and full.dtype == torch.float32 and bool((full == 1.5).all())
    assert zeros.shape == (4,) and zeros.dtype == torch.int32 and not zeros.any()
    assert arange.dtype == torch.int32 and arange.tolist() == [0, 1, 2, 3]  # tl.arange is int32


def test_static_range_is_a_python_loop():
    x = torch.tensor([1, 10])
    assert torch_twin(_static_sum)(x, 3).tolist() == [3 * 1 + 0 + 1 + 2, 3 * 10 + 0 + 1 + 2]


def test_casts_take_tritons_dtypes():
    x = torch.tensor([-1.5, 0.0, 2.5])
    expected = (torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.uint8,
                torch.int8, torch.int16)
    casts = torch_twin(_casts)(x)
    assert tuple(c.dtype for c in casts) == expected
    assert casts[0].tolist() == [-1, 0, 2] and casts[5].tolist() == [False, False, True]


# ---- TwinPointer -----------------------------------------------------------------------------------------

def test_pointer_loads_gather_the_flattened_tensor():
    table = torch.arange(12, dtype=torch.int32).reshape(3, 4) * 10
    pointer = TwinPointer(table)
    assert torch_twin(_load)(pointer, 5).item() == 50  # element 5 of the flattened [3, 4]
    index = torch.tensor([[0, 11], [3, 4]], dtype=torch.int32)  # an integer tensor of offsets: a gather
    assert torch_twin(_load)(pointer, index).tolist() == [[0, 110], [30, 40]]


def test_pointer_arithmetic_accumulates_offsets_from_either_side():
    values = torch.arange(8) * 2
    pointer = 2 + (TwinPointer(values) + 1)  # `offset + pointer` as well as `pointer + offset`
    assert pointer.load().item() == 6
    assert (pointer + torch.tensor([0, 4])).load().tolist() == [6, 14]
    assert TwinPointer(values, offset=3).load().item() == 6


def test_pointers_inside_a_params_tuple():
    """As a fork's hooks read their runtime arguments (`tl.load(params[0] + head)`)."""
    slopes = torch.tensor([0.5, 0.25, 0.125])
    heads = torch.tensor([2, 0])
    got = torch_twin(_load_from_params)(heads, (TwinPointer(slopes), 4.0))
    assert got.tolist() == [0.5, 2.0]


# ---- calls and globals -----------------------------------------------------------------------------------

def test_nested_jit_calls_run_their_own_twins():
    assert torch_twin(_outer)(torch.tensor([1, 2])).tolist() == [1 * 2 + 3 + 1, 2 * 2 + 3 + 1]


def test_kernel_building_blocks_are_called_through_their_twins():
    q_idx = torch.arange(3)[:, None]
    k_idx = torch.arange(5)[None, :]
    seen = torch_twin(_calls_a_kernel_building_block)(q_idx, k_idx, 3, 5)
    assert torch.equal(seen, k_idx <= q_idx + (5 - 3))  # causal, bottom-right aligned


def test_building_blocks_called_as_a_modules_attributes_run_their_twins():
    q_idx = torch.arange(3)[:, None]
    k_idx = torch.arange(5)[None, :]
    seen = torch_twin(_calls_a_building_block_through_its_module)(q_idx, k_idx, 3, 5)
    assert torch.equal(seen, torch_twin(_calls_a_kernel_building_block)(q_idx, k_idx, 3, 5))


def test_constexpr_globals_are_their_values_and_plain_globals_pass_through():
    shifted, scaled = torch_twin(_globals)(torch.tensor([1.0]))
    assert shifted.item() == 1.0 + SHIFT.value and scaled.item() == PLAIN_GLOBAL


def test_a_twin_is_made_once_per_function():
    assert torch_twin(_outer) is torch_twin(_outer)


def test_twins_are_differentiable():
    """The references run the twins under autograd (a variant's score_mod, the masks)."""
    score = torch.linspace(-20.0, 20.0, 9, dtype=torch.float64, requires_grad=True)
    cap = 5.0
    capped = torch_twin(_softcap)(score, cap)
    torch.testing.assert_close(capped, cap * torch.tanh(score / cap))
    (grad,) = torch.autograd.grad(capped.sum(), score)
    torch.testing.assert_close(grad, 1 - torch.tanh(score / cap).detach() ** 2)


# ---- what the shim does not offer ------------------------------------------------------------------------

@pytest.mark.parametrize("fn,name", [(_program_id, "program_id"), (_dot, "dot")])
def test_a_name_outside_the_shim_raises_attribute_error_naming_it(fn, name):
    with pytest.raises(AttributeError, match=name):
        torch_twin(fn)(torch.ones(2, 2), torch.ones(2, 2)) if name == "dot" else torch_twin(fn)(torch.ones(2))


def test_only_jit_functions_have_twins():
    with pytest.raises(TypeError, match="triton.jit"):
        torch_twin(lambda x: x)


_INTERPRETED_TWIN = """
import torch, triton, triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from jfa.kernels import masks
from jfa.kernels.twin import torch_twin

assert isinstance(masks.visible, InterpretedFunction)
q_idx, k_idx = torch.arange(4)[:, None], torch.arange(6)[None, :]
visible = torch_twin(masks.visible)(q_idx, k_idx, 4, 6, 1, False, True)
assert torch.equal(visible, (q_idx - k_idx).abs() <= 1)
print("twin of an interpreted function ok")
"""


def test_functions_jitted_under_the_interpreter_have_twins_too():
    """With TRITON_INTERPRET=1 (the schedule tests' subprocesses), `@triton.jit` makes an
    InterpretedFunction; its twin is the same source's."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _INTERPRETED_TWIN], env=env, capture_output=True, text=True,
                         timeout=INTERPRETER_TIMEOUT_S)
    assert run.returncode == 0 and "ok" in run.stdout, (run.stdout + run.stderr)[-3000:]
