"""Host side of scheduling the jagged attention kernels: the tile list, built on the GPU.

A persistent kernel runs one program per SM; each program takes every P-th tile of a list. How
the list is ordered decides the load balance: jagged sequences differ in length by 10x or more,
and if the long tiles come last, the SMs that draw them finish long after the rest sit idle. So the
list is sorted by KV work, longest first (a greedy "longest processing time first" deal; the seed
does the same on the host, then deals in zigzag order).

Building it must not synchronize with the GPU (a `.item()` or `.tolist()` on the offsets would
stall the CPU until every earlier kernel finished). So the list is built with a handful of torch
ops on the device, sized by the host-known upper bound `B * ceil(max_seq_len_q / BLOCK_M)`:
every (sequence, query block) pair gets an *entry*; entries past a sequence's end get work -1
and sort behind the real ones, and the number of real entries goes to the kernel as a
one-element device tensor. Heads are not part of an entry: the kernel walks the list once per
head (tile t is head `t // entries`), so the programs running together share K/V through L2.
Equal-work entries keep their (sequence, query block) order, so a sequence's query blocks stay
neighbours; for broadcast-Q that keeps the shared Q block of a program's consecutive tiles equal.

Schedules are cached per (offsets tensor, its version, parameters); the cache holds weak references,
so a freed offsets tensor never matches a new one that happens to reuse its id.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch

CACHE_SIZE = 32  # schedules kept; a training step uses a handful of offsets tensors


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """The kernel's tile list: `entries[i] = seq * q_blocks_per_seq + q_block`, real ones first.

    `num_entries` is an int32 device tensor of one element (the real entries); `max_entries` is its
    host-known upper bound, which sizes the persistent grid.
    """

    entries: torch.Tensor
    num_entries: torch.Tensor
    q_blocks_per_seq: int
    max_entries: int


def kv_tiles_per_entry(q_lens: torch.Tensor, kv_lens: torch.Tensor, q_blocks_per_seq: int, *,
                       block_m: int, block_n: int, causal: bool, window: int | None) -> torch.Tensor:
    """KV tiles each (sequence, query block) visits, [B, q_blocks_per_seq]; -1 past the sequence end.

    The same range arithmetic as the kernel's `_tile_geometry`, vectorized (int64). Written with
    few torch ops because each costs a dispatch (microseconds) when the schedule is rebuilt for
    new offsets; python ints stand in for ranges that do not depend on the sequence.
    """
    q_lens = q_lens.to(torch.int64)[:, None]
    kv_lens = kv_lens.to(torch.int64)[:, None]
    row_lo = torch.arange(0, q_blocks_per_seq * block_m, block_m, device=q_lens.device,
                          dtype=torch.int64)
    row_hi = torch.minimum(row_lo + block_m, q_lens) - 1  # [B, blocks]
    kv_lo, first_col, kv_hi = 0, 0, kv_lens
    if causal:
        kv_hi = torch.minimum(kv_hi, row_hi + (kv_lens - q_lens + 1))
    if window is not None:
        kv_lo = (row_lo - window).clamp_(min=0)
        first_col = kv_lo - kv_lo % block_n
        kv_hi = torch.minimum(kv_hi, row_hi + (window + 1))
    tiles = (kv_hi - first_col + (block_n - 1)).div_(block_n, rounding_mode="floor")
    tiles = torch.where(kv_hi > kv_lo, tiles, 0)
    return torch.where(row_lo < q_lens, tiles, -1)


def build_tile_schedule(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, *, max_seq_len_q: int,
                        block_m: int, block_n: int, causal: bool, window: int | None,
                        broadcast_q: bool, host_q_offsets=None,
                        host_kv_offsets=None) -> TileSchedule:
    """Tile list for one launch, without a GPU->CPU synchronization (cached; see the module doc).

    With broadcast_q, `q_offsets` is `[0, q_len]` and `max_seq_len_q` is q_len. Passing the offsets
    also as host sequences (`host_q_offsets`, `host_kv_offsets`: lists or CPU tensors) builds the
    list on the CPU and copies it over, which skips the device ops when the caller has them anyway.
    """
    key = (max_seq_len_q, block_m, block_n, causal, window, broadcast_q)
    cached = _cache_lookup(q_offsets, kv_offsets, key)
    if cached is not None:
        return cached
    q_blocks_per_seq = max(1, -(-max_seq_len_q // block_m))
    device = kv_offsets.device
    if host_kv_offsets is not None:
        qo = torch.as_tensor(host_q_offsets, dtype=torch.int64)
        ko = torch.as_tensor(host_kv_offsets, dtype=torch.int64)
    else:
        qo, ko = q_offsets, kv_offsets
    kv_lens = ko[1:] - ko[:-1]
    q_lens = (torch.full_like(kv_lens, max_seq_len_q) if broadcast_q else qo[1:] - qo[:-1])
    work = kv_tiles_per_entry(q_lens, kv_lens, q_blocks_per_seq, block_m=block_m, block_n=block_n,
                              causal=causal, window=window)
    order = torch.argsort(work.reshape(-1), descending=True, stable=True)
    num_entries = (work >= 0).sum().reshape(1)
    schedule = TileSchedule(entries=_to_device(order.to(torch.int32), device),
                            num_entries=_to_device(num_entries.to(torch.int32), device),
                            q_blocks_per_seq=q_blocks_per_seq, max_entries=work.numel())
    _cache_store(q_offsets, kv_offsets, key, schedule)
    return schedule


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
