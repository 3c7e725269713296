"""CPU checks of the backward's kernels: the dK/dV kernel (`jfa.kernels.bwd_dkdv`), the dQ kernel
(`jfa.kernels.bwd_dq`) and the Delta preprocess (`jfa.kernels.bwd_delta`), on the configurations
`jfa.configs.select` gives the benchmark suites and the features.

The TLX kernels cannot run here, so their numbers are tested in tests/gpu. What the compiled code shows
is checked: a producer and two consumer warpgroups with their register budgets, wgmma, TMA and
mbarrier rings, shared memory within the H200's limit; how dQ is formed: DQ_SPLIT's and DQ_HANDOFF's
TMA reduce-adds, DQ_RESIDENT's two plain TMA stores per consumer, and no global atomics anywhere (the
dQ kernel is deterministic); dK and dV stored from registers; and, for the benchmark configurations,
the wgmma loops' spill reloads within their budgets. Then the block-sparse fork and the three example
variants (`jfa.variants`) compile in both kernels, and the Delta preprocess (plain Triton) runs in
Triton's interpreter against PyTorch.
"""
import os
import pathlib
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch

from jfa import configs, specs, variants
from jfa.kernels import bwd_delta, bwd_dkdv, bwd_dq
from jfa.kernels.bwd_dkdv import DQ_HANDOFF, DQ_NONE, DQ_RESIDENT, DQ_SPLIT
from jfa.kernels.forks.block_sparse import BLOCK_SPARSE_FORK
from jfa.kernels.hooks import DEFAULT_FORK
from jfa.workbench import inspect as jinspect
from tests.kernel_reports import (check_warp_specialized, compile_reports, global_atomics, loops_without_local_memory,
                                  report, tma_stores)
from tests.suite_shapes import suite_shape

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16, FP16 = torch.bfloat16, torch.float16
WINDOW = 64
GQA_KV_HEADS = 2
BLOCK_SPARSE_PARAMS = ("*i32", "*i32", "i32", "i32", "i32")  # `selection_params`: blocks, counts, sizes
GEM, GEM_SHORT, GEM_SHORT_WHOLE = ("gem", "L=2048,s=1.0"), ("gem", "L=256,s=0.5"), ("gem", "L=512,s=0.5")
PMA_Q64, PMA_Q256 = ("pma", "q=64,kv<=2048"), ("pma", "q=256,kv<=2048")
DENSE_D64 = ("dense", "B=4,H=32,N=4096,D=64")
INTERPRETER_TIMEOUT_S = 240
TMA_REDUCE = "TMA reduce (cp.reduce.async.bulk)"


class Job(NamedTuple):
    """One configuration of a backward kernel to compile: `inspect_spec`'s arguments."""

    kernel: str  # "dkdv" or "dq"
    config: object
    dtype: torch.dtype = BF16
    fork: object = DEFAULT_FORK
    params_signature: tuple | None = None

    def spec(self):
        module = bwd_dkdv if self.kernel == "dkdv" else bwd_dq
        return module.inspect_spec(self.config, self.dtype, self.fork, self.params_signature)


def _dkdv(case, dtype=BF16, **features) -> Job:
    return Job("dkdv", configs.select(suite_shape(*case, **features)).dkdv, dtype)


def _dq(case, dtype=BF16, **features) -> Job:
    """The dQ kernel's configuration for the case (what runs where the dQ kernel does)."""
    return Job("dq", configs.dq_config(suite_shape(*case, **features)), dtype)


# The benchmark suites' configurations (dense D=128 takes GEM L=2048's, cross GEM L=256's or L=2048's).
BENCHMARK_JOBS = {
    "dkdv-gem-short-none": _dkdv(GEM_SHORT),
    "dkdv-gem-split": _dkdv(GEM),
    "dkdv-pma-q256-split-early-v": _dkdv(PMA_Q256),
    "dkdv-pma-q64-resident": _dkdv(PMA_Q64),
    "dkdv-dense-d64-handoff": _dkdv(DENSE_D64),
    "dq-gem-short-half-tails": _dq(GEM_SHORT),
    "dq-gem-short-whole": _dq(GEM_SHORT_WHOLE),
}
# Features on top of them: masks, GQA, deterministic, fp16.
FEATURE_JOBS = {
    "dkdv-gem-short-none-causal": _dkdv(GEM_SHORT, causal=True),
    "dkdv-gem-split-causal-window": _dkdv(GEM, causal=True, window=WINDOW),
    "dkdv-pma-q64-resident-window": _dkdv(PMA_Q64, window=WINDOW),
    "dkdv-pma-q64-gqa-split": _dkdv(PMA_Q64, kv_heads=GQA_KV_HEADS),
    "dkdv-pma-q256-deterministic-none": _dkdv(PMA_Q256, deterministic=True),
    "dkdv-dense-d64-none-bulk-causal-window": _dkdv(DENSE_D64, causal=True, window=WINDOW),
    "dkdv-gem-split-fp16": _dkdv(GEM, FP16),
    "dq-gem-causal-window": _dq(GEM, causal=True, window=WINDOW),
    "dq-pma-q256-partials": _dq(PMA_Q256),
    "dq-pma-q64-gqa-paired-heads-partials": _dq(PMA_Q64, kv_heads=GQA_KV_HEADS),
    "dq-dense-d64-causal": _dq(DENSE_D64, causal=True),
    "dq-gem-short-fp16": _dq(GEM_SHORT, FP16),
}
_SPARSE = suite_shape(*GEM, causal=True, base_tiles=True, block_sparse=True)
FORK_JOBS = {
    "dkdv-block-sparse": Job("dkdv", configs.select(_SPARSE).dkdv, fork=BLOCK_SPARSE_FORK,
                             params_signature=BLOCK_SPARSE_PARAMS),
    "dq-block-sparse": Job("dq", configs.select(_SPARSE).dq, fork=BLOCK_SPARSE_FORK,
                           params_signature=BLOCK_SPARSE_PARAMS),
}
ALL_JOBS = {**BENCHMARK_JOBS, **FEATURE_JOBS, **FORK_JOBS}
VARIANT_PARAMS = {"alibi": (variants.alibi_slopes(specs.GEM_HEADS),), "global-tokens": (4, WINDOW),
                  "softcap": (30.0,)}
