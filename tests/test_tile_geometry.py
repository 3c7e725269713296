"""The kernels' tile geometry, run on the CPU through the torch twins (`jfa.kernels.twin.torch_twin`).

Which keys a query tile visits, which of its key tiles need no mask, when its last tile is a half
tile, which query blocks stream past a key tile and which of them need no mask: the kernels decide
it with `jfa.kernels.masks` and `jfa.kernels.tiles`, whose own source runs here on torch tensors,
over random batches whose lengths mix the tile edges, against masks written out by hand:

- query tiles (forward, dQ; `tiles.query_tile` on the CPU-built tile list): the visited key tiles
  cover every visible key, exactly (but where causal and window together leave a block's rows
  seeing nothing, where the block-level range may be loose); the mask-free bulk is exactly the fully
  visible tiles after the peeled first one; the half tail is taken exactly when the last tile holds
  at most BLOCK_N/2 visible keys; the list decodes to every (sequence, query block, head) once, and
  the schedule sorts by the kernels' own count;
- key tiles (dK/dV; `masks.visible_query_blocks`, `masks.full_query_blocks`, `tiles.key_tile`):
  likewise for the query blocks that see a key tile and those that see all of a consumer's keys;
- the persistent deal (`tiles.zigzag_tile`): every tile dealt once;
- the block-sparse fork (`forks.block_sparse`, its pointers as TwinPointers): a query block visits
  exactly its canonical selection's blocks, ascending, the whole ones first; a key block streams
  exactly the query blocks that selected it;
- the FP8 fork's transposed V (`forks.fp8.transposed_value_col`): every sequence on a 16-key column,
  none overlapping, and its Triton copy (in Triton's interpreter) equals jfa.fp8's PyTorch one;
- the definition itself: `masks.visible`'s twin equals the mask written in torch, and
  `reference.visible_mask` and `specs.attention_pairs` a brute force over (query, key) pairs.
"""
import itertools
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from jfa import configs, reference, schedule, specs
from jfa.kernels import bwd_dkdv, bwd_dq, fwd_sm90, masks, tiles
from jfa.kernels.forks import block_sparse, fp8
from jfa.kernels.hooks import DEFAULT_FORK, Fork
from jfa.kernels.twin import TwinPointer, torch_twin
from jfa.sparse import canonical_selection, transposed_selection
from tests.suite_shapes import suite_shape
from tests.test_schedule import random_lengths, to_offsets

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Tile edges of 32-, 64- and 128-key tiles and of their halves, and lengths just past them.
LENGTH_EDGES = (0, 1, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 191, 192, 193, 255, 256, 257, 383, 385)
MAX_LENGTHS = (130, 300, 700)
WINDOWS = (None, 0, 37, 64, 200)
HEADS = 4
QUERY_TILE_BATCHES = 40  # random batches per query-tile geometry
KEY_TILE_BATCHES = 40
FULL_BLOCK_TRIALS = 300
SPARSE_BATCHES = 25
FP8_BATCHES = 30
BRUTE_FORCE_MAX_LEN = 24  # (query, key) pairs enumerated one by one up to this length
INTERPRETER_TIMEOUT_S = 240

TWIN_FORK = Fork(*(None if hook is None else torch_twin(hook) for hook in DEFAULT_FORK))
SELECTION_BLOCK = block_sparse.SELECTION_BLOCK.value


def _query_geometries() -> dict:
    """(rows, BLOCK_N, HEADS_PER_TILE) of the query tiles `jfa.configs` gives the forward and dQ kernels."""
    shapes = {"gem-short": suite_shape("gem", "L=256,s=0.5"), "gem": suite_shape("gem", "L=2048,s=1.0"),
              "pma-q64": suite_shape("pma", "q=64,kv<=2048"), "dense-d64": suite_shape("dense", "B=4,H=32,N=4096,D=64")}
    found = {}
    for name, shape in shapes.items():
        forward, dq = configs.forward_config(shape), configs.dq_config(shape)
        found[f"forward-{name}"] = (fwd_sm90.tile_rows(forward), forward.BLOCK_N, forward.HEADS_PER_TILE)
        found[f"dq-{name}"] = (bwd_dq.tile_rows(dq), dq.BLOCK_N, dq.HEADS_PER_TILE)
    return {name: geometry for i, (name, geometry) in enumerate(found.items())
            if geometry not in list(found.values())[:i]}


