"""Host side of scheduling the jagged attention kernels: tile lists and block tables, built on the GPU.

A persistent kernel runs one program per SM; each program takes every P-th tile of a list. How
the list is ordered decides the load balance: jagged sequences differ in length by 10x or more,
and if the long tiles come last, the SMs that draw them finish long after the rest sit idle. So the
list is sorted by work, longest first (a greedy "longest processing time first" deal; the seed
does the same on the host, then deals in zigzag order, as the forward kernel does when every
sequence is one query block: `jfa.kernels.tiles`).

Building it must not synchronize with the GPU (a `.item()` or `.tolist()` on the offsets would
stall the CPU until every earlier kernel finished), so it is built on the device, sized by
host-known upper bounds: for the forward, every (sequence, query block) pair gets an *entry*
(`B * ceil(max_seq_len_q / BLOCK_M)` of them); for the backward, every (sequence, KV block) pair.
Entries past a sequence's end get work -1 and sort behind the real ones, and the number of real
entries goes to the kernel as a one-element device tensor. Heads are not part of an entry: the
kernel walks the list once per head, so the programs running together share K/V through L2.

The order is a *stable* descending sort by work: equal-work entries keep their (sequence, block)
order, so a sequence's query blocks stay neighbours; for broadcast-Q that keeps the shared Q block
of a program's consecutive tiles equal (the forward's Q reuse relies on it).

An entry's work is the kernels' own count (`query_entry_work`, `key_entry_work`, built from
`jfa.kernels.masks`), so the list sorts by exactly what the kernels will do.

Two builders produce identical lists:
- on CUDA, two small Triton launches (`_bin_entries_kernel`, `_scatter_entries_kernel`): work is
  an integer bounded by a host-known number (the KV tiles of the longest key sequence, or the query
  blocks of the longest query sequence), so a counting sort over work values needs no device-wide
  sort: each chunk of entries counts its work values, and each chunk then places its entries from
  the counts of all chunks. A torch-op build (argsort and friends) costs ~10x more, mostly dispatch;
- elsewhere (offsets on the CPU, or no work bound given), the same work functions on torch tensors
  (`jfa.kernels.twin`) and a stable argsort, which are also the reference the Triton builders are
  tested against.

Schedules are cached per (offsets tensors, their versions, parameters); the cache holds weak
references, so a freed offsets tensor never matches a new one that happens to reuse its id.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
import triton
import triton.language as tl

from jfa.kernels.masks import visible_key_range, visible_query_blocks
from jfa.kernels.tiles import consecutive_key_tiles
from jfa.kernels.twin import torch_twin
from jfa.specs import BLOCK_ATTENTION_BLOCK

CACHE_SIZE = 32  # schedules kept; a training step uses a handful of offsets tensors
SORT_CHUNK = 128  # entries per program of the counting sort (its rank matrix is CHUNK x CHUNK)
BIN_BLOCK = 32  # work values handled together when counting and placing entries
CHUNK_BLOCK = 32  # per-chunk counts read together when a chunk finds where its entries go
TABLE_CHUNK = 256  # sequences per program of the block-table builder
SORT_WARPS = 4

# What an entry is, for the counting sort's work function (a constexpr of `_bin_entries_kernel`).
FWD_ENTRIES = tl.constexpr(0)  # (sequence, query block); work = KV tiles it visits
BWD_ENTRIES = tl.constexpr(1)  # (sequence, KV block); work = query blocks that see it


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """The forward's tile list: `entries[i] = seq * q_blocks_per_seq + q_block`, real ones first.

    `num_entries` is an int32 device tensor of one element (the real entries); `max_entries` is its
    host-known upper bound, which sizes the persistent grid.
    """

    entries: torch.Tensor
    num_entries: torch.Tensor
    q_blocks_per_seq: int
    max_entries: int


@dataclasses.dataclass(frozen=True)
class KVTileSchedule:
    """The backward's tile list: `entries[i] = seq * kv_blocks_per_seq + kv_block`, real ones first.

    `num_entries` (int32, one element, on the device) counts the real entries; `max_entries` is its
    host-known bound, which sizes the persistent grid. Tile t is entry t // Hkv, KV head t % Hkv.
    """

    entries: torch.Tensor
    num_entries: torch.Tensor
    kv_blocks_per_seq: int
    max_entries: int


# ---- work per entry: the kernels' own counts ---------------------------------------------------------

@triton.jit
def query_entry_work(q_len, kv_len, q_block, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key tiles a (sequence, query block) entry visits, as the forward and dQ kernels count them
    (`masks.visible_key_range`, `tiles.consecutive_key_tiles`); -1 past the sequence end. Elementwise."""
    row_lo = q_block * BLOCK_M
    row_hi = tl.minimum(row_lo + BLOCK_M, q_len) - 1
    kv_lo, kv_hi, full_lo, full_hi = visible_key_range(row_lo, row_hi, q_len, kv_len, window, CAUSAL, HAS_WINDOW)
    _, _, tiles, _, _ = consecutive_key_tiles(0, 0, q_block, kv_lo, kv_hi, full_lo, full_hi, None, BLOCK_N)
    return tl.where(row_lo < q_len, tiles, -1)