VARIANTS = {"alibi": variants.ALIBI, "global-tokens": variants.GLOBAL_TOKENS, "softcap": variants.SOFTCAP}
VARIANT_KERNELS = ("dkdv", "dq")
VARIANT_NAMES = [f"{kernel}-variant {name}" for kernel in VARIANT_KERNELS for name in VARIANTS]


def _variant_spec(name: str):
    """The spec of "KERNEL-variant NAME": `Variant.kernel_specs`' entry for that kernel."""
    kernel, variant = name.split("-variant ")
    return VARIANTS[variant].kernel_specs(head_dim=specs.GEM_HEAD_DIM, params=VARIANT_PARAMS[variant])[kernel]


def _compile(name: str) -> jinspect.KernelReport:
    """Runs in a worker process: the report of one job (or variant kernel) compiled for sm_90."""
    return report(_variant_spec(name) if name in VARIANT_NAMES else ALL_JOBS[name].spec())


@pytest.fixture(scope="session")
def compiled() -> dict:
    """Every job and variant kernel compiled once per session; equal jobs share one compile."""
    return compile_reports(list(ALL_JOBS) + VARIANT_NAMES, _compile, key=lambda name: ALL_JOBS.get(name, name))


def _jobs(kernel: str, jobs=ALL_JOBS) -> list:
    return [name for name, job in jobs.items() if job.kernel == kernel]


# ---- both kernels ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_JOBS)
def test_compiles_to_the_warp_specialized_skeleton(compiled, name):
    consumers = (bwd_dkdv if ALL_JOBS[name].kernel == "dkdv" else bwd_dq).CONSUMERS.value
    check_warp_specialized(compiled[name], consumers, ALL_JOBS[name].config.CONSUMER_REGISTERS)


@pytest.mark.parametrize("name", ALL_JOBS)
def test_no_global_atomics(compiled, name):
    """dQ is formed without atomics: by the dQ kernel (each program owns its rows), by TMA reduce-adds
    (DQ_SPLIT), or summed in registers (DQ_RESIDENT); dK and dV are each written once."""
    assert global_atomics(compiled[name].ptx) == 0


# ---- the dK/dV kernel ------------------------------------------------------------------------------------

REDUCING_STRATEGIES = (DQ_SPLIT.value, DQ_HANDOFF.value)  # the fused modes that add dQ into an fp32 accumulator


@pytest.mark.parametrize("name", _jobs("dkdv"))
def test_dkdv_forms_dq_by_its_strategy(compiled, name):
    """DQ_SPLIT and DQ_HANDOFF add their dQ pieces by TMA reduce-adds; DQ_RESIDENT's dQ leaves once, by two
    plain TMA stores per consumer (the two halves of D); DQ_NONE issues neither. dK and dV leave from
    registers with row masks (a whole-tile TMA store would write into the next sequence's rows)."""
    strategy = ALL_JOBS[name].config.DQ
    kernel = compiled[name]
    assert (kernel.instructions[TMA_REDUCE] > 0) == (strategy in REDUCING_STRATEGIES)
    assert tma_stores(kernel.ptx) == (2 * bwd_dkdv.CONSUMERS.value if strategy == DQ_RESIDENT.value else 0)


def test_every_dq_strategy_is_compiled():
    assert {ALL_JOBS[name].config.DQ for name in _jobs("dkdv", BENCHMARK_JOBS)} == {
        DQ_NONE.value, DQ_SPLIT.value, DQ_RESIDENT.value, DQ_HANDOFF.value}


@pytest.mark.parametrize("name", _jobs("dkdv"))
def test_dkdv_specs_launch_at_the_kernels_num_stages(name):
    """The spec compiles what runs: `bwd_dkdv.num_stages(config)` (1 without fused dQ, 0 with it)."""
    config = ALL_JOBS[name].config
    assert ALL_JOBS[name].spec().num_stages == bwd_dkdv.num_stages(config) == int(config.DQ == DQ_NONE.value)


