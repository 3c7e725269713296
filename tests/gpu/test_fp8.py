"""The FP8 fork (`jfa.kernels.forks.fp8`) of the jagged forward on a Hopper GPU, run by `jfa.runner`,
against the fp32 reference on the same (already quantized) inputs: cosine similarity and SQNR at
least `specs.FP8_MIN_COSINE` and `specs.FP8_MIN_SQNR_DB`, just under what the kernel measures.
Outputs are NaN-poisoned views inside guard rows: every valid row must be written, nothing around it."""
import warnings

import pytest
import torch

import jfa
from jfa import fp8, reference, runner, specs
from jfa.dispatch import ReferenceFallbackWarning
from jfa.kernels.forks.fp8 import FP8_FORK, transposed_values
from tests.gpu.test_jagged_fwd import DEVICE, assert_guards_untouched, offsets, poisoned

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129, 257, 509, 1000]


def run_case(lengths, *, heads=(4, 4), head_dim=128, causal=False, window=None, seed=0, magnitude=1.0,
             broadcast_q_len=None):
    """`lengths`: the sequences' key (and query) lengths; with `broadcast_q_len` one shared query of
    that many rows attends to every key sequence (PMA)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rows = sum(lengths)
    q_rows = rows if broadcast_q_len is None else broadcast_q_len
    (q, q_s), (k, k_s), (v, v_s) = (
        reference.fp8_quantize_per_tensor(torch.randn(n, h, head_dim, device=DEVICE, generator=gen) * magnitude)
        for n, h in ((q_rows, heads[0]), (rows, heads[1]), (rows, heads[1])))
    off = offsets(lengths)
    q_off = off if broadcast_q_len is None else offsets([broadcast_q_len])
    out_rows = rows if broadcast_q_len is None else broadcast_q_len * len(lengths)
    out_buf, out_view = poisoned((out_rows, heads[0], head_dim), specs.FP8_OUT_DTYPE)
    lse_buf, lse_view = poisoned((heads[0], out_rows), torch.float32, row_dim=1)
    longest = max(lengths)
    fork = runner.ForkCall(fork=FP8_FORK, forward_params=(v_s,), base_tiles=True)
    out, lse = runner.forward(q, k, transposed_values(v, off), q_off, off, q_rows if broadcast_q_len else longest,
                              longest, None, causal, window, broadcast_q_len is not None, out=out_view, lse=lse_view,
                              fork=fork, qk_descale=q_s * k_s, out_dtype=specs.FP8_OUT_DTYPE)
    torch.cuda.synchronize()
    ref, ref_lse = reference.jagged_attention_ref(q.float() * q_s, k.float() * k_s, v.float() * v_s, q_off, off,
                                                  causal=causal, window=window,
                                                  broadcast_q=broadcast_q_len is not None)
    assert_guards_untouched(out_buf, out)
    assert_guards_untouched(lse_buf, lse, row_dim=1)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "rows left unwritten (still NaN)"
    cosine, sqnr = reference.fp8_agreement(out.float(), ref)
    assert cosine >= specs.FP8_MIN_COSINE and sqnr >= specs.FP8_MIN_SQNR_DB, (cosine, sqnr)
    # The LSE sees the same scores up to FP8 rounding of q and k (not of P): close, not equal.
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=0.1, rtol=0.02)
    return cosine, sqnr


@pytest.mark.parametrize("head_dim", specs.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_edge_lengths(head_dim, causal):
    run_case(EDGE_LENGTHS, head_dim=head_dim, causal=causal)


@pytest.mark.parametrize("group", [2, 4])
def test_gqa_and_window(group):
    run_case([300, 1, 2048, 129], heads=(8, 8 // group), window=100, seed=group)


@pytest.mark.parametrize("q_len", [1, 64, 256])
def test_broadcast_q(q_len):
    """PMA: one shared query against key sequences that start at unaligned keys (V^T's columns)."""
    run_case([0, 1, 37, 300, 129, 2048, 1023, 65], broadcast_q_len=q_len, seed=q_len)


def test_large_logits_stay_in_range():
    """x30 activations: the rescale keeps P within E4M3's range (no inf/NaN from P's quantization)."""
    run_case([700, 129], magnitude=30.0, causal=True, seed=3)


def test_public_api_runs_the_kernel():
    lengths = [300, 64, 513]
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    q, k, v = (torch.randn(sum(lengths), 2, 64, device=DEVICE, generator=gen).to(FP8) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceFallbackWarning)  # a fallback fails the test
        out = jfa.jagged_attention_fp8(q, k, v, offsets(lengths), offsets(lengths), causal=True)
    ref, _ = reference.jagged_attention_ref(q.float(), k.float(), v.float(), offsets(lengths), offsets(lengths),
                                            causal=True)
    cosine, sqnr = reference.fp8_agreement(out.float(), ref)
    assert out.dtype == specs.FP8_OUT_DTYPE and cosine >= specs.FP8_MIN_COSINE and sqnr >= specs.FP8_MIN_SQNR_DB


def test_pre_transposed_values_give_the_same_bytes():
    """V made once by `jfa.fp8.transpose_values` (v_transposed=True) gives the packed-V call's output
    bit for bit: the kernel reads the same V^T either way."""
    lengths = [300, 129, 1, 2048, 65]
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    q, k, v = (torch.randn(sum(lengths), 4, 128, device=DEVICE, generator=gen).to(FP8) for _ in range(3))
    off = offsets(lengths)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceFallbackWarning)  # a fallback fails the test
        packed = jfa.jagged_attention_fp8(q, k, v, off, off, causal=True)
        transposed = jfa.jagged_attention_fp8(q, k, fp8.transpose_values(v, off), off, off, causal=True,
                                              v_transposed=True)
    assert torch.equal(packed, transposed)
