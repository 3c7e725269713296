"""CPU checks of the jagged backward: every configuration compiles for sm_90 into a warp-specialized
wgmma kernel that fits in shared memory, and the KV-tile schedule matches the masks.

The kernels cannot run here (TLX needs a GPU), so the numbers are tested in
tests/gpu/test_jagged_bwd.py. Checked here: the compiled code's structure (wgmma, mbarrier rings,
setmaxnreg, TMA loads, fp32 atomics only where dQ is not deterministic) and the host schedule
against a brute-force visibility mask.
"""
import concurrent.futures
import math
import multiprocessing
import os
import re

import pytest
import torch

from jfa import schedule as tile_schedule, specs
from jfa.kernels import jagged_bwd
from jfa.reference import visible_mask
from jfa.workbench import inspect as jinspect
from jfa.workbench.bench import case_lengths

BF16, FP16 = torch.bfloat16, torch.float16
SEP, ATOMIC, TMA = "separate", "atomic", "tma_reduce"
# (head_dim, dtype, causal, window, broadcast_q, dq_mode[, max_queries]): every feature, and each head_dim
# and dtype on the plain kernel, without the full product (each compile takes ~10 s of one core).
CONFIGS = [
    (128, BF16, False, None, False, SEP),
    (64, BF16, False, None, False, SEP),
    (128, FP16, False, None, False, SEP),
    (64, FP16, False, None, False, SEP),
    (128, BF16, True, None, False, SEP),
    (128, BF16, False, 32, False, SEP),
    (128, BF16, True, 32, False, SEP),
    (128, BF16, False, None, True, SEP),
    (64, FP16, True, 32, True, SEP),
    (128, BF16, False, None, False, ATOMIC),
    (128, BF16, True, 32, True, ATOMIC),
    (128, BF16, False, None, False, TMA),
    (128, BF16, False, None, True, TMA),  # PMA's default: V's slot freed early (EARLY_V_RELEASE)
    (128, BF16, False, None, True, TMA, 64),  # PMA of one step per tile: ONE_STEP_TUNING (RESIDENT_Q)
    (128, BF16, True, 32, True, TMA, 64),
    (64, BF16, False, None, True, TMA, 64),
    (64, BF16, False, None, False, TMA),
    (64, BF16, True, None, False, TMA),
    (128, BF16, True, 32, True, TMA),
]
# (head_dim, dtype, causal, window, broadcast_q, shape): the deterministic dQ kernel, both shapes.
DQ_CASES = [(128, BF16, False, None, False, "long"), (128, BF16, False, None, False, "short"),
            (64, FP16, True, 32, False, "long"), (64, FP16, True, 32, False, "short"),
            (128, BF16, False, None, True, "long"), (128, BF16, True, 32, True, "short"),
            (64, BF16, False, None, False, "long-d64"), (64, BF16, True, 32, True, "long-d64")]
# The block-sparse forks (separate dQ, no window or broadcast-Q): (head_dim, dtype, causal, selection
# width) for the dK/dV kernel, and the same plus the shape for the dQ kernel.
SPARSE_CASES = [(128, BF16, False, 16), (64, FP16, True, 4)]
SPARSE_DQ_CASES = [(128, BF16, True, 16, "long"), (64, FP16, False, 8, "short")]


def _config_id(cfg):
    head_dim, dtype, causal, window, broadcast_q, *dq_mode = cfg
    return (f"d{head_dim}-{str(dtype).split('.')[-1]}{'-causal' if causal else ''}"
            f"{'-window' if window is not None else ''}{'-bcastq' if broadcast_q else ''}"
            f"{'-dq_' + dq_mode[0] if dq_mode else ''}{f'-q{dq_mode[1]}' if len(dq_mode) > 1 else ''}")


def _compile_spec(spec) -> dict:
    """Compiled for sm_90 as a launch would specialize it (pointers and the `aligned` strides divisible by 16)."""
    kernel = jinspect.compile_spec(spec, "sm_90")
    return dict(ptx=kernel.asm["ptx"], cubin=kernel.asm["cubin"], shared=kernel.metadata.shared)


