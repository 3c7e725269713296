"""Epilogues: how a tile's results leave for global memory.

Packed jagged tensors make every store a question of where a sequence ends: a TMA store writes
whole boxes, so a box that runs past its sequence's end would clobber the next sequence's rows.
Blocks that lie inside their sequence leave by one TMA store through a shared-memory stage; the
others (and every gradient whose rows are partly another sequence's) are stored from registers
with a row mask.
"""
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx


@triton.jit
def store_rows(out_ptr, lse_ptr, out, lse, out_row0, first_row, q_len, head, stride_out_row, stride_lse_head,
               ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Masked register store of an output tile `[ROWS, HEAD_DIM]` and its LSE (either may be None:
    not stored). The tile's rows are `first_row ..` of its sequence (q_len rows), stored from
    `out_row0 + row`; out is `[rows, heads, HEAD_DIM]` row-major.

    Row indices are formed here, not by the caller: computed before the key loop they would stay
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


@triton.jit
def store_output(out, lse, stage, desc_out, out_ptr, lse_ptr, out_row0, first_row, q_len, head, stride_out_row,
                 stride_lse_head, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, STAGED: tl.constexpr):
    """A consumer's `[ROWS, D]` output block and its LSE: through `stage` and TMA where it can.

    STAGED: the block is written to `stage` (a free shared-memory buffer of the output's dtype). A
    block whose rows all lie inside the sequence then leaves by one TMA store; one that runs past the
    sequence's end is read back in a row-major layout for the masked register store. Either way the
    layout change goes through `stage` instead of the compiler's own scratch, and a whole block does
    not queue 16 stores per thread ahead of the next tile's loads. The previous block's TMA store has
    read `stage` before it is written again (the wait here); a caller that hands the stage's memory
    to another role waits for the last store first (`tlx.async_descriptor_store_wait(0)`).
    """
    if STAGED:
        tlx.async_descriptor_store_wait(0)
        tlx.local_store(stage, out)
        if first_row + ROWS <= q_len:
            tlx.fence_async_shared()
            tlx.async_descriptor_store(desc_out, stage, [out_row0 + first_row, head * HEAD_DIM])
            store_rows(out_ptr, lse_ptr, None, lse, out_row0, first_row, q_len, head, stride_out_row,
                       stride_lse_head, ROWS, HEAD_DIM)
        else:
            store_rows(out_ptr, lse_ptr, tlx.local_load(stage), lse, out_row0, first_row, q_len, head,
                       stride_out_row, stride_lse_head, ROWS, HEAD_DIM)
    else:
        store_rows(out_ptr, lse_ptr, out, lse, out_row0, first_row, q_len, head, stride_out_row, stride_lse_head,
                   ROWS, HEAD_DIM)


@triton.jit
def store_key_rows(ptr, x, kv_rows, row_ok, kv_head, stride_row, HEAD_DIM: tl.constexpr):
    """Masked register store of a consumer's dK or dV rows (keys past the sequence end are another's)."""
    dims = tl.arange(0, HEAD_DIM)
    offs = kv_rows.to(tl.int64)[:, None] * stride_row + kv_head * HEAD_DIM + dims[None, :]
    tl.store(ptr + offs, x, mask=row_ok[:, None])


@triton.jit
def reduce_add_rows(desc, stage, x, scale, row, head, HEAD_DIM: tl.constexpr, COL_OFFSET: tl.constexpr = 0):
    """Add fp32 `x * scale` into the box at row `row`, columns head * HEAD_DIM + COL_OFFSET .., of
    `desc`'s tensor by one TMA reduce-add (`cp.reduce.async.bulk`), through `stage`. The previous
    reduce-add from `stage` has read it before it is rewritten: the wait comes first, and the scaling
    and the box's column after it, so that nothing waits with them in registers."""
    tlx.async_descriptor_store_wait(0)
    tlx.local_store(stage, x * scale)
    tlx.fence_async_shared()
    tlx.async_descriptor_store(desc, stage, [row, head * HEAD_DIM + COL_OFFSET], store_reduce="add")
