"""jfa: warp-specialized TLX attention kernels for jagged sequences, with references and a workbench.

`jfa.jagged_attention` is the entry point; `jfa.reference` holds the PyTorch references (the spec)
and `jfa.jagged` the offsets helpers and input validation.
"""
__version__ = "0.1.0"

from jfa import jagged, reference
from jfa.ops import ReferenceFallbackWarning, backend_for, jagged_attention

__all__ = ["__version__", "jagged", "reference", "jagged_attention", "backend_for", "ReferenceFallbackWarning"]