def _compile(job) -> dict:
    kind, cfg = job
    if kind == "tlx-sparse":
        head_dim, dtype, causal, width = cfg
        spec = jagged_bwd.inspect_spec(head_dim=head_dim, dtype=dtype, causal=causal, selection_width=width)
    elif kind == "dq-sparse":
        head_dim, dtype, causal, width, shape = cfg
        spec = jagged_bwd.dq_inspect_spec(head_dim=head_dim, dtype=dtype, causal=causal, config=shape,
                                          selection_width=width)
    elif kind == "tlx":
        head_dim, dtype, causal, window, broadcast_q, dq_mode, *max_queries = cfg  # sum(max_queries): 0 when absent
        spec = jagged_bwd.inspect_spec(head_dim=head_dim, dtype=dtype, causal=causal, window=window,
                                       broadcast_q=broadcast_q, dq_mode=dq_mode, max_queries=sum(max_queries))
    else:
        head_dim, dtype, causal, window, broadcast_q, shape = cfg
        spec = jagged_bwd.dq_inspect_spec(head_dim=head_dim, dtype=dtype, causal=causal, window=window,
                                          broadcast_q=broadcast_q, config=shape)
    return _compile_spec(spec)


@pytest.fixture(scope="session")
def compiled():
    """All configurations compiled once per session, in parallel on every core."""
    jobs = ([("tlx", c) for c in CONFIGS] + [("dq", c) for c in DQ_CASES] + [("tlx-sparse", c) for c in SPARSE_CASES]
            + [("dq-sparse", c) for c in SPARSE_DQ_CASES])
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=context) as pool:
        return dict(zip(jobs, pool.map(_compile, jobs)))


def _count(ptx: str, mnemonic: str) -> int:
    return len(re.findall(rf"^\s*(?:@%p\d+\s+)?{re.escape(mnemonic)}", ptx, flags=re.MULTILINE))


