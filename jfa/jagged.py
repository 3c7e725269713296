"""Jagged (packed variable-length) tensors: offsets, conversions, GEM-like lengths, validation.

A jagged batch is a packed `[total_rows, ...]` tensor plus `[B+1]` offsets (prefix sums, starting
at 0): sequence b is rows `offsets[b]:offsets[b+1]`. Zero-length sequences are valid.

Validation reads the offsets' values, which costs one device-to-host copy when they live on the GPU.
Offsets already on the CPU count as "known on the host": they are checked without any sync and the
kernel path copies them to the device itself, so a caller that keeps a CPU copy of its offsets
avoids the sync altogether.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from jfa import specs

__all__ = [
    "lengths_to_offsets",
    "offsets_to_lengths",
    "to_nested",
    "from_nested",
    "pad",
    "unpad",
    "gem_lengths",
    "JaggedProblem",
    "check_jagged_tensors",
    "validate_jagged_attention",
]

REFERENCE_DTYPES = (torch.float32, torch.float64)
FP8_DTYPES = (torch.float8_e4m3fn,)  # `jfa.jagged_attention_fp8`'s inputs
OFFSET_DTYPES = (torch.int32, torch.int64)


# ---- offsets -------------------------------------------------------------------------------------
def lengths_to_offsets(lengths, device=None) -> torch.Tensor:
    """int32 [B+1] offsets (0, then running sums) from B per-sequence lengths, on `device` (default:
    the lengths' own device).

    `lengths` is a 1-D integer tensor, or a sequence (list, tuple, numpy array) of ints. Each length
    must be >= 0 and the total must fit int32 offsets. Floating-point and bool lengths are rejected,
    whole-valued floats too: a length counts rows, and rounding it silently would hide the
    arithmetic that made it a float. Checking the values reads one three-number summary, a device
    sync for lengths on the GPU.
    """
    if isinstance(lengths, (list, tuple)) and any(isinstance(n, bool) for n in lengths):
        raise TypeError("lengths: contains bools; pass one integer row count per sequence")
    try:
        values = torch.as_tensor(lengths, device=device)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"lengths: expected a 1-D integer tensor or a sequence of ints ({exc}); "
                        "pass one integer row count per sequence") from None
    if values.ndim != 1:
        raise ValueError(f"lengths: expected a 1-D sequence of B lengths, got shape {tuple(values.shape)}; "
                         "pass one length per sequence (flatten it if it is nested)")
    if values.numel() == 0 and not isinstance(lengths, torch.Tensor):
        values = values.to(torch.int64)  # torch.as_tensor([]) is float32: an empty list is zero sequences
    if values.dtype == torch.bool or values.dtype.is_floating_point or values.dtype.is_complex:
        raise TypeError(f"lengths: dtype {values.dtype} is not an integer type; lengths count rows, so pass "
                        "integers (whole-valued floats: .round().long())")
    values = values.to(torch.int64)
    offsets = torch.zeros(values.numel() + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(values, 0, out=offsets[1:])
    if values.numel():
        smallest, largest, total = torch.stack((*torch.aminmax(values), offsets[-1])).tolist()
        if smallest < 0:
            index = int(torch.nonzero(values < 0)[0, 0])
            raise ValueError(f"lengths: length {int(values[index])} at index {index} is negative; every "
                             "sequence has >= 0 rows (0 is an empty sequence)")
        if largest > specs.INT32_MAX or total > specs.INT32_MAX:  # a huge length can wrap the int64 sum
            total = sum(values.tolist())
            raise ValueError(f"lengths: {total} rows in total exceed int32 offsets ({specs.INT32_MAX}); "
                             "split the batch into smaller ones")
    return offsets.to(torch.int32)


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """Per-sequence lengths [B] from [B+1] offsets, in the offsets' dtype."""
    return offsets[1:] - offsets[:-1]


# ---- conversions ---------------------------------------------------------------------------------
def to_nested(packed: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A torch nested tensor (jagged layout) viewing `packed` [T, ...] split by `offsets`."""
    return torch.nested.nested_tensor_from_jagged(packed, offsets=offsets.to(device=packed.device,
                                                                             dtype=torch.int64))


def from_nested(nested: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed values [T, ...], int32 offsets [B+1]) of a jagged-layout nested tensor."""
    if not nested.is_nested or nested.layout != torch.jagged:
        raise TypeError("nested: expected a nested tensor with layout=torch.jagged; build it with "
                        "torch.nested.nested_tensor(tensors, layout=torch.jagged)")
    return nested.values(), nested.offsets().to(torch.int32)


def _row_positions(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position inside the sequence) of every packed row."""
    bounds = offsets.to(torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(len(lengths), device=bounds.device), lengths,
                                         output_size=rows)
    return seq_of_row, torch.arange(rows, device=bounds.device) - bounds[:-1][seq_of_row]


def pad(packed: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None,
        value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed [T, ...] -> (padded [B, max_len, ...], mask [B, max_len]); mask is True on real rows.

    Padding rows hold `value`. `max_len` defaults to the longest sequence.
    """
    offsets = offsets.to(packed.device)
    lengths = offsets_to_lengths(offsets)
    longest = int(lengths.max()) if len(lengths) else 0
    max_len = longest if max_len is None else max_len
    if max_len < longest:
        raise ValueError(f"max_len: {max_len} is shorter than the longest sequence ({longest}); "
                         "pass None or a larger value")
    seq_of_row, position = _row_positions(offsets, packed.shape[0])
    padded = packed.new_full((len(lengths), max_len, *packed.shape[1:]), value)
    padded[seq_of_row, position] = packed
    mask = torch.arange(max_len, device=packed.device)[None, :] < lengths[:, None]
    return padded, mask


def unpad(padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Padded [B, L, ...] -> packed [T, ...]: the inverse of `pad`."""
    offsets = offsets.to(padded.device)
    seq_of_row, position = _row_positions(offsets, int(offsets[-1]))
    return padded[seq_of_row, position]


# ---- GEM-like lengths (shared/design/seed-notes.md section 4) -------------------------------------
def gem_lengths(batch: int, max_len: int, sparsity: float, seed: int) -> torch.Tensor:
    """int32 [batch] lengths ~ U[(2s-1)*L, L] (integers, inclusive), clipped to >= 1.

    sparsity s = 1.0 makes every length L; s = 0.5 gives U[0, L] clipped, i.e. U[1, L] in effect.
    The same seed gives the same lengths on every machine (a CPU generator draws them).
    """
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity: must be in [0, 1], got {sparsity}")
    low = max(1, math.floor((2 * sparsity - 1) * max_len))
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, max_len + 1, (batch,), generator=generator, dtype=torch.int64).to(torch.int32)


# ---- validation ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class JaggedProblem:
    """The checked facts of one jagged attention call, as the kernels and the reference need them."""

    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    total_q: int
    total_kv: int
    max_seq_len_q: int
    max_seq_len_kv: int
    sm_scale: float
    causal: bool
    window: int | None
    broadcast_q: bool
    out_rows: int


def _check_tensor(name: str, t, for_kernel: bool, fp8: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.ndim != 3:
        raise ValueError(f"{name}: expected 3 dims [rows, heads, head_dim], got shape {tuple(t.shape)}; "
                         "pack the sequences along dim 0")
    if fp8:
        allowed = FP8_DTYPES
    else:
        allowed = specs.SUPPORTED_DTYPES if for_kernel else specs.SUPPORTED_DTYPES + REFERENCE_DTYPES
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported here (allowed: {allowed}); convert with .to()")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (strides {t.stride()} for shape {tuple(t.shape)}); "
                         "call .contiguous()")
    if for_kernel and (t.storage_offset() * t.element_size()) % specs.TMA_ALIGN_BYTES:
        raise ValueError(f"{name}: starts {t.storage_offset()} elements into its storage, which is not "
                         f"{specs.TMA_ALIGN_BYTES}-byte aligned as TMA needs; pass a .clone()")


def _check_offsets(name: str, offsets, q: torch.Tensor) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name}: expected an integer torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in OFFSET_DTYPES:
        raise TypeError(f"{name}: dtype {offsets.dtype} is not an offset type; use .to(torch.int32)")
    if offsets.ndim != 1 or offsets.numel() < 1:
        raise ValueError(f"{name}: expected a 1-D [B+1] tensor, got shape {tuple(offsets.shape)}")
    if offsets.device != q.device and offsets.device.type != "cpu":
        raise ValueError(f"{name}: is on {offsets.device} but q is on {q.device}; "
                         "move it to q's device (or keep it on the CPU)")


def check_jagged_tensors(q, k, v, q_offsets, kv_offsets, *, sm_scale=None, window=None, broadcast_q=False,
                         for_kernel: bool = False, fp8: bool = False) -> None:
    """Every check that needs no offset values: types, shapes, dtypes, devices, layout, scalars.

    Safe under torch.compile (reads no tensor data). `for_kernel` restricts dtypes and head_dim to
    what the TLX kernels support and requires TMA-aligned tensors; without it the reference's wider
    set (float32/float64, any head_dim) is accepted.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, for_kernel, fp8)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}; use one dtype for q, k, v")
        if t.device != q.device:
            raise ValueError(f"{name}: is on {t.device} but q is on {q.device}; put q, k, v on one device")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}; k and v must match")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k: head_dim {k.shape[2]} differs from q's {q.shape[2]}; q and k need one head_dim")
    if for_kernel and q.shape[2] not in specs.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: {q.shape[2]} is not supported by the kernels "
                         f"(supported: {specs.SUPPORTED_HEAD_DIMS}); pad the head dim or use the reference")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"heads: q has {q.shape[1]} heads, k/v have {k.shape[1]}; GQA needs q heads to be "
                         "a multiple of k/v heads")
    _check_offsets("q_offsets", q_offsets, q)
    _check_offsets("kv_offsets", kv_offsets, q)
    if broadcast_q and q_offsets.numel() != 2:
        raise ValueError(f"q_offsets: broadcast_q needs exactly one query sequence ([0, q_len]), got "
                         f"{q_offsets.numel() - 1}; pass broadcast_q=False for per-sequence queries")
    if not broadcast_q and q_offsets.numel() != kv_offsets.numel():
        raise ValueError(f"kv_offsets: {kv_offsets.numel() - 1} KV sequences but q_offsets has "
                         f"{q_offsets.numel() - 1}; give one KV sequence per query sequence (or broadcast_q=True)")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window: expected an int or None, got {type(window).__name__}")
        if window < 0:
            raise ValueError(f"window: must be >= 0 (|i - j| <= window), got {window}; use None for no window")
    if sm_scale is not None:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
            raise TypeError(f"sm_scale: expected a float or None, got {type(sm_scale).__name__}")
        if not math.isfinite(sm_scale) or sm_scale <= 0:
            raise ValueError(f"sm_scale: must be finite and > 0, got {sm_scale}; None means 1/sqrt(head_dim)")


