"""The block-sparse forks of the jagged forward and backward on a Hopper GPU, against the fp32 reference.

As in test_jagged_fwd.py: fresh random inputs, NaN-poisoned `out` and `lse` views inside guard rows,
every valid row compared. The selections are drawn raw, as users hand them over: -1 padding, repeated
picks, picks past a sequence's keys, rows that select nothing (0 and LSE -inf), and selections of
every block (which must equal plain jagged attention).
"""
import warnings

import pytest
import torch

import jfa
from jfa import reference, specs
from jfa.dispatch import ReferenceFallbackWarning
from jfa.kernels import jagged_bwd, jagged_fwd
from jfa.sparse import canonical_selection
from tests.gpu.test_jagged_fwd import offsets

pytestmark = pytest.mark.gpu

BLOCK = specs.BLOCK_SPARSE_BLOCK
GUARD_ROWS = 5
EDGE_LENGTHS = [0, 1, 127, 128, 129, 255, 256, 257, 511, 640, 1000]


def raw_selection(lengths, heads, max_sel, seed, empty_rows=0.1):
    """Random picks in [-1, n_blocks + 1]: padding, repeats and out-of-range picks included; about
    `empty_rows` of the (sequence, head, query block) rows select nothing at all."""
    gen = torch.Generator().manual_seed(seed)
    q_blocks = max(1, -(-max(lengths, default=0) // BLOCK))
    widest = max(1, -(-max(lengths, default=0) // BLOCK))
    idx = torch.randint(-1, widest + 2, (len(lengths), heads, q_blocks, max_sel), generator=gen, dtype=torch.int32)
    empty = torch.rand(len(lengths), heads, q_blocks, 1, generator=gen) < empty_rows
    return idx.masked_fill(empty, -1).cuda()


def run_case(lengths, kv_block_idx, *, heads_q=4, heads_kv=4, head_dim=128, dtype=torch.bfloat16,
             causal=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(lengths)
    q = torch.randn(rows, heads_q, head_dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(rows, heads_kv, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(rows, heads_kv, head_dim, device="cuda", generator=gen).to(dtype)
    off = offsets(lengths)
    out_buf = torch.full((rows + 2 * GUARD_ROWS, heads_q, head_dim), float("nan"), device="cuda", dtype=dtype)
    lse_buf = torch.full((heads_q, rows + 2 * GUARD_ROWS), float("nan"), device="cuda")
    out_view, lse_view = out_buf[GUARD_ROWS:GUARD_ROWS + rows], lse_buf[:, GUARD_ROWS:GUARD_ROWS + rows]
    longest = max(lengths, default=0)
    out, lse = jagged_fwd.jagged_attention_fwd(
        q, k, v, off, off, longest, longest, None, causal, None, False, out=out_view, lse=lse_view,
        selection=canonical_selection(kv_block_idx, off, BLOCK))
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.block_sparse_attention_ref(q, k, v, off, off, kv_block_idx, BLOCK, BLOCK,
                                                            causal=causal)
    assert torch.isnan(out_buf[:GUARD_ROWS]).all() and torch.isnan(out_buf[-GUARD_ROWS:]).all()
    assert torch.isnan(lse_buf[:, :GUARD_ROWS]).all() and torch.isnan(lse_buf[:, -GUARD_ROWS:]).all()
    assert not torch.isnan(out).any(), "rows left unwritten (still NaN)"
    relerr = ((out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-6)).item()
    assert relerr <= specs.FWD_RELERR, f"relative error {relerr:.2e}"
    torch.testing.assert_close(out.float(), ref_out, **specs.FWD_TOL)
    torch.testing.assert_close(lse, ref_lse, **specs.FWD_TOL)
    return out, lse


@pytest.mark.parametrize("head_dim", specs.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", specs.SUPPORTED_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_edge_lengths_raw_selection(head_dim, dtype, causal):
    idx = raw_selection(EDGE_LENGTHS, 4, max_sel=5, seed=head_dim + causal)
    run_case(EDGE_LENGTHS, idx, head_dim=head_dim, dtype=dtype, causal=causal)


@pytest.mark.parametrize("group", [2, 4])
def test_gqa(group):
    lengths = [300, 1, 4096, 129, 700]
    run_case(lengths, raw_selection(lengths, 8, max_sel=12, seed=group), heads_q=8, heads_kv=8 // group)


@pytest.mark.parametrize("max_sel", [1, 3, 40])
def test_selection_widths(max_sel):
    """Widths 1, 4 and 64 after padding to a power of two (the kernel reads whole rows)."""
    lengths = [2053, 4096, 77, 1500]
    run_case(lengths, raw_selection(lengths, 2, max_sel=max_sel, seed=max_sel), heads_q=2, heads_kv=2,
             causal=max_sel == 3)


def test_nothing_selected_gives_zero_and_minus_inf():
    lengths = [200, 129]
    idx = torch.full((2, 4, 2, 3), -1, dtype=torch.int32, device="cuda")
    out, lse = run_case(lengths, idx)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_selecting_every_block_is_jagged_attention():
    lengths = [1000, 129, 2048, 1]
    widest = -(-max(lengths) // BLOCK)
    idx = torch.arange(widest, dtype=torch.int32, device="cuda").expand(len(lengths), 4, widest, widest).contiguous()
    off = offsets(lengths)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(sum(lengths), 4, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    sparse_out, sparse_lse = jagged_fwd.jagged_attention_fwd(q, k, v, off, off, 2048, 2048, None, True, None, False,
                                                             selection=canonical_selection(idx, off, BLOCK))
    dense_out, dense_lse = jagged_fwd.jagged_attention_fwd(q, k, v, off, off, 2048, 2048, None, True, None, False)
    torch.testing.assert_close(sparse_out, dense_out, atol=0, rtol=0)
    torch.testing.assert_close(sparse_lse, dense_lse, atol=0, rtol=0)


BWD_CASES = {
    "edge_d128": dict(lengths=EDGE_LENGTHS, head_dim=128, causal=False),
    "edge_d64_causal": dict(lengths=EDGE_LENGTHS, head_dim=64, causal=True),
    "gqa2_fp16": dict(lengths=[300, 1, 2048, 129, 700], heads_q=4, heads_kv=2, dtype=torch.float16, causal=True),
    "long_wide": dict(lengths=[4096, 2053, 77], max_sel=40),
}


@pytest.mark.parametrize("name", BWD_CASES)
def test_backward_kernels(name):
    """dQ, dK, dV of the block-sparse fork against autograd through the reference, into poisoned
    buffers: every row written, relative error <= specs.GRAD_RELERR, rows of empty selections 0."""
    case = dict(heads_q=4, heads_kv=4, head_dim=64, dtype=torch.bfloat16, causal=False, max_sel=5) | BWD_CASES[name]
    lengths = case["lengths"]
    gen = torch.Generator(device="cuda").manual_seed(len(name))
    rows = sum(lengths)
    q = torch.randn(rows, case["heads_q"], case["head_dim"], device="cuda", generator=gen).to(case["dtype"])
    k, v = (torch.randn(rows, case["heads_kv"], case["head_dim"], device="cuda", generator=gen).to(case["dtype"])
            for _ in range(2))
    off = offsets(lengths)
    idx = raw_selection(lengths, case["heads_q"], max_sel=case["max_sel"], seed=len(name))
    longest = max(lengths)
    selection = canonical_selection(idx, off, BLOCK)
    out, lse = jagged_fwd.jagged_attention_fwd(q, k, v, off, off, longest, longest, None, case["causal"], None,
                                               False, selection=selection)
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(case["dtype"])
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    jagged_bwd.jagged_attention_bwd(dout, q, k, v, out, lse, off, off, longest, longest, None, case["causal"], None,
                                    False, grads=grads, selection=selection)
    torch.cuda.synchronize()
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.block_sparse_attention_ref(*leaves, off, off, idx, BLOCK, BLOCK, causal=case["causal"])
    expected = torch.autograd.grad(ref_out, leaves, dout.float())
    for label, got, want in zip("qkv", grads, expected):
        assert not torch.isnan(got).any(), f"d{label}: rows left unwritten"
        relerr = ((got.float() - want).norm() / want.norm().clamp_min(1e-6)).item()
        assert relerr <= specs.GRAD_RELERR, f"d{label}: relative error {relerr:.2e}"


def test_public_api_runs_the_kernels_forward_and_backward():
    lengths = [300, 64, 513]
    off = offsets(lengths)
    idx = raw_selection(lengths, 2, max_sel=4, seed=9)
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (torch.randn(sum(lengths), 2, 64, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jfa.block_sparse_attention(q, k, v, off, off, idx, causal=True)
        out.float().square().sum().backward()
    assert not [w for w in caught if issubclass(w.category, ReferenceFallbackWarning)], "a pass fell back"
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.block_sparse_attention_ref(*ref_inputs, off, off, idx, BLOCK, BLOCK, causal=True)
    torch.testing.assert_close(out.float(), ref_out, **specs.FWD_TOL)
    ref_out.square().sum().backward()
    for t, r in zip((q, k, v), ref_inputs):
        relerr = ((t.grad.float() - r.grad).norm() / r.grad.norm()).item()
        assert relerr <= specs.GRAD_RELERR, f"relative gradient error {relerr:.2e}"
