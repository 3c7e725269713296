"""CPU checks of the forward kernel (`jfa.kernels.fwd_sm90`): the configurations `jfa.configs.select`
gives the benchmark suites and the features compile for sm_90 into the kernel the module describes.

The kernel cannot run here (TLX needs a Hopper GPU; Triton's interpreter does not run TLX), so its
numbers are tested in tests/gpu. What the compiled code shows is checked: a producer warpgroup and
CONSUMERS consumer warpgroups with their register budgets, wgmma, TMA and mbarrier rings, shared
memory within the H200's limit, the output's TMA stores, and for the benchmark configurations no spill
reloads inside the key loops and Q·K^T in flight together with P·V. Then the forks: FP8 multiplies in
FP8, and the block-sparse fork and the three example variants (`jfa.variants`) compile.

Every configuration is compiled once per session (`compiled`, `tests/kernel_reports.py`), in parallel
on the machine's cores, through Triton's on-disk cache.
"""
import re
from typing import NamedTuple

import pytest
import torch

from jfa import configs, specs, variants
from jfa.kernels import fwd_sm90
from jfa.kernels.forks.block_sparse import BLOCK_SPARSE_FORK
from jfa.kernels.forks.fp8 import FP8_FORK
from jfa.kernels.hooks import DEFAULT_FORK
from jfa.workbench import inspect as jinspect
from tests.kernel_reports import (check_warp_specialized, compile_reports, count, loops_without_local_memory, report,
                                  tma_stores)
from tests.suite_shapes import suite_shape

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
WINDOW = 64
BLOCK_SPARSE_PARAMS = ("*i32", "*i32", "i32", "i32", "i32")  # `selection_params`: blocks, counts, sizes
FP8_PARAMS = ("fp32",)  # V's scale
GEM, GEM_SHORT, GEM_SHORT_WHOLE = ("gem", "L=2048,s=1.0"), ("gem", "L=256,s=0.5"), ("gem", "L=512,s=0.5")
PMA_Q64, PMA_Q256 = ("pma", "q=64,kv<=2048"), ("pma", "q=256,kv<=2048")
DENSE_D64 = ("dense", "B=4,H=32,N=4096,D=64")


class Job(NamedTuple):
    """One forward configuration to compile: `fwd_sm90.inspect_spec`'s arguments."""

    config: fwd_sm90.ForwardConfig
    dtype: torch.dtype = BF16
    fork: object = DEFAULT_FORK
    params_signature: tuple | None = None
    out_dtype: torch.dtype | None = None

    def spec(self):
        return fwd_sm90.inspect_spec(self.config, self.dtype, self.fork, self.params_signature, self.out_dtype)


def _forward(case, **features) -> fwd_sm90.ForwardConfig:
    return configs.select(suite_shape(*case, **features)).forward


# The benchmark suites' configurations (dense D=128 takes GEM L=2048's, cross takes GEM L=256's).
BENCHMARK_JOBS = {
    "gem-short-keys-half-tails": Job(_forward(GEM_SHORT)),
    "gem-short-keys": Job(_forward(GEM_SHORT_WHOLE)),
    "gem-base": Job(_forward(GEM)),
    "pma-q64-paired-heads": Job(_forward(PMA_Q64)),
    "pma-q256": Job(_forward(PMA_Q256)),
    "dense-d64-three-consumers": Job(_forward(DENSE_D64)),
}
# Features on top of them: masks, a D=64 base tile, fp16.
FEATURE_JOBS = {
    "gem-base-causal": Job(_forward(GEM, causal=True)),
    "gem-base-causal-window": Job(_forward(GEM, causal=True, window=WINDOW)),
    "gem-short-keys-half-tails-causal-window": Job(_forward(GEM_SHORT, causal=True, window=WINDOW)),
    "pma-q64-paired-heads-window": Job(_forward(PMA_Q64, window=WINDOW)),
    "dense-d64-three-consumers-causal": Job(_forward(DENSE_D64, causal=True)),
    "d64-base-window": Job(configs.forward_config(suite_shape(*GEM, window=WINDOW)._replace(head_dim=64))),
    "gem-base-fp16": Job(_forward(GEM), dtype=FP16),
}
FP8_JOBS = {
    "fp8": Job(_forward(GEM, base_tiles=True), FP8, FP8_FORK, FP8_PARAMS, specs.FP8_OUT_DTYPE),
    "fp8-pma-causal": Job(_forward(PMA_Q256, base_tiles=True, causal=True), FP8, FP8_FORK, FP8_PARAMS,
                          specs.FP8_OUT_DTYPE),
}
FORK_JOBS = {
    "block-sparse": Job(_forward(GEM, base_tiles=True, block_sparse=True), fork=BLOCK_SPARSE_FORK,
                        params_signature=BLOCK_SPARSE_PARAMS),
}
VARIANT_PARAMS = {"alibi": (variants.alibi_slopes(specs.GEM_HEADS),), "global-tokens": (4, WINDOW),
                  "softcap": (30.0,)}