QUERY_GEOMETRIES = _query_geometries()
KEY_GEOMETRIES = {f"d{d}": (configs.DKDV_BASE[d]["BLOCK_M"], configs.DKDV_BASE[d]["BLOCK_N"])
                  for d in specs.SUPPORTED_HEAD_DIMS}


def hand_written_mask(q_len: int, kv_len: int, causal: bool, window: int | None) -> torch.Tensor:
    """[q_len, kv_len]: key j visible to query i (docs/CONTRACTS.md), written out in torch."""
    i = torch.arange(q_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    ok = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        ok &= j <= i + (kv_len - q_len)
    if window is not None:
        ok &= (i - j).abs() <= window
    return ok


def _brute_force_pairs(q_len: int, kv_len: int, causal: bool, window: int | None) -> set:
    return {(i, j) for i in range(q_len) for j in range(kv_len)
            if (not causal or j - i <= kv_len - q_len) and (window is None or abs(i - j) <= window)}


def _random_batch(gen: torch.Generator, broadcast_q: bool):
    """(q_lens per sequence, kv_lens, causal, window) of a random batch."""
    max_len = MAX_LENGTHS[int(torch.randint(0, len(MAX_LENGTHS), (), generator=gen))]
    batch = int(torch.randint(1, 6, (), generator=gen))
    kv_lens = random_lengths(gen, batch, max_len, LENGTH_EDGES)
    if broadcast_q:
        q_lens = [max(1, random_lengths(gen, 1, max_len, LENGTH_EDGES)[0])] * batch
    elif bool(torch.rand((), generator=gen) < 0.3):  # cross-attention: other query lengths
        q_lens = random_lengths(gen, batch, max_len, LENGTH_EDGES)
    else:
        q_lens = kv_lens
    causal = bool(torch.rand((), generator=gen) < 0.5)
    window = WINDOWS[int(torch.randint(0, len(WINDOWS), (), generator=gen))]
    return q_lens, kv_lens, causal, window


def _as_lists(tile, count: int) -> dict:
    return {name: torch.as_tensor(value).expand(count).tolist() for name, value in tile._asdict().items()}


def decode_query_tiles(q_lens, kv_lens, broadcast_q, block_m, block_n, heads_per_tile, causal, window, half_tail,
                       reuse_q=False):
    """Every tile of the forward's tile list (`jfa.schedule`, CPU build) decoded by `tiles.query_tile`'s
    twin: (fields as lists, schedule)."""
    q_offsets = to_offsets([q_lens[0]] if broadcast_q else q_lens)
    kv_offsets = to_offsets(kv_lens)
    max_q = max(max(q_lens), 1)
    tile_list = schedule.build_tile_schedule(q_offsets, kv_offsets, max_seq_len_q=max_q, block_m=block_m,
                                             block_n=block_n, causal=causal, window=window, broadcast_q=broadcast_q)
    num_entries = int(tile_list.num_entries)
    problem = tiles.Problem(TwinPointer(q_offsets), TwinPointer(kv_offsets), TwinPointer(tile_list.entries),
                            num_entries, HEADS, tile_list.q_blocks_per_seq, q_lens[0] if broadcast_q else 0,
                            0 if window is None else window, 1, None)
    count = num_entries * HEADS // heads_per_tile
    if count == 0:
        return {}, tile_list
    decoded = torch_twin(tiles.query_tile)(torch.arange(count), problem, TWIN_FORK, block_m, block_n, heads_per_tile,
                                           causal, window is not None, broadcast_q, half_tail, reuse_q)
    return _as_lists(decoded, count), tile_list


def _check_query_tile(t: dict, i: int, mask: torch.Tensor, block_m, block_n, half_tail_on, exact, where):
    row_lo, q_len = t["row_lo"][i], t["q_len"][i]
    first_col, num, bulk_lo, bulk_hi, half = (t[k][i] for k in ("first_col", "num_kv_tiles", "bulk_lo", "bulk_hi",
                                                                 "half_tail"))
    kv_len = mask.shape[1]
    rows = mask[row_lo:min(row_lo + block_m, q_len)]
    assert rows.shape[0] > 0, where  # the list holds real blocks only
    seen = rows.any(0).nonzero().flatten().tolist()
    whole = num - half
    visited = set(range(first_col, first_col + whole * block_n)) | (
        set(range(first_col + whole * block_n, first_col + whole * block_n + block_n // 2)) if half else set())
    assert set(seen) <= visited, (where, "a visible key is not visited")
    if exact:
        if not seen:
            assert num == 0, (where, "tiles visited where no key is visible")
        else:
            assert first_col == seen[0] // block_n * block_n, where
            assert num == seen[-1] // block_n - seen[0] // block_n + 1, (where, "tiles that hold no visible key")
    # the half tail: only with two or more tiles, exactly when the last holds at most BLOCK_N/2 visible keys
    assert half in (0, 1) and (half_tail_on or not half), where
    last_start = first_col + (num - 1) * block_n
    if half:
        assert num >= 2 and all(c < last_start + block_n // 2 for c in seen), where
    if half_tail_on and exact and num >= 2:
        assert half == int(seen[-1] - last_start + 1 <= block_n // 2), (where, "half tail not taken where it fits")
    # the mask-free bulk: exactly the tiles after the peeled first one that every real row sees whole
    if num == 0:
        assert bulk_lo == bulk_hi == 0, where
        return
    assert 1 <= bulk_lo <= bulk_hi <= whole or bulk_lo == bulk_hi, where
    full = [n for n in range(1, whole)
            if first_col + (n + 1) * block_n <= kv_len
            and bool(rows[:, first_col + n * block_n:first_col + (n + 1) * block_n].all())]
    assert list(range(bulk_lo, bulk_hi)) == full, (where, bulk_lo, bulk_hi, full)


# Half tails only where a half tile is at least a wgmma's N, as configs compiles them.
QUERY_TILE_CASES = [pytest.param(name, half_tail, id=f"{name}-{'half' if half_tail else 'whole'}-tails")
                    for name, (_, block_n, _) in QUERY_GEOMETRIES.items() for half_tail in (False, True)
                    if not half_tail or block_n // 2 >= configs.MIN_HALF_TILE_KEYS]


@pytest.mark.parametrize("name, half_tail", QUERY_TILE_CASES)
def test_query_tiles_visit_exactly_the_visible_keys(name, half_tail):
    block_m, block_n, heads_per_tile = QUERY_GEOMETRIES[name]
    gen = torch.Generator().manual_seed(block_m * 1000 + block_n + half_tail)
    checked = 0
    for batch in range(QUERY_TILE_BATCHES):
        broadcast_q = bool(torch.rand((), generator=gen) < 0.3)
        q_lens, kv_lens, causal, window = _random_batch(gen, broadcast_q)
        if heads_per_tile == 2:  # paired heads: every query sequence fits one consumer's rows
            q_lens = [min(n, block_m) for n in q_lens]
            if broadcast_q:
                q_lens = [max(1, q_lens[0])] * len(q_lens)
        t, _ = decode_query_tiles(q_lens, kv_lens, broadcast_q, block_m, block_n, heads_per_tile, causal, window,
                                  half_tail)
        exact = not (causal and window is not None)
        for i in range(len(t.get("seq", ()))):
            seq = t["seq"][i]
            where = dict(geometry=name, batch=batch, seq=seq, q_block=t["q_block"][i], q_len=q_lens[seq],
                         kv_len=kv_lens[seq], causal=causal, window=window, broadcast_q=broadcast_q)
            mask = hand_written_mask(q_lens[seq], kv_lens[seq], causal, window)
            _check_query_tile(t, i, mask, block_m, block_n, half_tail, exact, where)
            checked += 1
    assert checked > QUERY_TILE_BATCHES  # the batches held tiles


@pytest.mark.parametrize("name", QUERY_GEOMETRIES)
def test_query_tile_list_decodes_every_block_and_head_once(name):
    """Head-major (tile t: head t // entries) or, with paired heads, entry-major (head group t % groups):
    either way every (sequence, query block) of the list meets every head once; broadcast-Q's REUSE_Q
    gives tiles of one query block and head one `q_key`."""
    block_m, block_n, heads_per_tile = QUERY_GEOMETRIES[name]
    gen = torch.Generator().manual_seed(block_m + block_n)
    for broadcast_q in (False, True):
        q_lens, kv_lens, causal, window = _random_batch(gen, broadcast_q)
        q_lens = [min(max(n, 1), block_m) for n in q_lens] if heads_per_tile == 2 else q_lens
        t, tile_list = decode_query_tiles(q_lens, kv_lens, broadcast_q, block_m, block_n, heads_per_tile, causal,
                                          window, False, reuse_q=broadcast_q)
        blocks = {(s, b) for s in range(len(kv_lens)) for b in range(-(-q_lens[s] // block_m))}
        decoded = [(s, b, h + c) for s, b, h in zip(t["seq"], t["q_block"], t["head"]) for c in range(heads_per_tile)]
        assert sorted(decoded) == sorted((s, b, h) for (s, b) in blocks for h in range(HEADS))
        assert all(h % heads_per_tile == 0 for h in t["head"])
        keys = {(b, h): k for b, h, k in zip(t["q_block"], t["head"], t["q_key"])}
        if broadcast_q:
            assert all(keys[b, h] == k for b, h, k in zip(t["q_block"], t["head"], t["q_key"]))
            assert len(set(keys.values())) == len(keys)
        else:
            assert t["q_key"] == list(range(len(t["q_key"])))


@pytest.mark.parametrize("name", QUERY_GEOMETRIES)
def test_the_schedule_sorts_by_the_kernels_own_key_tile_count(name):
    """`schedule.kv_tiles_per_entry` (the list's sort key) is the number of key tiles `query_tile` gives."""
    block_m, block_n, heads_per_tile = QUERY_GEOMETRIES[name]
    gen = torch.Generator().manual_seed(7 * block_m + block_n)
    for _ in range(QUERY_TILE_BATCHES // 4):
        q_lens, kv_lens, causal, window = _random_batch(gen, False)
        if heads_per_tile == 2:
            q_lens = [min(n, block_m) for n in q_lens]
        t, tile_list = decode_query_tiles(q_lens, kv_lens, False, block_m, block_n, heads_per_tile, causal, window,
                                          False)
        work = schedule.kv_tiles_per_entry(torch.tensor(q_lens), torch.tensor(kv_lens), tile_list.q_blocks_per_seq,
                                           block_m=block_m, block_n=block_n, causal=causal, window=window)
        for seq, block, num in zip(t.get("seq", ()), t.get("q_block", ()), t.get("num_kv_tiles", ())):
            assert work[seq, block] == num, (seq, block)


# ---- the persistent deal ---------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tiles,num_progs", [(0, 4), (3, 4), (4, 4), (17, 4), (100, 7), (264, 132)])
def test_zigzag_deal_hands_every_tile_to_one_program(num_tiles, num_progs):
    """Entry-major deal: program p's turns take tiles p, 2P-1-p, 2P+p, ...; together every tile once."""
    deal, turns = torch_twin(tiles.zigzag_tile), torch_twin(tiles.zigzag_turns)
    dealt = []
    for prog in range(num_progs):
        taken = [int(deal(turn, prog, num_progs)) for turn in range(int(turns(num_tiles, prog, num_progs)))]
        assert all(0 <= t < num_tiles for t in taken)
        assert taken[:2] == [prog, 2 * num_progs - 1 - prog][:len(taken)]
        dealt += taken
    assert sorted(dealt) == list(range(num_tiles))


# ---- key tiles: dK/dV ------------------------------------------------------------------------------------

def _query_block_geometry(mask: torch.Tensor, col0: int, block_m: int, block_n: int, first_row: int, num: int,
                          exact: bool, where):
    kv_len = mask.shape[1]
    seeing = mask[:, col0:min(col0 + block_n, kv_len)].any(1).nonzero().flatten().tolist()
    streamed = set(range(first_row, first_row + num * block_m))
    assert set(seeing) <= streamed, (where, "a query row that sees the keys is not streamed")
    assert first_row % block_m == 0 and first_row >= 0, where
    if exact:
        if not seeing:
            assert num == 0, where
        else:
            assert first_row == seeing[0] // block_m * block_m, where
            assert num == seeing[-1] // block_m - seeing[0] // block_m + 1, (where, "blocks that see no key")


def _full_blocks(mask, first_key, last_key, first_row, num, block_m) -> list:
    q_len, kv_len = mask.shape
    return [last_key < kv_len and first_row + (i + 1) * block_m <= q_len
            and bool(mask[first_row + i * block_m:first_row + (i + 1) * block_m, first_key:last_key + 1].all())
            for i in range(num)]


@pytest.mark.parametrize("name", KEY_GEOMETRIES)
def test_key_tiles_stream_exactly_the_query_blocks_that_see_them(name):
    """`tiles.key_tile` over the backward's tile list: each key tile streams the query blocks that see any
    of its keys (`masks.visible_query_blocks`, exactly but where causal and window together make the
    range loose), every (sequence, key block, key head) once, the count the schedule sorts by; and each
    consumer's mask-free bulk (`masks.full_query_blocks`) is exactly the blocks that see all its keys."""
    block_m, block_n = KEY_GEOMETRIES[name]
    keys = block_n // bwd_dkdv.CONSUMERS.value
    gen = torch.Generator().manual_seed(block_m + 3 * block_n)
    key_tile = torch_twin(tiles.key_tile)
    full_query_blocks = torch_twin(masks.full_query_blocks)
    for batch in range(KEY_TILE_BATCHES):
        broadcast_q = bool(torch.rand((), generator=gen) < 0.3)
        q_lens, kv_lens, causal, window = _random_batch(gen, broadcast_q)
        q_offsets, kv_offsets = to_offsets([q_lens[0]] if broadcast_q else q_lens), to_offsets(kv_lens)
        tile_list = schedule.build_kv_tile_schedule(q_offsets, kv_offsets, max_seq_len_kv=max(max(kv_lens), 1),
                                                    broadcast_q_len=q_lens[0] if broadcast_q else 0, block_m=block_m,
                                                    block_n=block_n, causal=causal, window=window)
        num_entries = int(tile_list.num_entries)
        problem = tiles.Problem(TwinPointer(q_offsets), TwinPointer(kv_offsets), TwinPointer(tile_list.entries),
                                num_entries, HEADS, tile_list.kv_blocks_per_seq, q_lens[0] if broadcast_q else 0,
                                0 if window is None else window, 1, None)
        work = schedule.q_blocks_per_kv_tile(torch.tensor(q_lens), torch.tensor(kv_lens), tile_list.kv_blocks_per_seq,
                                             block_m=block_m, block_n=block_n, causal=causal, window=window)
        exact = not (causal and window is not None)
        decoded = []
        for tile in range(num_entries * HEADS):
            shares = [key_tile(tile, problem, share, block_m, block_n, keys, causal, window is not None, broadcast_q)
                      for share in range(bwd_dkdv.CONSUMERS.value)]
            key = shares[0]
            seq, col0, first_row, num = int(key.seq), int(key.col0), int(key.first_row), int(key.num_q_blocks)
            decoded.append((seq, col0 // block_n, int(key.kv_head)))
            where = dict(geometry=name, batch=batch, seq=seq, col0=col0, q_len=q_lens[seq], kv_len=kv_lens[seq],
                         causal=causal, window=window, broadcast_q=broadcast_q)
            assert work[seq, col0 // block_n] == num, where
            mask = hand_written_mask(q_lens[seq], kv_lens[seq], causal, window)
            _query_block_geometry(mask, col0, block_m, block_n, first_row, num, exact, where)
            for share, part in enumerate(shares):  # each consumer's KEYS columns
                first_key = col0 + share * keys
                assert part.cols.tolist() == list(range(first_key, first_key + keys)), where
                lo, hi = (int(x) for x in full_query_blocks(first_key, first_key + keys - 1, first_row, num,
                                                             q_lens[seq], kv_lens[seq], 0 if window is None else window,
                                                             block_m, causal, window is not None))
                full = _full_blocks(mask, first_key, first_key + keys - 1, first_row, num, block_m)
                assert full == [lo <= i < hi for i in range(num)], (where, share, lo, hi, full)
        real = {(s, b) for s in range(len(kv_lens)) for b in range(-(-kv_lens[s] // block_n))}
        assert sorted(decoded) == sorted((s, b, h) for s, b in real for h in range(HEADS)), batch


def test_full_query_blocks_are_exactly_the_fully_visible_blocks():
    """`masks.full_query_blocks` on random spans of keys and rows, causal and window in every combination."""
    full_query_blocks = torch_twin(masks.full_query_blocks)
    gen = torch.Generator().manual_seed(0)
    block_m, keys = configs.DKDV_BASE[128]["BLOCK_M"], configs.DKDV_BASE[128]["BLOCK_N"] // bwd_dkdv.CONSUMERS.value
    for trial in range(FULL_BLOCK_TRIALS):
        causal, has_window = bool(torch.rand((), generator=gen) < 0.5), bool(torch.rand((), generator=gen) < 0.5)
        q_len, kv_len = (int(torch.randint(1, 701, (), generator=gen)) for _ in range(2))
        window = int(torch.randint(0, 301, (), generator=gen))
        first_key = int(torch.randint(0, -(-kv_len // keys) + 1, (), generator=gen)) * keys
        first_row = int(torch.randint(0, -(-q_len // block_m), (), generator=gen)) * block_m
        num = -(-(q_len - first_row) // block_m)
        lo, hi = (int(x) for x in full_query_blocks(first_key, first_key + keys - 1, first_row, num, q_len, kv_len,
                                                     window, block_m, causal, has_window))
        mask = hand_written_mask(q_len, kv_len, causal, window if has_window else None)
        full = _full_blocks(mask, first_key, first_key + keys - 1, first_row, num, block_m)
        assert 0 <= lo <= hi <= num and full == [lo <= i < hi for i in range(num)], (
            trial, causal, has_window, q_len, kv_len, window, first_key, first_row, lo, hi)


# ---- the block-sparse fork -------------------------------------------------------------------------------

def _selection_params(selection) -> tuple:
    """The fork's params for a selection (`selection_params`), its tensors as TwinPointers."""
    blocks, counts, *sizes = block_sparse.selection_params(selection, HEADS)
    return (TwinPointer(blocks), TwinPointer(counts), *sizes)


@pytest.mark.parametrize("kernel", ["forward", "dq"])
def test_block_sparse_query_blocks_visit_exactly_their_selection_whole_blocks_first(kernel):
    """`selected_key_tiles` / `selected_key_col` on raw selections (padding, repeats, picks past the
    sequence) made canonical: a query block that sees any key visits its distinct selected blocks in
    ascending order, each as SELECTION_BLOCK / BLOCK_N tiles; the mask-free bulk holds only tiles every
    row sees whole, and the blocks after it are not whole."""
    shape = suite_shape("gem", "L=2048,s=1.0", base_tiles=True, block_sparse=True, deterministic=True)
    config = configs.forward_config(shape) if kernel == "forward" else configs.dq_config(shape)
    block_m = fwd_sm90.tile_rows(config) if kernel == "forward" else bwd_dq.tile_rows(config)
    block_n = config.BLOCK_N
    assert block_m == SELECTION_BLOCK and SELECTION_BLOCK % block_n == 0
    per_block = SELECTION_BLOCK // block_n
    key_range = torch_twin(masks.visible_key_range)
    key_tiles, key_col = torch_twin(block_sparse.selected_key_tiles), torch_twin(block_sparse.selected_key_col)
    gen = torch.Generator().manual_seed(per_block)
    for batch in range(SPARSE_BATCHES):
        lengths = random_lengths(gen, int(torch.randint(1, 5, (), generator=gen)), 700, LENGTH_EDGES)
        causal = bool(torch.rand((), generator=gen) < 0.5)
        q_blocks = max(1, -(-max(lengths) // SELECTION_BLOCK))
        picks = int(torch.randint(1, 9, (), generator=gen))
        raw = torch.randint(-1, q_blocks + 2, (len(lengths), HEADS, q_blocks, picks), generator=gen, dtype=torch.int32)
        selection = canonical_selection(raw, to_offsets(lengths), SELECTION_BLOCK)
        params = _selection_params(selection)
        for seq, head, q_block in itertools.product(range(len(lengths)), range(HEADS), range(q_blocks)):
            length = lengths[seq]
            row_lo = q_block * SELECTION_BLOCK
            if row_lo >= length:
                continue
            row_hi = min(row_lo + block_m, length) - 1
            kv_lo, kv_hi, full_lo, full_hi = key_range(row_lo, row_hi, length, length, 0, causal, False)
            first_col, cursor, num, bulk_lo, bulk_hi = key_tiles(torch.tensor(seq), head, q_block, kv_lo, kv_hi,
                                                                  full_lo, full_hi, params, block_n)
            num, bulk_lo, bulk_hi = int(num), int(bulk_lo), int(bulk_hi)
            chosen = sorted({b for b in raw[seq, head, q_block].tolist() if 0 <= b and b * SELECTION_BLOCK < length})
            rows = hand_written_mask(length, length, causal, None)[row_lo:row_hi + 1]
            where = dict(kernel=kernel, batch=batch, seq=seq, head=head, q_block=q_block, length=length,
                         causal=causal, chosen=chosen)
            if not bool(rows.any()):
                assert num == 0, where
                continue
            cols = [int(key_col(n, first_col, cursor, block_n)) for n in range(num)]
            assert cols == [b * SELECTION_BLOCK + t * block_n for b in chosen for t in range(per_block)], where

            def whole(col, keys):
                return col + keys <= length and bool(rows[:, col:col + keys].all())

            if not chosen:
                assert num == bulk_lo == bulk_hi == 0, where
                continue
            assert bulk_lo == 1 and bulk_lo <= bulk_hi <= num, (where, bulk_lo, bulk_hi)
            assert all(whole(cols[n], block_n) for n in range(bulk_lo, bulk_hi)), (where, bulk_hi)
            assert not any(whole(b * SELECTION_BLOCK, SELECTION_BLOCK) for b in chosen[bulk_hi // per_block:]), (
                where, "a whole block after the bulk")


def test_block_sparse_key_blocks_stream_exactly_the_query_blocks_that_selected_them():
    """The dK/dV side: `selecting_query_blocks` / `selecting_query_row` over the transposed selection
    stream, past each key block, the query blocks that selected it, ascending, as 64-row blocks."""
    config = configs.dkdv_config(suite_shape("gem", "L=2048,s=1.0", base_tiles=True, block_sparse=True),
                                 bwd_dkdv.DQ_NONE.value)
    block_m, block_n = config.BLOCK_M, config.BLOCK_N
    assert block_n == SELECTION_BLOCK and SELECTION_BLOCK % block_m == 0
    per_block = SELECTION_BLOCK // block_m
    blocks_of, row_of = torch_twin(block_sparse.selecting_query_blocks), torch_twin(block_sparse.selecting_query_row)
    gen = torch.Generator().manual_seed(1)
    for batch in range(SPARSE_BATCHES):
        lengths = random_lengths(gen, int(torch.randint(1, 5, (), generator=gen)), 700, LENGTH_EDGES)
        q_blocks = max(1, -(-max(lengths) // SELECTION_BLOCK))
        raw = torch.randint(-1, q_blocks + 2, (len(lengths), HEADS, q_blocks, 4), generator=gen, dtype=torch.int32)
        selection = canonical_selection(raw, to_offsets(lengths), SELECTION_BLOCK)
        by_key = transposed_selection(selection, q_blocks)
        params = _selection_params(by_key)
        for seq, head, key_block in itertools.product(range(len(lengths)), range(HEADS), range(q_blocks)):
            picked = [selection.blocks[seq, head, qb, :int(selection.counts[seq, head, qb])].tolist()
                      for qb in range(q_blocks)]
            selectors = [qb for qb in range(q_blocks) if key_block in picked[qb]]
            cursor, count = blocks_of(torch.tensor(seq), head, key_block, 0, params, block_m, block_n)
            rows = [int(row_of(b, 0, cursor, block_m, block_n)) for b in range(int(count))]
            assert rows == [qb * SELECTION_BLOCK + t * block_m for qb in selectors for t in range(per_block)], (
                batch, seq, head, key_block, selectors)


# ---- the FP8 fork's transposed V -------------------------------------------------------------------------

def test_fp8_sequences_start_on_their_own_16_key_columns():
    """`transposed_value_col` puts every sequence's first key on a multiple of 16 (TMA faults on an unaligned
    innermost start), and no two sequences share a column; `transposed_value_layout` places every key at
    its sequence's column plus its position, inside `transposed_value_width` columns."""
    align = fp8.V_T_ALIGN_KEYS.value
    assert align == specs.TMA_ALIGN_BYTES  # one-byte keys
    column = torch_twin(fp8.transposed_value_col)
    gen = torch.Generator().manual_seed(2)
    for _ in range(FP8_BATCHES):
        lengths = random_lengths(gen, int(torch.randint(1, 9, (), generator=gen)), 300, LENGTH_EDGES)
        offsets = to_offsets(lengths, torch.int64)
        starts = column(offsets[:-1], torch.arange(len(lengths)))
        assert bool((starts % align == 0).all()), lengths
        spans = sorted(zip(starts.tolist(), lengths))
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), (lengths, spans)
        rows = sum(lengths)
        cols, width = fp8.transposed_value_layout(offsets, rows, "cpu")
        assert width == fp8.transposed_value_width(rows, len(lengths))
        expected = [start + k for start, n in zip(starts.tolist(), lengths) for k in range(n)]
        assert cols.tolist() == expected and len(set(expected)) == rows and all(c < width for c in expected)


_INTERPRETED_FP8_COPY = """
import torch
from jfa import fp8 as fp8_api
from jfa.kernels.forks import fp8
from tests.test_schedule import random_lengths, to_offsets
from tests.test_tile_geometry import LENGTH_EDGES

gen = torch.Generator().manual_seed(3)
for case in range({cases}):
    lengths = random_lengths(gen, int(torch.randint(1, 7, (), generator=gen)), 300, LENGTH_EDGES)
    if not sum(lengths):
        continue
    offsets = to_offsets(lengths)
    # no zeros among the values, so the zero gaps are told apart from them
    v = torch.randn(sum(lengths), 2, 16, generator=gen).abs_().add_(1).to(torch.float8_e4m3fn)
    by_kernel = fp8.transposed_values(v, offsets)
    by_torch = fp8_api.transpose_values(v, offsets)
    assert torch.equal(by_kernel.view(torch.uint8), by_torch.view(torch.uint8)), lengths
    cols, _ = fp8.transposed_value_layout(offsets, sum(lengths), "cpu")
    assert torch.equal(by_kernel.float()[:, cols], v.float().reshape(sum(lengths), -1).t()), lengths
    assert int((by_kernel.float() != 0).sum()) == v.numel(), lengths  # zeros everywhere else
print("checked", {cases})
"""


def test_fp8_transposed_values_kernel_equals_the_pytorch_copy_in_the_interpreter():
    """`forks.fp8.transposed_values` (plain Triton, run by Triton's interpreter) gives jfa.fp8's PyTorch copy
    byte for byte: each sequence's V^T at its columns, zeros between."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    code = _INTERPRETED_FP8_COPY.format(cases=FP8_BATCHES // 3)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=INTERPRETER_TIMEOUT_S)
    assert run.returncode == 0 and f"checked {FP8_BATCHES // 3}" in run.stdout, (run.stdout + run.stderr)[-4000:]


# ---- the definition of visibility ------------------------------------------------------------------------

SMALL_CASES = [(lq, lk, causal, window) for lq, lk in [(0, 5), (5, 0), (1, 1), (7, 7), (5, 13), (13, 5), (24, 24)]
               for causal in (False, True) for window in (None, 0, 3)]


@pytest.mark.parametrize("lq,lk,causal,window", SMALL_CASES)
def test_the_visible_twin_equals_the_hand_written_mask_in_both_orientations(lq, lk, causal, window):
    visible = torch_twin(masks.visible)
    rows, cols = torch.arange(lq), torch.arange(lk)
    args = (lq, lk, 0 if window is None else window, causal, window is not None)
    expected = hand_written_mask(lq, lk, causal, window)
    assert torch.equal(torch.as_tensor(visible(rows[:, None], cols[None, :], *args)).expand(lq, lk), expected)
    assert torch.equal(torch.as_tensor(visible(rows[None, :], cols[:, None], *args)).expand(lk, lq), expected.T)


@pytest.mark.parametrize("lq,lk,causal,window", SMALL_CASES)
def test_reference_mask_and_visible_key_ranges_agree_with_a_brute_force(lq, lk, causal, window):
    """`reference.visible_mask`, and `visible_key_range` of one row (its range is exactly its keys, all
    seen by the one row), against (query, key) pairs enumerated one by one."""
    pairs = _brute_force_pairs(lq, lk, causal, window)
    mask = reference.visible_mask(lq, lk, causal, window)
    assert {(i, j) for i, j in mask.nonzero().tolist()} == pairs
    key_range = torch_twin(masks.visible_key_range)
    for i in range(lq):
        kv_lo, kv_hi, full_lo, full_hi = (int(x) for x in key_range(i, i, lq, lk, 0 if window is None else window,
                                                                    causal, window is not None))
        keys = sorted(j for r, j in pairs if r == i)
        assert list(range(kv_lo, kv_hi)) == keys and list(range(full_lo, full_hi)) == keys, (i, keys)


def test_attention_pairs_agree_with_a_brute_force():
    gen = torch.Generator().manual_seed(4)
    for causal, window in itertools.product((False, True), (None, 0, 2, 9)):
        q_lens = torch.randint(0, BRUTE_FORCE_MAX_LEN + 1, (5,), generator=gen).tolist()
        kv_lens = torch.randint(0, BRUTE_FORCE_MAX_LEN + 1, (5,), generator=gen).tolist()
        expected = sum(len(_brute_force_pairs(lq, lk, causal, window)) for lq, lk in zip(q_lens, kv_lens))
        assert specs.attention_pairs(q_lens, kv_lens, causal=causal, window=window) == expected, (causal, window)
