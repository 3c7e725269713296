"""Every configuration choice of the jagged attention kernels, made in one place: `select`.

A call's `Shape` (what the host knows without a GPU sync: sizes, flags, bounds) decides, for each
jagged kernel of the call, its compile-time configuration: the forward's (`fwd_sm90.ForwardConfig`), the
dK/dV kernel's (`bwd_dkdv.DKDVConfig`) and, unless dQ is fused into that one, the dQ kernel's
(`bwd_dq.DQConfig`). Feature flags (head dim, causal, window, broadcast-Q, the fork) pass straight
through and multiply; the tunings below are few, and each says in one line what it buys. The
measurements behind them are in docs/decisions.md.

Block attention's configurations (`block_attention_forward` / `_backward`) follow from the head dim
and shared memory alone.

`reachable_configs()` enumerates what `select` can return, per kernel, for one dtype.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import NamedTuple

from jfa import specs
from jfa.kernels import block_attn
from jfa.kernels.bwd_dkdv import DQ_HANDOFF, DQ_NONE, DQ_RESIDENT, DQ_SPLIT, DKDVConfig
from jfa.kernels.bwd_dq import DQConfig
from jfa.kernels.fwd_sm90 import ForwardConfig
from jfa.kernels.tiles import ROWS_PER_CONSUMER

# ---- forward ----------------------------------------------------------------------------------------
# The base tiles: 128 keys per tile; at D=128 two K/V slots fill 192 of the 227 KB of shared memory,
# at D=64 three. 240 (232) consumer registers keep the key loop free of spills.
FWD_BASE = {128: dict(BLOCK_N=128, KV_BUFFERS=2, CONSUMERS=2, CONSUMER_REGISTERS=240),
            64: dict(BLOCK_N=128, KV_BUFFERS=3, CONSUMERS=2, CONSUMER_REGISTERS=232)}
# Short queries (every query sequence fits one consumer's 64 rows): two heads per tile, so the second
# consumer computes real rows instead of padding; the K/V ring carries both heads' tiles.
FWD_SHORT_QUERIES = {128: dict(BLOCK_N=64, KV_BUFFERS=2, CONSUMERS=2, CONSUMER_REGISTERS=232),
                     64: dict(BLOCK_N=128, KV_BUFFERS=2, CONSUMERS=2, CONSUMER_REGISTERS=232)}
# Short keys (at most SHORT_KEYS_MEAN per sequence on average): 64-key tiles in a 4-deep ring halve
# what of a tile does not overlap (GEM L=256-512 +4.5-8%).
FWD_SHORT_KEYS = {128: dict(BLOCK_N=64, KV_BUFFERS=4, CONSUMERS=2, CONSUMER_REGISTERS=240)}
SHORT_KEYS_MEAN = 384
# Long sequences at D=64 (queries and keys both average at least LONG_MEAN): three consumers of 64
# rows share each K/V tile (dense D=64 +15%).
FWD_LONG = {64: dict(BLOCK_N=128, KV_BUFFERS=3, CONSUMERS=3, CONSUMER_REGISTERS=160)}
LONG_MEAN = 1024
# Half last tiles when no key sequence is longer than this (GEM L=256 s=0.5 +8-9%; compiled in where
# no tile is partial it costs 1.5-2.6%).
HALF_TAIL_MAX_KEYS = 256
MIN_HALF_TILE_KEYS = 32  # a half tile is a wgmma's N, which starts at 32

# ---- dQ kernel --------------------------------------------------------------------------------------
# dQ holds the accumulator, S, dP and dS per consumer: 64-key tiles, and a K/V ring deep enough that a
# K slot, freed a step later than in the forward, never stalls the producer (1.03-1.14x over two
# slots); at D=128 one Q/dO slot pays for the depth.
DQ_BASE = {128: dict(BLOCK_N=64, KV_BUFFERS=4, Q_BUFFERS=1, CONSUMER_REGISTERS=240),
           64: dict(BLOCK_N=64, KV_BUFFERS=3, Q_BUFFERS=2, CONSUMER_REGISTERS=232)}
DQ_SHORT_QUERIES_BLOCK_N = {128: 32, 64: 64}  # two heads per tile double the ring's tiles
# Broadcast-Q's fp32 partials take 64 KB of layout-conversion scratch at D=128: three K/V slots fit.
DQ_PARTIALS_KV_BUFFERS = {128: 3}

# ---- dK/dV kernel -----------------------------------------------------------------------------------
# The base: 128-key tiles (64 per consumer), 64-row query blocks; a second K/V slot lets the next tile
# land while this one's last blocks run (6-10%). At D=64 the mask-free bulk loop pays (14-43%); at
# D=128 its extra loops made ptxas reload spilled values.
DKDV_BASE = {128: dict(BLOCK_M=64, BLOCK_N=128, Q_BUFFERS=2, KV_BUFFERS=2, CONSUMER_REGISTERS=240, MASK_FREE_BULK=False),
             64: dict(BLOCK_M=64, BLOCK_N=128, Q_BUFFERS=3, KV_BUFFERS=2, CONSUMER_REGISTERS=240, MASK_FREE_BULK=True)}
# Fused dQ where its fewer GEMMs pay, with broadcast-Q only where its per-program dQ copies do not
# outnumber the dQ kernel's per-sequence partials:
# - D=128, DQ_SPLIT: from a mean of 512 query rows per sequence (GEM L>=1024 1.05-1.08x, dense 1.08x;
#   shorter query streams give a key tile too few steps); its staging leaves room for one K/V slot;
# - D=64, DQ_HANDOFF: up to a mean of 4096 keys (1024 causal): dense D=64 1.05x over the dQ kernel.
FUSED = {128: dict(strategy=DQ_SPLIT.value, min_mean_queries=512, max_mean_keys=math.inf,
                   max_mean_keys_causal=math.inf, kv_buffers=1),
         64: dict(strategy=DQ_HANDOFF.value, min_mean_queries=0, max_mean_keys=4096, max_mean_keys_causal=1024,
                  kv_buffers=DKDV_BASE[64]["KV_BUFFERS"])}
# Broadcast-Q with one query block per key head (DQ_RESIDENT): dQ summed in registers, no adds
# (PMA q=64 1.40x at D=128); K, V and dO of the next tile land a tile ahead.
RESIDENT = {128: dict(KV_BUFFERS=2, V_BUFFERS=2, Q_BUFFERS=1)}


# ---- block attention -------------------------------------------------------------------------------
# One ring slot holds a unit's Q, K, V (and dO): the deepest ring that fits the shared memory, with the
# backward's P and dS staging beside it.
BLOCK_ATTENTION_CONSUMERS = 2
BLOCK_ATTENTION_SMEM_BYTES = 200 * 1024  # ring and staging within Hopper's 227 KiB, with room for the barriers
BLOCK_ATTENTION_MAX_RING_DEPTH = 4
BLOCK_ATTENTION_TILES_PER_SLOT = {"forward": 3, "backward": 4}  # Q, K, V (and dO)
BLOCK_ATTENTION_STAGING_TILES = 2  # P and dS, [64, 64] per consumer: the A operands of the transposed GEMMs


class Shape(NamedTuple):
    """What decides a call's configurations, all known on the host without a GPU sync."""

    head_dim: int
    q_heads: int
    kv_heads: int
    total_q: int  # packed query rows (the shared query's with broadcast-Q)
    total_kv: int
    num_seqs: int
    max_seq_len_q: int
    max_seq_len_kv: int
    causal: bool
    window: int | None
    broadcast_q: bool
    num_sms: int = specs.H200_SM_COUNT
    deterministic: bool = False
    base_tiles: bool = False  # a fork that takes the base tiles only (FP8, block-sparse)
    block_sparse: bool = False  # the iteration visits a selection's 128 x 128 blocks
    block_mask: bool = False  # a fork skips key tiles by a block-level mask (head by head, whole tiles)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernels' configurations for one call."""

    forward: ForwardConfig
    dkdv: DKDVConfig
    dq: DQConfig | None  # None: dQ is fused into the dK/dV kernel


