"""jfa: warp-specialized TLX attention kernels for jagged sequences, with references and a workbench."""
__version__ = "0.1.0"
