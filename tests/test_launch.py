"""`jfa.kernels.launch.CachedLaunch`: a kernel launched again skips Triton's binding, never its meaning.

Checked on the CPU with Triton's launch replaced by a recorder: the first call of a specialization
must go through Triton (which compiles and launches), a repeat must launch the kept compiled kernel
with every parameter in Triton's order, and anything Triton specializes on (a pointer's alignment or
dtype, an integer equal to 1 or a multiple of 16, a descriptor's box, a constexpr, the launch
options) must send the call back through Triton. The key is also compared with Triton's own binder:
two calls that share a key share Triton's specialization.
"""
import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from jfa.kernels import launch
from jfa.kernels.tma import rows_descriptor

TARGET = GPUTarget("cuda", 90, 32)


PROBE_WIDTH: tl.constexpr = tl.constexpr(4)  # a global the probe kernel reads


@triton.jit(do_not_specialize=["loose"])
def _probe_kernel(desc, x_ptr, n, loose, scale, maybe_ptr, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    tl.static_assert(PROBE_WIDTH > 0)


class _Compiled:
    """Stands in for Triton's CompiledKernel: records what the direct launch passes."""
    function = "function-handle"
    packed_metadata = "packed"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class _Driver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 1234)
        get_current_target = staticmethod(lambda: TARGET)


@pytest.fixture
def probe(monkeypatch):
    """A CachedLaunch of `_probe_kernel` whose Triton path is recorded instead of compiled."""
    monkeypatch.setattr(launch, "driver", _Driver)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())  # none set, as by default
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", knobs.HookChain(reversed=True))
    compiled = _Compiled()
    through_triton = []

    def triton_run(*args, grid, warmup, **kwargs):
        _probe_kernel.cache_key  # noqa: B018 -- as Triton's run does, finds the globals the kernel reads
        through_triton.append((grid, args, kwargs))
        return compiled

    monkeypatch.setattr(_probe_kernel, "run", triton_run)
    return launch.CachedLaunch(_probe_kernel), compiled, through_triton


def _args(rows=64, n=100, loose=5, scale=0.5, maybe=None, offset=0, box=64):
    buffer = torch.zeros(rows * 2 + 8, 1, 64, dtype=torch.bfloat16)
    x = torch.zeros(1024, dtype=torch.float32)[offset:]
    return (rows_descriptor(buffer[:rows], box), x, n, loose, scale, maybe)


CONFIG = dict(BLOCK=64, FLAG=True, num_warps=4, num_stages=1)


def test_repeat_launches_the_kept_kernel_with_every_parameter_in_order(probe):
    cached, compiled, through_triton = probe
    first = _args()
    assert cached[(3,)](*first, **CONFIG) is compiled
    assert len(through_triton) == 1 and not compiled.launches
    again = _args(n=200, loose=7, scale=0.25)  # new values, same specialization
    cached[(3, 2)](*again, **CONFIG)
    assert len(through_triton) == 1
    (launched,) = compiled.launches
    grid_x, grid_y, grid_z, stream, function, packed, metadata, enter, leave, *params = launched
    assert (grid_x, grid_y, grid_z, stream, function, packed) == (3, 2, 1, 1234, "function-handle", "packed")
    assert (metadata, enter, leave) == (None, None, None)
    assert params[:6] == list(again) and params[6:] == [64, True]  # constexprs after the positional ones
    assert cached.cache_size() == 1


@pytest.mark.parametrize("change", [
    dict(n=1),  # Triton makes an integer equal to 1 a constant
    dict(n=96),  # and specializes one divisible by 16
    dict(n=2 ** 40),  # a 64-bit integer
    dict(offset=1),  # a pointer not 16-byte aligned
    dict(maybe=torch.zeros(4)),  # None against a pointer
    dict(box=32),  # another descriptor box
])
def test_what_triton_specializes_on_goes_back_through_triton(probe, change):
    cached, compiled, through_triton = probe
    cached[(1,)](*_args(), **CONFIG)
    cached[(1,)](*_args(**change), **CONFIG)
    assert len(through_triton) == 2 and not compiled.launches


