"""jfa: warp-specialized TLX attention kernels for jagged sequences, with references and a workbench.

`jfa.jagged_attention` is the entry point; `jfa.reference` holds the PyTorch references (the spec)
and `jfa.jagged` the offsets helpers and input validation.
"""
__version__ = "0.1.0"

from jfa import jagged, reference
from jfa.ops import ReferenceFallbackWarning, backend_for, jagged_attention

__all__ = ["__version__", "jagged", "reference", "jagged_attention", "backend_for", "ReferenceFallbackWarning",
           "block_attention", "fused_projection_rotary_block_attention"]

# Block attention registers its own custom ops and imports its TLX kernels: load it on first use only.
_BLOCK_API = ("block_attention", "fused_projection_rotary_block_attention")


def __getattr__(name):
    if name in _BLOCK_API:
        from jfa import block

        return getattr(block, name)
    raise AttributeError(f"module 'jfa' has no attribute {name!r}")
