"""Block-sparse jagged attention: each 128-row query block attends only to the key blocks it selects.

The selection is the reference's (`reference.block_sparse_attention_ref`): `kv_block_idx` int
`[B, Hq, n_q_blocks, max_sel]`; entry `[b, h, i, :]` lists the sequence-local key blocks (block j =
keys `j*block_n .. (j+1)*block_n - 1`) that query block i of sequence b and head h sees, padded with
-1. Picks past a sequence's keys are ignored and a repeated pick counts once. `causal` masks further
inside the selection.

On a Hopper GPU the jagged kernels run with the block-sparse fork (`jfa.kernels.forks.block_sparse`):
the same warp roles, rings, softmax and epilogues; only the iteration changes. The forward and the
dQ kernel visit a query block's n-th selected key block instead of its n-th consecutive one, and the
dK/dV kernel streams, past each key block, only the query blocks that selected it
(`transposed_selection`). The kernels want each list sorted, distinct and in range, so
`canonical_selection` makes it so on the selection's device: two sorts and a comparison, no host
sync. Where the kernels cannot run, the PyTorch reference does (and says so once with a
`ReferenceFallbackWarning`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from jfa import dispatch, jagged, reference, specs

__all__ = ["block_sparse_attention", "block_sparse_attention_fwd", "block_sparse_attention_bwd",
           "validate_block_sparse_attention",
           "canonical_selection", "transposed_selection", "BlockSelection"]

SELECTION_DTYPES = (torch.int32, torch.int64)
_NOT_PICKED = torch.iinfo(torch.int32).max  # sorts after every real block number


@dataclass(frozen=True)
class BlockSelection:
    """A selection as the kernels read it: per (sequence, head, row block) a list of distinct blocks
    in ascending order, then zeros; `counts` says how many are real. The forward's rows are query
    blocks listing key blocks; its transpose (`transposed_selection`) lists, per key block, the
    query blocks that selected it."""
    blocks: Tensor  # int32 [B, Hq, row_blocks, width], width a power of two
    counts: Tensor  # int32 [B, Hq, row_blocks]

    @property
    def width(self) -> int:
        return self.blocks.shape[-1]

    @property
    def row_blocks(self) -> int:
        return self.blocks.shape[2]


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def canonical_selection(kv_block_idx: Tensor, kv_offsets: Tensor, block_n: int) -> BlockSelection:
    """Sort each row of `kv_block_idx`, drop -1 padding, picks past the sequence and repeats.

    Runs on kv_block_idx's device without reading values back (kv_offsets may be on the CPU).
    """
    idx = kv_block_idx.to(torch.int64)
    lengths = (kv_offsets[1:] - kv_offsets[:-1]).to(device=idx.device, dtype=torch.int64)
    key_blocks = (lengths + block_n - 1) // block_n
    in_range = (idx >= 0) & (idx < key_blocks[:, None, None, None])
    picked, _ = torch.where(in_range, idx, _NOT_PICKED).sort(dim=-1)
    repeat = torch.zeros_like(in_range)
    repeat[..., 1:] = picked[..., 1:] == picked[..., :-1]
    picked, _ = torch.where(repeat, _NOT_PICKED, picked).sort(dim=-1)
    real = picked != _NOT_PICKED
    blocks = torch.zeros(*idx.shape[:-1], _power_of_two_at_least(idx.shape[-1]), dtype=torch.int32,
                         device=idx.device)
    blocks[..., :idx.shape[-1]] = torch.where(real, picked, 0)
    return BlockSelection(blocks, real.sum(dim=-1, dtype=torch.int32))


def transposed_selection(selection: BlockSelection, key_blocks: int) -> BlockSelection:
    """Per (sequence, head, key block < key_blocks): the query blocks that selected it, ascending,
    for the backward's key-stationary kernel. On the selection's device, no host sync."""
    batch, heads, q_blocks, width = selection.blocks.shape
    device = selection.blocks.device
    picked = torch.arange(width, device=device) < selection.counts[..., None]
    chosen = torch.zeros(batch, heads, q_blocks, key_blocks + 1, dtype=torch.bool, device=device)
    # Padding entries land in a spare last column, dropped below.
    chosen.scatter_(3, torch.where(picked, selection.blocks.long(), key_blocks), True)
    by_key = chosen[..., :key_blocks].transpose(2, 3)  # [B, Hq, key_blocks, q_blocks]
    order = torch.where(by_key, torch.arange(q_blocks, device=device), q_blocks).sort(dim=-1).values
    blocks = torch.zeros(batch, heads, key_blocks, _power_of_two_at_least(q_blocks), dtype=torch.int32,
                         device=device)
    blocks[..., :q_blocks] = torch.where(order < q_blocks, order, 0)
    return BlockSelection(blocks, by_key.sum(dim=-1, dtype=torch.int32))


# ---- validation ---------------------------------------------------------------------------------

def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}: must be > 0, got {value}")
    return value


def _check_selection(kv_block_idx, problem: jagged.JaggedProblem, q: Tensor, block_m: int) -> None:
    if not isinstance(kv_block_idx, torch.Tensor):
        raise TypeError(f"kv_block_idx: expected an integer torch.Tensor, got {type(kv_block_idx).__name__}")
    if kv_block_idx.dtype not in SELECTION_DTYPES:
        raise TypeError(f"kv_block_idx: dtype {kv_block_idx.dtype} is not an index type; use .to(torch.int32)")
    if kv_block_idx.device != q.device and kv_block_idx.device.type != "cpu":
        raise ValueError(f"kv_block_idx: is on {kv_block_idx.device} but q is on {q.device}; move it there")
    q_blocks = math.ceil(problem.max_seq_len_q / block_m)
    expected = (problem.batch, problem.heads_q)
    if kv_block_idx.ndim != 4 or tuple(kv_block_idx.shape[:2]) != expected or kv_block_idx.shape[2] < q_blocks:
        raise ValueError(f"kv_block_idx: expected shape [B={expected[0]}, Hq={expected[1]}, n_q_blocks>={q_blocks}, "
                         f"max_sel], got {tuple(kv_block_idx.shape)}; pad unused picks with -1")


def validate_block_sparse_attention(q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n,
                                    max_seq_len_q=None, max_seq_len_kv=None, *, sm_scale=None,
                                    causal=False) -> jagged.JaggedProblem:
    """Check a `block_sparse_attention` call (raises naming the argument); reads the offsets once."""
    problem = jagged.validate_jagged_attention(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv,
                                               sm_scale=sm_scale, causal=causal)
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    _check_selection(kv_block_idx, problem, q, block_m)
    return problem


# ---- the custom op --------------------------------------------------------------------------------

def _reference_fwd(q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n, sm_scale, causal):
    out, lse = reference.block_sparse_attention_ref(q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n,
                                                    sm_scale=sm_scale, causal=causal)
    return out.to(q.dtype), lse.to(torch.float32)


@torch.library.custom_op("jfa::block_sparse_attention_fwd", mutates_args=())
def block_sparse_attention_fwd(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                               kv_block_idx: Tensor, block_m: int, block_n: int, max_seq_len_q: int,
                               max_seq_len_kv: int, sm_scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Block-sparse forward -> (out [Tq, Hq, D] in q's dtype, lse float32 [Hq, Tq]); inputs validated.
    This default implementation is the reference."""
    dispatch.warn_fallback(f"block-sparse: q is on {q.device.type}, the TLX kernels need a CUDA (sm_90) GPU")
    return _reference_fwd(q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n, sm_scale, causal)


