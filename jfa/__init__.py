"""jfa: warp-specialized TLX attention kernels for jagged sequences, with references and a workbench.

`jfa.jagged_attention` is the entry point; `jfa.variant` makes a fork of it from `@triton.jit` hooks;
`jfa.reference` holds the PyTorch references (the spec) and `jfa.jagged` the offsets helpers and
input validation.
"""
__version__ = "0.1.0"

from jfa import jagged, reference
from jfa.dispatch import ReferenceFallbackWarning
from jfa.ops import backend_for, jagged_attention

__all__ = ["__version__", "jagged", "reference", "jagged_attention", "backend_for", "ReferenceFallbackWarning",
           "block_attention", "fused_projection_rotary_block_attention", "block_sparse_attention",
           "jagged_attention_fp8", "variant", "variants"]

# These modules register their own custom ops or import TLX kernels: each is loaded on first use only.
_LAZY_API = {"block_attention": "block", "fused_projection_rotary_block_attention": "block",
             "block_sparse_attention": "sparse", "jagged_attention_fp8": "fp8", "variant": "variants"}


def __getattr__(name):
    import importlib

    if name in _LAZY_API:
        return getattr(importlib.import_module(f"jfa.{_LAZY_API[name]}"), name)
    if name == "variants":
        return importlib.import_module("jfa.variants")
    raise AttributeError(f"module 'jfa' has no attribute {name!r}")