# Local-memory loads or stores a wgmma loop of a benchmarked kernel may issue per step, where it issues
# any: what the loop issues at its register budget, so a change that adds reloads fails here first.
# DQ_NONE at D=128 indexes its K/V slot per step (`ring.per_step`), and one consumer's loop reloads a few
# values for it; DQ_RESIDENT's loop is the key-tile loop itself (one query block per program), with the
# program's dQ live across it, and one consumer reloads up to 14 values per tile. Every other benchmarked
# loop issues none.
LOOP_RELOAD_BUDGET = {"dkdv-gem-short-none": 3, "dkdv-pma-q64-resident": 14}


@pytest.mark.parametrize("name", BENCHMARK_JOBS)
def test_benchmark_configurations_keep_their_loops_reload_budget(compiled, name):
    allowed = LOOP_RELOAD_BUDGET.get(name, 0)
    assert loops_without_local_memory(compiled[name], allowed), (allowed, compiled[name].loops)


# ---- the dQ kernel ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", _jobs("dq"))
def test_dq_kernel_stores_from_registers_without_reduce_adds(compiled, name):
    """Each program writes its own rows of dQ (or its sequence's fp32 partial) once: no TMA reduce-add."""
    kernel = compiled[name]
    assert kernel.instructions[TMA_REDUCE] == 0 and tma_stores(kernel.ptx) == 0


@pytest.mark.parametrize("name", _jobs("dq"))
def test_dq_kernel_loops_reload_nothing_from_local_memory(compiled, name):
    """Masks, broadcast-Q's fp32 partials and paired heads included: the key loops hold no spilled value."""
    assert loops_without_local_memory(compiled[name]), compiled[name].loops


@pytest.mark.parametrize("name", _jobs("dq", BENCHMARK_JOBS))
def test_dq_steps_stay_in_flight(compiled, name):
    """A turn issues S(n), dP(n) and the previous tile's dQ together; the only waits for every wgmma right
    after an issue are each consumer's drain, the last tile's dQ (two with half tails: the half tile's)."""
    config = ALL_JOBS[name].config
    waits = jinspect.wgmma_waits(compiled[name].ttgir)
    assert waits["right_after_issue"] == bwd_dq.CONSUMERS.value * (2 if config.HALF_TAIL else 1), waits


# ---- forks -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FORK_JOBS)
def test_block_sparse_fork_compiles_in_both_kernels(compiled, name):
    """Its iteration compiles in (the dQ kernel's dQ; `test_compiles_to_the_warp_specialized_skeleton` checks
    the rest); the dK/dV kernel runs DQ_NONE beside the dQ kernel."""
    assert compiled[name].loops, "no wgmma loop found in the SASS"
    if ALL_JOBS[name].kernel == "dkdv":
        assert ALL_JOBS[name].config.DQ == DQ_NONE.value


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_example_variants_compile(compiled, name):
    spec = _variant_spec(name)
    kernel = name.split("-variant ")[0]
    assert spec.constexprs["FORK"] is VARIANTS[name.split("-variant ")[1]].fork
    consumers = (bwd_dkdv if kernel == "dkdv" else bwd_dq).CONSUMERS.value
    check_warp_specialized(compiled[name], consumers, spec.constexprs["CFG"].CONSUMER_REGISTERS)
    assert global_atomics(compiled[name].ptx) == 0
    assert compiled[name].loops, "no wgmma loop found in the SASS"


# ---- the Delta preprocess --------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", specs.SUPPORTED_HEAD_DIMS)
def test_delta_preprocess_compiles(head_dim):
    kernel = jinspect.inspect(bwd_delta.inspect_spec(head_dim), "sm_90", want_ptx=True)
    assert global_atomics(kernel.ptx) == 0 and kernel.roles[0].warps == kernel.total_warps


_INTERPRETED_DELTA = """
import torch
from jfa.kernels import bwd_delta

gen = torch.Generator().manual_seed(0)
for rows, heads, head_dim, dtype in [(0, 2, 64, torch.float16), (1, 1, 64, torch.bfloat16), (130, 3, 64, torch.float16),
                                     (64, 2, 128, torch.bfloat16), (257, 1, 128, torch.float16)]:
    out, dout = (torch.randn(rows, heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    delta = bwd_delta.compute_delta(out, dout)
    assert delta.shape == (heads, rows) and delta.dtype == torch.float32
    expected = (out.float() * dout.float()).sum(-1).T
    assert torch.allclose(delta, expected, atol=1e-4, rtol=1e-4), (rows, heads, head_dim, dtype)
print("delta ok")
"""


def test_delta_preprocess_matches_pytorch_in_the_interpreter():
    """Delta = rowsum(O * dO) per head in fp32, `[Hq, rows]` like the LSE, rows past every 64-row block's end
    masked (Triton's interpreter runs this plain-Triton kernel)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    run = subprocess.run([sys.executable, "-c", _INTERPRETED_DELTA], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=INTERPRETER_TIMEOUT_S)
    assert run.returncode == 0 and "delta ok" in run.stdout, (run.stdout + run.stderr)[-3000:]
