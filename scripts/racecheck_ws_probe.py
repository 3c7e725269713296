"""Probe kernels for compute-sanitizer racecheck: what it models in warp-specialized TLX code.

Racecheck reports hazards in jfa's kernels at each kernel's `def` line, on code the compiler
generated: Triton's warp-specialize dispatch, where the default partition stores each worker warp's
"what to run next" byte into shared memory before a CTA-wide `bar.sync 1` and the workers load it
after theirs. These probes have the same roles (a default task plus worker warpgroups, with and
without `registers=`, i.e. setmaxnreg) and show what racecheck follows:

- `plain`, `with_registers`, `task_barriers`: the scaffolding alone, each task writing only its own
  global slots: no hazards, so the dispatch bytes alone do not make racecheck flag them;
- `ring_handshake`: a two-slot mbarrier ring (full and empty barriers) between the default task and
  two consumer replicas, with no shared data: no hazards, also with 2000 programs;
- `ring_elected`: the same ring moving a tile through shared memory (`local_store`, `local_load`),
  freed by `tlx.barrier_arrive` as TLX lowers it, a warpgroup `bar.sync` and then one elected
  thread's mbarrier arrive: ordered under the PTX memory model, yet reported with over a thousand
  hazards per store/load pair, because racecheck does not follow the order through the `bar.sync`;
- `ring_per_thread`: that ring with TLX warp barriers (`tlx.alloc_warp_barrier`: every thread
  arrives): no hazards, so racecheck models mbarriers per arriving thread.

jfa's kernels move their tiles by TMA and wgmma, which racecheck does not track, so their elected
arrives cost nothing there; where consumers pass data through shared memory they use warp barriers.
Notebook 02 compiles the two ring probes for sm_90 and compares their PTX.

    compute-sanitizer --tool racecheck python scripts/racecheck_ws_probe.py [PROBE ...]   (GPU host)
"""
import sys

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

WORKER_REGISTERS = tl.constexpr(232)
WORKERS = tl.constexpr(2)
SLOTS_PER_PROGRAM = 3  # the default task's slot, then one per worker


@triton.jit
def roles_with_registers(out_ptr):
    base = tl.program_id(0) * 3
    with tlx.async_tasks():
        with tlx.async_task("default"):
            tl.store(out_ptr + base, 1.0)
        with tlx.async_task(num_warps=4, registers=WORKER_REGISTERS, replicate=WORKERS):
            tl.store(out_ptr + base + 1 + tlx.async_task_replica_id(), 2.0)


@triton.jit
def roles_plain(out_ptr):
    base = tl.program_id(0) * 3
    with tlx.async_tasks():
        with tlx.async_task("default"):
            tl.store(out_ptr + base, 1.0)
        with tlx.async_task(num_warps=4, replicate=WORKERS):
            tl.store(out_ptr + base + 1 + tlx.async_task_replica_id(), 2.0)


@triton.jit
def roles_with_task_barriers(out_ptr):
    """As with_registers, plus one barrier inside each task (Triton gives each task its own barrier id
    and thread count), as jfa's producer and consumers have around their shared-memory traffic."""
    base = tl.program_id(0) * 3
    with tlx.async_tasks():
        with tlx.async_task("default"):
            tl.debug_barrier()
            tl.store(out_ptr + base, 1.0)
        with tlx.async_task(num_warps=4, registers=WORKER_REGISTERS, replicate=WORKERS):
            tl.debug_barrier()
            tl.store(out_ptr + base + 1 + tlx.async_task_replica_id(), 2.0)


RING_SLOTS = tl.constexpr(2)
RING_STEPS = tl.constexpr(6)  # three passes over the ring: the producer waits on freed slots
TILE = tl.constexpr(64)


@triton.jit
def ring(out_ptr, WITH_DATA: tl.constexpr, PER_THREAD: tl.constexpr):
    """A two-slot ring from the default task to two consumer replicas. WITH_DATA: the producer stores
    a tile into the slot and each consumer loads it (plain shared-memory accesses racecheck sees).
    PER_THREAD: every thread arrives on the barriers (TLX warp barriers) instead of one elected thread
    after a warpgroup bar.sync (`tlx.alloc_barriers` + `tlx.barrier_arrive`)."""
    tiles = tlx.local_alloc((TILE, TILE), tl.float16, RING_SLOTS)
    if PER_THREAD:
        full = tlx.alloc_warp_barrier(RING_SLOTS, num_warps=4)
        empty = tlx.alloc_warp_barrier(RING_SLOTS, num_warps=4, num_arrivals=WORKERS)
    else:
        full = tlx.alloc_barriers(num_barriers=RING_SLOTS, arrive_count=1)
        empty = tlx.alloc_barriers(num_barriers=RING_SLOTS, arrive_count=WORKERS)
    base = tl.program_id(0) * 3
    with tlx.async_tasks():
        with tlx.async_task("default"):
            for i in range(RING_STEPS):
                slot = i % RING_SLOTS
                tlx.barrier_wait(empty[slot], ((i // RING_SLOTS) & 1) ^ 1)
                if WITH_DATA:
                    tlx.local_store(tiles[slot], tl.full((TILE, TILE), i, tl.float16))
                    tlx.fence_async_shared()
                tlx.barrier_arrive(full[slot])
            tl.store(out_ptr + base, 1.0)
        with tlx.async_task(num_warps=4, registers=WORKER_REGISTERS, replicate=WORKERS):
            total = 0.0
            for i in range(RING_STEPS):
                slot = i % RING_SLOTS
                tlx.barrier_wait(full[slot], (i // RING_SLOTS) & 1)
                if WITH_DATA:
                    total += tl.sum(tl.sum(tlx.local_load(tiles[slot]).to(tl.float32), 1), 0)
                tlx.barrier_arrive(empty[slot])
            expected = 0.0
            if WITH_DATA:
                expected = (TILE * TILE * (RING_STEPS - 1) * RING_STEPS // 2) * 1.0
            tl.store(out_ptr + base + 1 + tlx.async_task_replica_id(), tl.where(total == expected, 2.0, -1.0))


PROBES = {"with_registers": roles_with_registers, "plain": roles_plain, "task_barriers": roles_with_task_barriers,
          "ring_handshake": (ring, dict(WITH_DATA=False, PER_THREAD=False)),
          "ring_elected": (ring, dict(WITH_DATA=True, PER_THREAD=False)),
          "ring_per_thread": (ring, dict(WITH_DATA=True, PER_THREAD=True))}


def run(name: str, programs: int = 8) -> None:
    out = torch.full((programs * SLOTS_PER_PROGRAM,), float("nan"), device="cuda")  # poison
    kernel, constexprs = PROBES[name] if isinstance(PROBES[name], tuple) else (PROBES[name], {})
    kernel[(programs,)](out, num_warps=4, **constexprs)
    torch.cuda.synchronize()
    expected = torch.tensor([1.0, 2.0, 2.0], device="cuda").repeat(programs)
    assert torch.equal(out, expected), f"{name}: every task must write its slots (and the ring its data), got {out.tolist()}"
    print(f"probe {name}: ran, all {out.numel()} slots written")


if __name__ == "__main__":
    for name in sys.argv[1:] or PROBES:
        run(name)
