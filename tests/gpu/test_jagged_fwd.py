"""The jagged forward (`jfa.runner.forward`, the kernel `jfa.kernels.fwd_sm90`) on a Hopper GPU against
the fp32 reference `jfa.reference`.

Every case draws fresh random inputs and hands the kernel NaN-poisoned `out` and `lse` views into
larger buffers: a valid row the kernel forgot stays NaN and fails, and the guard rows around the
views must still be NaN afterwards (nothing written past the packed tensor). Every element of both
is compared with the reference. Lengths 63/65/127/129 put the next sequence's rows inside a TMA
tile, so a missing key mask or an unmasked store shows up as a wrong value next door; length 0
(empty sequences) and fully masked rows check the 0 / -inf rule.

Each case names the tuning of `jfa.configs` it runs and checks that `configs.forward_config` picks
it, so the cases cover every tuning the selection reaches, with the flags each multiplies by.
Cases of one configuration (and one specialization of the launch's integers) share a compile.
"""
import functools
import itertools
import zlib

import pytest
import torch

from jfa import configs, reference, runner, specs
from jfa.kernels import fwd_sm90

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
# Poisoned rows (LSE columns) before and after each view. 8 keeps the views 16-byte aligned, as a
# fresh tensor is, and each buffer's length is a multiple of 16: the LSE's head stride then falls in
# one Triton specialization for every case instead of compiling a kernel again per stride class.
GUARD_ROWS = 8
EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129, 0, 2, 131, 257, 509]
TUNINGS = {"base": configs.FWD_BASE, "short queries": configs.FWD_SHORT_QUERIES, "short keys": configs.FWD_SHORT_KEYS,
           "long": configs.FWD_LONG}


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)


def random_lengths(batch, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (batch,), generator=gen).tolist()


def random_inputs(lengths, heads, seed, head_dim=128, dtype=torch.bfloat16):
    """Fresh q, k, v and an upstream gradient dout over self-attention `lengths`, heads = (Hq, Hkv)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rows = sum(lengths)
    q = torch.randn(rows, heads[0], head_dim, device=DEVICE, generator=gen).to(dtype)
    k, v = (torch.randn(rows, heads[1], head_dim, device=DEVICE, generator=gen).to(dtype) for _ in range(2))
    dout = torch.randn(rows, heads[0], head_dim, device=DEVICE, generator=gen).to(dtype)
    return q, k, v, dout


def poisoned(shape, dtype, row_dim=0):
    """(buffer, view): a view of `shape` inside a NaN buffer with GUARD_ROWS or more poisoned rows on
    each side along `row_dim` (0 for `[T, H, D]` tensors, 1 for `[H, T]` LSEs)."""
    rows = shape[row_dim]
    padded = -(-(rows + 2 * GUARD_ROWS) // 16) * 16
    buffer = torch.full((*shape[:row_dim], padded, *shape[row_dim + 1:]), float("nan"), dtype=dtype, device=DEVICE)
    return buffer, buffer.narrow(row_dim, GUARD_ROWS, rows)


def assert_guards_untouched(buffer, view, row_dim=0):
    """Every element of `buffer` outside `view` (made by `poisoned`) is still NaN."""
    end = GUARD_ROWS + view.shape[row_dim]
    before = buffer.narrow(row_dim, 0, GUARD_ROWS)
    after = buffer.narrow(row_dim, end, buffer.shape[row_dim] - end)
    assert torch.isnan(before).all() and torch.isnan(after).all(), "written outside the tensor"


def assert_grads_close(grads, wants, same_dtype_grads, names=("dq", "dk", "dv")):
    """Kernel gradients against the fp32 reference's `wants`: nothing NaN or Inf, the norm of each error
    within specs.GRAD_RELERR, and every element within specs.GRAD_TOL, or, where some element of a
    tensor is past it, its largest error at most specs.GRAD_BASELINE_FACTOR times that of the reference
    run in the kernels' dtype (`same_dtype_grads()`, computed once, only then)."""
    baseline = functools.cache(same_dtype_grads)
    for i, (name, got, want) in enumerate(zip(names, grads, wants)):
        assert not torch.isnan(got).any(), f"{name}: rows left unwritten (still NaN)"
        assert torch.isfinite(got).all(), f"{name}: Inf"
        error = got.float() - want
        relerr = (error.norm() / want.norm().clamp_min(1e-30)).item()
        assert relerr <= specs.GRAD_RELERR, f"{name}: relative error {relerr:.2e}"
        past = ~torch.isclose(got.float(), want, **specs.GRAD_TOL)
        if not past.any():
            continue
        worst = error.abs().max().item()
        pytorch_error = (baseline()[i].float() - want).abs().max().item()
        assert worst <= specs.GRAD_BASELINE_FACTOR * pytorch_error, (
            f"{name}: {int(past.sum())} of {got.numel()} elements past specs.GRAD_TOL and the largest error "
            f"{worst:.3e} over {specs.GRAD_BASELINE_FACTOR:g}x PyTorch's own in {got.dtype} ({pytorch_error:.3e})")


