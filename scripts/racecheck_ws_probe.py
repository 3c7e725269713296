"""Does compute-sanitizer racecheck flag Triton's warp-specialization scaffolding by itself?

Racecheck reports hazards in jfa's forward and backward kernels at the kernel's `def` line: code the
compiler generated, not code we wrote. In the SASS, the pair it names is Triton's warp-specialize
dispatch: the default partition stores each worker warp's "what to run next" byte into shared
memory, a CTA-wide `bar.sync 1` follows, and the workers load their byte after the matching
`bar.sync 1` (an exit code is stored the same way at the end).

This probe is the control experiment: kernels with the same roles (a default task plus worker
warpgroups, with and without `registers=`, i.e. setmaxnreg, and with a barrier inside each task)
whose partitions touch no shared memory at all. Each task only writes its own global slots.

Outcome on the H200 (results/racecheck-20261129T1316Z.log): no hazards in any probe, nor in
tutorial t01; tutorial t04 and jfa's forward and backward get reports, and their SASS offsets are
exactly the scaffolding's dispatch-byte store and load. So the scaffolding's bytes are what
racecheck flags, but the scaffolding alone does not make it flag them; what else is needed (the
wgmma pipelines of t04 and jfa are the obvious difference) is not known.

    compute-sanitizer --tool racecheck python scripts/racecheck_ws_probe.py [with_registers|plain]
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


PROBES = {"with_registers": roles_with_registers, "plain": roles_plain, "task_barriers": roles_with_task_barriers}


def run(name: str, programs: int = 8) -> None:
    out = torch.full((programs * SLOTS_PER_PROGRAM,), float("nan"), device="cuda")  # poison
    PROBES[name][(programs,)](out, num_warps=4)
    torch.cuda.synchronize()
    expected = torch.tensor([1.0, 2.0, 2.0], device="cuda").repeat(programs)
    assert torch.equal(out, expected), f"{name}: every task must write its slots, got {out.tolist()}"
    print(f"probe {name}: ran, all {out.numel()} slots written")


if __name__ == "__main__":
    for name in sys.argv[1:] or PROBES:
        run(name)
