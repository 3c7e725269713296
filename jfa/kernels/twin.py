"""Run a `@triton.jit` function's own source on torch tensors: its PyTorch twin.

Attention's definitions (which pairs are visible, the ranges of tiles that follow, a fork's score
modification) are written once, as Triton functions that the kernels inline. The references and the
host schedules need the same definitions on torch tensors. Rather than a second copy that could
drift, `torch_twin(fn)` rebinds the function's code to a namespace in which `tl` is a small PyTorch
shim: the source that compiles into the kernel is the source the reference runs (autograd included).

What such a function may use: arithmetic and comparison operators, `&`, `|`, `~`, `if` on
compile-time flags, tuples, calls of other `@triton.jit` functions (twinned in turn, by name or as a module's attribute), `x.to(dtype)`,
and these names of `tl`: where, minimum, maximum, abs, cdiv, exp, exp2, log, log2, sqrt, rsqrt,
sigmoid, sin, cos, erf, floor, ceil, fma, full, zeros, arange, static_range, the math namespace,
the dtypes, and `tl.load(pointer + offset)` of a pointer the caller passes as a `TwinPointer`. A name
outside the shim raises AttributeError naming it. One difference remains: Triton's integer `//`
and `%` truncate toward zero where torch's floor, so integer divisions of negative values differ.
"""
from __future__ import annotations

import functools
import types

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


class TwinPointer:
    """A tensor standing in for a kernel pointer argument: `pointer + offset` then `tl.load` gathers
    `tensor.flatten()[offset]` (offset a Python int or an integer tensor)."""

    def __init__(self, tensor: torch.Tensor, offset=0):
        self.tensor = tensor
        self.offset = offset

    def __add__(self, offset):
        return TwinPointer(self.tensor, self.offset + offset)

    __radd__ = __add__

    def load(self):
        offset = self.offset if torch.is_tensor(self.offset) else torch.tensor(self.offset)
        return self.tensor.flatten()[offset.to(device=self.tensor.device, dtype=torch.long)]


def _as_tensor(x, like=None):
    return x if torch.is_tensor(x) else torch.tensor(x, device=None if like is None else like.device)


def _where(condition, x, y):
    condition = _as_tensor(condition)
    return torch.where(condition, _as_tensor(x, condition), _as_tensor(y, condition))


def _binary(op):
    def apply(x, y):
        if not torch.is_tensor(x) and not torch.is_tensor(y):
            return op(torch.tensor(x), torch.tensor(y))
        return op(_as_tensor(x, y if torch.is_tensor(y) else None), _as_tensor(y, x if torch.is_tensor(x) else None))
    return apply


def _unary(op):
    return lambda x: op(_as_tensor(x).to(torch.get_default_dtype()) if not torch.is_tensor(x) else x)


_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
           "int1": torch.bool, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
           "uint8": torch.uint8}

_MATH = types.SimpleNamespace(
    exp=_unary(torch.exp), exp2=_unary(torch.exp2), log=_unary(torch.log), log2=_unary(torch.log2),
    sqrt=_unary(torch.sqrt), rsqrt=_unary(torch.rsqrt), sin=_unary(torch.sin), cos=_unary(torch.cos),
    erf=_unary(torch.erf), floor=_unary(torch.floor), ceil=_unary(torch.ceil), abs=_unary(torch.abs),
    fma=lambda x, y, z: x * y + z)

# `tl` as the twins see it.
TL_SHIM = types.SimpleNamespace(
    where=_where, minimum=_binary(torch.minimum), maximum=_binary(torch.maximum),
    cdiv=lambda x, y: (x + y - 1) // y, sigmoid=_unary(torch.sigmoid),
    full=lambda shape, value, dtype: torch.full(tuple(shape), value, dtype=dtype),
    zeros=lambda shape, dtype: torch.zeros(tuple(shape), dtype=dtype),
    arange=lambda start, end: torch.arange(start, end, dtype=torch.int32),
    static_range=range, constexpr=lambda value: value, load=lambda pointer: pointer.load(),
    math=_MATH, **{name: getattr(_MATH, name) for name in vars(_MATH)}, **_DTYPES)


# What `@triton.jit` makes: a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction.
JIT_FUNCTION_TYPES = (triton.runtime.JITFunction, InterpretedFunction)


def _twin_global(value):
    if value is tl or value is tl.math:
        return TL_SHIM if value is tl else _MATH
    if isinstance(value, JIT_FUNCTION_TYPES):
        return torch_twin(value)
    if isinstance(value, tl.constexpr):
        return value.value
    if isinstance(value, types.ModuleType):
        return _TwinModule(value)
    return value


class _TwinModule:
    """A module as a twin sees it (`masks.visible(...)`): its attributes translated like globals."""

    def __init__(self, module: types.ModuleType):
        self._module = module

    def __getattr__(self, name):
        return _twin_global(getattr(self._module, name))


@functools.cache
def torch_twin(fn):
    """The PyTorch twin of a `@triton.jit` function (see the module docstring for what it may use)."""
    if not isinstance(fn, JIT_FUNCTION_TYPES):
        raise TypeError(f"torch_twin: expected a @triton.jit function, got {type(fn).__name__}")
    python_fn = fn.fn
    namespace = _TwinGlobals(python_fn.__globals__)
    return types.FunctionType(python_fn.__code__, namespace, python_fn.__name__, python_fn.__defaults__,
                              python_fn.__closure__)


class _TwinGlobals(dict):
    """The function's module globals, each translated for the twin on first use."""

    def __init__(self, module_globals: dict):
        super().__init__()
        self._module_globals = module_globals
        self["__builtins__"] = module_globals.get("__builtins__", __builtins__)

    def __missing__(self, name):
        if name not in self._module_globals:
            raise KeyError(name)
        value = self[name] = _twin_global(self._module_globals[name])
        return value
