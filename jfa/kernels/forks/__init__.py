"""Forks of the kernel skeletons written through their hooks (`jfa.kernels.hooks.Fork`), one per module."""