@triton.jit
def key_entry_work(q_len, kv_len, kv_block, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query blocks a (sequence, key block) entry streams, as the dK/dV kernel counts them
    (`masks.visible_query_blocks`); -1 past the sequence end. Elementwise."""
    col0 = kv_block * BLOCK_N
    _, blocks = visible_query_blocks(col0, q_len, kv_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    return tl.where(col0 < kv_len, blocks, -1)


def kv_tiles_per_entry(q_lens: torch.Tensor, kv_lens: torch.Tensor, q_blocks_per_seq: int, *,
                       block_m: int, block_n: int, causal: bool, window: int | None) -> torch.Tensor:
    """Key tiles each (sequence, query block) visits, [B, q_blocks_per_seq] int64; -1 past the sequence
    end: `query_entry_work` on torch tensors."""
    blocks = torch.arange(q_blocks_per_seq, device=q_lens.device, dtype=torch.int64)[None, :]
    return torch_twin(query_entry_work)(q_lens.to(torch.int64)[:, None], kv_lens.to(torch.int64)[:, None], blocks,
                                        0 if window is None else window, block_m, block_n, causal, window is not None)


def q_blocks_per_kv_tile(q_lens: torch.Tensor, kv_lens: torch.Tensor, kv_blocks_per_seq: int, *,
                         block_m: int, block_n: int, causal: bool, window: int | None) -> torch.Tensor:
    """Query blocks each (sequence, key block) streams, [B, kv_blocks_per_seq] int64; -1 past the end:
    `key_entry_work` on torch tensors."""
    blocks = torch.arange(kv_blocks_per_seq, device=q_lens.device, dtype=torch.int64)[None, :]
    return torch_twin(key_entry_work)(q_lens.to(torch.int64)[:, None], kv_lens.to(torch.int64)[:, None], blocks,
                                      0 if window is None else window, block_m, block_n, causal, window is not None)


@triton.jit
def _sequence_lengths(seq, ok, q_offsets_ptr, kv_offsets_ptr, broadcast_q_len,
                      BROADCAST_Q: tl.constexpr):
    """(q_len, kv_len) of each sequence in `seq`, int64; lanes that are not `ok` read nothing."""
    kv_len = (tl.load(kv_offsets_ptr + seq + 1, mask=ok, other=0).to(tl.int64)
              - tl.load(kv_offsets_ptr + seq, mask=ok, other=0).to(tl.int64))
    if BROADCAST_Q:
        q_len = tl.zeros_like(kv_len) + broadcast_q_len
    else:
        q_len = (tl.load(q_offsets_ptr + seq + 1, mask=ok, other=0).to(tl.int64)
                 - tl.load(q_offsets_ptr + seq, mask=ok, other=0).to(tl.int64))
    return q_len, kv_len


# ---- counting sort by work, longest first (Triton) -----------------------------------------------
#
# An entry's *bin* is its rank in the order: bin = max_work - work for real entries (longest first),
# bin = max_work + 1 for entries past a sequence's end. Launch 1 stores each entry's bin and each
# chunk's count per bin; launch 2 places entry i of chunk c, bin b at
#     (entries in bins < b) + (entries of bin b in chunks < c) + (entries of bin b before i in c),
# which is exactly where a stable descending sort puts it.
#
# Sizes and pointers change from one call to the next (and the scratch lives at odd offsets of one
# buffer): specializing on their value (== 1, divisible by 16) would recompile for nothing.
_SORT_RUNTIME_ARGS = ("q_offsets_ptr", "kv_offsets_ptr", "bins_ptr", "counts_ptr", "entries_ptr",
                      "num_real_ptr", "num_entries", "blocks_per_seq", "broadcast_q_len", "window",
                      "max_work", "num_bins", "num_chunks")
_TABLE_RUNTIME_ARGS = ("offsets_ptr", "block_start_ptr", "block_rows_ptr", "num_blocks_ptr",
                       "num_seqs", "capacity")

@triton.jit(do_not_specialize=_SORT_RUNTIME_ARGS, do_not_specialize_on_alignment=_SORT_RUNTIME_ARGS)
def _bin_entries_kernel(q_offsets_ptr, kv_offsets_ptr, bins_ptr, counts_ptr, num_entries,
                        blocks_per_seq, broadcast_q_len, window, max_work, num_bins,
                        ENTRIES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BROADCAST_Q: tl.constexpr,
                        CHUNK: tl.constexpr, BINS: tl.constexpr):
    """Launch 1, one program per chunk of entries: each entry's bin, and the chunk's bin counts."""
    chunk = tl.program_id(0)
    entry = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = entry < num_entries
    seq = entry // blocks_per_seq
    block = (entry % blocks_per_seq).to(tl.int64)
    q_len, kv_len = _sequence_lengths(seq, ok, q_offsets_ptr, kv_offsets_ptr, broadcast_q_len,
                                      BROADCAST_Q)
    if ENTRIES == FWD_ENTRIES:
        work = query_entry_work(q_len, kv_len, block, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    else:
        work = key_entry_work(q_len, kv_len, block, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    # A max_work below the real maximum (a caller's wrong bound) must not write out of bounds: the
    # list stays a permutation, only the order of the longest entries suffers.
    bins = tl.where(work >= 0, max_work - tl.minimum(work, max_work), max_work + 1).to(tl.int32)
    bins = tl.where(ok, bins, num_bins)  # lanes past the list fall in no bin
    tl.store(bins_ptr + entry, bins, mask=ok)
    for bin0 in range(0, num_bins, BINS):
        bin_ids = bin0 + tl.arange(0, BINS)
        counts = tl.sum((bins[:, None] == bin_ids[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + chunk * num_bins + bin_ids, counts, mask=bin_ids < num_bins)


@triton.jit(do_not_specialize=_SORT_RUNTIME_ARGS, do_not_specialize_on_alignment=_SORT_RUNTIME_ARGS)
def _scatter_entries_kernel(bins_ptr, counts_ptr, entries_ptr, num_real_ptr, num_entries,
                            num_chunks, num_bins, CHUNK: tl.constexpr, BINS: tl.constexpr,
                            CHUNKS: tl.constexpr):
    """Launch 2, one program per chunk: put each entry at its sorted position; count real entries."""
    chunk = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    entry = chunk * CHUNK + lane
    ok = entry < num_entries
    bins = tl.load(bins_ptr + entry, mask=ok, other=num_bins)
    # Equal-bin entries earlier in this chunk: keeps the sort stable.
    earlier = (bins[None, :] == bins[:, None]) & (lane[None, :] < lane[:, None])
    position = tl.sum(earlier.to(tl.int32), axis=1)
    in_lower_bins = 0  # entries of all chunks in the bins before this block of bins
    num_real = 0
    for bin0 in range(0, num_bins, BINS):
        bin_ids = bin0 + tl.arange(0, BINS)
        bin_ok = bin_ids < num_bins
        total = tl.zeros([BINS], tl.int32)  # per bin, over all chunks
        before = tl.zeros([BINS], tl.int32)  # per bin, over the chunks before this one
        for chunk0 in range(0, num_chunks, CHUNKS):
            chunk_ids = chunk0 + tl.arange(0, CHUNKS)
            counts = tl.load(counts_ptr + chunk_ids[:, None] * num_bins + bin_ids[None, :],
                             mask=(chunk_ids < num_chunks)[:, None] & bin_ok[None, :], other=0)
            total += tl.sum(counts, axis=0)
            before += tl.sum(tl.where((chunk_ids < chunk)[:, None], counts, 0), axis=0)
        bin_start = in_lower_bins + tl.cumsum(total, axis=0) - total + before
        position += tl.sum(tl.where(bins[:, None] == bin_ids[None, :], bin_start[None, :], 0), axis=1)
        in_lower_bins += tl.sum(total, axis=0)
        num_real += tl.sum(tl.where(bin_ids < num_bins - 1, total, 0), axis=0)
    tl.store(entries_ptr + position, entry, mask=ok)
    if chunk == 0:
        tl.store(num_real_ptr, num_real)


def sort_entries_by_work_triton(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, *, entries: str,
                                blocks_per_seq: int, max_work: int, broadcast_q_len: int | None,
                                block_m: int, block_n: int, causal: bool, window: int | None,
                                chunk: int = SORT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries sorted by work, longest first (stable), and the real count: two Triton launches.

    `entries` is "fwd" (sequence, query block) or "bwd" (sequence, KV block); `max_work` bounds the
    work of one entry (host-known); `broadcast_q_len` (not None) gives every sequence that many
    queries, and `q_offsets` is not read.
    `chunk` (a power of two) exists so the tests can run many chunks on small inputs.
    Returns (entries int32 [B * blocks_per_seq], real count int32 [1]) on the offsets' device.
    """
    if entries not in ("fwd", "bwd"):
        raise ValueError(f"entries must be 'fwd' or 'bwd', got {entries!r}")
    num_entries = (kv_offsets.numel() - 1) * blocks_per_seq
    num_bins = max_work + 2  # work 0..max_work, then "past the end"
    num_chunks = triton.cdiv(num_entries, chunk)
    device = kv_offsets.device
    # One allocation: the sorted list, its real count, then the sort's scratch (bins, counts).
    buffer = torch.empty(2 * num_entries + 1 + num_chunks * num_bins, dtype=torch.int32, device=device)
    sorted_entries, num_real = buffer[:num_entries], buffer[num_entries:num_entries + 1]
    if num_entries == 0:
        num_real.zero_()
        return sorted_entries, num_real
    bins, counts = buffer[num_entries + 1:2 * num_entries + 1], buffer[2 * num_entries + 1:]
    flags = dict(BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), HAS_WINDOW=window is not None,
                 BROADCAST_Q=broadcast_q_len is not None)
    _bin_entries_kernel[(num_chunks,)](
        q_offsets, kv_offsets, bins, counts, num_entries, blocks_per_seq, broadcast_q_len or 0,
        0 if window is None else window, max_work, num_bins,
        ENTRIES=(FWD_ENTRIES if entries == "fwd" else BWD_ENTRIES).value, CHUNK=chunk, BINS=BIN_BLOCK,
        num_warps=SORT_WARPS, **flags)
    _scatter_entries_kernel[(num_chunks,)](
        bins, counts, sorted_entries, num_real, num_entries, num_chunks, num_bins, CHUNK=chunk,
        BINS=BIN_BLOCK, CHUNKS=CHUNK_BLOCK, num_warps=SORT_WARPS)
    return sorted_entries, num_real