@block_sparse_attention_fwd.register_kernel("cuda")
def _block_sparse_attention_fwd_cuda(q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n, max_seq_len_q,
                                     max_seq_len_kv, sm_scale, causal):
    why = _why_not_sparse_kernel(dispatch.FORWARD_KERNEL, block_m, block_n, q, k, v)
    if why is not None:
        dispatch.warn_fallback(f"block-sparse: {why}")
        return _reference_fwd(q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n, sm_scale, causal)
    runner, _ = dispatch.load_runner()
    q_offsets, kv_offsets, selection = _kernel_inputs(q, q_offsets, kv_offsets, kv_block_idx, block_n)
    return runner.forward(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, causal, None, False,
                          fork=_fork_call(runner, selection, None, q.shape[1]))


@block_sparse_attention_fwd.register_fake
def _block_sparse_attention_fwd_fake(q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n,
                                     max_seq_len_q, max_seq_len_kv, sm_scale, causal):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


def _why_not_sparse_kernel(module_name: str, block_m: int, block_n: int, *tensors: Tensor) -> str | None:
    why = dispatch.why_not_kernel(module_name, *tensors)
    if why is None and (block_m, block_n) != (specs.BLOCK_SPARSE_BLOCK,) * 2:
        why = (f"block-sparse blocks of {block_m}x{block_n}: the kernels' query and key tiles are "
               f"{specs.BLOCK_SPARSE_BLOCK}x{specs.BLOCK_SPARSE_BLOCK}")
    return why


def _fork_call(runner, selection: BlockSelection, by_key_block: BlockSelection | None, heads: int):
    """The block-sparse fork (`jfa.kernels.forks.block_sparse`) with the selection as its arguments: the
    forward's (and the dQ kernel's) by query block, the dK/dV kernel's by key block."""
    from jfa.kernels.forks.block_sparse import BLOCK_SPARSE_FORK, selection_params

    return runner.ForkCall(fork=BLOCK_SPARSE_FORK, forward_params=selection_params(selection, heads),
                           key_stationary_params=None if by_key_block is None else selection_params(by_key_block, heads),
                           base_tiles=True, block_sparse=True)