def _offset_terms(offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """0-d tensors on the offsets' device: first, last, smallest value, smallest step, largest step.

    The steps are exact whenever no value is negative (differences of values in [0, dtype max]
    fit the dtype); a negative value is itself a decrease, since the offsets must start at 0.
    """
    first, last = offsets[0], offsets[-1]
    if offsets.numel() == 1:
        no_step = offsets.new_zeros(())
        return first, last, first, no_step, no_step
    steps = torch.diff(offsets)
    return first, last, offsets.min(), steps.min(), steps.max()


def _offset_facts(q_offsets: torch.Tensor, kv_offsets: torch.Tensor) -> tuple[list[int], list[int]]:
    """Both offsets' `_offset_terms` as ints, stacked and read once per device (offsets live on q's
    device or the CPU, so GPU offsets cost one device-to-host copy and CPU ones none)."""
    for name, offsets in (("q_offsets", q_offsets), ("kv_offsets", kv_offsets)):
        if offsets.device.type == "meta":
            raise ValueError(f"{name}: is a meta tensor, so its values cannot be checked; pass real offsets "
                             "(a CPU copy is fine)")
    if kv_offsets is q_offsets:
        facts = torch.stack(_offset_terms(q_offsets)).tolist()
        return facts, facts
    if q_offsets.device == kv_offsets.device:
        facts = torch.stack(_offset_terms(q_offsets) + _offset_terms(kv_offsets)).tolist()
        return facts[:5], facts[5:]
    return torch.stack(_offset_terms(q_offsets)).tolist(), torch.stack(_offset_terms(kv_offsets)).tolist()


def _check_offset_facts(name: str, offsets: torch.Tensor, facts: list[int], rows: int) -> int:
    """Check the summary of a valid prefix sum ending at `rows`; returns the longest sequence.

    Where a check fails, the detail of the message (the index that decreases) is found then.
    """
    first, last, smallest, smallest_step, longest = facts
    if first != 0:
        raise ValueError(f"{name}: must start at 0, starts at {first}")
    if smallest < 0 or smallest_step < 0:
        b = int(torch.nonzero(offsets[1:] < offsets[:-1])[0, 0])  # a comparison: exact at any magnitude
        raise ValueError(f"{name}: decreases at index {b + 1} ({int(offsets[b])} -> {int(offsets[b + 1])}); "
                         "offsets are prefix sums of non-negative lengths")
    if last != rows:
        raise ValueError(f"{name}: ends at {last} but the tensor has {rows} rows; the last offset "
                         "must equal the row count")
    return longest


def _max_len(name: str, given: int | None, longest: int) -> int:
    if given is None:
        return longest
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"{name}: expected an int or None, got {type(given).__name__}")
    if given < longest:
        raise ValueError(f"{name}: {given} is smaller than the longest sequence ({longest}); pass None to "
                         "compute it or a bound >= the real maximum")
    return given


