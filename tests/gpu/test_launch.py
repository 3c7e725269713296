"""`jfa.kernels.launch.CachedLaunch` on the H200: a repeated launch skips Triton and computes the same.

The forward and the deterministic backward run twice through `jfa.runner` on fresh random inputs
with NaN-poisoned outputs. The first call of each kernel (the forward, the Delta preprocess, the
dK/dV kernel, the dQ kernel) goes through Triton, the second launches the kept compiled kernel
directly; the second's outputs must equal the first's bit for bit and the fp32 reference's within
the usual tolerance.
"""
import pytest
import torch

from jfa import reference, runner, specs
from jfa.kernels import bwd_delta, bwd_dkdv, bwd_dq, fwd_sm90, launch
from tests.gpu.test_jagged_fwd import DEVICE, offsets

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 65, 128, 300, 1031]
HEADS = 4
LAUNCHES = {fwd_sm90: "_forward_launch", bwd_delta: "_delta_launch", bwd_dkdv: "_dkdv_launch", bwd_dq: "_dq_launch"}


def _relerr(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def _fresh_launch(monkeypatch, module, launch_name):
    """Replace the module's CachedLaunch with an empty one whose Triton path is counted."""
    kernel = getattr(module, launch_name).kernel
    through_triton = []
    triton_run = kernel.run

    def counted(*args, **kwargs):
        through_triton.append(kwargs.get("grid"))
        return triton_run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counted)
    monkeypatch.setattr(module, launch_name, launch.CachedLaunch(kernel))
    return through_triton


def test_repeated_forward_and_backward_skip_triton_and_match(monkeypatch):
    gen = torch.Generator(device=DEVICE).manual_seed(torch.seed() % 2**31)
    rows = sum(LENGTHS)
    q, k, v, dout = (torch.randn(rows, HEADS, 128, device=DEVICE, generator=gen).to(torch.bfloat16)
                     for _ in range(4))
    off = offsets(LENGTHS)
    calls = {module: _fresh_launch(monkeypatch, module, name) for module, name in LAUNCHES.items()}
    longest = max(LENGTHS)
    runs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((HEADS, rows), float("nan"), device=DEVICE)
        runner.forward(q, k, v, off, off, longest, longest, None, False, None, False, out=out, lse=lse)
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        runner.backward(dout, q, k, v, out, lse, off, off, longest, longest, None, False, None, False,
                        deterministic=True, grads=grads)
        runs.append((out, lse) + grads)
    for module, through_triton in calls.items():
        assert len(through_triton) == 1, f"{module.__name__}: {len(through_triton)} launches through Triton"
    for first, second in zip(*runs):
        assert torch.equal(first, second)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.jagged_attention_ref(*leaves, off, off)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.float())
    out, _, *grads = runs[1]
    assert _relerr(out, ref_out) <= specs.FWD_RELERR
    for name, got, want in zip("qkv", grads, ref_grads):
        assert _relerr(got, want) <= specs.GRAD_RELERR, f"d{name}"