@pytest.mark.parametrize("cfg", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_compiles_to_warp_specialized_wgmma(compiled, cfg):
    result = compiled[("tlx", cfg)]
    ptx, shared = result["ptx"], result["shared"]
    dq_mode = cfg[5]
    # S^T, dP^T, dV, dK (and dQ) all run on wgmma.
    assert _count(ptx, "wgmma.mma_async") > 0
    # Producer gives registers back, consumers take them.
    assert _count(ptx, "setmaxnreg.dec") >= 1 and _count(ptx, "setmaxnreg.inc") >= 1
    assert _count(ptx, "mbarrier.try_wait") > 0 and _count(ptx, "mbarrier.arrive") > 0
    assert _count(ptx, "cp.async.bulk.tensor") > 0
    assert shared <= specs.SHARED_BYTES_PER_BLOCK["sm_90"]
    resident_q = jagged_bwd.kernel_config(cfg[0], cfg[1], broadcast_q=cfg[4], dq_mode=dq_mode,
                                          max_queries=sum(cfg[6:]))["RESIDENT_Q"]
    # dK/dV are stored with row masks, never whole-tile TMA stores that would clobber the next sequence;
    # RESIDENT_Q's TMA stores write each consumer's dQ, two halves, once, to its program's own partial.
    tma_stores = _count(ptx, "cp.async.bulk.tensor.2d.global.shared")
    assert tma_stores == (2 * jagged_bwd.NUM_CONSUMERS.value if resident_q else 0)
    # dQ: fp32 atomics only in the atomic mode, one TMA reduce-add per consumer in the TMA mode (but
    # RESIDENT_Q, which sums in registers), and neither in the separate (deterministic) mode: float
    # atomics reorder sums.
    float_atomics = len(re.findall(r"(?:atom|red)\.global\.[\w.]*add\.f32", ptx))
    tma_reduces = _count(ptx, "cp.reduce.async.bulk.tensor")
    assert (float_atomics > 0) == (dq_mode == ATOMIC)
    assert (tma_reduces > 0) == (dq_mode == TMA and not resident_q)


@pytest.mark.parametrize("cfg", DQ_CASES, ids=[_config_id(c) for c in DQ_CASES])
def test_deterministic_dq_kernel_compiles_without_atomics(compiled, cfg):
    ptx = compiled[("dq", cfg)]["ptx"]
    assert _count(ptx, "wgmma.mma_async") > 0  # plain Triton tl.dot becomes wgmma on sm_90
    assert not re.search(r"\b(?:atom|red)\.global", ptx)  # \b: not the "red.global" of cp.async.*.shared.global


@pytest.mark.parametrize("job", [("tlx-sparse", c) for c in SPARSE_CASES] + [("dq-sparse", c) for c in SPARSE_DQ_CASES],
                         ids=lambda job: f"{job[0]}-" + "-".join(str(x).split(".")[-1] for x in job[1]))
def test_block_sparse_forks_compile(compiled, job):
    ptx, shared = compiled[job]["ptx"], compiled[job]["shared"]
    assert _count(ptx, "wgmma.mma_async") > 0
    assert not re.search(r"\b(?:atom|red)\.global", ptx)  # dQ by the separate kernel: no float atomics
    assert shared <= specs.SHARED_BYTES_PER_BLOCK["sm_90"]
    if job[0] == "tlx-sparse":
        assert _count(ptx, "setmaxnreg.dec") >= 1 and _count(ptx, "cp.async.bulk.tensor") > 0


def _runs_by_default(cfg) -> bool:
    """A benchmarked configuration the backward picks by itself: separate dQ, or tma_reduce at a head dim
    where the fused mode is a default."""
    head_dim, dtype, causal, window, _, dq_mode = cfg[:6]
    return dtype == BF16 and window is None and (
        (dq_mode == SEP and not causal) or (dq_mode == TMA and head_dim in jagged_bwd.FUSED_DQ_DEFAULT_HEAD_DIMS))


# Values a wgmma loop of a benchmarked kernel may reload from local memory per step (head dim, dQ mode):
# what they reloaded when last measured, so a change that adds reloads fails here first.
LOOP_RELOAD_BUDGET = {(64, SEP): 0, (64, TMA): 0, (128, SEP): 3, (128, TMA): 0}
# RESIDENT_Q streams no query blocks: its wgmma loop is the key-tile loop, one step per tile, with the
# program's dQ live across it. Consumer 1 reloads 14 values per tile there, consumer 0 none; that is
# the kernel measured 1.40x the two-K-slot one-step kernel it replaced (results/ab-bwd-resident-q-*).
RESIDENT_Q_LOOP_RELOAD_BUDGET = 14


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if _runs_by_default(c)], ids=_config_id)
def test_benchmark_configurations_keep_their_loops_reload_budget(compiled, cfg):
    """The benchmarked kernels keep (almost) nothing in local memory inside their wgmma loops. History:
    with the full mask D=128 reloaded one value per step, and with the three loops of the mask-free bulk
    up to 11 (measured 0.92-1.00x); rows-only masks made the loop clean. The K/V slot indexed per step
    (`common.per_step`) costs the separate D=128 kernel 3 reloads in one consumer's loop and ran
    1.00-1.09x on the shapes it is the default for; it took the fused D=128 step from 34-46 reloads
    to 7-19, where it passed the separate mode from a mean of 512 queries (results/bwd-dq-modes-d128-*);
    the head and key columns per step took it to 1, and two dS stages per consumer to 0."""
    head_dim, dq_mode = cfg[0], cfg[5]
    loops = jinspect.mma_loops(compiled[("tlx", cfg)]["cubin"])
    assert loops, "no wgmma loop found in the SASS"
    resident_q = jagged_bwd.kernel_config(head_dim, cfg[1], broadcast_q=cfg[4], dq_mode=dq_mode,
                                          max_queries=sum(cfg[6:]))["RESIDENT_Q"]
    budget = RESIDENT_Q_LOOP_RELOAD_BUDGET if resident_q else LOOP_RELOAD_BUDGET[(head_dim, dq_mode)]
    assert all(max(loop["local_loads"], loop["local_stores"]) <= budget for loop in loops), (budget, loops)


def test_ptx_instruction_counts_reported(compiled):
    """The D=128 bf16 base kernel's instruction mix, printed for the record (-s)."""
    ptx = compiled[("tlx", CONFIGS[0])]["ptx"]
    counts = {m: _count(ptx, m) for m in ("wgmma.mma_async", "setmaxnreg", "mbarrier",
                                           "cp.async.bulk.tensor", "atom.global", "red.global")}
    print(counts, "shared bytes", compiled[("tlx", CONFIGS[0])]["shared"])
    assert counts["wgmma.mma_async"] > 0 and counts["setmaxnreg"] > 0 and counts["mbarrier"] > 0


