"""CPU check of the forward's per-tile geometry (`jagged_fwd._tile_geometry`) against brute-force masks.

The geometry decides, for one tile (a sequence's block of query rows), which key tiles the kernel
visits, which of them run without masks, and whether the last one is loaded and multiplied at half
width. The kernel itself needs a GPU, but the geometry is plain Triton: here it runs in Triton's
interpreter through a small probe kernel, in a subprocess that imports the modules with
`TRITON_INTERPRET=1` set (as `tests/test_schedule.py` does), over random sequences whose lengths mix
the tile edges, with and without causal masks, windows and broadcast-Q. For every tile:

- every key some row of the block sees lies in the visited range (whole tiles, then the half tile);
- a half tile is taken only where the last tile's visible keys fit in its first half, and (where
  the block-level key range is exact, i.e. not causal and window together) always when they do;
- every key tile of the mask-free range is visible to every real row of the block, and that range
  starts after the peeled first tile and ends before the half tile.

The block-sparse fork's geometry is checked the same way against random raw selections (padding,
repeats, picks past the sequence): the tile visits exactly its distinct selected blocks when the
block sees any key, and its mask-free range is exactly the selected blocks every real row sees whole.
"""
import os
import pathlib
import subprocess
import sys

import torch
import triton
import triton.language as tl

from jfa import fp8
from jfa.jagged import lengths_to_offsets
from jfa.kernels import jagged_fwd
from jfa.reference import visible_mask
from jfa.sparse import canonical_selection
from tests.test_schedule import random_lengths

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK_M = jagged_fwd.tile_rows(1)
BLOCK_N = jagged_fwd.TUNING[(128, 1)]["BLOCK_N"]
HALF = BLOCK_N // 2
# Key-tile edges, and where a last tile turns from half (<= 64 keys) to whole: 192 | 193.
LENGTH_EDGES = (0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257)
WINDOWS = (None, 0, 37, 64, 200)
CASES = 150
SPARSE_CASES = 60
FP8_CASES = 40
INTERPRETER_TIMEOUT_S = 240
GEOMETRY_FIELDS = 6  # what _geometry_probe stores per tile


@triton.jit
def _geometry_probe(out_ptr, tile_entries_ptr, num_entries, q_offsets_ptr, kv_offsets_ptr,
                    kv_blocks_ptr, kv_block_counts_ptr, q_blocks_per_seq, broadcast_q_len, window,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, BROADCAST_Q: tl.constexpr, HALF_TAIL: tl.constexpr,
                    BLOCK_SPARSE: tl.constexpr, SEL_WIDTH: tl.constexpr, FP8: tl.constexpr):
    """One program per tile (one query head, one head per tile, head-major): store its geometry,
    (first_col, num_kv_tiles, bulk_lo, bulk_hi, half_tail, v_start)."""
    tile = tl.program_id(0)
    (head, q_key, q_row0, out_row0, row_lo, q_len, kv_start, v_start, kv_len, first_col, selected,
     num_kv_tiles, bulk_lo, bulk_hi, half_tail) = jagged_fwd._tile_geometry(
         tile, tile_entries_ptr, num_entries, q_offsets_ptr, kv_offsets_ptr, kv_blocks_ptr,
         kv_block_counts_ptr, q_blocks_per_seq, 1, q_blocks_per_seq, broadcast_q_len, window, BLOCK_M,
         BLOCK_N, 1, CAUSAL, HAS_WINDOW, BROADCAST_Q, False, HALF_TAIL, BLOCK_SPARSE, SEL_WIDTH, FP8)
    base = out_ptr + tile * GEOMETRY_FIELDS
    tl.store(base, first_col)
    tl.store(base + 1, num_kv_tiles)
    tl.store(base + 2, bulk_lo)
    tl.store(base + 3, bulk_hi)
    tl.store(base + 4, half_tail)
    tl.store(base + 5, v_start)


