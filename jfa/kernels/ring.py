"""The TMA ring: shared-memory buffers that a producer fills by TMA and consumers drain.

A ring of DEPTH slots lets the producer load tile n + DEPTH - 1 while the consumers still compute
on tile n. Every buffer has two mbarriers: `full` completes when the bytes the producer announced
have landed, `empty` when each of the buffer's readers has arrived on it. Producer and consumers
count the tiles they have passed through the ring, and the count alone says which slot a tile
takes and which phase of its barriers to wait for (`ring_slot`), so the two sides agree without
talking.

A slot may hold LANES buffers side by side: one per head when a tile pairs two heads, each lane
with its own barriers, as if LANES rings were interleaved in one allocation. Buffer and barrier
`slot * LANES + lane` belong together.

The four steps, in the order each side takes them:

    setup:     ring = make_ring(tlx.local_alloc(shape, dtype, DEPTH * LANES), DEPTH, LANES, READERS)
    producer:  index = ring_acquire(ring, count, BYTES)       # wait until the slot is free
               tlx.async_descriptor_load(desc, ring.buffers[index], coords, ring.fulls[index])
    consumer:  index = ring_wait(ring, count)                  # wait until its bytes landed
               ... read ring.buffers[index] ...
               ring_release(ring, index)                       # one reader is done with it
"""
from typing import NamedTuple

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx


class Ring(NamedTuple):
    """DEPTH slots of LANES shared-memory buffers of one shape, each with a full and an empty barrier."""

    buffers: object  # DEPTH * LANES buffers; buffer `slot * LANES + lane`
    fulls: object  # completes when the buffer's announced bytes have landed
    empties: object  # completes when all of the buffer's readers have released it
    DEPTH: object  # slots (a compile-time constant; Triton carries tuple fields as values, which fold)
    LANES: object  # buffers per slot


@triton.jit
def make_ring(buffers, DEPTH: tl.constexpr, LANES: tl.constexpr = 1, READERS: tl.constexpr = 1):
    """A Ring over `buffers` (DEPTH * LANES of them, from one `tlx.local_alloc`): allocates each
    buffer's full and empty barrier; a buffer is free again once READERS consumers released it.

    Kernels allocate all their buffers first and then their rings' barriers, so the large buffers
    sit next to each other in shared memory, aligned, and the small barriers after them.
    """
    return Ring(buffers, tlx.alloc_barriers(num_barriers=DEPTH * LANES, arrive_count=1),
                tlx.alloc_barriers(num_barriers=DEPTH * LANES, arrive_count=READERS), DEPTH, LANES)


@triton.jit
def make_key_value_rings(k_buffers, v_buffers, DEPTH: tl.constexpr, LANES: tl.constexpr, READERS: tl.constexpr):
    """The K ring and the V ring of a query tile's key stream: as deep and as wide as each other."""
    return make_ring(k_buffers, DEPTH, LANES, READERS), make_ring(v_buffers, DEPTH, LANES, READERS)


@triton.jit
def ring_slot(count, DEPTH: tl.constexpr):
    """Slot and mbarrier phase of the `count`-th use of a DEPTH-deep ring.

    An mbarrier flips its phase each time it completes, so the k-th reuse of a slot waits for phase
    `(count // DEPTH) & 1`. A producer waiting on an *empty* barrier waits for `phase ^ 1`: a fresh
    barrier counts as having completed the phase before 0, so the first pass does not block.
    """
    return count % DEPTH, (count // DEPTH) & 1


@triton.jit
def ring_acquire(ring, count, BYTES: tl.constexpr, lane=0):
    """Producer: wait until the `count`-th tile's buffer is free, announce the BYTES its loads bring;
    returns the buffer's index."""
    slot, phase = ring_slot(count, ring.DEPTH)
    index = slot * ring.LANES + lane
    tlx.barrier_wait(ring.empties[index], phase ^ 1)
    tlx.barrier_expect_bytes(ring.fulls[index], BYTES)
    return index


@triton.jit
def ring_wait(ring, count, lane=0):
    """Consumer: wait until the `count`-th tile's bytes have landed; returns its buffer's index."""
    slot, phase = ring_slot(count, ring.DEPTH)
    index = slot * ring.LANES + lane
    tlx.barrier_wait(ring.fulls[index], phase)
    return index


@triton.jit
def ring_index(ring, count, lane=0):
    """The buffer index of the `count`-th tile (for a buffer already waited for)."""
    slot, _ = ring_slot(count, ring.DEPTH)
    return slot * ring.LANES + lane


@triton.jit
def ring_release(ring, index):
    """Consumer: this reader is done with buffer `index` (the producer may refill it once all are)."""
    tlx.barrier_arrive(ring.empties[index], 1)


@triton.jit
def leading_rows(buffer, ROWS: tl.constexpr):
    """The first ROWS rows of a shared-memory buffer (the whole buffer when it has ROWS): a half key
    tile is loaded into, and multiplied from, the first half of its slot."""
    if ROWS == buffer.shape[0]:
        return buffer
    return tlx.local_slice(buffer, [0, 0], [ROWS, buffer.shape[1]])


@triton.jit
def per_step(x):
    """`x`, recomputed at each use inside a loop (an opaque `mov`, never hoisted).

    A buffer picked by a loop-invariant index (a key tile's ring slot in a loop over query blocks)
    gives loop-invariant wgmma descriptors, one per k-step of every matrix multiply that reads it.
    Hoisted out of the loop they stay live across it, and at 240 registers ptxas spills them and
    reloads them every step, right before the wgmmas that need them. Indexing through
    `per_step(slot)` makes the compiler form them at the use instead, with a few integer adds.
    """
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