def test_bad_config_raises():
    with pytest.raises(ValueError, match="head_dim"):
        jagged_bwd.kernel_config(96, BF16)
    with pytest.raises(TypeError, match="dtype"):
        jagged_bwd.kernel_config(128, torch.float32)
    with pytest.raises(ValueError, match="dq_mode"):
        jagged_bwd.kernel_config(128, BF16, dq_mode="fast")
    with pytest.raises(ValueError, match="deterministic"):
        jagged_bwd.resolve_dq_mode("atomic", deterministic=True)
    with pytest.raises(ValueError, match="block-sparse"):
        jagged_bwd.kernel_config(128, BF16, dq_mode="atomic", selection_width=8)
    assert jagged_bwd.resolve_dq_mode(None, deterministic=True) == "separate"
    assert jagged_bwd.resolve_dq_mode(None, deterministic=False) == jagged_bwd.DEFAULT_DQ_MODE


def test_early_v_release_only_with_broadcast_q_in_the_fused_d128_step_or_resident_q():
    """Measured faster with broadcast-Q only (one or a few steps per tile), so self-attention keeps one barrier;
    RESIDENT_Q (one step per tile) frees V after dP at either head dim."""
    assert jagged_bwd.kernel_config(128, BF16, broadcast_q=True, dq_mode=TMA)["EARLY_V_RELEASE"]
    assert jagged_bwd.kernel_config(64, BF16, broadcast_q=True, dq_mode=TMA, max_queries=64)["EARLY_V_RELEASE"]
    for head_dim, broadcast_q, dq_mode in [(128, False, TMA), (128, True, SEP), (128, True, ATOMIC), (64, True, TMA)]:
        assert not jagged_bwd.kernel_config(head_dim, BF16, broadcast_q=broadcast_q, dq_mode=dq_mode)["EARLY_V_RELEASE"]


def test_one_step_tuning_only_where_every_broadcast_tile_runs_one_step():
    """RESIDENT_Q (Q and dQ kept per program) needs one query block and one query head per key head."""
    one_step = jagged_bwd.ONE_STEP_TUNING[128]
    config = jagged_bwd.kernel_config(128, BF16, broadcast_q=True, dq_mode=TMA, max_queries=64)
    assert config["RESIDENT_Q"] and all(config[name] == value for name, value in one_step.items())
    assert jagged_bwd.kernel_config(64, BF16, broadcast_q=True, dq_mode=TMA, max_queries=64)["RESIDENT_Q"]
    assert not jagged_bwd.kernel_config(64, BF16, broadcast_q=True, dq_mode=ATOMIC, max_queries=64)["RESIDENT_Q"]
    for max_queries, gqa_group, broadcast_q in [(65, 1, True), (16, 2, True), (0, 1, True), (64, 1, False)]:
        config = jagged_bwd.kernel_config(128, BF16, broadcast_q=broadcast_q, dq_mode=TMA, max_queries=max_queries,
                                          gqa_group=gqa_group)
        assert not config["RESIDENT_Q"]
        assert config["NUM_V_BUFFERS"] == config["NUM_KV_BUFFERS"] == jagged_bwd.FUSED_DQ_TUNING[128]["NUM_KV_BUFFERS"]


def test_resident_q_grid_keeps_one_key_head_per_program():
    """A multiple of the key heads within the SMs (or the tiles), at least one program per key head."""
    assert jagged_bwd.resident_q_grid(132, 4, 10**6) == 132
    assert jagged_bwd.resident_q_grid(132, 5, 10**6) == 130
    assert jagged_bwd.resident_q_grid(132, 67, 10**6) == 67
    assert jagged_bwd.resident_q_grid(132, 4, 10) == 8
    assert jagged_bwd.resident_q_grid(132, 200, 10**6) == 200


def test_deterministic_runs_resident_q_where_it_is_the_default():
    """RESIDENT_Q adds nothing (each program stores its dQ once; the copies are summed in a fixed order), so
    deterministic=True keeps it where it is the default; elsewhere, and for atomics, the separate mode."""
    resolve = jagged_bwd.resolve_dq_mode
    assert resolve(None, deterministic=True, default="tma_reduce", resident_q=True) == "tma_reduce"
    assert resolve("tma_reduce", deterministic=True, default="separate", resident_q=True) == "tma_reduce"
    assert resolve(None, deterministic=True, default="separate", resident_q=True) == "separate"
    assert resolve(None, deterministic=True, default="tma_reduce", resident_q=False) == "separate"
    for mode, resident_q in (("atomic", True), ("tma_reduce", False)):
        with pytest.raises(ValueError, match="deterministic"):
            resolve(mode, deterministic=True, resident_q=resident_q)


