"""Building blocks shared by the Hopper TLX attention kernels (jagged forward, block attention, forks).

Each helper is a small `@triton.jit` function that the kernels inline. They hold the pieces that are
easy to get subtly wrong and that every warp-specialized attention kernel needs in the same form:

- `ring_slot`: which buffer of an N-deep ring a running counter lands in, and the mbarrier phase
  to wait for. Producer and consumer keep the same counter, so they agree without talking.
- `pingpong_enter` / `pingpong_exit`: the consumer warpgroups take turns issuing wgmma, round robin,
  so one warpgroup's softmax overlaps the others' matrix multiplies instead of all fighting for the
  tensor cores at once (FlashAttention-3's "ping-pong" schedule; with three warpgroups, its head-dim
  64 one).
- `visible_mask`: which (query, key) pairs of a score tile may attend, in sequence-local positions
  (key padding, bottom-right causal, symmetric window), exactly as docs/CONTRACTS.md defines them.
- `sequence_rows`: where a sequence's query, output and key rows are in the packed tensors.
- `visible_key_range`: the keys a block of query rows may see, and those every row of it sees (the
  query-stationary kernels' KV loops and their mask-free bulk).
- `loop_segment`: the bounds of the masked / mask-free bulk / masked loops a range of blocks is
  split into (forward and backward alike).
- `zigzag_turns` / `zigzag_tile`: which tiles of a longest-first list a persistent program takes.
- `online_softmax_step`: one KV tile of the streaming softmax in the exp2 domain, with the
  conditional rescale of the running maximum.
- `lse_delta_rows`: a query block's LSE and Delta, the backward's per-row terms.
- `finalize_rows`: the epilogue math: normalize by the row sum and form the natural-log LSE, with the
  "row saw no key" case giving 0 and -inf.
- `rows_descriptor` (host side): the TMA view of a packed `[T, H, D]` tensor that the kernels' boxes
  of one head's rows are cut from.
- `sm_major` / `num_sms` / `persistent_programs` (host side): the GPU facts every launch asks for, read
  once per device, and the persistent grid they give.
"""
import functools

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from triton._utils import validate_block_shape
from triton.tools.tensor_descriptor import TensorDescriptor

from jfa import specs

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # softmax runs in exp2: e^x = 2^(x*log2 e)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # back to natural log for the LSE

# Keep the running row maximum until a new tile's maximum exceeds it by more than this many log2
# units (the seed's choice of 8). Probabilities are then bounded by 2^8 = 256 before normalization,
# far inside fp32 and bf16 range, and most KV tiles after the first few leave the reference alone.
# On Blackwell that skips a tensor-memory round trip of the accumulator; here the accumulator is in
# registers and is multiplied by alpha (exactly 1 for such rows) either way, branch-free.
RESCALE_THRESHOLD_LOG2: tl.constexpr = tl.constexpr(8.0)

# Named barriers 0..15 exist per CTA; Triton itself uses low ids, the TLX tutorials use 9 and 10
# for the ping-pong handshake and so do we.
PINGPONG_BARRIER_FIRST: tl.constexpr = tl.constexpr(9)  # consumer c's turn barrier is FIRST + c
PINGPONG_THREADS: tl.constexpr = tl.constexpr(256)  # the waiting consumer's and the handing one's 128 threads


