"""Launching a kernel again without paying Triton's per-call argument binding.

Why: `kernel[grid](*args, **config)` re-binds every argument in Python on each call. It builds a
dict of all the kernel's parameters (ours have 40-60, a third of them constexprs), specializes each
one, formats the launch options into the cache key and looks the compiled kernel up by it. On the
H200's host that comes to 100-200 µs for each launch of our kernels, against 15-22 µs for an empty
kernel, and a training step of a small jagged batch issues four of them plus the backward's TMA
descriptors: the step would wait on the CPU, not on the GPU (docs/decisions.md, CachedLaunch).

`CachedLaunch(kernel)[grid](*args, **config)` keeps Triton's meaning. The first call of each
specialization goes through Triton (which compiles or loads the kernel, then launches it), and the
compiled kernel is kept under a key made of what Triton specializes on: each positional argument's
`native_specialize_impl` (a pointer's dtype and 16-byte alignment, an integer equal to 1 or a
multiple of 16, a descriptor's dtype and block shape), every keyword (constexprs, warps, stages;
a fork's tuple of hooks by identity), the device and the global knobs Triton reads. A later call with the same key launches the compiled
kernel directly, unless a module global the kernel reads has been rebound since: Triton checks that
on every launch (and refuses a changed value), so such a call goes back through Triton. The key
never says less than Triton's own (it keeps the whole specialization of every argument), so it can
miss where Triton would hit but never hit where Triton would compile.

Launch hooks (a profiler's `knobs.runtime.launch_enter_hook`) need Triton's launch metadata, so
with one set every call goes through Triton, as does a grid given as a function and every call
under Triton's interpreter.
"""
from __future__ import annotations

import triton
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.compiler.compiler import make_backend
from triton.runtime.driver import driver

_UNBOUND = object()  # a global name with no binding


class _ByIdentity:
    """A constexpr that is a tuple of jit functions (a fork's hooks), standing in the key for itself by
    identity: hashing the tuple hashes every jit function in it (a lock and a property each), which
    costs more than the rest of the key. Identity is stricter than equality, so it can only miss."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value  # held, so its id is not reused while the key exists

    def __hash__(self):
        return id(self.value)

    def __eq__(self, other):
        return isinstance(other, _ByIdentity) and other.value is self.value


def _constexpr_fact(value):
    """A constexpr's part of the key: the value, or `_ByIdentity` for a tuple holding jit functions."""
    if isinstance(value, tuple) and any(isinstance(item, triton.runtime.JITFunction) for item in value):
        return _ByIdentity(value)
    return value


class CachedLaunch:
    """`kernel[grid](...)` with the compiled kernel kept per specialization (see the module doc)."""

    def __init__(self, kernel: triton.runtime.JITFunction):
        self.kernel = kernel
        self._params = getattr(kernel, "params", None)  # None under TRITON_INTERPRET: no compiled kernel
        # per parameter: constexpr, and else the flags Triton's binder passes to native_specialize_impl
        self._flags = [(p.is_constexpr, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                       for p in self._params or ()]
        self._compiled = {}  # key -> (compiled kernel, values of the parameters passed by keyword, globals read)
        self._backends = {}  # device -> the backend Triton specializes for

    def __getitem__(self, grid):
        return lambda *args, **config: self.launch(grid, args, config)

    def _backend(self, device: int):
        backend = self._backends.get(device)
        if backend is None:
            backend = self._backends[device] = make_backend(driver.active.get_current_target())
        return backend

    def key(self, device: int, args: tuple, config: dict) -> tuple:
        """What the compiled kernel depends on, for these arguments on `device`."""
        backend = self._backend(device)
        facts = [("constexpr", _constexpr_fact(arg)) if constexpr
                 else native_specialize_impl(backend, arg, const, specialize, align)
                 for (constexpr, const, specialize, align), arg in zip(self._flags, args)]
        stages_hook = knobs.runtime.add_stages_inspection_hook
        keywords = tuple((name, _constexpr_fact(value)) for name, value in config.items())
        return (device, tuple(facts), keywords, knobs.runtime.debug,
                knobs.compilation.instrumentation_mode, None if stages_hook is None else stages_hook()[1])

    def launch(self, grid: tuple, args: tuple, config: dict):
        hooked = _has_hooks(knobs.runtime.launch_enter_hook) or _has_hooks(knobs.runtime.launch_exit_hook)
        if hooked or callable(grid) or self._params is None:
            return self.kernel[grid](*args, **config)
        device = driver.active.get_current_device()
        key = self.key(device, args, config)
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **config)
            keyword_values = tuple(config[p.name] if p.name in config else p.default for p in self._params[len(args):])
            self._compiled[key] = (compiled, keyword_values, self._globals_read())
            return compiled
        compiled, keyword_values, globals_read = entry
        for namespace, name, value in globals_read:
            if namespace.get(name, _UNBOUND) is not value:  # rebound: Triton checks it (and raises if it changed)
                return self.kernel[grid](*args, **config)
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], grid_y, grid_z, driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *keyword_values)
        return compiled

    def _globals_read(self) -> tuple:
        """The module globals the compiled kernel read, as (namespace, name, the object bound now)."""
        return tuple((namespace, name, namespace.get(name, _UNBOUND))
                     for (name, _), (_, namespace) in self.kernel.used_global_vals.items())

    def cache_size(self) -> int:
        """Compiled specializations kept (one per key seen)."""
        return len(self._compiled)


def _has_hooks(hook) -> bool:
    """Whether a launch hook knob holds a hook: Triton 3.8 keeps a `HookChain` (its `calls` may be empty)
    where earlier versions kept None or the hook itself."""
    return hook is not None and bool(getattr(hook, "calls", True))