def test_an_unspecialized_integer_stays_on_the_kept_kernel(probe):
    cached, compiled, through_triton = probe
    cached[(1,)](*_args(loose=5), **CONFIG)
    cached[(1,)](*_args(loose=1), **CONFIG)  # `loose` is do_not_specialize: 1 is no constant there
    assert len(through_triton) == 1 and len(compiled.launches) == 1


@pytest.mark.parametrize("change", [dict(BLOCK=128), dict(FLAG=False), dict(num_warps=8), dict(num_stages=0)])
def test_constexprs_and_launch_options_are_part_of_the_key(probe, change):
    cached, compiled, through_triton = probe
    cached[(1,)](*_args(), **CONFIG)
    cached[(1,)](*_args(), **{**CONFIG, **change})
    assert len(through_triton) == 2 and not compiled.launches


def test_a_launch_hook_sends_every_call_through_triton(probe):
    cached, compiled, through_triton = probe
    knobs.runtime.launch_enter_hook.add(lambda metadata: None)
    for _ in range(3):
        cached[(1,)](*_args(), **CONFIG)
    assert len(through_triton) == 3 and not compiled.launches


def test_shared_key_means_shared_triton_specialization(probe):
    """Over combinations of argument variants, equal keys imply equal specializations from Triton's binder."""
    cached, _, _ = probe
    binder = create_function_from_signature(_probe_kernel.signature, _probe_kernel.params, make_backend(TARGET))
    variants = itertools.product((1, 16, 17, 2 ** 40), (1, 3), (0, 1, 4), (None, torch.zeros(4)), (32, 64))
    seen = {}
    for n, loose, offset, maybe, box in variants:
        args = _args(n=n, loose=loose, offset=offset, maybe=maybe, box=box)
        _, specialization, _ = binder(*args, **CONFIG)
        key = cached.key(0, args, CONFIG)
        assert seen.setdefault(key, specialization) == specialization
    assert len(seen) > 1


def test_triton_default_knobs_count_as_no_hook():
    """Triton 3.8 keeps an empty HookChain where no hook is set: that must take the direct launch."""
    assert not launch._has_hooks(knobs.runtime.launch_enter_hook)
    assert not launch._has_hooks(knobs.runtime.launch_exit_hook)
    assert not launch._has_hooks(None)
    assert launch._has_hooks(lambda metadata: None)


def test_a_rebound_global_goes_back_through_triton(probe, monkeypatch):
    """Triton checks on every launch that the globals a kernel read keep their values (and raises if one
    changed); a kept kernel must not skip that."""
    cached, compiled, through_triton = probe
    cached[(1,)](*_args(), **CONFIG)
    assert any(name == "PROBE_WIDTH" for name, _ in _probe_kernel.used_global_vals)
    cached[(1,)](*_args(), **CONFIG)
    assert len(through_triton) == 1 and len(compiled.launches) == 1
    monkeypatch.setitem(globals(), "PROBE_WIDTH", tl.constexpr(8))
    cached[(1,)](*_args(), **CONFIG)
    assert len(through_triton) == 2 and len(compiled.launches) == 1


@triton.jit
def _hook():
    pass


def test_a_tuple_of_jit_functions_keys_by_identity(probe, monkeypatch):
    """A fork (a tuple of jit functions) as a constexpr stands in the key for itself: the same tuple
    shares a key, an equal but separate one does not (stricter than Triton, so it can only miss), and
    hashing the key hashes no jit function."""
    cached, _, _ = probe
    fork = (_hook, None)
    key = cached.key(0, _args(), dict(CONFIG, FLAG=fork))
    assert key == cached.key(0, _args(), dict(CONFIG, FLAG=fork))
    assert key != cached.key(0, _args(), dict(CONFIG, FLAG=(_hook, None)))
    hashed = []
    monkeypatch.setattr(type(_hook), "__hash__", lambda self: hashed.append(self) or 0)
    hash(key)
    assert not hashed
