"""What the compile tests of the jagged kernels share: compiling many configurations once, in parallel,
and the checks every warp-specialized kernel must pass (`jfa.workbench.inspect` reports)."""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import re

from jfa import specs
from jfa.workbench import inspect as jinspect

TARGET = "sm_90"


def compile_reports(names, compile_one, key=lambda name: name) -> dict:
    """{name: compile_one(name)} computed in worker processes, one per core (compiling is CPU-bound and
    single-threaded; Triton's disk cache makes later sessions fast too). `compile_one` must be a module
    level function (the workers are forked, so it may read the caller's module globals); names that
    `key` maps to the same value share one compile."""
    first = {}
    for name in names:
        first.setdefault(key(name), name)
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(os.cpu_count() or 1, len(first)),
                                                mp_context=context) as pool:
        done = dict(zip(first.values(), pool.map(compile_one, first.values())))
    return {name: done[first[key(name)]] for name in names}


def report(spec) -> jinspect.KernelReport:
    """`jfa.workbench.inspect.inspect` for sm_90, with the PTX and the TTGIR."""
    return jinspect.inspect(spec, TARGET, want_ptx=True, want_ttgir=True)


def count(ptx: str, mnemonic: str) -> int:
    """Instructions of the PTX that start with `mnemonic` (predicated or not)."""
    return len(re.findall(rf"^\s*(?:@!?%p\d+\s+)?{re.escape(mnemonic)}", ptx, flags=re.MULTILINE))


def tma_stores(ptx: str) -> int:
    return count(ptx, "cp.async.bulk.tensor.2d.global.shared")


def global_atomics(ptx: str) -> int:
    """Atomic or reducing instructions on global memory (`\\b`: not the `red.global` inside TMA's names)."""
    return len(re.findall(r"\b(?:atom|red)\.global", ptx))


def check_warp_specialized(kernel: jinspect.KernelReport, consumers: int, consumer_registers: int) -> None:
    """A producer warpgroup and `consumers` consumer warpgroups, the consumers at their register budget, the
    producer below it, all within the SM's register file; wgmma, TMA loads, mbarrier rings, setmaxnreg
    moving registers between them; the shared memory within one CTA's limit."""
    names = [role.name for role in kernel.roles]
    assert names == ["producer"] + [f"consumer{c}" for c in range(consumers)], names
    assert all(role.warps == specs.WARPGROUP_WARPS for role in kernel.roles), kernel.roles
    assert all(role.requested_registers == role.registers == consumer_registers for role in kernel.roles[1:]), \
        kernel.roles
    assert kernel.roles[0].registers < consumer_registers, kernel.roles
    used = sum(role.warps * specs.WARP_SIZE * role.registers for role in kernel.roles)
    assert used <= specs.REGISTERS_PER_SM, (used, kernel.roles)
    assert any(k.startswith("dec") for k in kernel.setmaxnreg) and any(k.startswith("inc") for k in kernel.setmaxnreg)
    assert kernel.instructions["wgmma.mma_async"] > 0
    assert kernel.instructions["TMA load (cp.async.bulk.tensor g->s)"] > 0
    assert kernel.instructions["mbarrier.try_wait"] > 0 and kernel.instructions["mbarrier.arrive (all)"] > 0
    assert kernel.shared_bytes <= specs.SHARED_BYTES_PER_BLOCK[TARGET], kernel.shared_bytes


def loops_without_local_memory(kernel: jinspect.KernelReport, allowed: int = 0) -> bool:
    """The innermost SASS loops that issue MMAs load and store local memory at most `allowed` times each."""
    assert kernel.loops, "no wgmma loop found in the SASS"
    return all(max(loop["local_loads"], loop["local_stores"]) <= allowed for loop in kernel.loops)