# The batch that compile-only views configure the kernels for: GEM's B and heads, sequences of at most
# INSPECT_MAX_LEN rows averaging half of it (what a GEM s=0.5 batch looks like to `select`).
INSPECT_MAX_LEN = 1024


def gem_like_shape(head_dim: int = specs.GEM_HEAD_DIM, *, causal: bool = False, window: int | None = None,
                   broadcast_q: bool = False, max_len: int = INSPECT_MAX_LEN, heads: int = specs.GEM_HEADS,
                   **flags) -> Shape:
    """A GEM-like batch's `Shape` (specs.GEM_BATCH sequences of mean max_len / 2): what compile-only
    views (`Variant.kernel_specs`, `python -m jfa inspect`, the notebooks' compile reports) select for."""
    total = specs.GEM_BATCH * (max_len // 2)
    return Shape(head_dim=head_dim, q_heads=heads, kv_heads=heads, total_q=max_len if broadcast_q else total,
                 total_kv=total, num_seqs=specs.GEM_BATCH, max_seq_len_q=max_len, max_seq_len_kv=max_len,
                 causal=causal, window=window, broadcast_q=broadcast_q, **flags)


def _mean(total: int, seqs: int) -> float:
    return total / max(seqs, 1)


def _features(shape: Shape) -> dict:
    return dict(CAUSAL=bool(shape.causal), HAS_WINDOW=shape.window is not None, BROADCAST_Q=bool(shape.broadcast_q))


def heads_per_tile(shape: Shape) -> int:
    """2 when every query sequence fits one consumer's rows and the heads pair up (not with a fork whose
    iteration or block mask is per head), else 1."""
    paired = (shape.max_seq_len_q <= ROWS_PER_CONSUMER.value and shape.q_heads % 2 == 0
              and not (shape.base_tiles or shape.block_mask))
    return 2 if paired else 1


def forward_config(shape: Shape) -> ForwardConfig:
    """The forward kernel's configuration."""
    d = shape.head_dim
    pairs = heads_per_tile(shape)
    mean_q = shape.total_q if shape.broadcast_q else _mean(shape.total_q, shape.num_seqs)
    mean_kv = _mean(shape.total_kv, shape.num_seqs)
    plain = not (shape.base_tiles or shape.block_mask)
    if pairs == 2:
        tuning = FWD_SHORT_QUERIES[d]
    elif plain and d in FWD_LONG and min(mean_q, mean_kv) >= LONG_MEAN:
        tuning = FWD_LONG[d]
    elif plain and d in FWD_SHORT_KEYS and mean_kv <= SHORT_KEYS_MEAN:
        tuning = FWD_SHORT_KEYS[d]
    else:
        tuning = FWD_BASE[d]
    half_tail = (plain and pairs == 1 and shape.max_seq_len_kv <= HALF_TAIL_MAX_KEYS
                 and tuning["BLOCK_N"] // 2 >= MIN_HALF_TILE_KEYS)
    return ForwardConfig(HEAD_DIM=d, HEADS_PER_TILE=pairs, HALF_TAIL=half_tail, **tuning, **_features(shape))


def dq_config(shape: Shape) -> DQConfig:
    """The dQ kernel's configuration."""
    d = shape.head_dim
    pairs = heads_per_tile(shape)
    tuning = dict(DQ_BASE[d])
    if pairs == 2:
        tuning["BLOCK_N"] = DQ_SHORT_QUERIES_BLOCK_N[d]
    if shape.broadcast_q:
        tuning["KV_BUFFERS"] = DQ_PARTIALS_KV_BUFFERS.get(d, tuning["KV_BUFFERS"])
    plain = not (shape.base_tiles or shape.block_mask)
    half_tail = (plain and shape.max_seq_len_kv <= HALF_TAIL_MAX_KEYS
                 and tuning["BLOCK_N"] // 2 >= MIN_HALF_TILE_KEYS)
    return DQConfig(HEAD_DIM=d, HEADS_PER_TILE=pairs, HALF_TAIL=half_tail, **tuning, **_features(shape))


def dq_strategy(shape: Shape) -> int:
    """How dQ is formed for this call: DQ_NONE (the dQ kernel), DQ_RESIDENT, or the head dim's fused mode."""
    if shape.block_sparse or shape.block_mask:
        # Forks that skip query blocks take the dQ kernel: DQ_SPLIT loads the next query block's LSE and
        # Delta a step ahead, which a skipped block would misalign.
        return DQ_NONE.value
    one_block = _resident_applies(shape)
    if shape.broadcast_q and shape.num_sms > shape.num_seqs:
        return DQ_NONE.value  # a fused mode's dQ copy per program would outnumber the per-sequence partials
    if one_block:  # deterministic as well: each program stores its dQ once
        return DQ_RESIDENT.value
    fused = FUSED[shape.head_dim]
    mean_queries = math.inf if shape.broadcast_q else _mean(shape.total_q, shape.num_seqs)
    max_mean_keys = fused["max_mean_keys_causal" if shape.causal else "max_mean_keys"]
    if (shape.deterministic or mean_queries < fused["min_mean_queries"]
            or _mean(shape.total_kv, shape.num_seqs) > max_mean_keys):
        return DQ_NONE.value
    return fused["strategy"]


def _resident_applies(shape: Shape) -> bool:
    """DQ_RESIDENT's condition: broadcast-Q of one query block, one query head per key head."""
    return (shape.broadcast_q and shape.total_q <= DKDV_BASE[shape.head_dim]["BLOCK_M"]
            and shape.q_heads == shape.kv_heads and shape.head_dim in RESIDENT)


def check_dq_strategy(shape: Shape, strategy: int) -> None:
    """Raise ValueError unless the dK/dV kernel can form dQ this way for this call (a forced strategy)."""
    names = {DQ_NONE.value: "DQ_NONE", DQ_SPLIT.value: "DQ_SPLIT", DQ_HANDOFF.value: "DQ_HANDOFF",
             DQ_RESIDENT.value: "DQ_RESIDENT"}
    if strategy not in names:
        raise ValueError(f"dq_strategy: one of bwd_dkdv's {sorted(names.values())} values, got {strategy!r}")
    if strategy == DQ_NONE.value:
        return
    name = names[strategy]
    if shape.block_sparse or shape.block_mask:
        raise ValueError(f"dq_strategy: a fork that skips query blocks takes the dQ kernel (DQ_NONE), not {name}")
    if strategy == DQ_HANDOFF.value and shape.head_dim != 64:
        raise ValueError(f"dq_strategy: DQ_HANDOFF's stages fit shared memory at head dim 64 only, not {shape.head_dim}")
    if strategy == DQ_RESIDENT.value and not _resident_applies(shape):
        raise ValueError("dq_strategy: DQ_RESIDENT needs broadcast-Q of one query block, one query head per key "
                         f"head and a head dim in {sorted(RESIDENT)}")


def dkdv_config(shape: Shape, strategy: int) -> DKDVConfig:
    """The dK/dV kernel's configuration for a dQ strategy."""
    d = shape.head_dim
    tuning = dict(DKDV_BASE[d])
    tuning["V_BUFFERS"] = tuning["KV_BUFFERS"]
    # The mask-free bulk is a range of consecutive query blocks; a selection's blocks are not.
    tuning["MASK_FREE_BULK"] = tuning["MASK_FREE_BULK"] and not shape.block_sparse
    early_v = False
    if strategy in (DQ_SPLIT.value, DQ_HANDOFF.value):
        tuning["KV_BUFFERS"] = tuning["V_BUFFERS"] = FUSED[d]["kv_buffers"]
        # One K/V slot: V's own barrier lets the next tile's V land under the last step (PMA 1.04-1.07x;
        # a tile of self-attention runs enough steps to hide it).
        early_v = bool(shape.broadcast_q) and strategy == DQ_SPLIT.value
    elif strategy == DQ_RESIDENT.value:
        tuning.update(RESIDENT[d])
        early_v = True
    return DKDVConfig(HEAD_DIM=d, DQ=strategy, EARLY_V_RELEASE=early_v, **tuning, **_features(shape))


def select(shape: Shape) -> Plan:
    """Every kernel's configuration for a call of this shape."""
    strategy = dq_strategy(shape)
    return Plan(forward=forward_config(shape), dkdv=dkdv_config(shape, strategy),
                dq=dq_config(shape) if strategy == DQ_NONE.value else None)


def _block_attention_ring_depth(head_dim: int, tiles_per_slot: int, staging_bytes: int = 0, elem_bytes: int = 2) -> int:
    slot_bytes = tiles_per_slot * specs.BLOCK_ATTENTION_BLOCK * head_dim * elem_bytes
    return max(1, min(BLOCK_ATTENTION_MAX_RING_DEPTH, (BLOCK_ATTENTION_SMEM_BYTES - staging_bytes) // slot_bytes))


def block_attention_forward(head_dim: int, group: int = 1) -> block_attn.ForwardConfig:
    """Block attention's forward configuration for one head dim and GQA group."""
    depth = _block_attention_ring_depth(head_dim, BLOCK_ATTENTION_TILES_PER_SLOT["forward"])
    return block_attn.ForwardConfig(HEAD_DIM=head_dim, GROUP=group, RING_DEPTH=depth,
                                    CONSUMERS=BLOCK_ATTENTION_CONSUMERS)


def block_attention_backward(head_dim: int, group: int = 1, rotary: bool = False) -> block_attn.BackwardConfig:
    """Block attention's backward configuration, with or without the rotary epilogue."""
    staging = BLOCK_ATTENTION_CONSUMERS * BLOCK_ATTENTION_STAGING_TILES * specs.BLOCK_ATTENTION_BLOCK ** 2 * 2
    depth = _block_attention_ring_depth(head_dim, BLOCK_ATTENTION_TILES_PER_SLOT["backward"], staging)
    return block_attn.BackwardConfig(HEAD_DIM=head_dim, GROUP=group, RING_DEPTH=depth,
                                     CONSUMERS=BLOCK_ATTENTION_CONSUMERS, ROTARY=bool(rotary))


def reachable_configs() -> dict[str, set]:
    """The configurations `select` returns over the shapes that tell its choices apart, per kernel
    (one dtype: the dtype is a kernel argument's type, not part of these)."""
    seen = {"forward": set(), "dq": set(), "dkdv": set()}
    # (mean, longest) rows per sequence on each side: on both sides of every bound above
    queries = ((32, 32), (200, 200), (512, 4096), (1024, 1024), (4096, 4096))
    keys = ((100, 100), (200, 200), (300, 512), (512, 512), (1024, 1024), (2048, 4096), (8192, 8192))
    for d, causal, window, bq, (mean_q, max_q), (mean_kv, max_kv), seqs, det, sparse in itertools.product(
            specs.SUPPORTED_HEAD_DIMS, (False, True), (None, 8), (False, True), queries, keys, (4, 1152),
            (False, True), (False, True)):
        if sparse and (bq or window is not None):
            continue
        shape = Shape(head_dim=d, q_heads=4, kv_heads=4, total_q=max_q if bq else mean_q * seqs,
                      total_kv=mean_kv * seqs, num_seqs=seqs, max_seq_len_q=max_q, max_seq_len_kv=max_kv,
                      causal=causal, window=window, broadcast_q=bq, deterministic=det, base_tiles=sparse,
                      block_sparse=sparse)
        plan = select(shape)
        seen["forward"].add(plan.forward)
        seen["dkdv"].add(plan.dkdv)
        if plan.dq is not None:
            seen["dq"].add(plan.dq)
    return seen
