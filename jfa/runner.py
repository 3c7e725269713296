"""How one jagged attention call runs on a Hopper GPU: its plan, tile lists, buffers and launches.

Every entry point that runs the jagged kernels (`jfa.jagged_attention`, block-sparse, FP8, user
variants) comes through `forward` and `backward`, with the fork that says what it changes and the
fork's runtime arguments. Inputs are validated already, contiguous, with int32 offsets on q's device.

Forward: the configuration (`jfa.configs.select`), the query-tile list (`jfa.schedule`), the
persistent grid, one launch of `fwd_sm90`. Backward: Delta = rowsum(O * dO) (`bwd_delta`), the
dK/dV kernel over the key-tile list, and dQ from the dQ kernel over the query-tile list, or fused
into the dK/dV kernel; copies of the shared query's dQ (broadcast-Q) summed in a fixed order.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from jfa import configs, schedule, specs
from jfa.kernels import bwd_delta, bwd_dkdv, bwd_dq, fwd_sm90
from jfa.kernels.bwd_dkdv import CONSUMERS, DQ_NONE, DQ_RESIDENT
from jfa.kernels.hooks import DEFAULT_FORK
from jfa.kernels.softmax import LOG2E
from jfa.kernels.tiles import num_sms, persistent_programs


class ForkCall(NamedTuple):
    """A fork as one call runs it: its hooks, its runtime arguments per kernel, what it asks of the tiles."""

    fork: object = DEFAULT_FORK
    forward_params: object = None  # the forward's and the dQ kernel's
    key_stationary_params: object = None  # the dK/dV kernel's
    base_tiles: bool = False  # FP8, block-sparse: the base tiles only
    block_sparse: bool = False
    block_mask: bool = False


PLAIN = ForkCall()


def call_shape(q, k, kv_offsets, max_seq_len_q, max_seq_len_kv, causal, window, broadcast_q, *, deterministic=False,
               fork: ForkCall = PLAIN) -> configs.Shape:
    """The `configs.Shape` of a validated call (sizes from the tensors: no GPU sync)."""
    return configs.Shape(head_dim=q.shape[2], q_heads=q.shape[1], kv_heads=k.shape[1], total_q=q.shape[0],
                         total_kv=k.shape[0], num_seqs=kv_offsets.numel() - 1, max_seq_len_q=max_seq_len_q,
                         max_seq_len_kv=max_seq_len_kv, causal=bool(causal), window=window,
                         broadcast_q=bool(broadcast_q), num_sms=num_sms(q.device), deterministic=deterministic,
                         base_tiles=fork.base_tiles, block_sparse=fork.block_sparse, block_mask=fork.block_mask)


def _query_tiles(q_offsets, kv_offsets, shape: configs.Shape, rows: int, block_n: int):
    return schedule.build_tile_schedule(q_offsets, kv_offsets, max_seq_len_q=shape.max_seq_len_q, block_m=rows,
                                        block_n=block_n, causal=shape.causal, window=shape.window,
                                        broadcast_q=shape.broadcast_q, max_seq_len_kv=shape.max_seq_len_kv)


def forward(q, k, v, q_offsets, kv_offsets, max_seq_len_q: int, max_seq_len_kv: int, sm_scale: float | None, causal,
            window, broadcast_q, *, out=None, lse=None, fork: ForkCall = PLAIN, qk_descale: float = 1.0,
            out_dtype=None):
    """(out `[Tq_out, Hq, D]`, lse fp32 `[Hq, Tq_out]`) of the forward kernel.

    `out` and `lse` may be given (contiguous rows; lse's head stride is free), so tests can poison them
    and check that only valid rows are written. `qk_descale` multiplies the scores' scale (FP8's q and k
    scales); a 2-D `v` is the FP8 fork's transposed V (`jfa.kernels.forks.fp8.transposed_values`);
    `out_dtype` defaults to q's.
    """
    num_seqs = kv_offsets.numel() - 1
    q_heads, head_dim = q.shape[1], q.shape[2]
    out_rows = num_seqs * q.shape[0] if broadcast_q else q.shape[0]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    if out is None:
        out = torch.empty((out_rows, q_heads, head_dim), dtype=out_dtype or q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((q_heads, out_rows), dtype=torch.float32, device=q.device)
    if out_rows == 0:
        return out, lse
    if k.shape[0] == 0:  # no keys anywhere (a zero-row TMA view is invalid)
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    shape = call_shape(q, k, kv_offsets, max_seq_len_q, max_seq_len_kv, causal, window, broadcast_q, fork=fork)
    config = configs.forward_config(shape)
    tiles = _query_tiles(q_offsets, kv_offsets, shape, fwd_sm90.tile_rows(config), config.BLOCK_N)
    programs = persistent_programs(shape.num_sms, tiles.max_entries * (q_heads // config.HEADS_PER_TILE))
    desc_v = transposed_value_descriptor(v, head_dim, config.BLOCK_N) if v.ndim == 2 else None
    fwd_sm90.launch(q, k, v, out, lse, q_offsets, kv_offsets, tiles, config, programs=programs,
                    qk_scale_log2=sm_scale * qk_descale * LOG2E.value, window=window, fork=fork.fork,
                    fork_params=fork.forward_params, desc_v=desc_v)
    return out, lse


def backward(dout, q, k, v, out, lse, q_offsets, kv_offsets, max_seq_len_q: int, max_seq_len_kv: int,
             sm_scale: float | None, causal, window, broadcast_q, *, deterministic=False, grads=None,
             fork: ForkCall = PLAIN, dq_strategy: int | None = None):
    """(dq, dk, dv) in the dtypes of q, k, v; `out`, `lse` are the forward's.

    `grads` may give the (dq, dk, dv) buffers to fill, so tests can poison them. `dq_strategy`
    (bwd_dkdv's DQ_*) replaces the configured one where the kernel can run it (`configs.check_dq_strategy`:
    DQ_SPLIT at either head dim, DQ_HANDOFF at 64, DQ_RESIDENT where it applies, none but DQ_NONE for
    forks that skip query blocks).
    `deterministic=True` makes every gradient bitwise repeatable: dQ by the dQ kernel, or by
    DQ_RESIDENT's fixed-order sum.
    """
    num_seqs = kv_offsets.numel() - 1
    q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    if grads is None:
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    dq, dk, dv = grads
    if q.shape[0] == 0 or k.shape[0] == 0 or num_seqs == 0:  # no scores anywhere, no gradient
        for g in grads:
            g.zero_()
        return dq, dk, dv
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    qk_scale_log2 = sm_scale * LOG2E.value
    shape = call_shape(q, k, kv_offsets, max_seq_len_q, max_seq_len_kv, causal, window, broadcast_q,
                       deterministic=deterministic, fork=fork)
    if dq_strategy is None:
        strategy = configs.dq_strategy(shape)
    else:
        configs.check_dq_strategy(shape, dq_strategy)
        strategy = dq_strategy
    config = configs.dkdv_config(shape, strategy)
    delta = bwd_delta.compute_delta(out, dout)
    key_tiles = schedule.build_kv_tile_schedule(q_offsets, kv_offsets, max_seq_len_kv=max_seq_len_kv,
                                                broadcast_q_len=q.shape[0] if broadcast_q else 0,
                                                block_m=config.BLOCK_M, block_n=config.BLOCK_N, causal=causal,
                                                window=window, max_seq_len_q=max_seq_len_q)
    programs = dkdv_programs(strategy, shape.num_sms, key_tiles.max_entries, kv_heads)
    fused = strategy != DQ_NONE.value
    copies = programs if (broadcast_q and fused) else 1  # one fp32 dQ per program with broadcast-Q
    if strategy == DQ_RESIDENT.value:  # each consumer of each program writes its [BLOCK_M, D] dQ once, whole
        dq_accum = torch.empty((programs * CONSUMERS.value, config.BLOCK_M, 1, head_dim), dtype=torch.float32,
                               device=q.device)
        partial_rows = CONSUMERS.value * config.BLOCK_M
    elif fused:
        dq_accum = torch.zeros((copies, q.shape[0], q_heads, head_dim), dtype=torch.float32, device=q.device)
        partial_rows = q.shape[0] if copies > 1 else 0
    else:  # the dQ kernel's; the dK/dV kernel's TMA view needs one box to exist
        dq_accum = torch.empty((1, config.BLOCK_M, 1, head_dim), dtype=torch.float32, device=q.device)
        partial_rows = 0
    bwd_dkdv.launch(dout, q, k, v, lse, delta, dk, dv, dq_accum, q_offsets, kv_offsets, key_tiles, config,
                    programs=programs, sm_scale=sm_scale, qk_scale_log2=qk_scale_log2, window=window,
                    dq_partial_rows=partial_rows, fork=fork.fork, fork_params=fork.key_stationary_params)
    if strategy == DQ_RESIDENT.value:
        per_head = dq_accum.view(programs // kv_heads, kv_heads, CONSUMERS.value, config.BLOCK_M, head_dim)
        dq.copy_(per_head[:, :, :, :q.shape[0]].sum((0, 2)).transpose(0, 1))
    elif fused:
        dq.copy_(dq_accum.sum(0) if copies > 1 else dq_accum[0])
    else:
        _dq_by_kernel(dout, q, k, v, lse, delta, dq, q_offsets, kv_offsets, shape, sm_scale, qk_scale_log2, fork)
    return dq, dk, dv


def dkdv_programs(strategy: int, num_sms: int, tiles_per_head: int, kv_heads: int) -> int:
    """The dK/dV kernel's persistent grid. Under DQ_RESIDENT program p takes the tiles p, p + grid, ...:
    all of key head p % kv_heads, so its grid is a multiple of the key heads, at least one program each."""
    max_tiles = tiles_per_head * kv_heads
    if strategy == DQ_RESIDENT.value:
        return max(kv_heads, min(num_sms, max_tiles) // kv_heads * kv_heads)
    return persistent_programs(num_sms, max_tiles)


def _dq_by_kernel(dout, q, k, v, lse, delta, dq, q_offsets, kv_offsets, shape, sm_scale, qk_scale_log2, fork):
    """dQ by the dQ kernel; with broadcast-Q into one fp32 partial per sequence, summed in a fixed order."""
    config = configs.dq_config(shape)
    tiles = _query_tiles(q_offsets, kv_offsets, shape, bwd_dq.tile_rows(config), config.BLOCK_N)
    programs = persistent_programs(shape.num_sms, tiles.max_entries * (shape.q_heads // config.HEADS_PER_TILE))
    if shape.broadcast_q:
        target = torch.empty((shape.num_seqs, q.shape[0], shape.q_heads, shape.head_dim), dtype=torch.float32,
                             device=q.device)
    else:
        target = dq
    bwd_dq.launch(dout, q, k, v, lse, delta, target.flatten(0, 1) if shape.broadcast_q else target, q_offsets,
                  kv_offsets, tiles, config, programs=programs, sm_scale=sm_scale, qk_scale_log2=qk_scale_log2,
                  window=shape.window, fork=fork.fork, fork_params=fork.forward_params)
    if shape.broadcast_q:
        dq.copy_(target.sum(0))


def transposed_value_descriptor(v_t: torch.Tensor, head_dim: int, block_n: int) -> TensorDescriptor:
    """The TMA view of the FP8 fork's transposed V `[Hkv*D, width]`: boxes of D channels x BLOCK_N keys."""
    return TensorDescriptor(v_t, shape=list(v_t.shape), strides=[v_t.shape[1], 1], block_shape=[head_dim, block_n])

