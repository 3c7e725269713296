"""The block-sparse fork (`jfa.kernels.forks.block_sparse`) of the jagged forward and backward on a Hopper
GPU, run by `jfa.runner`, against the fp32 reference.

As in test_jagged_fwd.py: fresh random inputs, NaN-poisoned `out`/`lse` and dq/dk/dv views inside
guard rows, every element compared. The selections are drawn raw, as users hand them over: -1
padding, repeated picks, picks past a sequence's keys, rows that select nothing (0 and LSE -inf),
and selections of every block (which must equal plain jagged attention).
"""
import math
import warnings

import pytest
import torch

import jfa
from jfa import reference, runner, specs
from jfa.dispatch import ReferenceFallbackWarning
from jfa.kernels.forks.block_sparse import BLOCK_SPARSE_FORK, selection_params
from jfa.sparse import canonical_selection, transposed_selection
from tests.gpu.test_jagged_fwd import DEVICE, assert_grads_close, assert_guards_untouched, offsets, poisoned, random_inputs

pytestmark = pytest.mark.gpu

BLOCK = specs.BLOCK_SPARSE_BLOCK
EDGE_LENGTHS = [0, 1, 127, 128, 129, 255, 256, 257, 511, 640, 1000]


def raw_selection(lengths, heads, max_sel, seed, empty_rows=0.1):
    """Random picks in [-1, n_blocks + 1]: padding, repeats and out-of-range picks included; about
    `empty_rows` of the (sequence, head, query block) rows select nothing at all."""
    gen = torch.Generator().manual_seed(seed)
    blocks = max(1, -(-max(lengths, default=0) // BLOCK))
    idx = torch.randint(-1, blocks + 2, (len(lengths), heads, blocks, max_sel), generator=gen, dtype=torch.int32)
    empty = torch.rand(len(lengths), heads, blocks, 1, generator=gen) < empty_rows
    return idx.masked_fill(empty, -1).to(DEVICE)


def sparse_fork(kv_block_idx, off, heads, max_kv):
    """The fork call of a selection: by query block for the forward and dQ, by key block for dK/dV."""
    selection = canonical_selection(kv_block_idx, off, BLOCK)
    by_key_block = transposed_selection(selection, math.ceil(max_kv / BLOCK))
    return runner.ForkCall(fork=BLOCK_SPARSE_FORK, forward_params=selection_params(selection, heads),
                           key_stationary_params=selection_params(by_key_block, heads), base_tiles=True,
                           block_sparse=True)


def forward_into_poison(q, k, v, off, longest, causal, fork=runner.PLAIN):
    """The runner's forward into NaN-poisoned views; checks nothing was written around them."""
    rows, heads, head_dim = q.shape
    out_buf, out_view = poisoned((rows, heads, head_dim), q.dtype)
    lse_buf, lse_view = poisoned((heads, rows), torch.float32, row_dim=1)
    out, lse = runner.forward(q, k, v, off, off, longest, longest, None, causal, None, False, out=out_view,
                              lse=lse_view, fork=fork)
    torch.cuda.synchronize()
    assert_guards_untouched(out_buf, out)
    assert_guards_untouched(lse_buf, lse, row_dim=1)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "rows left unwritten (still NaN)"
    return out, lse


def run_forward(lengths, kv_block_idx, *, heads=(4, 4), head_dim=128, dtype=torch.bfloat16, causal=False, seed=0):
    """The fork's forward into poisoned views, every element against the reference; returns (out, lse)."""
    q, k, v, _ = random_inputs(lengths, heads, seed, head_dim, dtype)
    off = offsets(lengths)
    longest = max(lengths, default=0)
    out, lse = forward_into_poison(q, k, v, off, longest, causal, sparse_fork(kv_block_idx, off, heads[0], longest))
    ref_out, ref_lse = reference.block_sparse_attention_ref(q, k, v, off, off, kv_block_idx, BLOCK, BLOCK,
                                                            causal=causal)
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
    run_forward(EDGE_LENGTHS, idx, head_dim=head_dim, dtype=dtype, causal=causal)


@pytest.mark.parametrize("group", [2, 4])
def test_gqa(group):
    lengths = [300, 1, 4096, 129, 700]
    run_forward(lengths, raw_selection(lengths, 8, max_sel=12, seed=group), heads=(8, 8 // group))


@pytest.mark.parametrize("max_sel", [1, 3, 40])
def test_selection_widths(max_sel):
    """Widths 1, 4 and 64 after padding to a power of two (the kernel reads whole rows)."""
    lengths = [2053, 4096, 77, 1500]
    run_forward(lengths, raw_selection(lengths, 2, max_sel=max_sel, seed=max_sel), heads=(2, 2),
                causal=max_sel == 3)


def test_nothing_selected_gives_zero_and_minus_inf():
    idx = torch.full((2, 4, 2, 3), -1, dtype=torch.int32, device=DEVICE)
    out, lse = run_forward([200, 129], idx)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_selecting_every_block_is_jagged_attention():
    """Every block selected gives the plain forward's output bit for bit (the same base tiles, in order)."""
    lengths = [1000, 129, 2048, 1]
    widest = -(-max(lengths) // BLOCK)
    idx = torch.arange(widest, dtype=torch.int32, device=DEVICE).expand(len(lengths), 4, widest, widest).contiguous()
    off = offsets(lengths)
    q, k, v, _ = random_inputs(lengths, (4, 4), seed=5)
    sparse = forward_into_poison(q, k, v, off, 2048, True, sparse_fork(idx, off, 4, 2048))
    dense = forward_into_poison(q, k, v, off, 2048, True)
    for got, want in zip(sparse, dense):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


BWD_CASES = {
    "edge_d128": dict(lengths=EDGE_LENGTHS, head_dim=128),
    "edge_d64_causal": dict(lengths=EDGE_LENGTHS, causal=True),
    "gqa2_fp16_causal": dict(lengths=[300, 1, 2048, 129, 700], heads=(4, 2), dtype=torch.float16, causal=True),
    "long_wide": dict(lengths=[4096, 2053, 77], max_sel=40),
}


@pytest.mark.parametrize("name", list(BWD_CASES))
def test_backward(name):
    """dQ (the dQ kernel, the configured strategy with a selection), dK, dV of the fork against autograd
    through the reference, into poisoned buffers: every row written, every element within
    specs.GRAD_TOL or the bound of `assert_grads_close`, rows of empty selections 0."""
    case = dict(heads=(4, 4), head_dim=64, dtype=torch.bfloat16, causal=False, max_sel=5) | BWD_CASES[name]
    lengths, heads, causal = case["lengths"], case["heads"], case["causal"]
    q, k, v, dout = random_inputs(lengths, heads, len(name), case["head_dim"], case["dtype"])
    off = offsets(lengths)
    idx = raw_selection(lengths, heads[0], max_sel=case["max_sel"], seed=len(name))
    longest = max(lengths)
    fork = sparse_fork(idx, off, heads[0], longest)
    out, lse = forward_into_poison(q, k, v, off, longest, causal, fork)
    buffers = [poisoned(tuple(t.shape), t.dtype) for t in (q, k, v)]
    grads = runner.backward(dout, q, k, v, out, lse, off, off, longest, longest, None, causal, None, False,
                            grads=tuple(view for _, view in buffers), fork=fork)
    torch.cuda.synchronize()

    def reference_grads(upcast):
        leaves = [(t.float() if upcast else t.clone()).requires_grad_() for t in (q, k, v)]
        ref_out, _ = reference.block_sparse_attention_ref(*leaves, off, off, idx, BLOCK, BLOCK, causal=causal,
                                                          upcast=upcast)
        return torch.autograd.grad(ref_out, leaves, dout.to(ref_out.dtype))
    for buffer, view in buffers:
        assert_guards_untouched(buffer, view)
    assert_grads_close(grads, reference_grads(upcast=True), lambda: reference_grads(upcast=False))


def test_public_api_runs_the_kernels_forward_and_backward():
    lengths = [300, 64, 513]
    off = offsets(lengths)
    idx = raw_selection(lengths, 2, max_sel=4, seed=9)
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    q, k, v = (torch.randn(sum(lengths), 2, 64, device=DEVICE, generator=gen).to(torch.bfloat16).requires_grad_()
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
