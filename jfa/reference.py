"""Pure-PyTorch references: the specification every kernel is tested against.

Each function computes in float32 (float64 when given float64, so tests can check the references
themselves), runs on any device and is differentiable with autograd, which makes it the backward
reference too. With `upcast=False` the jagged and block-sparse references compute in the inputs' own
dtype instead, as a PyTorch model would: their error is the baseline of the gpu tests' gradient
bound (`specs.GRAD_BASELINE_FACTOR`). The semantics are those of `docs/CONTRACTS.md`; where a choice
had to be made it is written in the docstring. The jagged reference is also the CPU fallback of
`jfa.jagged_attention`, so it loops over sequences with one batched matmul per sequence (never a
padded `[B, L, L]` score tensor, which would not fit for the GEM-like shapes).
"""
from __future__ import annotations

import functools
import math

import torch

from jfa import specs
from jfa.kernels import masks
from jfa.kernels.twin import torch_twin

__all__ = [
    "jagged_attention_ref",
    "jagged_attention_bwd_ref",
    "block_attention_ref",
    "block_sparse_attention_ref",
    "block_sparse_attention_bwd_ref",
    "rotary_ref",
    "rotary_conj_ref",
    "make_sinu_pos",
    "fused_projection_rotary_block_attention_ref",
    "fp8_quantize_per_tensor",
    "fp8_quantize_per_block",
    "fp8_dequantize_per_block",
    "mx_quantize",
    "mx_dequantize",
    "fp8_agreement",
]

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# E4M3's largest power of two is 2**8: an MX block scaled by 2**(floor(log2(amax)) - 8) fits E4M3.
E4M3_EMAX = 8
# E8M0 stores a bare exponent with bias 127; 255 is NaN, so the usable exponents are -127..127.
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


def _compute_dtype(*tensors: torch.Tensor, upcast: bool = True) -> torch.dtype:
    """float64 if any input is float64 (for checking the references), else float32; the first input's
    own dtype where `upcast` is False."""
    if not upcast:
        return tensors[0].dtype
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _host_list(offsets: torch.Tensor) -> list[int]:
    """Offsets as Python ints: one device-to-host copy, done once per call."""
    return [int(x) for x in offsets.tolist()]


def visible_mask(lq: int, lk: int, causal: bool, window: int | None, device="cpu") -> torch.Tensor:
    """Boolean [lq, lk] mask of the keys each query sees (sequence-local positions): the kernels'
    own definition (`jfa.kernels.masks.visible`) run on torch tensors.

    causal is bottom-right aligned (key j visible iff j <= i + lk - lq, FlashAttention's convention);
    the window is the seed's symmetric band |i - j| <= W on top-left positions.
    """
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    visible = torch_twin(masks.visible)(i, j, lq, lk, 0 if window is None else window, causal, window is not None)
    return visible.expand(lq, lk)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                      sm_scale: float, score_mod=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [H, lq, D] over k, v [H, lk, D] (already head-expanded).

    `visible` broadcasts to [H, lq, lk]; `score_mod(scores)` modifies the scaled scores first.
    Returns out [H, lq, D] and lse [H, lq]. P is formed as exp(S - LSE), as the kernels do, with LSE
    replaced by 0 on rows that see no key: those rows get P = 0, hence output 0 and LSE -inf,
    without a NaN in the forward or the backward.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * sm_scale
    if score_mod is not None:
        scores = score_mod(scores).to(scores.dtype)  # a hook's fp32 parameters do not promote the scores
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    lse_finite = lse.masked_fill(torch.isinf(lse), 0.0)
    probs = torch.exp(scores - lse_finite[..., None])
    return torch.matmul(probs, v), lse


