"""Small standalone TLX kernels that build up, one idea each, to the production kernels in `jfa`.

Each tutorial compiles anywhere (its `inspect_spec()` feeds `jfa.workbench.inspect.inspect`) and checks
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


def check_matrices(**named) -> None:
    """Each named tensor must be a contiguous 2-D float16 matrix whose rows TMA can load; a ValueError
    names the argument that is not."""
    import torch

    from jfa.specs import TMA_ALIGN_BYTES

    for arg, t in named.items():
        if t.dim() != 2 or not t.is_contiguous() or t.dtype != torch.float16:
            raise ValueError(f"{arg} must be a contiguous 2-D float16 tensor, got {t.dtype} {tuple(t.shape)}")
        if (t.shape[1] * t.element_size()) % TMA_ALIGN_BYTES:
            raise ValueError(f"TMA needs {TMA_ALIGN_BYTES}-byte aligned rows: pad {arg}.shape[1] ({t.shape[1]})")


def matrix_descriptor(t, box):
    """A TMA descriptor of the contiguous matrix `t`, loading and storing `box`-shaped tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, shape=list(t.shape), strides=[t.shape[1], 1], block_shape=list(box))


def gemm_operands(a, b, out, a_box, b_box, c_box):
    """The GEMM tutorials' host side of ``a @ b``: check the operands (`check_matrices`, matching K),
    make `out` if it is None, and return `(c, a_desc, b_desc, c_desc)`, TMA descriptors whose boxes
    are `a_box`, `b_box`, `c_box`."""
    import torch

    check_matrices(a=a, b=b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a.shape[1] must equal b.shape[0]")
    c = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=a.dtype) if out is None else out
    return (c, *(matrix_descriptor(t, box) for t, box in ((a, a_box), (b, b_box), (c, c_box))))


def check_gemm(gemm, label: str, M: int, N: int, K: int, seed: int) -> None:
    """`gemm(a, b, out=c)` against an fp32 torch matmul on fresh random float16 data, `c` poisoned with
    NaN so an element left unwritten fails; every element is compared."""
    import torch

    from jfa.specs import FWD_TOL

    torch.manual_seed(seed)
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
    gemm(a, b, out=c)
    torch.testing.assert_close(c.float(), a.float() @ b.float(), **FWD_TOL)
    print(f"{label} check passed: ({M}x{K}) @ ({K}x{N}) against fp32 torch")


def main(inspect_spec, run_check, *also_on_gpu, blackwell: bool = False) -> None:
    """What ``python -m tutorials.tNN`` does: print the kernel's `jfa.workbench.inspect` report, then run its
    self-check and `also_on_gpu` (a benchmark, say) where its GPU is present, or say why not."""
    from jfa.workbench.inspect import inspect

    if blackwell:
        print("compiled for sm_100, not run here\n")
    print(inspect(inspect_spec()).to_text())
    ready, why = (blackwell_tlx_available if blackwell else hopper_tlx_available)()
    if ready:
        run_check()
        for step in also_on_gpu:
            step()
    else:
        print(f"\nGPU check skipped: {why}")