@triton.jit
def ring_slot(count, NUM_BUFFERS: tl.constexpr):
    """Buffer index and mbarrier phase of the `count`-th use of an N-deep ring.

    An mbarrier flips its phase each time it completes, so the k-th reuse of a slot waits for phase
    `(count // N) & 1`. A producer waiting on an *empty* barrier uses `phase ^ 1`: a fresh barrier
    counts as having completed the phase before 0, so the first pass through the ring does not block.
    """
    return count % NUM_BUFFERS, (count // NUM_BUFFERS) & 1


@triton.jit
def per_step(x):
    """`x`, recomputed at each use inside a loop (an opaque `mov`, never hoisted).

    A shared-memory buffer picked by a loop-invariant index (the K/V slot of a KV-stationary loop)
    gives loop-invariant wgmma descriptors, one per k-step of every matrix multiply that reads it.
    Hoisted out of the loop they stay live across it, and at 240 registers ptxas spills them and
    reloads them every step, right before the wgmmas that need them. Indexing through `per_step(slot)`
    makes the compiler form them at the use instead, with a few integer adds.
    """
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pingpong_start(cid: tl.constexpr, NUM_CONSUMERS: tl.constexpr = 2):
    """Called once by each consumer before its first wgmma: the last consumer lets consumer 0 go first."""
    if cid == NUM_CONSUMERS - 1:
        tlx.named_barrier_arrive(PINGPONG_BARRIER_FIRST, PINGPONG_THREADS)


@triton.jit
def pingpong_enter(cid: tl.constexpr):
    """Wait for our turn to issue a wgmma (the consumer before us, round robin, has issued its own)."""
    tlx.named_barrier_wait(PINGPONG_BARRIER_FIRST + cid, PINGPONG_THREADS)


@triton.jit
def pingpong_exit(cid: tl.constexpr, NUM_CONSUMERS: tl.constexpr = 2):
    """Hand the turn to the next consumer right after issuing (not after completion)."""
    tlx.named_barrier_arrive(PINGPONG_BARRIER_FIRST + (cid + 1) % NUM_CONSUMERS, PINGPONG_THREADS)


@triton.jit
def zigzag_turns(num_tiles, prog, num_progs):
    """How many tiles program `prog` of `num_progs` takes from a list of `num_tiles` (see zigzag_tile)."""
    full_turns = num_tiles // num_progs
    return full_turns + (zigzag_tile(full_turns, prog, num_progs) < num_tiles).to(tl.int32)


@triton.jit
def zigzag_tile(turn, prog, num_progs):
    """The tile program `prog` takes on its `turn`-th pass over a list sorted longest first.

    Each turn deals the next `num_progs` tiles, one per program, in alternating directions: program
    p takes the p-th of them on even turns and the (num_progs-1-p)-th on odd ones. Dealing always in
    the same direction would hand program 0 the longest tile of every turn and the last program the
    shortest, a gap that grows with every turn; alternating pairs each long draw with a short one.
    """
    return turn * num_progs + tl.where(turn % 2 == 0, prog, num_progs - 1 - prog)


@triton.jit
def visible_mask(rows, cols, q_len, kv_len, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[rows, cols] booleans: may query `rows[i]` attend to key `cols[j]` (sequence-local positions).

    Keys past the sequence end are never visible: the TMA tile may hold rows of the next sequence
    (or zeros past the tensor end), and masking them here is what makes that harmless.
    """
    visible = cols[None, :] < kv_len
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + (kv_len - q_len))
    if HAS_WINDOW:
        visible = visible & (cols[None, :] >= rows[:, None] - window)
        visible = visible & (cols[None, :] <= rows[:, None] + window)
    return visible


@triton.jit
def sequence_rows(seq, q_offsets_ptr, kv_offsets_ptr, broadcast_q_len, BROADCAST_Q: tl.constexpr):
    """(q_start, q_len, out_row0, kv_start, kv_len) of sequence `seq`.

    With broadcast-Q every sequence reads the one shared query (rows 0..q_len-1) while its output
    rows (dO, LSE, Delta) start at seq * q_len.
    """
    kv_start = tl.load(kv_offsets_ptr + seq)
    kv_len = tl.load(kv_offsets_ptr + seq + 1) - kv_start
    if BROADCAST_Q:
        q_start = 0
        q_len = broadcast_q_len
        out_row0 = seq * broadcast_q_len
    else:
        q_start = tl.load(q_offsets_ptr + seq)
        q_len = tl.load(q_offsets_ptr + seq + 1) - q_start
        out_row0 = q_start
    return q_start, q_len, out_row0, kv_start, kv_len


@triton.jit
def visible_key_range(row_lo, row_hi, q_len, kv_len, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(kv_lo, kv_hi, full_lo, full_hi) for the query rows row_lo..row_hi (row_hi the last real one).

    Keys in [kv_lo, kv_hi) are visible to some row of the block, keys in [full_lo, full_hi) to every
    row (the latter may be empty, full_lo >= full_hi). A KV tile inside the second range needs no
    mask: `visible_mask` would be all True there.
    """
    kv_lo = 0
    kv_hi = kv_len
    full_lo = 0
    full_hi = kv_len
    if CAUSAL:
        kv_hi = tl.minimum(kv_hi, row_hi + (kv_len - q_len) + 1)
        full_hi = tl.minimum(full_hi, row_lo + (kv_len - q_len) + 1)
    if HAS_WINDOW:
        kv_lo = tl.maximum(row_lo - window, 0)
        kv_hi = tl.minimum(kv_hi, row_hi + window + 1)
        full_lo = tl.maximum(row_hi - window, 0)
        full_hi = tl.minimum(full_hi, row_lo + window + 1)
    return kv_lo, kv_hi, full_lo, full_hi


@triton.jit
def loop_segment(segment: tl.constexpr, start, bulk_lo, bulk_hi, end):
    """[lo, hi) of segment 0 (leading masked blocks), 1 (the mask-free bulk) or 2 (trailing masked
    blocks) of start..end. Written `for segment in tl.static_range(3)`, the three loops share one
    call site, and each is compiled with its own MASKED = segment != 1."""
    if segment == 0:
        return start, bulk_lo
    elif segment == 1:
        return bulk_lo, bulk_hi
    else:
        return bulk_hi, end


@triton.jit
def online_softmax_step(qk, m_i, l_i, qk_scale_log2, MAY_HAVE_EMPTY_ROWS: tl.constexpr):
    """Fold one tile of raw scores into the running (max, sum); return (p, alpha, m_new, l_new).

    `qk` are raw Q·K^T scores with invisible entries already set to -inf; `qk_scale_log2` is
    `sm_scale * log2(e)`, so `m_i` lives in scaled log2 units. The row reference `m` only moves when
    the tile's maximum exceeds it by more than RESCALE_THRESHOLD_LOG2; `alpha` is the factor the
    caller applies to its accumulator (exactly 1 for rows whose reference stayed).
    With MAY_HAVE_EMPTY_ROWS (masked tiles) a row may have seen no key yet (m = -inf); it is given
    reference 0 so its probabilities are exp2(-inf) = 0 instead of NaN.
    """
    tile_max = tl.max(qk, 1) * qk_scale_log2
    candidate = tl.maximum(m_i, tile_max)
    # -inf - -inf is NaN and compares False: a row that still sees nothing keeps m = -inf.
    moves = (candidate - m_i) > RESCALE_THRESHOLD_LOG2
    m_new = tl.where(moves, candidate, m_i)
    if MAY_HAVE_EMPTY_ROWS:
        reference = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        reference = m_new
    p = tl.math.exp2(qk * qk_scale_log2 - reference[:, None])
    alpha = tl.where(moves, tl.math.exp2(m_i - m_new), 1.0)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def finalize_rows(acc, m_i, l_i, out_dtype: tl.constexpr):
    """Epilogue math: (acc / l in out_dtype, natural-log LSE); a row that saw no key gets 0, -inf.

    The cast happens here, in the accumulator's register layout, so the layout change a masked
    store needs moves 16-bit values through shared memory instead of fp32 ones (half the scratch).
    """
    saw_keys = l_i > 0.0
    inv_l = tl.where(saw_keys, 1.0 / l_i, 0.0)
    out = (acc * inv_l[:, None]).to(out_dtype)
    lse = tl.where(saw_keys, (m_i + tl.math.log2(l_i)) * LN2, float("-inf"))
    return out, lse


@triton.jit
def lse_delta_rows(lse_ptr, delta_ptr, head, out_row0, q_row0, q_len, stride_lse_head, stride_delta_head,
                   BLOCK_M: tl.constexpr):
    """LSE (in log2 units) and Delta of the query block at sequence-local row `q_row0`; 0 past `q_len`.

    Both are `[heads, rows]` with the row index `out_row0 + row` (the backward's per-row terms)."""
    q_rows = q_row0 + tl.arange(0, BLOCK_M)
    row_ok = q_rows < q_len
    lse = tl.load(lse_ptr + head.to(tl.int64) * stride_lse_head + out_row0 + q_rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + head.to(tl.int64) * stride_delta_head + out_row0 + q_rows, mask=row_ok, other=0.0)
    return lse * LOG2E, delta


@triton.jit
def store_rows(out_ptr, lse_ptr, out, lse, out_row0, first_row, q_len, head, stride_out_row,
               stride_lse_head, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Masked store of an output tile and its LSE (either may be None, then not stored): rows past
    the sequence end are never written.

    A TMA store writes whole boxes: in a block that runs past its sequence's end it would clobber
    the next sequence's rows, so such blocks store from registers with a row mask (out is
    `[rows, heads, HEAD_DIM]` row-major).
    The tile's rows are `first_row ..` of its sequence (q_len rows), stored from `out_row0 + row`.
    Row indices are formed here, not by the caller: computed before the KV loop they would stay
    live through it (in the store's layout, several registers per thread) and push it to spill.
    """
    rows = first_row + tl.arange(0, ROWS)
    row_valid = rows < q_len
    out_rows = out_row0 + rows
    if out is not None:
        dims = tl.arange(0, HEAD_DIM)
        row_base = out_rows.to(tl.int64) * stride_out_row + head * HEAD_DIM
        tl.store(out_ptr + row_base[:, None] + dims[None, :], out, mask=row_valid[:, None])
    if lse is not None:
        tl.store(lse_ptr + head.to(tl.int64) * stride_lse_head + out_rows, lse, mask=row_valid)


class RowsDescriptor(TensorDescriptor):
    """The TMA descriptor `rows_descriptor` returns: a `TensorDescriptor` whose checks cost plain
    integer tests. The dataclass' own checks (block shape through Triton's constexpr helpers, the
    rank, the padding) cost more than the rest of building it, on every launch; here the block shape
    is checked once per shape and the rest is known from `rows_descriptor`'s `[T, H*D]` view."""

    def __post_init__(self):
        _check_box(tuple(self.block_shape))
        if self.base.data_ptr() % specs.TMA_ALIGN_BYTES:
            raise ValueError(f"a TMA view needs a {specs.TMA_ALIGN_BYTES}-byte aligned base address, got "
                             f"{self.base.data_ptr():#x}: pass a tensor that starts at an allocation (.contiguous())")
        if self.strides[0] * self.base.element_size() % specs.TMA_ALIGN_BYTES:
            raise ValueError(f"a TMA view needs rows {specs.TMA_ALIGN_BYTES}-byte aligned, got a row stride of "
                             f"{self.strides[0]} elements of {self.base.element_size()} bytes: pad the rows")


@functools.lru_cache(maxsize=None)
def _check_box(block_shape: tuple) -> None:
    validate_block_shape(list(block_shape))


def rows_descriptor(t: torch.Tensor, box_rows: int, box_cols: int | None = None) -> RowsDescriptor:
    """TMA view of a packed `[T, H, D]` tensor as `[T, H*D]`; one box = `box_rows` rows of one head
    (or `box_cols` of its columns), at column `head * D`.

    The row stride is the tensor's own, so a view of a buffer with padding rows around it (the gpu
    tests' poisoned outputs) or between rows is addressed as the register stores address it. Heads
    and head dim must be contiguous within a row: the `[T, H*D]` view depends on it.
    """
    rows, heads, dim = t.shape
    if t.stride(2) != 1 or (heads > 1 and t.stride(1) != dim):
        raise ValueError(f"a TMA view of a [T, H, D] tensor needs each row's heads and head dim contiguous "
                         f"(strides (row, {dim}, 1)), got strides {tuple(t.stride())} for shape {tuple(t.shape)}: "
                         "pass a tensor with contiguous rows (.contiguous())")
    if rows == 0:
        raise ValueError("a TMA view needs at least one row: callers return before launching on an empty batch")
    row_stride = t.stride(0) if rows > 1 else heads * dim
    return RowsDescriptor(t, shape=[rows, heads * dim], strides=[row_stride, 1],
                          block_shape=[box_rows, box_cols or dim])


# A device's properties never change in a process, and torch's own query costs several µs per call,
# more in a backward (autograd runs it on its device thread): read them once per device.
@functools.lru_cache(maxsize=None)
def _device_properties(index: int):
    return torch.cuda.get_device_properties(index)


def sm_major(device: torch.device) -> int:
    """The major compute capability of a CUDA device (9 for Hopper)."""
    return _device_properties(device.index).major


def num_sms(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device: one persistent program each."""
    return _device_properties(device.index).multi_processor_count


def persistent_programs(device: torch.device, units: int) -> int:
    """A persistent grid: one program per SM, fewer when there are fewer work units, at least one."""
    return max(1, min(num_sms(device), units))