def _positions(heads: int, lq: int, lk: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(head [H, 1, 1], query position [1, lq, 1], key position [1, 1, lk]): a variant's hook arguments."""
    return (torch.arange(heads, device=device)[:, None, None], torch.arange(lq, device=device)[None, :, None],
            torch.arange(lk, device=device)[None, None, :])


def _expand_kv_heads(t: torch.Tensor, q_heads: int) -> torch.Tensor:
    """GQA: query head h reads KV head h // G, so KV head j is repeated G times in place."""
    group = q_heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def jagged_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                         kv_offsets: torch.Tensor, *, sm_scale: float | None = None, causal: bool = False,
                         window: int | None = None, broadcast_q: bool = False, score_mod=None, mask_mod=None,
                         upcast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged (variable-length) softmax attention; returns (out [Tq_out, Hq, D], lse [Hq, Tq_out]).

    q is [Tq, Hq, D], k and v [Tk, Hkv, D] with Hq = G*Hkv; offsets are [B+1] prefix sums. With
    `broadcast_q` the single query sequence (q_offsets == [0, q_len]) attends to each of the B KV
    sequences and batch b's output rows start at b*q_len. Inputs are not validated here (see
    `jfa.jagged.validate_jagged_attention`); offsets are read to the host once.

    A variant's hooks, as torch functions (`jfa.variants`): `score_mod(score, seq, head, q_idx, k_idx)`
    modifies the scaled scores and `mask_mod(seq, head, q_idx, k_idx)` hides pairs on top of causal
    and window; `head` is [H, 1, 1], `q_idx` [1, lq, 1], `k_idx` [1, 1, lk], `seq` an int.
    `upcast=False` computes in the inputs' dtype (module docstring).
    """
    dtype = _compute_dtype(q, k, v, upcast=upcast)
    q, k, v = q.to(dtype), _expand_kv_heads(k.to(dtype), q.shape[1]), _expand_kv_heads(v.to(dtype), q.shape[1])
    heads, head_dim = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    q_bounds, kv_bounds = _host_list(q_offsets), _host_list(kv_offsets)
    batch = len(kv_bounds) - 1
    if broadcast_q:
        q_bounds = [0] + [q_bounds[1]] * batch  # every batch reads the same query rows 0:q_len

    out_pieces, lse_pieces = [], []
    for b in range(batch):
        q_start, q_end = (0, q_bounds[b + 1]) if broadcast_q else (q_bounds[b], q_bounds[b + 1])
        kv_start, kv_end = kv_bounds[b], kv_bounds[b + 1]
        lq, lk = q_end - q_start, kv_end - kv_start
        # Empty sequences go through the same math (no key: P = 0, output 0, LSE -inf), so the output
        # stays in autograd's graph of q, k and v even where every piece is empty.
        visible = visible_mask(lq, lk, causal, window, q.device) if (causal or window is not None) else None
        seq_score_mod = None
        if score_mod is not None or mask_mod is not None:
            head_idx, q_idx, k_idx = _positions(heads, lq, lk, q.device)
            if mask_mod is not None:
                own = mask_mod(b, head_idx, q_idx, k_idx)
                visible = own if visible is None else visible & own
            if score_mod is not None:
                seq_score_mod = functools.partial(score_mod, seq=b, head=head_idx, q_idx=q_idx, k_idx=k_idx)
        out_seq, lse_seq = _masked_attention(q[q_start:q_end].transpose(0, 1), k[kv_start:kv_end].transpose(0, 1),
                                             v[kv_start:kv_end].transpose(0, 1), visible, scale, seq_score_mod)
        out_pieces.append(out_seq.transpose(0, 1))
        lse_pieces.append(lse_seq)
    if not out_pieces:
        return q.new_zeros(0, heads, head_dim), q.new_zeros(heads, 0)
    return torch.cat(out_pieces, dim=0), torch.cat(lse_pieces, dim=1)


def jagged_attention_bwd_ref(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             q_offsets: torch.Tensor, kv_offsets: torch.Tensor, *, sm_scale: float | None = None,
                             causal: bool = False, window: int | None = None, broadcast_q: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of `jagged_attention_ref`, written out: (dq, dk, dv) in float32 (float64 if given).

    Same math as the kernels (seed-notes section 1): Delta = rowsum(O * dO), P = exp(S - LSE),
    dV = P^T dO, dS = P * (dO V^T - Delta), dQ = scale * dS K, dK = scale * dS^T Q. GQA sums dK, dV
    over the G query heads of each KV head; broadcast-Q sums dQ over the B batches. It exists
    besides autograd because autograd does not record inside a custom op's implementation
    (`jfa.ops` uses this as its CPU backward), and it states what a kernel backward must compute.
    """
    dtype = _compute_dtype(q, k, v)
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    q = q.to(dtype)
    k_all, v_all = _expand_kv_heads(k.to(dtype), heads), _expand_kv_heads(v.to(dtype), heads)
    grad_out = grad_out.to(dtype)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    q_bounds, kv_bounds = _host_list(q_offsets), _host_list(kv_offsets)
    dq, dk_all, dv_all = torch.zeros_like(q), torch.zeros_like(k_all), torch.zeros_like(v_all)
    for b in range(len(kv_bounds) - 1):
        q_rows = slice(0, q_bounds[1]) if broadcast_q else slice(q_bounds[b], q_bounds[b + 1])
        lq = q_rows.stop - q_rows.start
        out_rows = slice(b * lq, (b + 1) * lq) if broadcast_q else q_rows
        kv_rows = slice(kv_bounds[b], kv_bounds[b + 1])
        if lq == 0 or kv_rows.stop == kv_rows.start:
            continue  # no scores, so no gradient flows
        q_seq, k_seq, v_seq = (t[rows].transpose(0, 1) for t, rows in ((q, q_rows), (k_all, kv_rows), (v_all, kv_rows)))
        lk = k_seq.shape[1]
        visible = visible_mask(lq, lk, causal, window, q.device) if (causal or window is not None) else None
        dq_seq, dk_seq, dv_seq = _masked_attention_bwd(grad_out[out_rows].transpose(0, 1), q_seq, k_seq, v_seq,
                                                       visible, scale)
        dq[q_rows] += dq_seq.transpose(0, 1)
        dk_all[kv_rows], dv_all[kv_rows] = dk_seq.transpose(0, 1), dv_seq.transpose(0, 1)
    return dq, _sum_kv_head_groups(dk_all, kv_heads), _sum_kv_head_groups(dv_all, kv_heads)


