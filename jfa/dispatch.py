"""From the public entry points to the TLX kernels: what `ops`, `sparse`, `fp8` and `block` share.

Every entry point runs a kernel of `jfa.kernels` where it can and the PyTorch reference elsewhere,
and says so:

- `load_kernel_module(name)` imports `jfa.kernels.<name>` on first use, so a kernel module that fails
  to import (no TLX, an error in the module) never breaks `import jfa`; the reference runs instead;
- `load_runner()` imports `jfa.runner`, which runs the jagged kernels (and imports them), likewise;
- `why_not_kernel(name, q, *others)` is None where that kernel can run on these tensors, else the
  reason it cannot: device, dtype, head dim, TMA alignment, the import, the module's `is_supported`;
- `warn_fallback(reason)` warns with a `ReferenceFallbackWarning`, once per reason in a process;
- `kernel_offsets(q, q_offsets, kv_offsets)` gives the offsets as the kernels read them.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import warnings

import torch
from torch import Tensor

from jfa import specs

__all__ = ["ReferenceFallbackWarning", "load_kernel_module", "load_runner", "why_not_kernel", "warn_fallback",
           "kernel_offsets", "FORWARD_KERNEL", "BACKWARD_KERNEL"]

KERNEL_PACKAGE = "jfa.kernels"
RUNNER = "jfa.runner"
FORWARD_KERNEL = "fwd_sm90"  # the jagged forward's module, for `why_not_kernel`
BACKWARD_KERNEL = "bwd_dkdv"


class ReferenceFallbackWarning(UserWarning):
    """The PyTorch reference ran instead of a TLX kernel (filter it with this category)."""


_warned_reasons: set[str] = set()


# Frames in these folders are the library's, not the user's: the warning names the first frame
# outside them (an entry point's caller; for a backward, the line that called `.backward()`).
_INTERNAL_DIRS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (torch.__file__, __file__))


def _callers_stacklevel() -> int:
    """The `stacklevel` of the first frame outside jfa and torch, counted from warn_fallback's caller."""
    frame, level = sys._getframe(2), 2  # 1: warn_fallback itself, 2: its caller
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def warn_fallback(reason: str) -> None:
    """Say that the reference runs and why, once per reason, at the user's line that called jfa."""
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        warnings.warn(f"jfa: running the PyTorch reference: {reason}", ReferenceFallbackWarning,
                      stacklevel=_callers_stacklevel())


@functools.cache
def load_kernel_module(name: str):
    """(module, "") or (None, why it did not import); imported once, on first use."""
    try:
        return importlib.import_module(f"{KERNEL_PACKAGE}.{name}"), ""
    except Exception as exc:  # a kernel module that fails to import must not take the API down
        return None, f"{KERNEL_PACKAGE}.{name} did not import ({type(exc).__name__}: {exc})"


@functools.cache
def load_runner():
    """(jfa.runner, "") or (None, why it did not import); imported once, on first use."""
    try:
        return importlib.import_module(RUNNER), ""
    except Exception as exc:  # see load_kernel_module
        return None, f"{RUNNER} did not import ({type(exc).__name__}: {exc})"


def why_not_kernel(name: str, q: Tensor, *others: Tensor, dtypes=specs.SUPPORTED_DTYPES) -> str | None:
    """None when the TLX kernel module `name` can run on q (and `others`), else the reason it cannot."""
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, the TLX kernels need a CUDA (sm_90) GPU"
    if q.dtype not in dtypes:
        return f"dtype {q.dtype} has no kernel (kernels take {dtypes})"
    if q.shape[-1] not in specs.SUPPORTED_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} has no kernel (kernels take {specs.SUPPORTED_HEAD_DIMS})"
    if any(t.data_ptr() % specs.TMA_ALIGN_BYTES for t in (q, *others)):
        return f"an input is not {specs.TMA_ALIGN_BYTES}-byte aligned as TMA needs (pass a .clone())"
    module, why = load_kernel_module(name)
    if module is None:
        return why
    if not module.is_supported(q):
        return f"{KERNEL_PACKAGE}.{name}.is_supported(q) is False on this GPU"
    return None


def kernel_offsets(q: Tensor, q_offsets: Tensor, kv_offsets: Tensor) -> tuple[Tensor, Tensor]:
    """The offsets as the kernels read them: int32 on q's device (copied without a host wait)."""
    return tuple(o.to(device=q.device, dtype=torch.int32, non_blocking=True) for o in (q_offsets, kv_offsets))