def test_default_dq_mode_fuses_only_where_measured_faster():
    """Dense selection, keys averaging at most FUSED_DQ_MAX_MEAN_KEYS (FUSED_DQ_MAX_MEAN_KEYS_CAUSAL when
    causal) and queries at least FUSED_DQ_MIN_MEAN_QUERIES, at a head dim of FUSED_DQ_DEFAULT_HEAD_DIMS:
    tma_reduce; anything else, and anything deterministic, the separate mode (results/bwd-dq-modes-*).
    The benchmark's dense batches, where it was measured faster at both head dims, fuse."""
    for dense in specs.BENCH_SUITES["dense"]:
        assert jagged_bwd.default_dq_mode(dense["head_dim"], False, dense["max_len"], False) == "tma_reduce"
    bound, causal_bound = jagged_bwd.FUSED_DQ_MAX_MEAN_KEYS[64], jagged_bwd.FUSED_DQ_MAX_MEAN_KEYS_CAUSAL[64]
    assert jagged_bwd.default_dq_mode(64, causal=True, mean_keys=causal_bound, block_sparse=False) == "tma_reduce"
    fused = jagged_bwd.default_dq_mode(64, causal=False, mean_keys=bound, block_sparse=False)
    assert fused == "tma_reduce"
    assert jagged_bwd.resolve_dq_mode(None, deterministic=False, default=fused) == "tma_reduce"
    assert jagged_bwd.resolve_dq_mode(None, deterministic=True, default=fused) == "separate"
    assert jagged_bwd.resolve_dq_mode("atomic", deterministic=False, default=fused) == "atomic"
    least = jagged_bwd.FUSED_DQ_MIN_MEAN_QUERIES[128]
    for causal in (False, True):
        assert jagged_bwd.default_dq_mode(128, causal, 100 * least, False) == "tma_reduce"
        assert jagged_bwd.default_dq_mode(128, causal, least, False) == "tma_reduce"
        assert jagged_bwd.default_dq_mode(128, causal, least - 1, False) == "separate"
    # the query rows decide, not the keys; broadcast-Q passes no query bound (inf)
    assert jagged_bwd.default_dq_mode(128, False, 1032, False, mean_queries=256) == "separate"
    assert jagged_bwd.default_dq_mode(128, False, 100, False, mean_queries=least) == "tma_reduce"
    assert jagged_bwd.default_dq_mode(128, False, 100, False, mean_queries=math.inf) == "tma_reduce"
    for head_dim, causal, mean_keys, block_sparse in [(64, True, causal_bound + 1, False),
                                                      (64, False, bound + 1, False), (64, False, 100, True),
                                                      (128, False, 4096, True), (96, False, 1024, False)]:
        assert jagged_bwd.default_dq_mode(head_dim, causal, mean_keys, block_sparse) == "separate"
    # broadcast-Q with fewer sequences than programs: the fused mode's per-program dQ copies would outnumber
    # the separate mode's per-sequence ones
    assert jagged_bwd.default_dq_mode(64, False, 100, False, more_dq_copies=True) == "separate"
    assert jagged_bwd.default_dq_mode(128, False, 4096, False, more_dq_copies=True) == "separate"


def test_batch_dq_mode_on_the_benchmark_batches():
    """The mode the backward picks by itself for each benchmark batch, from the packed sizes alone: at
    D=128 the fused mode from a mean of FUSED_DQ_MIN_MEAN_QUERIES query rows per sequence (broadcast-Q,
    over more sequences than SMs, whatever its rows), at D=64 up to FUSED_DQ_MAX_MEAN_KEYS keys."""
    num_sms = specs.H200_SM_COUNT
    least = jagged_bwd.FUSED_DQ_MIN_MEAN_QUERIES[128]
    for suite in ("gem", "pma", "dense"):
        for case in specs.BENCH_SUITES[suite]:
            q_lens, kv_lens = case_lengths(case)
            broadcast_q = suite == "pma"
            q_rows = q_lens[0] if broadcast_q else sum(q_lens)
            mean_queries = math.inf if broadcast_q else sum(q_lens) / len(q_lens)
            for head_dim in specs.SUPPORTED_HEAD_DIMS:
                mode = jagged_bwd.batch_dq_mode(head_dim, q_rows, sum(kv_lens), len(kv_lens), num_sms, False,
                                                broadcast_q, False)
                fused = mean_queries >= least if head_dim == 128 else True
                assert mode == ("tma_reduce" if fused else "separate"), (suite, case["case"], head_dim, mode)
    # broadcast-Q over fewer sequences than SMs: never fused (its per-program dQ copies would outnumber)
    assert jagged_bwd.batch_dq_mode(64, 64, 100 * 40, 40, num_sms, False, True, False) == "separate"
    assert jagged_bwd.batch_dq_mode(128, 4096, 4096, 1, num_sms, True, False, True) == "separate"  # block-sparse