def _masked_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          visible: torch.Tensor | None, sm_scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `_masked_attention` for one sequence ([H, rows, D] each), written out."""
    out, lse = _masked_attention(q, k, v, visible, sm_scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * sm_scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    delta = (out * do).sum(-1, keepdim=True)
    dscores = probs * (torch.matmul(do, v.transpose(-1, -2)) - delta)
    return (sm_scale * torch.matmul(dscores, k), sm_scale * torch.matmul(dscores.transpose(-1, -2), q),
            torch.matmul(probs.transpose(-1, -2), do))


def _sum_kv_head_groups(grad_all: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """GQA: a KV head's gradient is the sum over the query heads that read it."""
    return grad_all.unflatten(1, (kv_heads, grad_all.shape[1] // kv_heads)).sum(2)


def _block_layout(offsets: torch.Tensor, rows: int, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For every packed row: the global index of its block and its position inside the block.

    Blocks restart at every sequence start, so the last block of a sequence may be partial.
    """
    bounds = offsets.to(torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    blocks_per_seq = (lengths + block - 1) // block
    first_block = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
    seq_of_row = torch.repeat_interleave(torch.arange(len(lengths), device=bounds.device), lengths,
                                         output_size=rows)
    local_pos = torch.arange(rows, device=bounds.device) - bounds[:-1][seq_of_row]
    block_of_row = first_block[seq_of_row] + local_pos // block
    return block_of_row, local_pos % block, int(blocks_per_seq.sum())


def block_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                        block: int = specs.BLOCK_ATTENTION_BLOCK, *, sm_scale: float | None = None) -> torch.Tensor:
    """Block-diagonal self-attention: each `block`-token block of a sequence attends only to itself.

    q [T, Hq, D], k/v [T, Hkv, D] share `offsets`; the last block of a sequence is masked to its real
    size. All blocks are scattered into one padded [n_blocks, block, H, D] batch and computed with
    one batched matmul, so this stays fast for thousands of blocks. Returns out [T, Hq, D].
    """
    dtype = _compute_dtype(q, k, v)
    q, k, v = q.to(dtype), _expand_kv_heads(k.to(dtype), q.shape[1]), _expand_kv_heads(v.to(dtype), q.shape[1])
    rows, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    block_of_row, pos_in_block, n_blocks = _block_layout(offsets.to(q.device), rows, block)

    def to_blocks(t: torch.Tensor) -> torch.Tensor:
        padded = t.new_zeros(n_blocks, block, heads, head_dim)
        padded = padded.index_put((block_of_row, pos_in_block), t)
        return padded.permute(0, 2, 1, 3)  # [n_blocks, H, block, D]

    key_present = torch.zeros(n_blocks, block, dtype=torch.bool, device=q.device)
    key_present[block_of_row, pos_in_block] = True
    out_blocks, _ = _masked_attention(to_blocks(q), to_blocks(k), to_blocks(v), key_present[:, None, None, :], scale)
    return out_blocks.permute(0, 2, 1, 3)[block_of_row, pos_in_block]


def _selected_keys(chosen: torch.Tensor, lq: int, lk: int, block_m: int, block_n: int, causal: bool) -> torch.Tensor:
    """[H, lq, lk] visibility of one sequence from its selection rows `chosen` [H, n_q_blocks, max_sel]."""
    n_q_blocks, n_kv_blocks = -(-lq // block_m), -(-lk // block_n)
    chosen = chosen[:, :n_q_blocks]
    in_range = (chosen >= 0) & (chosen < n_kv_blocks)
    block_mask = torch.zeros(chosen.shape[0], n_q_blocks, n_kv_blocks + 1, dtype=torch.bool, device=chosen.device)
    # Out-of-range picks land in a spare last column that is dropped below.
    block_mask.scatter_(2, torch.where(in_range, chosen, n_kv_blocks), True)
    visible = block_mask[:, :, :n_kv_blocks].repeat_interleave(block_m, 1).repeat_interleave(block_n, 2)
    visible = visible[:, :lq, :lk]
    if causal:
        visible = visible & visible_mask(lq, lk, True, None, chosen.device)
    return visible


def block_sparse_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                               kv_offsets: torch.Tensor, kv_block_idx: torch.Tensor, block_m: int, block_n: int,
                               *, sm_scale: float | None = None, causal: bool = False, upcast: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged attention where each query block sees only its selected key blocks.

    Selection: `kv_block_idx` is int [B, Hq, n_q_blocks, max_sel]. Entry [b, h, i, :] lists the
    sequence-local KV block numbers (block j = keys j*block_n .. (j+1)*block_n - 1 of sequence b)
    that query block i (queries i*block_m .. of sequence b) of head h attends to, padded with -1.
    n_q_blocks covers the longest query sequence; rows beyond a sequence and block numbers beyond
    its KV length are ignored; a repeated block counts once. `causal` further masks inside the
    selection. Returns (out [Tq, Hq, D], lse [Hq, Tq]); rows that select nothing get 0 and -inf.
    `upcast=False` computes in the inputs' dtype (module docstring).
    """
    dtype = _compute_dtype(q, k, v, upcast=upcast)
    q, k, v = q.to(dtype), _expand_kv_heads(k.to(dtype), q.shape[1]), _expand_kv_heads(v.to(dtype), q.shape[1])
    heads, head_dim = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    q_bounds, kv_bounds = _host_list(q_offsets), _host_list(kv_offsets)
    selection = kv_block_idx.to(device=q.device, dtype=torch.int64)

    out_pieces, lse_pieces = [], []
    for b in range(len(q_bounds) - 1):
        lq, lk = q_bounds[b + 1] - q_bounds[b], kv_bounds[b + 1] - kv_bounds[b]
        if lq == 0:
            continue
        visible = _selected_keys(selection[b], lq, lk, block_m, block_n, causal)
        q_seq = q[q_bounds[b]:q_bounds[b + 1]].transpose(0, 1)
        kv_rows = slice(kv_bounds[b], kv_bounds[b + 1])
        out_seq, lse_seq = _masked_attention(q_seq, k[kv_rows].transpose(0, 1), v[kv_rows].transpose(0, 1),
                                             visible, scale)
        out_pieces.append(out_seq.transpose(0, 1))
        lse_pieces.append(lse_seq)
    if not out_pieces:
        return q.new_zeros(0, heads, head_dim), q.new_zeros(heads, 0)
    return torch.cat(out_pieces, dim=0), torch.cat(lse_pieces, dim=1)


def block_sparse_attention_bwd_ref(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   q_offsets: torch.Tensor, kv_offsets: torch.Tensor, kv_block_idx: torch.Tensor,
                                   block_m: int, block_n: int, *, sm_scale: float | None = None, causal: bool = False
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of `block_sparse_attention_ref`, written out (as `jagged_attention_bwd_ref`):
    (dq, dk, dv) in float32 (float64 if given); usable where autograd records nothing."""
    dtype = _compute_dtype(q, k, v)
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    q, grad_out = q.to(dtype), grad_out.to(dtype)
    k_all, v_all = _expand_kv_heads(k.to(dtype), heads), _expand_kv_heads(v.to(dtype), heads)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    q_bounds, kv_bounds = _host_list(q_offsets), _host_list(kv_offsets)
    selection = kv_block_idx.to(device=q.device, dtype=torch.int64)
    dq, dk_all, dv_all = torch.zeros_like(q), torch.zeros_like(k_all), torch.zeros_like(v_all)
    for b in range(len(q_bounds) - 1):
        q_rows, kv_rows = slice(q_bounds[b], q_bounds[b + 1]), slice(kv_bounds[b], kv_bounds[b + 1])
        lq, lk = q_rows.stop - q_rows.start, kv_rows.stop - kv_rows.start
        if lq == 0 or lk == 0:
            continue
        visible = _selected_keys(selection[b], lq, lk, block_m, block_n, causal)
        grads = _masked_attention_bwd(grad_out[q_rows].transpose(0, 1), q[q_rows].transpose(0, 1),
                                      k_all[kv_rows].transpose(0, 1), v_all[kv_rows].transpose(0, 1), visible, scale)
        dq[q_rows], dk_all[kv_rows], dv_all[kv_rows] = (g.transpose(0, 1) for g in grads)
    return dq, _sum_kv_head_groups(dk_all, kv_heads), _sum_kv_head_groups(dv_all, kv_heads)


def _sin_cos(sinu_pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Split sinu_pos [M, D] (sin | cos halves) into per-element sin and cos [M, 1, D]."""
    half = sinu_pos.shape[-1] // 2
    sin = sinu_pos[:, :half].to(dtype).repeat_interleave(2, dim=-1)
    cos = sinu_pos[:, half:].to(dtype).repeat_interleave(2, dim=-1)
    return sin[:, None, :], cos[:, None, :]


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) pairs of the last dim -> (-x2, x1): a quarter turn of every pair."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def rotary_ref(x: torch.Tensor, sinu_pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [M, H, D]: x' = x*cos + rotate_every_two(x)*sin.

    sinu_pos [M, D] holds sin in its first D/2 columns and cos in its last D/2, one value per
    interleaved pair (columns 2p and 2p+1 share angle p).
    """
    dtype = _compute_dtype(x)
    x = x.to(dtype)
    sin, cos = _sin_cos(sinu_pos, dtype)
    return x * cos + _rotate_every_two(x) * sin


def rotary_conj_ref(x: torch.Tensor, sinu_pos: torch.Tensor) -> torch.Tensor:
    """The inverse rotation, x*cos - rotate_every_two(x)*sin: undoes `rotary_ref`.

    A rotation is orthogonal, so this is also its backward: d(input) = rotary_conj_ref(d(output)).
    """
    dtype = _compute_dtype(x)
    x = x.to(dtype)
    sin, cos = _sin_cos(sinu_pos, dtype)
    return x * cos - _rotate_every_two(x) * sin


def make_sinu_pos(offsets: torch.Tensor, head_dim: int, *, base: float = 10000.0) -> torch.Tensor:
    """sinu_pos [M, head_dim] for packed sequences, with sequence-local positions.

    Angle of pair p at position t is t * base**(-2p/head_dim), the usual RoPE frequencies.
    """
    bounds = offsets.to(torch.int64).cpu()
    lengths = bounds[1:] - bounds[:-1]
    rows = int(bounds[-1])
    seq_of_row = torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=rows)
    position = (torch.arange(rows) - bounds[:-1][seq_of_row]).to(torch.float64)
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = position[:, None] * inv_freq[None, :]
    return torch.cat((angle.sin(), angle.cos()), dim=1).to(torch.float32).to(offsets.device)


def fused_projection_rotary_block_attention_ref(x: torch.Tensor, w: torch.Tensor, sinu_pos: torch.Tensor,
                                                offsets: torch.Tensor, q_heads: int, kv_heads: int,
                                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Projection, rotary and block attention in one: the fused path of the seed's block attention.

    qkv = x [M, E] @ w [E, (q_heads + 2*kv_heads)*D] (+ bias), split into q, k, v; rotary is applied
    to all three (as the seed does); then `block_attention_ref`. Returns out [M, q_heads*D].
    """
    dtype = _compute_dtype(x, w)
    rows = x.shape[0]
    head_dim = w.shape[1] // (q_heads + 2 * kv_heads)
    qkv = x.to(dtype) @ w.to(dtype)
    if bias is not None:
        qkv = qkv + bias.to(dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (rotary_ref(t.reshape(rows, -1, head_dim), sinu_pos) for t in (q, k, v))
    return block_attention_ref(q, k, v, offsets).reshape(rows, q_heads * head_dim)


def fp8_quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """float8_e4m3fn x with one scale for the whole tensor, as `jfa.jagged_attention_fp8` takes it:
    (x_fp8, scale) with x ~= x_fp8 * scale, scale = amax / 448 (1 for an all-zero x). The scale is
    returned as a Python float, so on a GPU this reads amax back (a sync)."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    scale = amax / FP8_E4M3_MAX if amax > 0 else 1.0
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp8_agreement(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity, SQNR in dB) of `got` against `want` over every element: the MXFP8 work's
    measures of a low-precision result (`specs.MXFP8_MIN_COSINE`, `specs.MXFP8_MIN_SQNR_DB`)."""
    got, want = got.detach().double().flatten(), want.detach().double().flatten()
    cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
    sqnr_db = float(10 * torch.log10(want.square().sum() / (got - want).square().sum().clamp_min(1e-30)))
    return cosine, sqnr_db


def fp8_quantize_per_block(x: torch.Tensor, block_rows: int = specs.FP8_BLOCK_ROWS
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [T, H, D] to float8_e4m3fn with one float32 scale per (block of rows, head).

    scale = amax / 448 over the block (1 where the block is all zero), so x ~= x_fp8 * scale.
    Returns (x_fp8 [T, H, D], scale [ceil(T / block_rows), H]).
    """
    rows, heads, head_dim = x.shape
    n_blocks = -(-rows // block_rows)
    padded = x.new_zeros(n_blocks * block_rows, heads, head_dim, dtype=torch.float32)
    padded[:rows] = x.float()
    amax = padded.unflatten(0, (n_blocks, block_rows)).abs().amax(dim=(1, 3))  # [n_blocks, H]
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    scaled = x.float() / scale.repeat_interleave(block_rows, 0)[:rows, :, None]
    return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp8_dequantize_per_block(x_fp8: torch.Tensor, scale: torch.Tensor,
                             block_rows: int = specs.FP8_BLOCK_ROWS) -> torch.Tensor:
    """float32 values of a `fp8_quantize_per_block` result."""
    rows = x_fp8.shape[0]
    return x_fp8.float() * scale.repeat_interleave(block_rows, 0)[:rows, :, None]


def mx_quantize(x: torch.Tensor, block: int = specs.MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (OCP microscaling): E4M3 elements, one E8M0 power-of-two scale per `block` elements.

    Blocks are `block` contiguous elements of the last dim (which must be a multiple of `block`).
    The shared exponent is floor(log2(amax)) - 8, so the block's largest element lands in E4M3's top
    binade; elements that still exceed 448 after rounding are clamped. Returns
    (elements float8_e4m3fn, same shape as x; scales uint8 [..., last_dim / block]) where the
    scale byte is the biased exponent (value 2**(byte - 127)), exactly E8M0's bit pattern.
    """
    if x.shape[-1] % block:
        raise ValueError(f"x: the last dim ({x.shape[-1]}) must be a multiple of the MX block ({block}); "
                         "pad it first")
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(dim=-1)
    exponent = torch.floor(torch.log2(amax)) - E4M3_EMAX  # -inf for all-zero blocks, clamped next
    exponent = exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    scaled = groups / torch.exp2(exponent)[..., None]
    elements = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).flatten(-2)
    return elements, (exponent + E8M0_BIAS).to(torch.uint8)


def mx_dequantize(elements: torch.Tensor, scales: torch.Tensor, block: int = specs.MX_BLOCK) -> torch.Tensor:
    """float32 values of an `mx_quantize` result."""
    scale = torch.exp2(scales.float() - E8M0_BIAS)
    return (elements.float().unflatten(-1, (-1, block)) * scale[..., None]).flatten(-2)
