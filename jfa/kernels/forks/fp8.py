"""The FP8 fork of the forward: Q·K^T and P·V as FP8 wgmma, P quantized to E4M3 on the fly.

E4M3 inputs with per-tensor scales (real value = stored value * scale). What changes is the math's
operands, through the skeleton's hooks:

- V's layout: Hopper's FP8 wgmma reads its B operand only K-major (keys contiguous), so V comes
  transposed, `[Hkv*D, keys]`, in buffers `[D, BLOCK_N]` (`Fork.value_shape`, `Fork.load_values`)
  that P·V multiplies through a transposed view; every sequence starts on a 16-key column, because
  a TMA load whose innermost start is not 16-byte aligned faults (`transposed_value_col`);
- P: cast to V's dtype (E4M3) in registers right before its P·V. It needs no scale of its own: the
  conditional rescale keeps its entries in [0, 2^8], inside E4M3's range (448);
- the scales: q's and k's fold into the exp2 argument (the host's qk_scale_log2), v's multiplies the
  accumulator once before normalization (`Fork.scale_output`; `params = (v_scale,)`).

Blackwell's block-scaled MMA (one E8M0 scale per 32 elements, `jfa.reference.mx_quantize`) has no
Hopper instruction; an MXFP8 fork replaces `Fork.pv` (and the Q·K^T wgmma likewise) by one wgmma per
32-element slice of the contraction, each partial product scaled by its two operands' scales.
"""
import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa import specs
from jfa.kernels.hooks import Fork
from jfa.kernels.twin import torch_twin

V_T_ALIGN_KEYS: tl.constexpr = tl.constexpr(specs.TMA_ALIGN_BYTES)  # 16 bytes are 16 one-byte keys
TRANSPOSE_BLOCK_COLS, TRANSPOSE_BLOCK_CHANNELS = 128, 64  # `transposed_values`' block of V^T


@triton.jit
def transposed_value_col(kv_start, seq):
    """Column of sequence `seq`'s first key in the transposed V: its packed start rounded up to 16
    keys, plus one 16-key gap per earlier sequence, which keeps sequences apart whatever their lengths."""
    return tl.cdiv(kv_start, V_T_ALIGN_KEYS) * V_T_ALIGN_KEYS + seq * V_T_ALIGN_KEYS


@triton.jit
def key_minor_values(BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A V buffer as the channels' rows: `[HEAD_DIM, BLOCK_N]`, keys contiguous."""
    return (HEAD_DIM, BLOCK_N)


@triton.jit
def load_transposed_values(desc, buffer, kv_start, col, seq, kv_col, barrier, KEYS: tl.constexpr):
    """TMA-load a V^T tile: channels kv_col .., keys from the sequence's aligned column + col."""
    tlx.async_descriptor_load(desc, buffer, [kv_col, transposed_value_col(kv_start, seq) + col], barrier)


@triton.jit
def transposed_value_view(buffer, KEYS: tl.constexpr):
    """P·V's B operand from a `[D, BLOCK_N]` V^T buffer: its transposed view (FP8 has no half tiles)."""
    return tlx.local_trans(buffer)


@triton.jit
def scale_by_v(acc, params):
    """V's per-tensor scale, applied once to the accumulator."""
    return acc * params[0]


FP8_FORK = Fork(value_shape=key_minor_values, load_values=load_transposed_values, value_operand=transposed_value_view,
                scale_output=scale_by_v)


def transposed_value_width(rows: int, num_seqs: int) -> int:
    """Columns of the transposed V for `rows` keys in `num_seqs` sequences."""
    align = V_T_ALIGN_KEYS.value
    return -(-max(rows, 1) // align) * align + num_seqs * align


def transposed_value_layout(kv_offsets: torch.Tensor, rows: int, device) -> tuple[torch.Tensor, int]:
    """(column of every key, int64 [rows]; width) of the transposed V `[Hkv*D, width]`: the kernel's
    `transposed_value_col` on torch tensors. Gap columns hold zeros."""
    offsets = kv_offsets.to(device=device, dtype=torch.int64)
    keys = torch.arange(rows, device=device)
    seq = torch.searchsorted(offsets[1:], keys, right=True)
    starts = offsets[seq]
    cols = torch_twin(transposed_value_col)(starts, seq) + (keys - starts)
    return cols, transposed_value_width(rows, offsets.numel() - 1)


@triton.jit
def _transpose_values_kernel(v_ptr, source_key_ptr, v_t_ptr, channels, width, BLOCK_COLS: tl.constexpr,
                             BLOCK_CHANNELS: tl.constexpr):
    """One [channels, columns] block of V^T: each column gathers its source key's row (coalesced along
    the channels), the block is stored along the columns (coalesced along the keys); gap columns
    (source key -1) get zeros."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    chans = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    source = tl.load(source_key_ptr + cols, mask=cols < width, other=-1)
    in_channels = chans[:, None] < channels
    block = tl.load(v_ptr + source[None, :].to(tl.int64) * channels + chans[:, None],
                    mask=in_channels & (source[None, :] >= 0), other=0)
    tl.store(v_t_ptr + chans[:, None].to(tl.int64) * width + cols[None, :], block,
             mask=in_channels & (cols[None, :] < width))


def transposed_values(v: torch.Tensor, kv_offsets: torch.Tensor) -> torch.Tensor:
    """V in the fork's layout, `[Hkv*D, width]`, built on v's device with no host sync: a
    gather-transpose kernel (torch's column scatter or byte transpose of the same data takes longer
    than the attention kernel)."""
    rows, heads, dim = v.shape
    channels = heads * dim
    cols, width = transposed_value_layout(kv_offsets, rows, v.device)
    source_key = torch.full((width,), -1, dtype=torch.int32, device=v.device)
    source_key[cols] = torch.arange(rows, dtype=torch.int32, device=v.device)
    v_t = torch.empty((channels, width), dtype=torch.uint8, device=v.device)
    grid = (triton.cdiv(width, TRANSPOSE_BLOCK_COLS), triton.cdiv(channels, TRANSPOSE_BLOCK_CHANNELS))
    _transpose_values_kernel[grid](v.reshape(rows, channels).contiguous().view(torch.uint8), source_key, v_t, channels,
                                   width, TRANSPOSE_BLOCK_COLS, TRANSPOSE_BLOCK_CHANNELS)
    return v_t.view(v.dtype)
