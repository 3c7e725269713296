"""`jfa.kernels.launch.CachedLaunch` on the H200: a repeated launch skips Triton and computes the same.

The forward and the deterministic backward run twice on fresh random inputs with NaN-poisoned
outputs. The first call of each kernel goes through Triton, the second launches the kept compiled
kernel directly; the second's outputs must equal the first's bit for bit and the fp32 reference's
within the usual tolerance.
"""
import pytest
import torch

from jfa import reference, specs
from jfa.kernels import jagged_bwd, jagged_fwd, launch

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 65, 128, 300, 1031]
HEADS = 4


def _relerr(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def _fresh_launch(monkeypatch, module, launch_name, kernel):
    """Replace the module's CachedLaunch with an empty one whose Triton path is counted."""
    through_triton = []
    triton_run = kernel.run

    def counted(*args, **kwargs):
        through_triton.append(kwargs.get("grid"))
        return triton_run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counted)
    monkeypatch.setattr(module, launch_name, launch.CachedLaunch(kernel))
    return through_triton


def test_repeated_forward_and_backward_skip_triton_and_match(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    rows = sum(LENGTHS)
    q, k, v, dout = (torch.randn(rows, HEADS, 128, device="cuda", generator=gen).to(torch.bfloat16)
                     for _ in range(4))
    offsets = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    fwd_calls = _fresh_launch(monkeypatch, jagged_fwd, "_jagged_fwd_launch", jagged_fwd._jagged_fwd_kernel)
    bwd_calls = _fresh_launch(monkeypatch, jagged_bwd, "_jagged_bwd_launch", jagged_bwd._jagged_bwd_kernel)
    longest = max(LENGTHS)
    runs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((HEADS, rows), float("nan"), device="cuda")
        jagged_fwd.jagged_attention_fwd(q, k, v, offsets, offsets, longest, longest, None, False, None, False,
                                        out=out, lse=lse)
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        jagged_bwd.jagged_attention_bwd(dout, q, k, v, out, lse, offsets, offsets, longest, longest, None, False,
                                        None, False, deterministic=True, grads=grads)
        runs.append((out, lse) + grads)
    # the forward kernel launched twice for the forward, twice for the deterministic dQ: one Triton call each
    assert len(fwd_calls) == 2 and len(bwd_calls) == 1
    for first, second in zip(*runs):
        assert torch.equal(first, second)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.jagged_attention_ref(*leaves, offsets, offsets)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.float())
    out, _, *grads = runs[1]
    assert _relerr(out, ref_out) <= specs.FWD_RELERR
    for name, got, want in zip("qkv", grads, ref_grads):
        assert _relerr(got, want) <= specs.GRAD_RELERR, f"d{name}"
