"""Block attention kernels on a Hopper GPU against the fp32 references of `jfa.reference`.

Every test draws fresh random inputs, hands the kernel NaN-poisoned output buffers and checks every
element: a row the kernel forgot to write stays NaN and fails the comparison. Partial blocks (lengths
63, 65, 1, ...) put rows of the next sequence inside a block's TMA tile, so a missing key mask or an
unmasked store shows up as a wrong value next door.
"""
import math

import pytest
import torch

from jfa import reference, specs
from jfa import block
from jfa.block import block_attention, fused_projection_rotary_block_attention
from jfa.kernels import rotary

pytestmark = pytest.mark.gpu

EDGE_LENGTHS = [0, 1, 63, 64, 65, 128, 0, 2, 127, 129]


def snr_db(expected: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-noise ratio of `got` against `expected`, in dB (higher is better)."""
    expected, got = expected.double(), got.double()
    noise = (expected - got).square().sum().item()
    return math.inf if noise == 0 else 10 * math.log10(expected.square().sum().item() / noise)


def make_offsets(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")


def random_lengths(batch: int, max_len: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()


def make_qkv(rows, heads_q, heads_kv, head_dim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(rows, h, head_dim, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
                 for h in (heads_q, heads_kv, heads_kv))


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def reference_grads(q, k, v, offsets, dout):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = reference.block_attention_ref(*leaves, offsets)
    return out, torch.autograd.grad(out, leaves, dout.float())


CASES = {
    "seed_B64_U256_H4_D64": dict(lengths=random_lengths(64, 256, seed=1), heads_q=4, heads_kv=4, head_dim=64),
    "edge_lengths_D64": dict(lengths=EDGE_LENGTHS, heads_q=4, heads_kv=4, head_dim=64),
    "edge_lengths_D128": dict(lengths=EDGE_LENGTHS, heads_q=2, heads_kv=2, head_dim=128),
    "U256_D128": dict(lengths=random_lengths(32, 256, seed=2), heads_q=4, heads_kv=4, head_dim=128),
    "gqa_G2_D64": dict(lengths=random_lengths(24, 200, seed=3), heads_q=4, heads_kv=2, head_dim=64),
    "gqa_G4_D128": dict(lengths=EDGE_LENGTHS, heads_q=4, heads_kv=1, head_dim=128),
    "many_sequences": dict(lengths=random_lengths(1500, 100, seed=4), heads_q=2, heads_kv=2, head_dim=64),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_reference(case, dtype):
    cfg = CASES[case]
    offsets = make_offsets(cfg["lengths"])
    q, k, v = make_qkv(sum(cfg["lengths"]), cfg["heads_q"], cfg["heads_kv"], cfg["head_dim"], dtype, seed=10)
    out = block.block_attention_fwd(q, k, v, offsets, out=poisoned_like(q))
    expected = reference.block_attention_ref(q, k, v, offsets)
    assert not out.isnan().any(), "some output rows were never written"
    torch.testing.assert_close(out.float(), expected, **specs.FWD_TOL)


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_reference(case):
    cfg = CASES[case]
    offsets = make_offsets(cfg["lengths"])
    q, k, v = make_qkv(sum(cfg["lengths"]), cfg["heads_q"], cfg["heads_kv"], cfg["head_dim"], torch.bfloat16, seed=11)
    dout = make_qkv(q.shape[0], cfg["heads_q"], 1, cfg["head_dim"], torch.bfloat16, seed=12)[0]
    grads = block.block_attention_bwd(q, k, v, offsets, dout,
                                      grads=(poisoned_like(q), poisoned_like(k), poisoned_like(v)))
    _, expected = reference_grads(q, k, v, offsets, dout)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        assert not got.isnan().any(), f"{name}: some rows were never written"
        torch.testing.assert_close(got.float(), want, **specs.BLOCK_ATTN_GRAD_TOL, msg=name)
        assert snr_db(want, got) > specs.BLOCK_ATTN_GRAD_SNR_DB, f"{name}: SNR {snr_db(want, got):.1f} dB"


def test_public_api_autograd_matches_reference():
    """The seed's test: B=64, lengths U[1,256], H=4, D=64, through the custom op and autograd."""
    lengths = random_lengths(64, 256, seed=5)
    offsets = make_offsets(lengths)
    q, k, v = (t.requires_grad_() for t in make_qkv(sum(lengths), 4, 4, 64, torch.bfloat16, seed=13))
    dout = torch.randn_like(q)
    out = block_attention(q, k, v, offsets)
    out.backward(dout)
    expected_out, expected = reference_grads(q, k, v, offsets, dout)
    torch.testing.assert_close(out.float(), expected_out, **specs.FWD_TOL)
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), expected):
        torch.testing.assert_close(got.float(), want, **specs.BLOCK_ATTN_GRAD_TOL, msg=name)
        assert snr_db(want, got) > specs.BLOCK_ATTN_GRAD_SNR_DB, f"{name}: SNR {snr_db(want, got):.1f} dB"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_epilogue_writes_conjugate_rotated_dz(head_dim):
    """The backward's rotary epilogue equals rotary_conj(dq | dk | dv) of the plain backward."""
    lengths = EDGE_LENGTHS + random_lengths(8, 256, seed=6)
    offsets = make_offsets(lengths)
    q, k, v = make_qkv(sum(lengths), 4, 2, head_dim, torch.bfloat16, seed=14)
    dout = torch.randn_like(q)
    sinu_pos = reference.make_sinu_pos(offsets, head_dim)
    dz = torch.full((q.shape[0], 8 * head_dim), float("nan"), dtype=q.dtype, device="cuda")
    block.block_attention_rotary_bwd(q, k, v, offsets, dout, sinu_pos, dz=dz)
    _, (dq, dk, dv) = reference_grads(q, k, v, offsets, dout)
    expected = torch.cat([reference.rotary_conj_ref(g, sinu_pos).flatten(1) for g in (dq, dk, dv)], dim=1)
    assert not dz.isnan().any(), "some dz rows were never written"
    torch.testing.assert_close(dz.float(), expected, **specs.BLOCK_ATTN_GRAD_TOL)
    assert snr_db(expected, dz) > specs.BLOCK_ATTN_GRAD_SNR_DB


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_pass_and_unfused_dz_match_the_reference(head_dim):
    """The Triton rotary pass on a column slice of qkv, and the unfused dz built from it."""
    lengths = EDGE_LENGTHS + random_lengths(8, 256, seed=7)
    offsets = make_offsets(lengths)
    rows = sum(lengths)
    sinu_pos = reference.make_sinu_pos(offsets, head_dim)
    qkv = torch.randn(rows, 8 * head_dim, device="cuda", dtype=torch.bfloat16)
    k_view = qkv[:, 4 * head_dim:6 * head_dim].view(rows, 2, head_dim)
    out = torch.full((rows, 2, head_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    rotary.rotate(k_view, sinu_pos, out=out)
    torch.testing.assert_close(out.float(), reference.rotary_ref(k_view, sinu_pos), **specs.FWD_TOL)
    grads = tuple(torch.randn(rows, h, head_dim, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    dz = rotary.rotary_conj_dz(grads, sinu_pos)
    expected = torch.cat([reference.rotary_conj_ref(g, sinu_pos).flatten(1) for g in grads], dim=1)
    torch.testing.assert_close(dz.float(), expected, **specs.FWD_TOL)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_projection_rotary_matches_reference(heads, with_bias):
    q_heads, kv_heads = heads
    lengths, head_dim, embed = random_lengths(64, 256, seed=7), 64, 256
    offsets = make_offsets(lengths)
    rows, width = sum(lengths), (q_heads + 2 * kv_heads) * head_dim
    gen = torch.Generator(device="cuda").manual_seed(15)
    x32 = torch.randn(rows, embed, device="cuda", generator=gen)
    w32 = torch.randn(embed, width, device="cuda", generator=gen) / math.sqrt(embed)
    b32 = torch.randn(width, device="cuda", generator=gen) if with_bias else None
    sinu_pos = reference.make_sinu_pos(offsets, head_dim)
    dout = torch.randn(rows, q_heads * head_dim, device="cuda", generator=gen)

    x, w = x32.bfloat16().requires_grad_(), w32.bfloat16().requires_grad_()
    b = b32.bfloat16().requires_grad_() if with_bias else None
    out = fused_projection_rotary_block_attention(x, w, sinu_pos, offsets, q_heads, kv_heads, bias=b)
    out.backward(dout.bfloat16())

    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    br = b.detach().float().requires_grad_() if with_bias else None
    expected = reference.fused_projection_rotary_block_attention_ref(xr, wr, sinu_pos, offsets, q_heads, kv_heads,
                                                                     bias=br)
    expected.backward(dout.bfloat16().float())
    assert snr_db(expected, out) > specs.ROTARY_FWD_SNR_DB, f"out: SNR {snr_db(expected, out):.1f} dB"
    checks = [("dx", xr.grad, x.grad), ("dw", wr.grad, w.grad)] + ([("dbias", br.grad, b.grad)] if with_bias else [])
    for name, want, got in checks:
        assert snr_db(want, got) > specs.ROTARY_GRAD_SNR_DB, f"{name}: SNR {snr_db(want, got):.1f} dB"