def _geometry(q_lens, kv_lens, broadcast_q_len, causal, window, half_tail, selection=None, fp8=False):
    """(entries, geometry): every (sequence, query block) tile and its `_geometry_probe` row."""
    blocks = max(1, -(-max(q_lens) // BLOCK_M))
    entries = [(seq, block) for seq in range(len(kv_lens)) for block in range(blocks)]
    out = torch.full((len(entries), GEOMETRY_FIELDS), -99, dtype=torch.int32)
    _geometry_probe[(len(entries),)](
        out, torch.arange(len(entries), dtype=torch.int32), len(entries), lengths_to_offsets(q_lens),
        lengths_to_offsets(kv_lens), None if selection is None else selection.blocks,
        None if selection is None else selection.counts, blocks, broadcast_q_len,
        0 if window is None else window, BLOCK_M, BLOCK_N, causal, window is not None, broadcast_q_len > 0,
        half_tail, selection is not None, 1 if selection is None else selection.width, fp8)
    return entries, out


def _check_tile(q_len, kv_len, block, geometry, causal, window, half_tail_on, where):
    first_col, num_kv_tiles, bulk_lo, bulk_hi, half_tail, _ = geometry
    rows = slice(block * BLOCK_M, min((block + 1) * BLOCK_M, q_len))
    if rows.start >= q_len:
        return  # a block past the sequence end: the kernel stores nothing for it
    seen = visible_mask(q_len, kv_len, causal, window)[rows]
    seen_cols = seen.any(0).nonzero().flatten().tolist()
    whole = num_kv_tiles - half_tail
    visited_end = first_col + whole * BLOCK_N + half_tail * HALF
    assert all(first_col <= c < visited_end for c in seen_cols), (where, geometry, seen_cols[-3:])
    assert half_tail in (0, 1) and (half_tail_on or half_tail == 0), (where, geometry)
    if half_tail:
        assert num_kv_tiles >= 2, (where, geometry)
    last_start = first_col + (num_kv_tiles - 1) * BLOCK_N
    exact_range = not (causal and window is not None)
    if half_tail_on and exact_range and num_kv_tiles >= 2 and seen_cols:
        fits = max(seen_cols) < last_start + HALF
        assert half_tail == int(fits), (where, geometry, max(seen_cols))
    assert 1 <= bulk_lo <= bulk_hi <= whole or (num_kv_tiles == 0 and bulk_hi <= 0), (where, geometry)
    for n in range(bulk_lo, bulk_hi):
        cols = slice(first_col + n * BLOCK_N, first_col + (n + 1) * BLOCK_N)
        assert cols.stop <= kv_len and bool(seen[:, cols].all()), (where, geometry, n)


def check_geometry(cases: int, seed: int) -> int:
    """Run in the interpreter subprocess: `cases` random batches, every tile of each checked."""
    gen = torch.Generator().manual_seed(seed)
    for case in range(cases):
        batch = int(torch.randint(1, 6, (), generator=gen))
        max_len = int(torch.tensor([130, 300, 700])[torch.randint(0, 3, (), generator=gen)])
        kv_lens = random_lengths(gen, batch, max_len, LENGTH_EDGES)
        broadcast = bool(torch.rand((), generator=gen) < 0.3)
        q_lens = [max(1, *random_lengths(gen, 1, max_len, LENGTH_EDGES))] * batch if broadcast else kv_lens
        causal = bool(torch.rand((), generator=gen) < 0.5)
        window = WINDOWS[int(torch.randint(0, len(WINDOWS), (), generator=gen))]
        if broadcast:
            causal, window = False, None  # broadcast-Q queries have no position of their own
        half_tail_on = bool(torch.rand((), generator=gen) < 0.8)
        entries, out = _geometry(q_lens, kv_lens, q_lens[0] if broadcast else 0, causal, window,
                                 half_tail_on)
        for (seq, block), geometry in zip(entries, out.tolist()):
            where = dict(case=case, seq=seq, block=block, q_len=q_lens[seq], kv_len=kv_lens[seq],
                         causal=causal, window=window, broadcast=broadcast, half_tail=half_tail_on)
            _check_tile(q_lens[seq], kv_lens[seq], block, geometry, causal, window, half_tail_on, where)
    return cases


def check_sparse_geometry(cases: int, seed: int) -> int:
    """Run in the interpreter subprocess: the block-sparse fork on `cases` random batches and raw
    selections; for every tile the visited blocks and the mask-free range against the masks."""
    gen = torch.Generator().manual_seed(seed)
    for case in range(cases):
        batch = int(torch.randint(1, 5, (), generator=gen))
        lengths = random_lengths(gen, batch, 700, LENGTH_EDGES)
        causal = bool(torch.rand((), generator=gen) < 0.5)
        q_blocks = max(1, -(-max(lengths) // BLOCK_M))
        picks = int(torch.randint(1, 9, (), generator=gen))
        raw = torch.randint(-1, q_blocks + 2, (batch, 1, q_blocks, picks), generator=gen, dtype=torch.int32)
        selection = canonical_selection(raw, lengths_to_offsets(lengths), BLOCK_N)
        entries, out = _geometry(lengths, lengths, 0, causal, None, False, selection)
        for (seq, block), (_, num_kv_tiles, bulk_lo, bulk_hi, _, _) in zip(entries, out.tolist()):
            rows = slice(block * BLOCK_M, min((block + 1) * BLOCK_M, lengths[seq]))
            if rows.start >= lengths[seq]:
                continue
            seen = visible_mask(lengths[seq], lengths[seq], causal, None)[rows]
            chosen = sorted({b for b in raw[seq, 0, block].tolist() if 0 <= b * BLOCK_N < lengths[seq]})
            where = dict(case=case, seq=seq, block=block, length=lengths[seq], causal=causal, chosen=chosen)
            expected = len(chosen) if seen.any() else 0
            assert num_kv_tiles == expected, (where, num_kv_tiles)
            whole = [b for b in chosen if (b + 1) * BLOCK_N <= lengths[seq]
                     and bool(seen[:, b * BLOCK_N:(b + 1) * BLOCK_N].all())]
            if expected:  # tile 0 is peeled (masked); the bulk holds every other whole block
                assert bulk_lo == 1 and 1 <= bulk_hi <= expected, (where, bulk_lo, bulk_hi)
                assert all(b in whole for b in chosen[1:bulk_hi]), (where, bulk_hi, whole)
                assert not any(b in whole for b in chosen[bulk_hi:]), (where, bulk_hi, whole)
    return cases


def check_fp8_value_columns(cases: int, seed: int) -> int:
    """Run in the interpreter subprocess: FP8's transposed V (`transposed_values`, host) puts each
    sequence's keys exactly where the kernel's geometry (`v_start`) will load them, every start on a
    16-key column (TMA faults on unaligned innermost starts), and nothing else but zero gaps."""
    gen = torch.Generator().manual_seed(seed)
    for case in range(cases):
        lengths = random_lengths(gen, int(torch.randint(1, 7, (), generator=gen)), 300, LENGTH_EDGES)
        offsets = lengths_to_offsets(lengths)
        # E4M3 as the kernel takes it, with no zeros so that the gaps are told apart
        v = torch.randn(sum(lengths), 2, 16, generator=gen).abs_().add_(1).to(jagged_fwd.FP8_DTYPE)
        v_t = jagged_fwd.transposed_values(v, offsets)
        # the kernel copy and the PyTorch one (jfa.fp8, off the GPU) give the same bytes
        assert torch.equal(v_t.view(torch.uint8), fp8.transpose_values(v, offsets).view(torch.uint8))
        v_t, v = v_t.float(), v.float()
        broadcast_q_len = 64 if case % 2 else 0  # PMA: the sequence index is the key batch's
        q_lens = [broadcast_q_len] * len(lengths) if broadcast_q_len else lengths
        entries, out = _geometry(q_lens, lengths, broadcast_q_len, False, None, False, fp8=True)
        placed = 0
        for (seq, block), geometry in zip(entries, out.tolist()):
            v_start, start, length = geometry[-1], int(offsets[seq]), lengths[seq]
            where = dict(case=case, seq=seq, lengths=lengths, v_start=v_start)
            assert v_start % jagged_fwd.V_T_ALIGN_KEYS.value == 0, where
            assert torch.equal(v_t[:, v_start:v_start + length], v[start:start + length].reshape(length, -1).t()), where
            placed += length * v_t.shape[0] if block == 0 else 0
        assert int((v_t != 0).sum()) == placed, (case, lengths)
    return cases


def _run_in_interpreter(call: str, expected: str):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    code = f"from tests.test_jagged_fwd_geometry import *; print({call})"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=INTERPRETER_TIMEOUT_S)
    assert run.returncode == 0 and expected in run.stdout, (run.stdout + run.stderr)[-4000:]


def test_tile_geometry_matches_the_masks_in_the_interpreter():
    _run_in_interpreter(f"'checked', check_geometry({CASES}, 7)", f"checked {CASES}")


def test_block_sparse_geometry_matches_the_masks_in_the_interpreter():
    _run_in_interpreter(f"'checked', check_sparse_geometry({SPARSE_CASES}, 11)", f"checked {SPARSE_CASES}")


def test_fp8_transposed_values_sit_where_the_kernel_loads_them():
    _run_in_interpreter(f"'checked', check_fp8_value_columns({FP8_CASES}, 13)", f"checked {FP8_CASES}")