VARIANTS = {"alibi": variants.ALIBI, "global-tokens": variants.GLOBAL_TOKENS, "softcap": variants.SOFTCAP}
ALL_JOBS = {**BENCHMARK_JOBS, **FEATURE_JOBS, **FP8_JOBS, **FORK_JOBS}


def _variant_spec(name):
    return VARIANTS[name].kernel_specs(head_dim=specs.GEM_HEAD_DIM, params=VARIANT_PARAMS[name])["forward"]


def _compile(name: str) -> jinspect.KernelReport:
    """Runs in a worker process: the report of one job (or "variant NAME") compiled for sm_90."""
    return report(_variant_spec(name[len("variant "):]) if name.startswith("variant ") else ALL_JOBS[name].spec())


@pytest.fixture(scope="session")
def compiled() -> dict:
    """Every job and variant compiled once per session; jobs with equal arguments share one compile."""
    return compile_reports(list(ALL_JOBS) + [f"variant {v}" for v in VARIANTS], _compile,
                           key=lambda name: ALL_JOBS.get(name, name))


@pytest.mark.parametrize("name", ALL_JOBS)
def test_compiles_to_the_warp_specialized_skeleton(compiled, name):
    config = ALL_JOBS[name].config
    check_warp_specialized(compiled[name], config.CONSUMERS, config.CONSUMER_REGISTERS)


@pytest.mark.parametrize("name", ALL_JOBS)
def test_whole_output_blocks_leave_by_tma_store(compiled, name):
    """One TMA store per consumer from its stage in shared memory, except where the output's dtype is not the
    inputs' (FP8) and with broadcast-Q on paired heads, which store every block from registers."""
    job = ALL_JOBS[name]
    paired_broadcast = job.config.BROADCAST_Q and job.config.HEADS_PER_TILE == 2
    staged = (job.out_dtype or job.dtype) == job.dtype and not paired_broadcast
    ptx = compiled[name].ptx
    assert tma_stores(ptx) == (job.config.CONSUMERS if staged else 0)
    if staged:
        assert count(ptx, "cp.async.bulk.wait_group.read") > 0


# Spill bytes ptxas may report for a benchmark configuration (per thread): values the epilogue and the
# tile decode keep in local memory outside the key loops.
FORWARD_SPILL_BUDGET_BYTES = 112


@pytest.mark.parametrize("name", BENCHMARK_JOBS)
def test_benchmark_configurations_spill_within_the_budget(compiled, name):
    spills = compiled[name].spill_bytes
    assert max(spills.values()) <= FORWARD_SPILL_BUDGET_BYTES, spills


@pytest.mark.parametrize("name", {**BENCHMARK_JOBS, **FEATURE_JOBS})
def test_key_loops_reload_nothing_from_local_memory(compiled, name):
    """The innermost SASS loops that issue the wgmmas (the key loops) neither load nor store local memory:
    whatever ptxas spills stays outside them."""
    assert loops_without_local_memory(compiled[name]), compiled[name].loops


@pytest.mark.parametrize("name", BENCHMARK_JOBS)
def test_qk_and_pv_stay_in_flight(compiled, name):
    """The key loop waits for Q·K^T only after issuing P·V, as written: the only waits for every wgmma right
    after an issue are each consumer's drain, the last tile's P·V with nothing left to hide it (two with
    half tails: the half tile's own drain too). Triton's pipeliner would add one after every wgmma at
    num_stages >= 1 (`fwd_sm90.NUM_STAGES`)."""
    config = ALL_JOBS[name].config
    waits = jinspect.wgmma_waits(compiled[name].ttgir)
    assert waits["right_after_issue"] == config.CONSUMERS * (2 if config.HALF_TAIL else 1), waits


@pytest.mark.parametrize("name", FP8_JOBS)
def test_fp8_fork_multiplies_in_fp8(compiled, name):
    """Both GEMMs of the FP8 fork are E4M3 wgmma (Q·K^T and P·V), never a 16-bit one."""
    ptx = compiled[name].ptx
    wgmmas = re.findall(r"wgmma\.mma_async\S*", ptx)
    assert wgmmas and all(".e4m3.e4m3" in w for w in wgmmas), sorted(set(wgmmas))


@pytest.mark.parametrize("variant", VARIANTS)
def test_example_variants_compile(compiled, variant):
    """`Variant.kernel_specs`' forward for each example variant: the skeleton with its hooks compiled in."""
    spec = _variant_spec(variant)
    assert spec.constexprs["FORK"] is VARIANTS[variant].fork
    config = spec.constexprs["CFG"]
    check_warp_specialized(compiled[f"variant {variant}"], config.CONSUMERS, config.CONSUMER_REGISTERS)
    assert compiled[f"variant {variant}"].loops, "no wgmma loop found in the SASS"