def sort_entries_by_work_torch(work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference order: a stable descending argsort of `work` [B, blocks] (-1 = no entry)."""
    order = torch.argsort(work.reshape(-1), descending=True, stable=True)
    num_real = (work >= 0).sum().reshape(1)
    return order.to(torch.int32), num_real.to(torch.int32)


# ---- the forward's tile list --------------------------------------------------------------------

def build_tile_schedule(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, *, max_seq_len_q: int,
                        block_m: int, block_n: int, causal: bool, window: int | None,
                        broadcast_q: bool, max_seq_len_kv: int | None = None, host_q_offsets=None,
                        host_kv_offsets=None) -> TileSchedule:
    """Tile list for one launch, without a GPU->CPU synchronization (cached; see the module doc).

    With broadcast_q, `q_offsets` is `[0, q_len]` and `max_seq_len_q` is q_len. On CUDA,
    `max_seq_len_kv` (a bound on every key sequence's length) selects the Triton build; without it
    the torch ops run. Passing the offsets also as host sequences (`host_q_offsets`,
    `host_kv_offsets`: lists or CPU tensors) builds the list on the CPU and copies it over.
    """
    key = ("fwd", max_seq_len_q, max_seq_len_kv, block_m, block_n, causal, window, broadcast_q)
    cached = _cache_lookup(q_offsets, kv_offsets, key)
    if cached is not None:
        return cached
    q_blocks_per_seq = max(1, -(-max_seq_len_q // block_m))
    device = kv_offsets.device
    if host_kv_offsets is None and kv_offsets.is_cuda and max_seq_len_kv is not None:
        entries, num_entries = sort_entries_by_work_triton(
            q_offsets, kv_offsets, entries="fwd", blocks_per_seq=q_blocks_per_seq,
            max_work=max(0, -(-max_seq_len_kv // block_n)),
            broadcast_q_len=max_seq_len_q if broadcast_q else None, block_m=block_m, block_n=block_n,
            causal=causal, window=window)
    else:
        qo, ko = q_offsets, kv_offsets
        if host_kv_offsets is not None:
            qo = torch.as_tensor(host_q_offsets, dtype=torch.int64)
            ko = torch.as_tensor(host_kv_offsets, dtype=torch.int64)
        kv_lens = ko[1:] - ko[:-1]
        q_lens = torch.full_like(kv_lens, max_seq_len_q) if broadcast_q else qo[1:] - qo[:-1]
        work = kv_tiles_per_entry(q_lens, kv_lens, q_blocks_per_seq, block_m=block_m,
                                  block_n=block_n, causal=causal, window=window)
        entries, num_entries = (_to_device(t, device) for t in sort_entries_by_work_torch(work))
    schedule = TileSchedule(entries=entries, num_entries=num_entries,
                            q_blocks_per_seq=q_blocks_per_seq,
                            max_entries=(kv_offsets.numel() - 1) * q_blocks_per_seq)
    _cache_store(q_offsets, kv_offsets, key, schedule)
    return schedule


# ---- the backward's tile list -------------------------------------------------------------------

def build_kv_tile_schedule(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, *, max_seq_len_kv: int,
                           broadcast_q_len: int, block_m: int, block_n: int, causal: bool,
                           window: int | None, max_seq_len_q: int | None = None) -> KVTileSchedule:
    """KV tiles sorted by query work, longest first, without a GPU->CPU sync (cached).

    The forward's list orders query blocks by the keys they visit; the backward needs the transpose
    (KV blocks by the queries that see them), whose causal bound runs the other way. Tiles with no
    work stay in the list: their dK and dV rows must still be written (as zeros).
    `broadcast_q_len` > 0 gives every sequence that many queries (broadcast-Q); 0 reads `q_offsets`.
    On CUDA, a work bound (`max_seq_len_q`, or `broadcast_q_len`) selects the Triton build.
    """
    key = ("bwd", max_seq_len_q, max_seq_len_kv, broadcast_q_len, block_m, block_n, causal, window)
    cached = _cache_lookup(q_offsets, kv_offsets, key)
    if cached is not None:
        return cached
    kv_blocks_per_seq = max(1, -(-max_seq_len_kv // block_n))
    longest_q = broadcast_q_len or max_seq_len_q
    if kv_offsets.is_cuda and longest_q is not None:
        entries, num_entries = sort_entries_by_work_triton(
            q_offsets, kv_offsets, entries="bwd", blocks_per_seq=kv_blocks_per_seq,
            max_work=-(-longest_q // block_m), broadcast_q_len=broadcast_q_len or None, block_m=block_m,
            block_n=block_n, causal=causal, window=window)
    else:
        kv_lens = kv_offsets[1:] - kv_offsets[:-1]
        q_lens = (torch.full_like(kv_lens, broadcast_q_len) if broadcast_q_len
                  else q_offsets[1:] - q_offsets[:-1])
        work = q_blocks_per_kv_tile(q_lens, kv_lens, kv_blocks_per_seq, block_m=block_m,
                                    block_n=block_n, causal=causal, window=window)
        entries, num_entries = sort_entries_by_work_torch(work)
    schedule = KVTileSchedule(entries=entries, num_entries=num_entries,
                              kv_blocks_per_seq=kv_blocks_per_seq,
                              max_entries=(kv_offsets.numel() - 1) * kv_blocks_per_seq)
    _cache_store(q_offsets, kv_offsets, key, schedule)
    return schedule


# ---- block attention's block table --------------------------------------------------------------

@triton.jit(do_not_specialize=_TABLE_RUNTIME_ARGS, do_not_specialize_on_alignment=_TABLE_RUNTIME_ARGS)
def _block_table_kernel(offsets_ptr, block_start_ptr, block_rows_ptr, num_blocks_ptr, num_seqs,
                        capacity, BLOCK: tl.constexpr, SEQS: tl.constexpr):
    """One program per chunk of sequences writes its sequences' blocks; the last one the rest.

    A program finds where its blocks start by summing the block counts of all earlier sequences
    itself (a few loads per earlier chunk), so one launch suffices and no scan crosses programs.
    Offsets may be int32 or int64; rows fit int32 (the kernels index them so), so math is int32.
    """
    chunk = tl.program_id(0)
    first_seq = chunk * SEQS
    blocks_before = 0
    for seq0 in range(0, first_seq, SEQS):
        seq = seq0 + tl.arange(0, SEQS)
        lens = (tl.load(offsets_ptr + seq + 1) - tl.load(offsets_ptr + seq)).to(tl.int32)
        blocks_before += tl.sum(tl.cdiv(lens, BLOCK), axis=0)  # every seq < first_seq is real
    seq = first_seq + tl.arange(0, SEQS)
    ok = seq < num_seqs
    seq_start = tl.load(offsets_ptr + seq, mask=ok, other=0).to(tl.int32)
    lens = tl.load(offsets_ptr + seq + 1, mask=ok, other=0).to(tl.int32) - seq_start
    blocks = tl.cdiv(lens, BLOCK)
    first_block = blocks_before + tl.cumsum(blocks, axis=0) - blocks
    for block in range(0, tl.max(blocks, axis=0)):
        slot = first_block + block
        write = (block < blocks) & (slot < capacity)
        tl.store(block_start_ptr + slot, seq_start + block * BLOCK, mask=write)
        tl.store(block_rows_ptr + slot, tl.minimum(lens - block * BLOCK, BLOCK), mask=write)
    if chunk == tl.num_programs(0) - 1:
        # Unused slots: continue the last sequence's blocks past its end (0 rows), as the torch
        # build's index arithmetic does; the kernels never read them.
        num_blocks = blocks_before + tl.sum(blocks, axis=0)
        tl.store(num_blocks_ptr, num_blocks)
        last_start = tl.load(offsets_ptr + num_seqs - 1).to(tl.int32)
        end = tl.load(offsets_ptr + num_seqs).to(tl.int32)
        last_first_block = num_blocks - tl.cdiv(end - last_start, BLOCK)
        for slot0 in range(num_blocks, capacity, SEQS):
            slot = slot0 + tl.arange(0, SEQS)
            start = last_start + (slot - last_first_block) * BLOCK
            tl.store(block_start_ptr + slot, start, mask=slot < capacity)
            tl.store(block_rows_ptr + slot, tl.minimum(tl.maximum(end - start, 0), BLOCK),
                     mask=slot < capacity)


def block_table_triton(offsets: torch.Tensor, total_rows: int, *, seqs_per_program: int = TABLE_CHUNK):
    """`build_block_table` in one Triton launch (`seqs_per_program`, a power of two, for tests)."""
    num_seqs = offsets.numel() - 1
    capacity = triton.cdiv(total_rows, BLOCK_ATTENTION_BLOCK) + num_seqs
    table = torch.empty(2 * capacity + 1, dtype=torch.int32, device=offsets.device)
    block_start, block_rows, num_blocks = table[:capacity], table[capacity:2 * capacity], table[-1:]
    if num_seqs == 0:
        num_blocks.zero_()
        return block_start, block_rows, num_blocks
    _block_table_kernel[(triton.cdiv(num_seqs, seqs_per_program),)](
        offsets, block_start, block_rows, num_blocks, num_seqs, capacity,
        BLOCK=BLOCK_ATTENTION_BLOCK, SEQS=seqs_per_program, num_warps=SORT_WARPS)
    return block_start, block_rows, num_blocks


def block_table_torch(offsets: torch.Tensor, total_rows: int):
    """`build_block_table` with torch ops (the CPU build, and the Triton build's reference)."""
    seq_lens = (offsets[1:] - offsets[:-1]).to(torch.int64)
    num_seqs = seq_lens.numel()
    capacity = triton.cdiv(total_rows, BLOCK_ATTENTION_BLOCK) + num_seqs
    if num_seqs == 0:
        empty = torch.zeros(capacity, dtype=torch.int32, device=offsets.device)
        return empty, empty.clone(), torch.zeros(1, dtype=torch.int32, device=offsets.device)
    blocks_per_seq = (seq_lens + BLOCK_ATTENTION_BLOCK - 1) // BLOCK_ATTENTION_BLOCK
    blocks_end = torch.cumsum(blocks_per_seq, 0)
    slot = torch.arange(capacity, device=offsets.device, dtype=torch.int64)
    seq = torch.searchsorted(blocks_end, slot, right=True).clamp_(max=num_seqs - 1)
    block_in_seq = slot - (blocks_end - blocks_per_seq)[seq]
    block_start = offsets.to(torch.int64)[seq] + block_in_seq * BLOCK_ATTENTION_BLOCK
    block_rows = (offsets.to(torch.int64)[seq + 1] - block_start).clamp_(0, BLOCK_ATTENTION_BLOCK)
    num_blocks = blocks_end[-1:].to(torch.int32)
    return block_start.to(torch.int32), block_rows.to(torch.int32), num_blocks


def build_block_table(offsets: torch.Tensor, total_rows: int):
    """Start row and real row count of every 64-token block, built on ``offsets``' device (cached).

    Returns ``(block_start, block_rows, num_blocks)``: int32 tensors of a static upper-bound length
    ``cdiv(total_rows, 64) + B`` (every sequence wastes at most one partial block) and a one-element
    tensor holding the real block count, which the kernel reads; entries past it are never visited.
    """
    key = ("blocks", total_rows)
    cached = _cache_lookup(offsets, offsets, key)
    if cached is not None:
        return cached
    build = block_table_triton if offsets.is_cuda else block_table_torch
    table = build(offsets, total_rows)
    _cache_store(offsets, offsets, key, table)
    return table


# ---- cache and copies ---------------------------------------------------------------------------

def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy without stalling the CPU: a pinned host buffer lets the copy run asynchronously."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


_cache: dict = {}


def _cache_lookup(q_offsets, kv_offsets, key):
    hit = _cache.get((id(q_offsets), id(kv_offsets), key))
    if hit is None:
        return None
    q_ref, kv_ref, versions, schedule = hit
    if q_ref() is q_offsets and kv_ref() is kv_offsets and versions == (q_offsets._version,
                                                                        kv_offsets._version):
        return schedule
    return None


def _cache_store(q_offsets, kv_offsets, key, schedule):
    if len(_cache) >= CACHE_SIZE:
        _cache.pop(next(iter(_cache)))
    _cache[(id(q_offsets), id(kv_offsets), key)] = (
        weakref.ref(q_offsets), weakref.ref(kv_offsets),
        (q_offsets._version, kv_offsets._version), schedule)


def clear_cache() -> None:
    """Forget every cached schedule (benchmarks call this to time the build itself)."""
    _cache.clear()
