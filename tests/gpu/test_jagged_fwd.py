"""The jagged forward kernel on a Hopper GPU against the fp32 reference `jfa.reference`.

Every case draws fresh random inputs and hands the kernel NaN-poisoned `out` and `lse` views into
larger buffers: a valid row the kernel forgot stays NaN and fails, and the guard rows around the
views must still be NaN afterwards (nothing written past the packed tensor). Lengths 63/65/127/129
put the next sequence's rows inside a TMA tile, so a missing key mask or an unmasked store shows up
as a wrong value next door; length 0 (empty sequences) and fully masked rows check the 0 / -inf rule.
"""
import zlib

import pytest
import torch

from jfa import reference, specs
from jfa.kernels import jagged_fwd

pytestmark = pytest.mark.gpu

GUARD_ROWS = 7  # poisoned rows before and after the output view
EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129, 0, 2, 131, 257, 509]


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device="cuda")


def random_lengths(batch, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (batch,), generator=gen).tolist()


def run_case(q_lens, kv_lens, *, heads_q=4, heads_kv=4, head_dim=128, dtype=torch.bfloat16,
             causal=False, window=None, broadcast_q=False, sm_scale=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q_rows = q_lens[0] if broadcast_q else sum(q_lens)
    kv_rows = sum(kv_lens)
    q = torch.randn(q_rows, heads_q, head_dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(kv_rows, heads_kv, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(kv_rows, heads_kv, head_dim, device="cuda", generator=gen).to(dtype)
    q_off = offsets([q_lens[0]] if broadcast_q else q_lens)
    kv_off = offsets(kv_lens)
    out_rows = q_rows * len(kv_lens) if broadcast_q else q_rows

    out_buf = torch.full((out_rows + 2 * GUARD_ROWS, heads_q, head_dim), float("nan"),
                         device="cuda", dtype=dtype)
    lse_buf = torch.full((heads_q, out_rows + 2 * GUARD_ROWS), float("nan"), device="cuda")
    out_view = out_buf[GUARD_ROWS:GUARD_ROWS + out_rows]
    lse_view = lse_buf[:, GUARD_ROWS:GUARD_ROWS + out_rows]
    out, lse = jagged_fwd.jagged_attention_fwd(
        q, k, v, q_off, kv_off, max(q_lens) if q_lens else 0, max(kv_lens) if kv_lens else 0,
        sm_scale, causal, window, broadcast_q, out=out_view, lse=lse_view)
    torch.cuda.synchronize()
    assert out.data_ptr() == out_view.data_ptr() and lse.data_ptr() == lse_view.data_ptr()

    ref_out, ref_lse = reference.jagged_attention_ref(q, k, v, q_off, kv_off, sm_scale=sm_scale,
                                                      causal=causal, window=window,
                                                      broadcast_q=broadcast_q)
    assert torch.isnan(out_buf[:GUARD_ROWS]).all() and torch.isnan(out_buf[-GUARD_ROWS:]).all()
    assert torch.isnan(lse_buf[:, :GUARD_ROWS]).all() and torch.isnan(lse_buf[:, -GUARD_ROWS:]).all()
    assert not torch.isnan(out).any(), "rows left unwritten (still NaN)"
    got = out.float()
    denom = ref_out.norm().clamp_min(1e-6)
    relerr = ((got - ref_out).norm() / denom).item()
    assert relerr <= specs.FWD_RELERR, f"relative error {relerr:.2e}"
    torch.testing.assert_close(got, ref_out, **specs.FWD_TOL)
    torch.testing.assert_close(lse, ref_lse, **specs.FWD_TOL)


def test_is_supported():
    assert jagged_fwd.is_supported(torch.empty(1, 1, 128, device="cuda", dtype=torch.bfloat16))
    assert not jagged_fwd.is_supported(torch.empty(1, 1, 128, device="cuda", dtype=torch.float32))
    assert not jagged_fwd.is_supported(torch.empty(1, 1, 96, device="cuda", dtype=torch.bfloat16))
    assert not jagged_fwd.is_supported(torch.empty(1, 1, 128, dtype=torch.bfloat16))


SELF_CASES = {
    "edge_lengths": dict(lengths=EDGE_LENGTHS),
    "long_up_to_8192": dict(lengths=[8192, 1000, 4099, 17, 2053], heads_q=2, heads_kv=2),
    "random_2048": dict(lengths=random_lengths(40, 1, 2048, seed=1)),
    "d64": dict(lengths=EDGE_LENGTHS, head_dim=64),
    "d64_random": dict(lengths=random_lengths(30, 1, 1500, seed=2), head_dim=64),
    "fp16": dict(lengths=EDGE_LENGTHS, dtype=torch.float16),
    "fp16_d64": dict(lengths=random_lengths(20, 0, 700, seed=3), dtype=torch.float16, head_dim=64),
    "gqa2": dict(lengths=EDGE_LENGTHS, heads_q=8, heads_kv=4),
    "gqa4": dict(lengths=random_lengths(16, 1, 1000, seed=4), heads_q=8, heads_kv=2),
    "gqa8_d64": dict(lengths=EDGE_LENGTHS, heads_q=8, heads_kv=1, head_dim=64),
    "sm_scale": dict(lengths=[300, 77], sm_scale=0.3),
    "causal": dict(lengths=EDGE_LENGTHS, causal=True),
    "causal_long": dict(lengths=[4097, 1500, 33], causal=True, heads_q=2, heads_kv=2),
    "causal_d64_fp16": dict(lengths=EDGE_LENGTHS, causal=True, head_dim=64, dtype=torch.float16),
    "window32": dict(lengths=EDGE_LENGTHS, window=32),
    "window200": dict(lengths=random_lengths(12, 1, 2500, seed=5), window=200),
    "window0": dict(lengths=[129, 300], window=0),
    "causal_window": dict(lengths=EDGE_LENGTHS + [1031], causal=True, window=100),
    # EDGE_LENGTHS average 114 keys: at D=128 those cases run the short-key tiles
    # (`jagged_fwd.SHORT_KV_TUNING`); one long sequence puts the same edges on 128-key tiles.
    "edge_lengths_long_tiles": dict(lengths=EDGE_LENGTHS + [4096]),
    "causal_long_tiles": dict(lengths=EDGE_LENGTHS + [4096], causal=True),
    "window32_long_tiles": dict(lengths=EDGE_LENGTHS + [4096], window=32, heads_q=8, heads_kv=4),
    # short keys with half last tiles (no sequence over jagged_fwd.HALF_TAIL_MAX_KV_LEN)
    "short_kv_half_tail": dict(lengths=[0, 1, 31, 32, 33, 63, 64, 65, 97, 127, 128, 129, 200, 255, 256]),
    "short_kv_half_tail_causal_window_gqa": dict(lengths=[256, 33, 0, 129, 97, 200, 64], causal=True,
                                                 window=40, heads_q=8, heads_kv=2),
    "short_kv_fp16": dict(lengths=random_lengths(40, 1, 512, seed=9), dtype=torch.float16),
    # queries and keys averaging jagged_fwd.LONG_MEAN_LEN or more: at D=64 three consumers, 192-row
    # tiles (`jagged_fwd.LONG_TUNING`), with sequences ending in each consumer's rows and in none
    "long3_d64": dict(lengths=[4096, 1000, 2049, 1, 192, 193, 0, 383, 4000, 129], head_dim=64),
    "long3_d64_causal_window_gqa": dict(lengths=[2048, 191, 1025, 64, 3000], causal=True, window=100,
                                        heads_q=8, heads_kv=2, head_dim=64),
    "long3_d64_fp16_causal": dict(lengths=[1500, 1700, 900, 193, 2000], causal=True, head_dim=64,
                                  dtype=torch.float16),
    # every query <= 64 rows: two heads per tile (one per consumer)
    "short_paired": dict(lengths=[0, 1, 63, 64, 2, 33] + random_lengths(20, 0, 64, seed=8)),
    "short_paired_causal_window_gqa": dict(lengths=[64, 1, 0, 40, 63], causal=True, window=9,
                                           heads_q=8, heads_kv=2),
    "short_paired_d64_fp16": dict(lengths=[64, 17, 0, 64, 5], head_dim=64, dtype=torch.float16),
    "short_odd_heads": dict(lengths=[64, 17, 0, 3], heads_q=3, heads_kv=3),
}


@pytest.mark.parametrize("name", list(SELF_CASES))
def test_self_attention(name):
    case = dict(SELF_CASES[name])
    lengths = case.pop("lengths")
    if name.endswith("long_tiles") or name.startswith("short_kv"):  # the path the name promises
        assert jagged_fwd.is_short_kv(sum(lengths), len(lengths)) == name.startswith("short_kv")
    if name.startswith("long3"):
        assert jagged_fwd.is_long(sum(lengths), sum(lengths), len(lengths))
    run_case(lengths, lengths, seed=zlib.crc32(name.encode()), **case)


CROSS_CASES = {
    "cross": dict(),
    "cross_causal": dict(causal=True),  # kv shorter than q: early rows see nothing (0, -inf)
    "cross_window": dict(window=50),
    "cross_gqa4_d64": dict(heads_q=8, heads_kv=2, head_dim=64),
}


@pytest.mark.parametrize("name", list(CROSS_CASES))
def test_cross_attention(name):
    q_lens = [0, 1, 63, 200, 129, 64, 300, 5, 1000]
    kv_lens = [5, 0, 129, 64, 63, 1, 256, 2048, 999]
    run_case(q_lens, kv_lens, seed=zlib.crc32(name.encode()), **CROSS_CASES[name])


def test_cross_attention_long_d64():
    """Queries and keys of different lengths, both long on average: three consumers (LONG_TUNING)."""
    q_lens, kv_lens = [1100, 5, 3000, 193, 1300], [2000, 1500, 100, 900, 1000]
    assert jagged_fwd.is_long(sum(q_lens), sum(kv_lens), len(q_lens))
    run_case(q_lens, kv_lens, causal=True, head_dim=64, seed=12)


PMA_KV_LENGTHS = [0, 1, 37, 64, 65, 128, 200, 2048, 1023] + random_lengths(23, 1, 2048, seed=6)


@pytest.mark.parametrize("q_len", [1, 16, 64, 128, 256])
def test_broadcast_q(q_len):
    run_case([q_len], PMA_KV_LENGTHS, broadcast_q=True, seed=q_len)


@pytest.mark.parametrize("case", [dict(window=40), dict(causal=True),
                                  dict(head_dim=64, dtype=torch.float16, heads_q=8, heads_kv=2)],
                         ids=["window", "causal", "d64_fp16_gqa4"])
def test_broadcast_q_variants(case):
    run_case([200], PMA_KV_LENGTHS, broadcast_q=True, seed=7, **case)


def test_broadcast_q_long_d64():
    """Broadcast-Q with 1024 query rows over long keys at D=64: three consumers (LONG_TUNING)."""
    kv_lens = [2048, 1023, 1, 0, 3000, 1500, 1100]
    assert jagged_fwd.is_long(1024 * len(kv_lens), sum(kv_lens), len(kv_lens))
    run_case([1024], kv_lens, broadcast_q=True, head_dim=64, seed=11)


def test_no_keys_anywhere():
    """Every KV sequence empty: no launch can read K, the wrapper writes 0 and -inf."""
    run_case([5, 70], [0, 0])
