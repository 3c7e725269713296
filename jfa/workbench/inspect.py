"""Compile-only views of TLX kernels: what a kernel asks of the machine, without a GPU.

A warp-specialized kernel's performance is decided by choices that are invisible in its Python
source once it runs: how many warps each role got, how many registers each role may hold, how much
shared memory the rings take, whether the MMAs really became `wgmma` (Hopper) or `tcgen05.mma`
into tensor memory (Blackwell), how many TMA copies and mbarrier operations the pipeline issues.
All of that is fixed at compile time, so it can be read on a laptop: compile for a named target
with `triton.compile(..., target=GPUTarget("cuda", 90 | 100, 32))` and read the artifacts.

Where each fact comes from:

- roles and warps: the TTGIR `ttg.warp_specialize` op. Its `default` region runs on the kernel's
  `num_warps` warps; each `partitionN(...) num_warps(K)` region is one more role. Because
  `setmaxnreg` acts on whole warpgroups (4 warps), the allocation pass may add an idle partition
  that pads the warp count up to a multiple of 4; the report lists it as "padding".
- registers: the same op's `requestedRegisters` (what `tlx.async_task(registers=...)` asked for)
  and `actualRegisters` (what every role, the default one included, will run with). Triton adds
  `actualRegisters` in its warp-group allocation pass, which runs inside the LLVM lowering, so we
  rerun that one pass on the final TTGIR. The PTX shows the outcome as `setmaxnreg.inc/dec N`,
  clamped to the hardware's per-thread maximum.
- shared memory: the compiler's `metadata.shared` (bytes, rings and barriers included).
- tensor memory (sm_100): `metadata.tmem_size`, the columns of the 512 an SM has.
- instruction mix: static counts of PTX mnemonics (each appearance in the code, not executions).

Compiles go through Triton's normal on-disk cache, so a second inspection of the same kernel and
configuration costs well under a second.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

from jfa.kernels.spec import KernelSpec
from jfa.specs import INSPECT_TARGETS, SETMAXNREG_MAX, TMEM_COLUMNS, WARP_SIZE

@dataclasses.dataclass
class Role:
    """One warp-specialized role: its warps and its per-thread register budget."""

    name: str
    warps: int
    requested_registers: int | None  # what the source asked for; None: the compiler decides
    registers: int | None  # what the role runs with (after setmaxnreg's clamp); None: not set


# PTX names a bulk tensor copy's direction as .dst.src: shared <- global is a TMA load.
_TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.\d+d\.shared::\w+\.global")
_TMA_STORE = re.compile(r"cp\.async\.bulk\.tensor\.\d+d\.global\.shared::")

# Name shown in the report -> test on a PTX mnemonic (the instruction with its modifiers).
INSTRUCTION_GROUPS = {
    "wgmma.mma_async": lambda m: m.startswith("wgmma.mma_async"),
    "wgmma fence/commit/wait": lambda m: m.startswith(("wgmma.fence", "wgmma.commit_group", "wgmma.wait_group")),
    "tcgen05.mma": lambda m: m.startswith("tcgen05.mma"),
    "tcgen05.* (all)": lambda m: m.startswith("tcgen05."),
    "TMA load (cp.async.bulk.tensor g->s)": lambda m: bool(_TMA_LOAD.match(m)),
    "TMA store (cp.async.bulk.tensor s->g)": lambda m: bool(_TMA_STORE.match(m)),
    "TMA reduce (cp.reduce.async.bulk)": lambda m: m.startswith("cp.reduce.async.bulk"),
    "mbarrier.init": lambda m: m.startswith("mbarrier.init"),
    "mbarrier.arrive (all)": lambda m: m.startswith("mbarrier.arrive"),
    "mbarrier.arrive.expect_tx": lambda m: m.startswith(("mbarrier.arrive.expect_tx", "mbarrier.expect_tx")),
    "mbarrier.try_wait": lambda m: m.startswith("mbarrier.try_wait"),
    "bar.sync / barrier.sync": lambda m: m.startswith(("bar.sync", "barrier.sync")),
    "bar.arrive / barrier.arrive": lambda m: m.startswith(("bar.arrive", "barrier.arrive")),
    "setmaxnreg": lambda m: m.startswith("setmaxnreg"),
}


@dataclasses.dataclass
class KernelReport:
    """What one compiled configuration asks of the machine; see the module docstring for sources."""

    name: str
    target: str
    roles: list
    total_warps: int
    shared_bytes: int
    tmem_columns: int | None  # sm_100 only; None on Hopper, which has no tensor memory
    setmaxnreg: dict  # "inc 240" / "dec 40" -> occurrences in the PTX
    instructions: dict  # INSTRUCTION_GROUPS name -> static count in the PTX
    spill_bytes: dict  # ptxas's "spill stores" / "spill loads" per thread (bytes), from `ptxas -v`
    loops: list | None  # the SASS's innermost loops that issue MMAs (`mma_loops`); None without nvdisasm
    ptx: str | None = None
    ttgir: str | None = None

    @property
    def threads(self) -> int:
        return self.total_warps * WARP_SIZE

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"threads": self.threads}

    def to_text(self) -> str:
        tmem = "-" if self.tmem_columns is None else f"{self.tmem_columns} of {TMEM_COLUMNS} columns"
        lines = [
            f"{self.name} @ {self.target}",
            f"  warps {self.total_warps} ({self.threads} threads) | shared memory {self.shared_bytes:,} B"
            f" | tensor memory {tmem}",
            "",
            f"  {'role':<14}{'warps':>6}{'regs asked':>12}{'regs/thread':>13}",
        ]
        for role in self.roles:
            asked = "-" if role.requested_registers is None else role.requested_registers
            regs = "-" if role.registers is None else role.registers
            lines.append(f"  {role.name:<14}{role.warps:>6}{asked:>12}{regs:>13}")
        setmaxnreg = ", ".join(f"{k} x{v}" for k, v in self.setmaxnreg.items()) or "none"
        spills = ", ".join(f"{k} {v} B" for k, v in self.spill_bytes.items())
        lines += ["", f"  setmaxnreg in PTX: {setmaxnreg}", f"  register spills (ptxas): {spills}"]
        if self.loops is None:
            lines.append("  MMA loops (SASS): nvdisasm not found")
        else:
            lines.append(f"  MMA loops (SASS, innermost): {len(self.loops)}")
            lines += [f"    at {loop['address']:#07x}: {loop['instructions']:>5} instructions, {loop['mma']:>3} MMA, "
                      f"spill reloads {loop['local_loads']}, spill stores {loop['local_stores']}"
                      for loop in self.loops]
        lines += [
                  "", "  PTX instructions (static count)"]
        lines += [f"    {group:<40}{count:>6}" for group, count in self.instructions.items()]
        return "\n".join(lines)


class KernelCompileError(RuntimeError):
    """Raised when Triton cannot compile a spec; the message names the kernel and the target."""


def inspect(spec: KernelSpec, target: str | None = None, want_ptx: bool = False,
            want_ttgir: bool = False) -> KernelReport:
    """Compile `spec` for `target` ("sm_90" or "sm_100"; default: the spec's own) and report it.

    Raises ValueError for an unknown target or an incomplete spec, and KernelCompileError
    (naming the kernel, the target and the compiler's diagnostic) when Triton rejects the kernel.
    """
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"spec must be a jfa.kernels.spec.KernelSpec (from a module's inspect_spec()), "
                        f"got {type(spec).__name__}")
    target = spec.target if target is None else target
    if target not in INSPECT_TARGETS:
        raise ValueError(f"target must be one of {sorted(INSPECT_TARGETS)}, got {target!r}")
    kernel = compile_spec(spec, target)
    ttgir = kernel.asm["ttgir"]
    ptx = kernel.asm["ptx"]
    mnemonics = _ptx_mnemonics(ptx)
    tmem_columns = kernel.metadata.tmem_size if INSPECT_TARGETS[target] >= 100 else None
    return KernelReport(
        name=spec.name,
        target=target,
        roles=_roles(_allocate_warp_groups(ttgir, target), len(_PARTITION.findall(ttgir)), spec),
        total_warps=kernel.metadata.num_warps,
        shared_bytes=kernel.metadata.shared,
        tmem_columns=tmem_columns,
        setmaxnreg=_setmaxnreg(ptx),
        instructions={group: sum(n for m, n in mnemonics.items() if test(m))
                      for group, test in INSTRUCTION_GROUPS.items()},
        spill_bytes=spill_bytes(ptx, INSPECT_TARGETS[target]),
        loops=mma_loops(kernel.asm["cubin"]),
        ptx=ptx if want_ptx else None,
        ttgir=ttgir if want_ttgir else None,
    )


def _full_signature(spec: KernelSpec) -> dict:
    """The spec's signature in argument order, with every constexpr marked as one."""
    signature = {}
    for arg in spec.fn.arg_names:
        if arg in spec.constexprs:
            signature[arg] = "constexpr"
        elif arg in spec.signature:
            signature[arg] = spec.signature[arg]
        else:
            raise ValueError(f"KernelSpec {spec.name!r}: argument {arg!r} is in neither `signature` "
                             f"nor `constexprs`; give it a type or a compile-time value")
    return signature


BLACKWELL_ARCH = 100
BLACKWELL_PTXAS_MIN_CUDA = (12, 8)  # the first CUDA whose ptxas assembles sm_100a


_INTEGER_TYPES = ("i32", "i64")
ALIGNMENT_BYTES = 16  # what Triton's launcher tests pointers and integers against ("D" specialization)
# The flags Triton's own cubin step passes to ptxas (backends/nvidia/compiler.py), so the spill
# counts are those of the binary that runs.
_PTXAS_FLAGS = ("-lineinfo", "-v", "--regAllocOptLevel=2")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@functools.lru_cache(maxsize=64)
def spill_bytes(ptx: str, arch: int) -> dict:
    """Per-thread spill traffic ptxas reports for this PTX: {"stores": B, "loads": B}.

    Triton does not keep ptxas's log, so assemble once more with its flags (about a second for a
    large kernel; cached per PTX text).
    """
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(arch).path, *_PTXAS_FLAGS, f"--gpu-name={sm_arch_from_capability(arch)}",
                               source, "-o", os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True)
    found = _SPILLS.findall(done.stderr)
    if done.returncode != 0 or not found:
        raise KernelCompileError(f"ptxas did not report spills (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return {"stores": sum(int(st) for st, _ in found), "loads": sum(int(ld) for _, ld in found)}


_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(\S+)(.*?)\s*;")
_SASS_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def mma_loops(cubin: bytes) -> list | None:
    """The innermost loops of the machine code that issue MMAs: where an attention kernel spends its time.

    A loop is a branch back to an earlier label; innermost means no other backward branch inside it
    (the many short barrier-polling loops hold no MMA and are left out). For each: its address,
    instruction count, MMA instructions (HGMMA on Hopper, UTC*MMA on Blackwell) and local-memory
    traffic (LDL / STL: register spills and their reloads). ptxas's spill total says *whether* a
    kernel spills; this says whether the spills sit in the hot loop. None where Triton's nvdisasm is
    not available (the GPU bundle drops it).
    """
    from triton.knobs import nvidia

    try:
        nvdisasm = nvidia.nvdisasm.path
    except RuntimeError:  # Triton raises "Cannot find nvdisasm" where neither its copy nor the env's exists
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    labels, code, pending = {}, [], []  # code: (address, opcode, operands)
    for line in done.stdout.splitlines():
        if label := _SASS_LABEL.match(line):
            pending.append(label.group(1))
        elif instruction := _SASS_INSTRUCTION.search(line):
            address = int(instruction.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            code.append((address, instruction.group(2), instruction.group(3)))
    back_edges = [(labels[target.group(1)], address) for address, opcode, operands in code
                  if opcode.startswith("BRA") and (target := _SASS_BRANCH_TARGET.search(operands))
                  and labels.get(target.group(1), address) < address]
    loops = []
    for start, end in back_edges:
        if any(start <= other < end for _, other in back_edges):
            continue  # an inner loop sits inside this one
        opcodes = [opcode for address, opcode, _ in code if start <= address <= end]
        loop = dict(address=start, instructions=len(opcodes), mma=sum("MMA" in op for op in opcodes),
                    local_loads=sum(op.startswith("LDL") for op in opcodes),
                    local_stores=sum(op.startswith("STL") for op in opcodes))
        if loop["mma"]:
            loops.append(loop)
    return loops


def _fall_back_to_host_ptxas_for_blackwell() -> None:
    """Point Triton's `ptxas-blackwell` at the host's ptxas where the wheel's copy is missing.

    Triton's wheel ships a separate `ptxas-blackwell`; the offline GPU bundle drops Triton's
    binaries to stay small and names the host's CUDA ptxas in TRITON_PTXAS_PATH instead. A ptxas of
    CUDA >= 12.8 assembles sm_100a too, so the compile-only sm_100 views work there as well.
    """
    import triton
    from triton.knobs import NvidiaTool

    shipped = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    if os.environ.get("TRITON_PTXAS_BLACKWELL_PATH") or os.path.exists(shipped):
        return
    host = NvidiaTool.from_path(os.environ.get("TRITON_PTXAS_PATH", ""))
    if host is not None and tuple(map(int, host.version.split("."))) >= BLACKWELL_PTXAS_MIN_CUDA:
        os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = host.path


def compile_spec(spec: KernelSpec, target: str):
    """`triton.compile` of one spec for `target` ("sm_90" / "sm_100"), specialized as a launch would be.

    Returns Triton's compiled kernel (its `.asm` holds ttgir, ptx, cubin); raises KernelCompileError.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = _full_signature(spec)
    arg_index = {name: i for i, name in enumerate(spec.fn.arg_names)}
    unknown = [name for name in spec.aligned if signature.get(name) not in _INTEGER_TYPES]
    if unknown:
        raise ValueError(f"KernelSpec {spec.name!r}: `aligned` names {unknown}, which are not integer "
                         f"arguments; list only i32/i64 arguments there")
    # Pointers (also inside a tuple argument, such as a fork's params) and the aligned integers.
    divisible = [(arg_index[name],) for name, ty in signature.items() if isinstance(ty, str) and ty.startswith("*")]
    divisible += [(arg_index[name], i) for name, ty in signature.items() if isinstance(ty, tuple)
                  for i, element in enumerate(ty) if element.startswith("*")]
    divisible += [(arg_index[name],) for name in spec.aligned]
    attrs = {path: [["tt.divisibility", ALIGNMENT_BYTES]] for path in divisible}
    source = ASTSource(fn=spec.fn, signature=signature, constexprs=spec.constexprs, attrs=attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if INSPECT_TARGETS[target] >= BLACKWELL_ARCH:
        _fall_back_to_host_ptxas_for_blackwell()
    # On a verifier failure Triton prints the whole module to stdout; the report keeps the diagnostics.
    with _stderr_captured() as log, contextlib.redirect_stdout(io.StringIO()):
        try:
            kernel = triton.compile(source, target=GPUTarget("cuda", INSPECT_TARGETS[target], WARP_SIZE),
                                    options=options)
            error = None
        except Exception as exc:
            error = exc
    if error is None:
        sys.stderr.write(log[0])  # warnings of a successful compile are the user's to see
        return kernel
    diagnostics = [line for line in log[0].splitlines() if "error" in line.lower()]
    detail = "\n".join(diagnostics[-5:]) or f"{type(error).__name__}: {error}"
    raise KernelCompileError(f"compiling kernel {spec.name!r} for {target} failed:\n{detail}") from error


@contextlib.contextmanager
def _stderr_captured():
    """MLIR prints compile diagnostics on the process's stderr, not in the Python exception.

    Capture them (file descriptor 2) so a failure can name its cause. The captured text is
    delivered as `log[0]` once the block ends.
    """
    sys.stderr.flush()
    saved_fd = os.dup(2)
    log = []
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield log
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            sink.seek(0)
            log.append(sink.read().decode(errors="replace"))


def _allocate_warp_groups(ttgir: str, target: str) -> str:
    """Rerun Triton's warp-group allocation on the final TTGIR so it carries `actualRegisters`."""
    from triton._C.libtriton import ir, passes
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    context = ir.context()
    ir.load_dialects(context)
    CUDABackend(GPUTarget("cuda", INSPECT_TARGETS[target], WARP_SIZE)).load_dialects(context)
    with tempfile.NamedTemporaryFile("w", suffix=".ttgir") as f:
        f.write(ttgir)
        f.flush()
        module = ir.parse_mlir_module(f.name, context)
    module.context = context
    manager = ir.pass_manager(context)
    passes.ttgpuir.add_allocate_warp_groups(manager, False)
    manager.run(module, "jfa.workbench.inspect")
    return module.str_nodebug()


_INT_ARRAY = r"array<i32(?::\s*([\d,\s]*))?>"
_PARTITION = re.compile(r"^\s*partition\d+\(.*num_warps\((\d+)\)", re.M)


def _roles(ttgir: str, user_partitions: int, spec: KernelSpec) -> list:
    """Roles from the first `ttg.warp_specialize` op; one role of `num_warps` if there is none.

    `ttgir` is the module after warp-group allocation; partitions past the first
    `user_partitions` were added by that pass as padding.
    """
    default_warps = int(re.search(r'"ttg.num-warps"\s*=\s*(\d+)', ttgir).group(1))
    op = re.search(r"ttg\.warp_specialize\(.*", ttgir)
    partition_warps = [int(w) for w in _PARTITION.findall(ttgir)]
    warps = [default_warps] + partition_warps
    requested = [None] + _int_array(op.group(0) if op else "", "requestedRegisters", len(partition_warps))
    actual = _int_array(op.group(0) if op else "", "actualRegisters", len(warps))
    ttgir_names = ["default"] + [f"partition{i}" if i < user_partitions else "padding"
                                 for i in range(len(partition_warps))]
    names = list(spec.role_names[:1 + user_partitions])
    names += ttgir_names[len(names):]
    return [Role(name=names[i], warps=warps[i], requested_registers=requested[i],
                 registers=None if actual[i] is None else min(actual[i], SETMAXNREG_MAX))
            for i in range(len(warps))]


def _int_array(op_text: str, attribute: str, length: int) -> list:
    match = re.search(attribute + r"\s*=\s*" + _INT_ARRAY, op_text)
    if not match or not match.group(1):
        return [None] * length
    return [int(v) for v in match.group(1).split(",")]


def wgmma_waits(ttgir: str) -> dict:
    """Count a Hopper kernel's wgmma waits in its TTGIR: {"total": n, "right_after_issue": m}.

    The second counts waits for every wgmma in flight (`pendings = 0`) placed on the line right
    after an issue: such a wgmma finishes before anything else runs, so it overlaps nothing of its
    own warpgroup. Triton's software pipeliner (`num_stages >= 1`) inserts one after each
    `tlx.async_dot` whose result it cannot prove safe to leave in flight; a kernel's own
    `tlx.async_dot_wait(0, ...)` issued immediately counts too.
    """
    lines = ttgir.splitlines()
    waits = [i for i, line in enumerate(lines) if "ttng.warp_group_dot_wait" in line]
    right_after = [i for i in waits if i > 0 and "ttng.warp_group_dot " in lines[i - 1]
                   and "pendings = 0" in lines[i]]
    return {"total": len(waits), "right_after_issue": len(right_after)}


def _ptx_mnemonics(ptx: str) -> Counter:
    """Instruction mnemonics with their modifiers, one count per appearance in the PTX text."""
    counts = Counter()
    for line in ptx.splitlines():
        match = re.match(r"\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)(\s|;|$)", line)
        if match and not line.rstrip().endswith(":"):
            counts[match.group(1)] += 1
    return counts


def _setmaxnreg(ptx: str) -> dict:
    found = re.findall(r"setmaxnreg\.(inc|dec)\S*\s+(\d+)", ptx)
    return dict(sorted(Counter(f"{kind} {value}" for kind, value in found).items()))


# ---- `python -m jfa inspect` ---------------------------------------------------------------------

INSPECTABLE_PACKAGES = ("tutorials", "jfa.kernels")  # where MODULE is looked up when not a full path


def main(argv: list[str]) -> int:
    """`python -m jfa inspect MODULE [KEY=VALUE ...]`: compile MODULE.inspect_spec(**cfg) and print."""
    import argparse
    import importlib
    import json

    parser = argparse.ArgumentParser(
        prog="python -m jfa inspect",
        description="Compile a kernel without a GPU and report its warp roles, registers, shared "
                    "and tensor memory, and PTX instruction mix.",
        epilog="examples: t01 | t04 PINGPONG=False | fwd_sm90 head_dim=64 causal=True | "
               "bwd_dkdv dq=split BLOCK_M=64 | block_attn direction=backward rotary=True | "
               "t05 --target sm_100 | jfa.kernels.bwd_delta dtype=float16. The jagged kernels and block "
               "attention take the options of a call (head_dim, causal, window, broadcast_q, max_len, heads; "
               "bwd_dkdv's dq: none, split, handoff or resident; block_attn's direction, group, rotary) and "
               "configure themselves as jfa.configs does for a GEM-like batch; UPPER-CASE keys then replace "
               "fields of that configuration.")
    parser.add_argument("module", nargs="?", help="a module with inspect_spec(): dotted path, or a name "
                        f"or prefix inside {' / '.join(INSPECTABLE_PACKAGES)}; omit to list them")
    parser.add_argument("config", nargs="*", metavar="KEY=VALUE",
                        help="keyword arguments of inspect_spec(), or a call's options (see below)")
    parser.add_argument("--target", choices=sorted(INSPECT_TARGETS), help="default: the kernel's own")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--ptx", action="store_true", help="also print the PTX")
    parser.add_argument("--ttgir", action="store_true", help="also print the TTGIR")
    args = parser.parse_args(argv)

    if args.module is None:
        print("inspectable modules:\n" + "\n".join(f"  {name}" for name in _inspectable_modules()))
        return 0
    try:
        name = _resolve_module(args.module)
        module = importlib.import_module(name)
        report = inspect(module.inspect_spec(**_spec_arguments(name, _parse_config(args.config))),
                         target=args.target, want_ptx=args.ptx, want_ttgir=args.ttgir)
    except (ImportError, ValueError, TypeError, KernelCompileError) as exc:
        print(f"python -m jfa inspect: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    for flag, text in (("ttgir", report.ttgir), ("ptx", report.ptx)):
        if text and not args.json:
            print(f"\n---- {flag} ----\n{text}")
    return 0


def _inspectable_modules() -> list:
    """Modules of INSPECTABLE_PACKAGES that define inspect_spec() (read as text: nothing is imported)."""
    import importlib
    import importlib.util
    import pkgutil

    found = []
    for package in INSPECTABLE_PACKAGES:
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            name = f"{package}.{info.name}"
            with open(importlib.util.find_spec(name).origin) as source:
                defines_spec = "def inspect_spec(" in source.read()
            if defines_spec:
                found.append(name)
    return found


def _resolve_module(name: str) -> str:
    """A dotted path as is; otherwise the inspectable module named exactly `name` (bwd_dq, even if
    another module's name starts with it), else the one whose name starts with `name` (t04)."""
    if "." in name:
        return name
    modules = _inspectable_modules()
    short = {module: module.rsplit(".", 1)[1] for module in modules}
    matches = ([m for m in modules if short[m] == name]
               or [m for m in modules if short[m].startswith(name)])
    if len(matches) != 1:
        raise ValueError(f"module {name!r} matches {matches or 'nothing'}; choose one of {modules}")
    return matches[0]


# Kernels whose inspect_spec takes a configuration NamedTuple: built from a call's options, as
# jfa.configs chooses it for a GEM-like batch.
CONFIGURED_KERNELS = ("jfa.kernels.fwd_sm90", "jfa.kernels.bwd_dq", "jfa.kernels.bwd_dkdv", "jfa.kernels.block_attn")
SHAPE_OPTIONS = ("head_dim", "causal", "window", "broadcast_q", "max_len", "heads")
DQ_STRATEGY_NAMES = ("none", "split", "handoff", "resident")


def _spec_arguments(module: str, options: dict) -> dict:
    """inspect_spec's keyword arguments: for CONFIGURED_KERNELS the `config` that jfa.configs selects
    from the call's options, with UPPER-CASE options replacing its fields; other modules' as given."""
    if module not in CONFIGURED_KERNELS:
        return options
    from jfa import configs
    from jfa.kernels import bwd_dkdv

    fields = {key: options.pop(key) for key in list(options) if key.isupper()}
    kernel = module.rsplit(".", 1)[1]
    if kernel == "block_attn":
        direction = options.pop("direction", "forward")
        head_dim, group = options.pop("head_dim", 128), options.pop("group", 1)
        if direction == "forward":
            config = configs.block_attention_forward(head_dim, group)
        elif direction == "backward":
            config = configs.block_attention_backward(head_dim, group, options.pop("rotary", False))
        else:
            raise ValueError(f"direction: 'forward' or 'backward', got {direction!r}")
    else:
        strategy = options.pop("dq", None) if kernel == "bwd_dkdv" else None
        shape = configs.gem_like_shape(**{key: options.pop(key) for key in SHAPE_OPTIONS if key in options})
        if kernel == "fwd_sm90":
            config = configs.forward_config(shape)
        elif kernel == "bwd_dq":
            config = configs.dq_config(shape)
        else:
            if strategy is not None and strategy not in DQ_STRATEGY_NAMES:
                raise ValueError(f"dq: one of {DQ_STRATEGY_NAMES}, got {strategy!r}")
            value = (configs.dq_strategy(shape) if strategy is None
                     else getattr(bwd_dkdv, f"DQ_{strategy.upper()}").value)
            config = configs.dkdv_config(shape, value)
    unknown = sorted(set(fields) - set(config._fields))
    if unknown:
        raise ValueError(f"{unknown} are not fields of {type(config).__name__}; its fields: {list(config._fields)}")
    return dict(options, config=config._replace(**fields))


def _parse_config(pairs: list) -> dict:
    """KEY=VALUE strings -> kwargs: Python literals, torch dtype names (float16), or plain strings."""
    import ast

    import torch

    config = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"config entries are KEY=VALUE, got {pair!r}")
        try:
            config[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            dtype = getattr(torch, text, None)
            config[key] = dtype if isinstance(dtype, torch.dtype) else text
    return config