def _kernel_inputs(q, q_offsets, kv_offsets, kv_block_idx, block_n):
    """(q_offsets, kv_offsets, selection) as both kernels read them, on q's device, without a host wait."""
    q_offsets, kv_offsets = dispatch.kernel_offsets(q, q_offsets, kv_offsets)
    selection = canonical_selection(kv_block_idx.to(q.device, non_blocking=True), kv_offsets, block_n)
    return q_offsets, kv_offsets, selection


def _reference_bwd(grad_out, q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n, sm_scale, causal):
    grads = reference.block_sparse_attention_bwd_ref(grad_out, q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m,
                                                     block_n, sm_scale=sm_scale, causal=causal)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


@torch.library.custom_op("jfa::block_sparse_attention_bwd", mutates_args=())
def block_sparse_attention_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               q_offsets: Tensor, kv_offsets: Tensor, kv_block_idx: Tensor, block_m: int,
                               block_n: int, max_seq_len_q: int, max_seq_len_kv: int, sm_scale: float,
                               causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Block-sparse backward -> (dq, dk, dv) in the dtypes of q, k, v. This default implementation is
    the reference (`reference.block_sparse_attention_bwd_ref`)."""
    dispatch.warn_fallback(f"block-sparse backward: q is on {q.device.type}, the TLX kernels need a CUDA (sm_90) GPU")
    return _reference_bwd(grad_out, q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n, sm_scale, causal)


@block_sparse_attention_bwd.register_kernel("cuda")
def _block_sparse_attention_bwd_cuda(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, kv_block_idx, block_m,
                                     block_n, max_seq_len_q, max_seq_len_kv, sm_scale, causal):
    why = _why_not_sparse_kernel(dispatch.BACKWARD_KERNEL, block_m, block_n, q, k, v, grad_out)
    if why is not None:
        dispatch.warn_fallback(f"block-sparse backward: {why}")
        return _reference_bwd(grad_out, q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n, sm_scale,
                              causal)
    runner, _ = dispatch.load_runner()
    q_offsets, kv_offsets, selection = _kernel_inputs(q, q_offsets, kv_offsets, kv_block_idx, block_n)
    by_key_block = transposed_selection(selection, math.ceil(max_seq_len_kv / block_n))
    return runner.backward(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale,
                           causal, None, False, fork=_fork_call(runner, selection, by_key_block, q.shape[1]))


@block_sparse_attention_bwd.register_fake
def _block_sparse_attention_bwd_fake(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, kv_block_idx, block_m,
                                     block_n, max_seq_len_q, max_seq_len_kv, sm_scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, kv_offsets, kv_block_idx, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, kv_offsets, kv_block_idx)
    ctx.params = params  # block_m, block_n, max_seq_len_q, max_seq_len_kv, sm_scale, causal
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, q_offsets, kv_offsets, kv_block_idx = ctx.saved_tensors
    grads = block_sparse_attention_bwd(grad_out.contiguous(), q, k, v, out, lse, q_offsets, kv_offsets, kv_block_idx,
                                       *ctx.params)
    return tuple(grads) + (None,) * (3 + len(ctx.params))


torch.library.register_autograd("jfa::block_sparse_attention_fwd", _backward, setup_context=_setup_context)


# ---- public entry point ---------------------------------------------------------------------------

def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                           kv_block_idx: Tensor, block_m: int = specs.BLOCK_SPARSE_BLOCK,
                           block_n: int = specs.BLOCK_SPARSE_BLOCK, *, max_seq_len_q: int | None = None,
                           max_seq_len_kv: int | None = None, sm_scale: float | None = None,
                           causal: bool = False, return_lse: bool = False):
    """Jagged attention in which query block i of sequence b, head h sees only the key blocks
    `kv_block_idx[b, h, i]` lists (module docstring). q [Tq, Hq, D], k/v [Tk, Hkv, D] (GQA allowed),
    offsets int [B+1]. Returns out [Tq, Hq, D] (and lse float32 [Hq, Tq] when `return_lse`); rows
    that select nothing get 0 and LSE -inf. Differentiable in q, k, v. The TLX kernels run for
    128x128 blocks on a Hopper GPU; anything else runs the reference and says so.
    Validation reads the offsets (a sync when they live on the GPU).
    """
    problem = validate_block_sparse_attention(q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n,
                                              max_seq_len_q, max_seq_len_kv, sm_scale=sm_scale, causal=causal)
    out, lse = block_sparse_attention_fwd(q, k, v, q_offsets, kv_offsets, kv_block_idx, block_m, block_n,
                                          problem.max_seq_len_q, problem.max_seq_len_kv, problem.sm_scale, causal)
    return (out, lse) if return_lse else out