def assert_tuning(q, k, kv_off, max_q, max_kv, causal, window, broadcast_q, tuning, half_tail):
    """`configs.forward_config` picks the named tuning (and half last key tiles or not) for this call."""
    config = configs.forward_config(runner.call_shape(q, k, kv_off, max_q, max_kv, causal, window, broadcast_q))
    entry = TUNINGS[tuning][q.shape[2]]
    assert entry.items() <= config._asdict().items(), f"expected the {tuning!r} tuning, got {config}"
    assert (config.HEADS_PER_TILE == 2) == (tuning == "short queries"), config
    assert config.HALF_TAIL == half_tail, config


def run_case(q_lens, kv_lens, *, heads=(4, 4), head_dim=128, dtype=torch.bfloat16, causal=False, window=None,
             broadcast_q=False, sm_scale=None, tuning=None, half_tail=False, seed=0):
    """Forward of one problem into poisoned views, checked against the reference. `q_lens` is
    `[q_len]` with broadcast-Q; `tuning` (a `TUNINGS` key) is checked first when given."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q_rows = q_lens[0] if broadcast_q else sum(q_lens)
    kv_rows = sum(kv_lens)
    q = torch.randn(q_rows, heads[0], head_dim, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(kv_rows, heads[1], head_dim, device=DEVICE, generator=gen).to(dtype)
    v = torch.randn(kv_rows, heads[1], head_dim, device=DEVICE, generator=gen).to(dtype)
    q_off, kv_off = offsets(q_lens), offsets(kv_lens)
    max_q, max_kv = max(q_lens, default=0), max(kv_lens, default=0)
    if tuning is not None:
        assert_tuning(q, k, kv_off, max_q, max_kv, causal, window, broadcast_q, tuning, half_tail)
    out_rows = q_rows * len(kv_lens) if broadcast_q else q_rows
    out_buf, out_view = poisoned((out_rows, heads[0], head_dim), dtype)
    lse_buf, lse_view = poisoned((heads[0], out_rows), torch.float32, row_dim=1)

    out, lse = runner.forward(q, k, v, q_off, kv_off, max_q, max_kv, sm_scale, causal, window, broadcast_q,
                              out=out_view, lse=lse_view)
    torch.cuda.synchronize()
    assert out.data_ptr() == out_view.data_ptr() and lse.data_ptr() == lse_view.data_ptr()
    ref_out, ref_lse = reference.jagged_attention_ref(q, k, v, q_off, kv_off, sm_scale=sm_scale, causal=causal,
                                                      window=window, broadcast_q=broadcast_q)
    assert_guards_untouched(out_buf, out)
    assert_guards_untouched(lse_buf, lse, row_dim=1)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "rows left unwritten (still NaN)"
    got = out.float()
    relerr = ((got - ref_out).norm() / ref_out.norm().clamp_min(1e-6)).item()
    assert relerr <= specs.FWD_RELERR, f"relative error {relerr:.2e}"
    torch.testing.assert_close(got, ref_out, **specs.FWD_TOL)
    torch.testing.assert_close(lse, ref_lse, **specs.FWD_TOL)


def test_is_supported():
    """The jagged kernels take bf16, fp16 and (through the FP8 fork) E4M3 at D 64 and 128, on this GPU only."""
    def q(dtype=torch.bfloat16, head_dim=128, device=DEVICE):
        return torch.empty(1, 1, head_dim, device=device, dtype=dtype)

    for dtype in (*specs.SUPPORTED_DTYPES, torch.float8_e4m3fn):
        assert all(fwd_sm90.is_supported(q(dtype, d)) for d in specs.SUPPORTED_HEAD_DIMS)
    assert not fwd_sm90.is_supported(q(torch.float32))
    assert not fwd_sm90.is_supported(q(head_dim=96))
    assert not fwd_sm90.is_supported(q(device="cpu"))


# Averaging 114 keys, EDGE_LENGTHS run the short-key tiles at D=128; one long sequence puts the same
# edges on the base tiles. At most 256 keys: half last tiles. Every query at most 64 rows: two heads
# per tile. Queries and keys averaging 1024 or more at D=64: three consumers.
SELF_CASES = {
    "edge_lengths": dict(lengths=EDGE_LENGTHS, tuning="short keys"),
    "edge_lengths_causal": dict(lengths=EDGE_LENGTHS, causal=True, tuning="short keys"),
    "edge_lengths_window32": dict(lengths=EDGE_LENGTHS, window=32, tuning="short keys"),
    "edge_lengths_window0": dict(lengths=[129, 300, 1], window=0, tuning="short keys"),
    "edge_lengths_causal_window_gqa2": dict(lengths=EDGE_LENGTHS + [1031], causal=True, window=100, heads=(8, 4),
                                            tuning="short keys"),
    "sm_scale": dict(lengths=[300, 77], sm_scale=0.3, tuning="short keys"),
    "fp16": dict(lengths=EDGE_LENGTHS, dtype=torch.float16, tuning="short keys"),
    "base_tiles_up_to_8000": dict(lengths=EDGE_LENGTHS + [8000, 2053], heads=(2, 2), tuning="base"),
    "base_tiles_random_1900": dict(lengths=random_lengths(24, 1, 1900, seed=1), tuning="base"),
    "base_tiles_causal": dict(lengths=EDGE_LENGTHS + [4200], causal=True, tuning="base"),
    "base_tiles_window37_gqa2": dict(lengths=EDGE_LENGTHS + [4200], window=37, heads=(8, 4), tuning="base"),
    "d64": dict(lengths=EDGE_LENGTHS, head_dim=64, tuning="base"),
    "d64_random_causal_gqa8": dict(lengths=random_lengths(30, 1, 1500, seed=2), causal=True, heads=(8, 1),
                                   head_dim=64, tuning="base"),
    "d64_fp16_window64": dict(lengths=random_lengths(20, 0, 700, seed=3), window=64, head_dim=64,
                              dtype=torch.float16, tuning="base"),
    "half_tiles": dict(lengths=[0, 1, 31, 32, 33, 63, 64, 65, 97, 127, 128, 129, 200, 255, 256],
                       tuning="short keys", half_tail=True),
    "half_tiles_causal_window_gqa4": dict(lengths=[256, 33, 0, 129, 97, 200, 64], causal=True, window=40,
                                          heads=(8, 2), tuning="short keys", half_tail=True),
    "half_tiles_odd_heads": dict(lengths=[64, 17, 0, 3, 200], heads=(3, 3), tuning="short keys", half_tail=True),
    "three_consumers_d64": dict(lengths=[4096, 1000, 2049, 1, 192, 193, 0, 383, 4000, 129], head_dim=64,
                                tuning="long"),
    "three_consumers_d64_fp16_causal_window_gqa4": dict(lengths=[2048, 191, 1025, 64, 3000], causal=True,
                                                        window=100, heads=(8, 2), head_dim=64,
                                                        dtype=torch.float16, tuning="long"),
    "paired_heads": dict(lengths=[0, 1, 63, 64, 2, 33] + random_lengths(20, 0, 64, seed=8), tuning="short queries"),
    "paired_heads_causal_window_gqa4": dict(lengths=[64, 1, 0, 40, 63], causal=True, window=9, heads=(8, 2),
                                            tuning="short queries"),
    "paired_heads_d64_fp16": dict(lengths=[64, 17, 0, 64, 5], head_dim=64, dtype=torch.float16,
                                  tuning="short queries"),
}


@pytest.mark.parametrize("name", list(SELF_CASES))
def test_self_attention(name):
    case = dict(SELF_CASES[name])
    lengths = case.pop("lengths")
    run_case(lengths, lengths, seed=zlib.crc32(name.encode()), **case)


CROSS_Q_LENS = [0, 1, 63, 200, 129, 64, 300, 5, 1000]
CROSS_KV_LENS = [5, 0, 129, 64, 63, 1, 256, 2048, 999]
CROSS_CASES = {
    "cross": dict(),
    "cross_causal": dict(causal=True),  # keys shorter than queries: early rows see nothing (0, -inf)
    "cross_window": dict(window=50),
    "cross_gqa4_d64": dict(heads=(8, 2), head_dim=64),
}


@pytest.mark.parametrize("name", list(CROSS_CASES))
def test_cross_attention(name):
    """Query and key lengths differ per sequence: bottom-right causal, the window on top-left positions."""
    run_case(CROSS_Q_LENS, CROSS_KV_LENS, tuning="base", seed=zlib.crc32(name.encode()), **CROSS_CASES[name])


def test_cross_attention_three_consumers_d64():
    """Queries and keys of different lengths, both long on average, causal: three consumers at D=64."""
    run_case([1100, 5, 3000, 193, 1300], [2000, 1500, 100, 900, 1000], causal=True, head_dim=64, tuning="long",
             seed=12)


PMA_KV_LENGTHS = [0, 1, 37, 64, 65, 128, 200, 2048, 1023] + random_lengths(23, 1, 2048, seed=6)


@pytest.mark.parametrize("q_len", [1, 16, 64, 128, 256])
def test_broadcast_q(q_len):
    """One shared query against every key sequence: up to 64 rows two heads per tile, then whole tiles."""
    run_case([q_len], PMA_KV_LENGTHS, broadcast_q=True, tuning="short queries" if q_len <= 64 else "base",
             seed=q_len)


@pytest.mark.parametrize("case", [dict(window=40), dict(causal=True),
                                  dict(head_dim=64, dtype=torch.float16, heads=(8, 2))],
                         ids=["window", "causal", "d64_fp16_gqa4"])
def test_broadcast_q_flags(case):
    run_case([200], PMA_KV_LENGTHS, broadcast_q=True, tuning="base", seed=7, **case)


def test_broadcast_q_three_consumers_d64():
    """1024 shared query rows over long keys at D=64: three consumers."""
    run_case([1024], [2048, 1023, 1, 0, 3000, 1500, 1100], broadcast_q=True, head_dim=64, tuning="long", seed=11)


@pytest.mark.parametrize("q_lens,kv_lens", [([5, 70], [0, 0]), ([0, 0], [3, 5])], ids=["no_keys", "no_queries"])
def test_no_keys_or_no_queries_anywhere(q_lens, kv_lens):
    """Every key sequence empty, or every query sequence: no launch (a zero-row TMA view is invalid);
    the runner writes 0 and -inf into the views, or nothing where there are no rows."""
    run_case(q_lens, kv_lens)