def validate_jagged_attention(q, k, v, q_offsets, kv_offsets, max_seq_len_q=None, max_seq_len_kv=None, *,
                              sm_scale=None, causal=False, window=None, broadcast_q=False,
                              for_kernel: bool = False, fp8: bool = False) -> JaggedProblem:
    """Check a jagged attention call and describe it; raises ValueError/TypeError naming the argument.

    The offsets' values are checked with tensor operations that reduce both offsets to one small
    summary (first and last value, smallest value and step, longest sequence), read once: a single
    device-to-host copy for GPU offsets, none for CPU ones. See `check_jagged_tensors` for
    `for_kernel`.
    """
    check_jagged_tensors(q, k, v, q_offsets, kv_offsets, sm_scale=sm_scale, window=window,
                         broadcast_q=broadcast_q, for_kernel=for_kernel, fp8=fp8)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    q_facts, kv_facts = _offset_facts(q_offsets, kv_offsets)
    longest_q = _check_offset_facts("q_offsets", q_offsets, q_facts, q.shape[0])
    longest_kv = _check_offset_facts("kv_offsets", kv_offsets, kv_facts, k.shape[0])
    max_q = _max_len("max_seq_len_q", max_seq_len_q, longest_q)
    max_kv = _max_len("max_seq_len_kv", max_seq_len_kv, longest_kv)
    batch = kv_offsets.numel() - 1
    heads_q, heads_kv, head_dim = q.shape[1], k.shape[1], q.shape[2]
    out_rows = batch * q.shape[0] if broadcast_q else q.shape[0]
    for name, rows, heads in (("q", q.shape[0], heads_q), ("k", k.shape[0], heads_kv), ("v", v.shape[0], heads_kv),
                              ("out", out_rows, heads_q)):
        if rows * heads * head_dim > specs.INT32_MAX:
            raise ValueError(f"{name}: {rows} rows x {heads} heads x {head_dim} dims exceeds int32 indexing "
                             f"({specs.INT32_MAX}); split the batch into smaller calls")
    return JaggedProblem(
        batch=batch, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, total_q=q.shape[0], total_kv=k.shape[0],
        max_seq_len_q=max_q, max_seq_len_kv=max_kv,
        sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale),
        causal=causal, window=window, broadcast_q=broadcast_q, out_rows=out_rows)