# ---- the schedule ----------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 40), (True, 200)])
def test_query_block_ranges_cover_exactly_the_visible_queries(causal, window):
    """Each KV block's query-block range spans the queries that see it (with causal and window
    together the block-level range may include a few blocks whose rows all see nothing)."""
    combined = causal and window is not None
    gen = torch.Generator().manual_seed(0)
    block_m, block_n = 64, 128
    q_lens = torch.randint(0, 700, (24,), generator=gen)
    kv_lens = torch.randint(0, 700, (24,), generator=gen)
    q_lens[:4] = torch.tensor([0, 1, 129, 300])
    kv_lens[:4] = torch.tensor([5, 0, 64, 40])
    kv_blocks = -(-int(kv_lens.max()) // block_n)
    blocks = tile_schedule.q_blocks_per_kv_tile(q_lens, kv_lens, kv_blocks, block_m=block_m, block_n=block_n,
                                             causal=causal, window=window)
    for b in range(len(q_lens)):
        lq, lk = int(q_lens[b]), int(kv_lens[b])
        vis = visible_mask(lq, lk, causal, window)
        for kb in range(kv_blocks):
            if kb * block_n >= lk:
                assert blocks[b, kb] == -1
                continue
            rows = vis[:, kb * block_n:(kb + 1) * block_n].any(1).nonzero().flatten()
            if rows.numel() == 0:
                assert blocks[b, kb] == 0 or combined
                continue
            needed = int(rows[-1]) // block_m - int(rows[0]) // block_m + 1
            assert blocks[b, kb] == needed or (combined and blocks[b, kb] >= needed)


def test_schedule_keeps_idle_tiles_and_sorts_longest_first():
    """Tiles no query sees stay in the list (their dK/dV rows must be zeroed); longest run first."""
    q_offsets = torch.tensor([0, 0, 300, 301], dtype=torch.int32)  # sequence 0 has no queries
    kv_offsets = torch.tensor([0, 200, 500, 501], dtype=torch.int32)
    schedule = tile_schedule.build_kv_tile_schedule(q_offsets, kv_offsets, max_seq_len_kv=300, broadcast_q_len=0,
                                                    block_m=64, block_n=128, causal=False, window=None)
    assert schedule.kv_blocks_per_seq == 3
    assert schedule.num_entries.tolist() == [2 + 3 + 1]
    real = schedule.entries[:6].tolist()
    seqs = [e // schedule.kv_blocks_per_seq for e in real]
    assert seqs[:3] == [1, 1, 1]  # 5 query blocks each
    assert seqs[3] == 2 and sorted(seqs[4:]) == [0, 0]


def test_broadcast_q_schedule_uses_the_shared_query_length():
    kv_offsets = torch.tensor([0, 10, 900], dtype=torch.int32)
    schedule = tile_schedule.build_kv_tile_schedule(torch.tensor([0, 256], dtype=torch.int32), kv_offsets,
                                                    max_seq_len_kv=890, broadcast_q_len=256, block_m=64,
                                                    block_n=128, causal=False, window=None)
    assert schedule.num_entries.tolist() == [1 + 7]
    assert schedule.max_entries == 2 * 7


# ---- the plain-Triton kernels, run by Triton's CPU interpreter ---------------------------------
# The Delta preprocess and the deterministic dQ kernel use no TLX, so TRITON_INTERPRET=1 runs them
# here. The interpreter must be on before the module is imported, hence a subprocess. fp16 only:
# the interpreter mishandles bf16 dot operands (garbage products), which the GPU tests cover.
_INTERPRETED_DQ_CHECK = r"""
import math, sys, torch
from jfa import reference, specs
from jfa.kernels import jagged_bwd as jb

def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)

def check(q_lens, kv_lens, heads_q, heads_kv, head_dim, causal, window, broadcast_q, seed, config):
    gen = torch.Generator().manual_seed(seed)
    q_rows = q_lens[0] if broadcast_q else sum(q_lens)
    q = torch.randn(q_rows, heads_q, head_dim, generator=gen).half()
    k, v = (torch.randn(sum(kv_lens), heads_kv, head_dim, generator=gen).half() for _ in range(2))
    q_off, kv_off = offsets([q_lens[0]] if broadcast_q else q_lens), offsets(kv_lens)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    mask = dict(causal=causal, window=window, broadcast_q=broadcast_q)
    out, lse = reference.jagged_attention_ref(*leaves, q_off, kv_off, **mask)
    dout = torch.randn(out.shape, generator=gen).half()
    dq_ref = torch.autograd.grad(out, leaves[0], dout.float())[0]
    out_low = out.detach().half()
    delta = jb.compute_delta(out_low, dout)
    assert torch.allclose(delta, (out_low.float() * dout.float()).sum(-1).T, atol=1e-4), "Delta"
    scale = 1 / math.sqrt(head_dim)
    target = torch.full((len(kv_lens), *q.shape) if broadcast_q else q.shape, float("nan"),
                        dtype=torch.float32 if broadcast_q else q.dtype)
    jb.launch_dq(q, k, v, dout, lse.detach().contiguous(), delta, target, q_off, kv_off, max(q_lens), scale,
                 causal, window, broadcast_q, config)
    dq = target.sum(0) if broadcast_q else target.float()
    assert not torch.isnan(dq).any(), "dQ rows left unwritten"
    relerr = ((dq - dq_ref).norm() / dq_ref.norm()).item()
    assert relerr <= specs.GRAD_RELERR, f"dQ relative error {relerr:.2e} ({config})"

# The block-sparse fork: each query block walks its selected key blocks (raw picks: padding, repeats,
# picks past the sequence), against autograd through the block-sparse reference.
def check_sparse(lengths, heads, causal, seed, config):
    from jfa.sparse import canonical_selection
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(lengths), heads, 64, generator=gen).half() for _ in range(3))
    off = offsets(lengths)
    q_blocks = -(-max(lengths) // specs.BLOCK_SPARSE_BLOCK)
    raw = torch.randint(-1, q_blocks + 1, (len(lengths), heads, q_blocks, 3), generator=gen, dtype=torch.int32)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    block = specs.BLOCK_SPARSE_BLOCK
    out, lse = reference.block_sparse_attention_ref(*leaves, off, off, raw, block, block, causal=causal)
    dout = torch.randn(out.shape, generator=gen).half()
    dq_ref = torch.autograd.grad(out, leaves[0], dout.float())[0]
    delta = jb.compute_delta(out.detach().half(), dout)
    target = torch.full(q.shape, float("nan"), dtype=q.dtype)
    jb.launch_dq(q, k, v, dout, lse.detach().float().contiguous(), delta, target, off, off, max(lengths),
                 1 / math.sqrt(64), causal, None, False, config, canonical_selection(raw, off, block))
    assert not torch.isnan(target).any(), "dQ rows left unwritten"
    relerr = ((target.float() - dq_ref).norm() / dq_ref.norm()).item()
    assert relerr <= specs.GRAD_RELERR, f"block-sparse dQ relative error {relerr:.2e} ({config})"

# Both kernel shapes; sequences of several 64-key tiles, so the masked head, the mask-free bulk and the
# masked tail loops all run (windows and causal move the bulk's edges).
for config in jb.DQ_CONFIGS:
    check_sparse([300, 1, 0, 129, 400], 2, False, 4, config)
    check_sparse([300, 129, 400, 77], 2, True, 5, config)
    check([0, 1, 63, 65, 130, 7, 300], [0, 1, 63, 65, 130, 7, 300], 4, 2, 64, False, None, False, 0, config)
    check([5, 64, 130, 0, 20, 290], [70, 64, 20, 9, 0, 330], 2, 2, 64, True, 16, False, 1, config)
    check([290, 140, 3], [300, 200, 3], 2, 2, 64, False, 70, False, 3, config)
    check([33] * 4, [5, 0, 70, 130], 2, 1, 64, True, None, True, 2, config)
print("interpreted dQ kernel ok")
"""


def test_deterministic_dq_kernel_interpreted_matches_reference():
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _INTERPRETED_DQ_CHECK], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "interpreted dQ kernel ok" in result.stdout


def test_dq_kernel_shape_follows_mean_sequence_lengths():
    """Many query rows and many keys per sequence get the 128-row dQ blocks, the rest the 64-row ones
    (at D=64, many query rows)."""
    rows, keys = jagged_bwd.DQ_LONG_MIN_MEAN_ROWS, jagged_bwd.DQ_LONG_MIN_MEAN_KEYS
    b = 1152
    assert jagged_bwd.dq_config(b * 128, b * 128, b, broadcast_q=False) == "short"  # GEM L=256, s=0.5
    assert jagged_bwd.dq_config(b * 256, b * 256, b, broadcast_q=False) == "short"  # GEM L=256, s=1
    assert jagged_bwd.dq_config(b * 512, b * 512, b, broadcast_q=False) == "long"  # GEM L=512, s=1
    assert jagged_bwd.dq_config(b * rows, b * keys, b, broadcast_q=False) == "long"
    assert jagged_bwd.dq_config(b * rows, b * keys - 1, b, broadcast_q=False) == "short"
    assert jagged_bwd.dq_config(64, b * 1024, b, broadcast_q=True) == "short"  # PMA q=64: rows = q_len
    assert jagged_bwd.dq_config(256, b * 1024, b, broadcast_q=True) == "long"  # PMA q=256
    assert jagged_bwd.dq_config(0, 0, 0, broadcast_q=False) == "short"
    # D=64: the 4-warp 128-row shape from the mean query rows alone
    assert jagged_bwd.dq_config(b * 256, b * 256, b, broadcast_q=False, head_dim=64) == "long-d64"  # L=256, s=1
    assert jagged_bwd.dq_config(b * 128, b * 128, b, broadcast_q=False, head_dim=64) == "short"  # L=256, s=0.5
    assert jagged_bwd.dq_config(256, b * 100, b, broadcast_q=True, head_dim=64) == "long-d64"
    assert set(jagged_bwd.DQ_CONFIGS) == {"short", "long", "long-d64"}
    with pytest.raises(ValueError, match="config must be one of"):
        jagged_bwd.dq_inspect_spec(config="medium")


_INTERPRETED_BULK_CHECK = r"""
import random, torch, triton, triton.language as tl
from jfa.kernels import jagged_bwd as jb
from jfa.reference import visible_mask

@triton.jit
def probe(args_ptr, out_ptr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    vals = [tl.load(args_ptr + i) for i in tl.static_range(7)]
    lo, hi = jb._full_block_range(vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], vals[6], BLOCK_M, CAUSAL,
                                  HAS_WINDOW)
    tl.store(out_ptr, lo)
    tl.store(out_ptr + 1, hi)

rng = random.Random(0)
BLOCK_M, KEYS = 64, 64
for trial in range(400):
    causal, has_window = rng.random() < 0.5, rng.random() < 0.5
    q_len, kv_len = rng.randint(1, 700), rng.randint(1, 700)
    window = rng.randint(0, 300)
    first_key = rng.randrange(0, kv_len + KEYS, KEYS) // KEYS * KEYS
    first_row = rng.randrange(0, q_len, BLOCK_M) // BLOCK_M * BLOCK_M
    num_blocks = -(-(q_len - first_row) // BLOCK_M)
    args = torch.tensor([first_key, first_key + KEYS - 1, first_row, num_blocks, q_len, kv_len, window],
                        dtype=torch.int32)
    out = torch.zeros(2, dtype=torch.int32)
    probe[(1,)](args, out, BLOCK_M, causal, has_window)
    mask = visible_mask(q_len, kv_len, causal=causal,
                        window=window if has_window else None)
    full = []
    for i in range(num_blocks):
        r0, k0 = first_row + i * BLOCK_M, first_key
        inside = r0 + BLOCK_M <= q_len and k0 + KEYS <= kv_len
        full.append(inside and bool(mask[r0:r0 + BLOCK_M, k0:k0 + KEYS].all()))
    lo, hi = out.tolist()
    assert 0 <= lo <= hi <= num_blocks, (trial, lo, hi, num_blocks)
    assert full == [lo <= i < hi for i in range(num_blocks)], (trial, causal, has_window, q_len, kv_len, window,
                                                               first_key, first_row, lo, hi, full)
print("bulk range ok")
"""


def test_mask_free_bulk_range_is_exactly_the_fully_visible_blocks():
    """`_full_block_range` (run by Triton's interpreter) against brute force over the reference mask:
    the blocks it calls mask-free are exactly those where every (query, key) pair is visible."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _INTERPRETED_BULK_CHECK], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bulk range ok" in result.stdout
