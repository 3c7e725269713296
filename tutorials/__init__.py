"""Small standalone TLX kernels that build up, one idea each, to the production kernels in `jfa`.

Each tutorial compiles anywhere (its `inspect_spec()` feeds `jfa.inspect.inspect`) and checks
itself against PyTorch with `run_check()` where the hardware it targets is present.
"""


def hopper_tlx_available() -> tuple[bool, str]:
    """(True, "") when a Hopper GPU and TLX are both usable here; otherwise (False, the reason)."""
    return _gpu_available(major=9, arch="a Hopper (sm_90)")


def blackwell_tlx_available() -> tuple[bool, str]:
    """(True, "") when a Blackwell datacenter GPU (sm_100) and TLX are both usable here."""
    return _gpu_available(major=10, arch="a Blackwell (sm_100)")


def _gpu_available(major: int, arch: str) -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, f"no CUDA GPU on this machine; the kernel needs {arch} GPU"
    found_major, found_minor = torch.cuda.get_device_capability()
    if found_major != major:
        return False, f"the kernel needs {arch} GPU, found sm_{found_major}{found_minor}"
    try:
        import triton.language.extra.tlx  # noqa: F401
    except ImportError as exc:
        return False, f"TLX is not importable: {exc}"
    return True, ""
