"""CPU checks of the jagged forward: every configuration compiles for sm_90 into a warp-specialized
wgmma kernel that fits in shared memory, and the tile schedule's arithmetic matches the masks.

The kernel cannot run here (TLX needs a GPU; the interpreter cannot run it), so correctness of the
numbers is tested in tests/gpu/test_jagged_fwd.py. What can be checked without a GPU is checked:
the compiled code's structure, and the host schedule against a brute-force mask.
"""
import concurrent.futures
import itertools
import multiprocessing
import os
import re

import pytest
import torch

from jfa import specs
from jfa.kernels import jagged_fwd
from jfa.reference import visible_mask
from jfa.schedule import build_tile_schedule, clear_cache, kv_tiles_per_entry
from jfa.workbench import inspect as jinspect

BF16, FP16 = torch.bfloat16, torch.float16
# (head_dim, dtype, causal, window, broadcast_q, heads_per_tile, half_tail, selection_width, short_kv,
#  long_seqs):
# every flag combination with one head per tile, a spread of them with two (the short-query mode has
# its own ring layout), a spread with half last tiles (compiled in for KV sequences of at most 256
# keys), the block-sparse fork (selection_width > 0; one head per tile, no window or broadcast-Q) and
# a spread with the short-key tuning (64-key tiles, a 4-deep ring: `jagged_fwd.SHORT_KV_TUNING`) and
# one with the long-sequence tuning (three consumers at D=64: `jagged_fwd.LONG_TUNING`).
CONFIGS = [cfg + (1, False) for cfg in itertools.product(specs.SUPPORTED_HEAD_DIMS, specs.SUPPORTED_DTYPES,
                                                         (False, True), (None, 32), (False, True))]
CONFIGS += [(64, BF16, False, None, True, 2, False), (128, BF16, False, None, True, 2, False),
            (128, BF16, True, 32, False, 2, False), (128, FP16, False, None, False, 2, False),
            (64, FP16, True, 32, True, 2, False), (128, BF16, False, 32, True, 2, False)]
CONFIGS += [(128, BF16, False, None, False, 1, True), (128, BF16, False, None, True, 1, True),
            (128, FP16, True, 32, False, 1, True), (64, BF16, False, None, False, 1, True),
            (128, BF16, False, None, True, 2, True), (64, FP16, True, None, True, 2, True)]
CONFIGS = [cfg + (0,) for cfg in CONFIGS]
CONFIGS += [(128, BF16, False, None, False, 1, False, 16), (128, FP16, True, None, False, 1, False, 8),
            (64, BF16, True, None, False, 1, False, 32), (64, FP16, False, None, False, 1, False, 1)]
# The FP8 fork (E4M3 inputs; one head per tile, no half tiles).
FP8 = torch.float8_e4m3fn
CONFIGS += [(128, FP8, False, None, False, 1, False, 0), (64, FP8, True, 32, False, 1, False, 0),
            (128, FP8, False, None, True, 1, False, 0), (128, FP8, True, None, False, 1, False, 0)]
CONFIGS = [cfg + (False,) for cfg in CONFIGS]
CONFIGS += [(128, BF16, False, None, False, 1, False, 0, True), (128, BF16, False, None, False, 1, True, 0, True),
            (128, FP16, True, 32, False, 1, True, 0, True), (128, BF16, False, None, True, 1, True, 0, True),
            (128, BF16, True, None, False, 1, False, 0, True)]
CONFIGS = [cfg + (False,) for cfg in CONFIGS]
CONFIGS += [(64, BF16, False, None, False, 1, False, 0, False, True),
            (64, FP16, True, 32, False, 1, False, 0, False, True),
            (64, BF16, False, None, True, 1, False, 0, False, True),
            (64, BF16, True, None, False, 1, True, 0, False, True)]


def _config_id(cfg):
    head_dim, dtype, causal, window, broadcast_q, heads, half_tail, selection_width, short_kv, long_seqs = cfg
    return (f"d{head_dim}-{str(dtype).split('.')[-1]}{'-causal' if causal else ''}"
            f"{'-window' if window is not None else ''}{'-bcastq' if broadcast_q else ''}"
            f"{'-2heads' if heads == 2 else ''}{'-halftail' if half_tail else ''}"
            f"{f'-sparse{selection_width}' if selection_width else ''}{'-shortkv' if short_kv else ''}"
            f"{'-long' if long_seqs else ''}")


def _compile(cfg) -> dict:
    """Compile one configuration for sm_90; returns what the checks read (picklable)."""
    head_dim, dtype, causal, window, broadcast_q, heads, half_tail, selection_width, short_kv, long_seqs = cfg
    # Two heads per tile means every sequence is one query block, where the kernel runs entry-major.
    spec = jagged_fwd.inspect_spec(head_dim=head_dim, dtype=dtype, causal=causal, window=window,
                                   broadcast_q=broadcast_q, heads_per_tile=heads, entry_major=heads == 2,
                                   half_tail=half_tail, selection_width=selection_width,
                                   short_kv=short_kv, long_seqs=long_seqs)
    kernel = jinspect.compile_spec(spec, "sm_90")
    return dict(ptx=kernel.asm["ptx"], cubin=kernel.asm["cubin"], shared=kernel.metadata.shared,
                wgmma_waits=jinspect.wgmma_waits(kernel.asm["ttgir"]))


@pytest.fixture(scope="session")
def compiled():
    """All configurations compiled once per session, in parallel on every core (compiling is
    CPU-bound and single-threaded; Triton's disk cache makes later sessions fast too)."""
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=context) as pool:
        return dict(zip(CONFIGS, pool.map(_compile, CONFIGS)))


def _consumers(cfg) -> int:
    """The configuration's consumer warpgroups (three with the long-sequence tuning at D=64)."""
    head_dim, dtype, short_kv, long_seqs = cfg[0], cfg[1], cfg[8], cfg[9]
    return jagged_fwd.kernel_config(head_dim, dtype, short_kv=short_kv, long_seqs=long_seqs)["NUM_CONSUMERS"]


def _count(ptx: str, mnemonic: str) -> int:
    return len(re.findall(rf"^\s*(?:@%p\d+\s+)?{re.escape(mnemonic)}", ptx, flags=re.MULTILINE))


@pytest.mark.parametrize("cfg", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_compiles_to_warp_specialized_wgmma(compiled, cfg):
    ptx, shared = compiled[cfg]["ptx"], compiled[cfg]["shared"]
    # QK^T and P·V both run on wgmma, in both consumers.
    assert _count(ptx, "wgmma.mma_async") > 0
    # The producer gives registers back and the consumers take them: setmaxnreg dec and inc.
    assert _count(ptx, "setmaxnreg.dec") >= 1 and _count(ptx, "setmaxnreg.inc") >= 1
    # The rings are mbarrier pipelines: TMA loads arrive with expect_tx, consumers try_wait.
    assert _count(ptx, "mbarrier.try_wait") > 0
    assert _count(ptx, "mbarrier.arrive") > 0
    assert _count(ptx, "cp.async.bulk.tensor") > 0
    assert shared <= specs.SHARED_BYTES_PER_BLOCK["sm_90"]
    # Whole output blocks leave by one TMA store per consumer from shared memory, except in the FP8
    # fork (bf16 output of one-byte inputs) and entry-major broadcast-Q (two heads per tile here),
    # which store every block with a row mask.
    dtype, broadcast_q, heads = cfg[1], cfg[4], cfg[5]
    stores = _count(ptx, "cp.async.bulk.tensor.2d.global.shared")
    if dtype == FP8 or (broadcast_q and heads == 2):
        assert stores == 0
    else:
        assert stores == _consumers(cfg) and _count(ptx, "cp.async.bulk.wait_group.read") > 0


def test_ptx_instruction_counts_reported(compiled):
    """The D=128 bf16 base kernel, with its instruction mix printed for the record (-s)."""
    base = next(c for c in CONFIGS if _config_id(c) == "d128-bfloat16")
    ptx = compiled[base]["ptx"]
    counts = {m: _count(ptx, m) for m in ("wgmma.mma_async", "setmaxnreg", "mbarrier",
                                           "cp.async.bulk.tensor", "bar.sync", "bar.arrive")}
    print(counts, "shared bytes", compiled[base]["shared"])
    assert counts["wgmma.mma_async"] > 0 and counts["setmaxnreg"] > 0 and counts["mbarrier"] > 0


# Spill bytes ptxas may report for the benchmark configurations (per thread), almost none of them in
# the KV loop. At 232 consumer registers and with the row indices formed before the loop, D=128
# spilled about 2 KB, inside the loop too, and the dense forward ran 13% slower on the H200.
# The TMA-store epilogue (`jagged_fwd._store_output`) keeps a few more tile values in local memory
# outside the loops: the block-sparse fork's 88 B became 112 B.
FORWARD_SPILL_BUDGET_BYTES = 112
# Local loads (and stores) allowed per KV loop body, by configuration; the mask-free loops are clean.
# The half-tail kernel keeps one loop-carried register in local memory in one consumer's masked edge
# loop (one LDL and one STL per edge step, a step or two per tile); it was measured with that spill:
# GEM L=256 s=0.5 +8-9% (results/fwd-half-tail-ab-*). With QK^T and P·V in flight together
# (jagged_fwd.NUM_STAGES = 0) broadcast-Q q=256 reloads one value per masked edge step (measured
# 0.994x the num_stages 1 kernel, within the rounds' spread) and the block-sparse fork two (80 B of
# spills in all, against 228 B for the same source at num_stages 1).
KV_LOOP_LOCAL_ACCESSES = {"gem-d128-halftail": 1, "pma-q256": 1, "block-sparse-d128": 2}


BENCHMARK_CONFIGS = {"gem-d128": (128, BF16, False, None, False, 1, False, 0, False),
                     "pma-q256": (128, BF16, False, None, True, 1, False, 0, False),
                     "pma-q64": (128, BF16, False, None, True, 2, False, 0, False),
                     "gem-d64": (64, BF16, False, None, False, 1, False, 0, False),
                     "gem-d128-halftail": (128, BF16, False, None, False, 1, True, 0, False),
                     "block-sparse-d128": (128, BF16, False, None, False, 1, False, 16, False),
                     "gem-d128-shortkv": (128, BF16, False, None, False, 1, False, 0, True),
                     "gem-d128-shortkv-halftail": (128, BF16, False, None, False, 1, True, 0, True)}
BENCHMARK_CONFIGS = {name: cfg + (False,) for name, cfg in BENCHMARK_CONFIGS.items()}
BENCHMARK_CONFIGS["dense-d64-long"] = (64, BF16, False, None, False, 1, False, 0, False, True)


@pytest.mark.parametrize("name", BENCHMARK_CONFIGS)
def test_benchmark_configurations_do_not_spill(compiled, name):
    cfg = BENCHMARK_CONFIGS[name]
    spills = jinspect.spill_bytes(compiled[cfg]["ptx"], 90)
    assert max(spills.values()) <= FORWARD_SPILL_BUDGET_BYTES, spills
    kv_loops = jinspect.mma_loops(compiled[cfg]["cubin"])
    assert kv_loops, "no wgmma loop found in the SASS"
    allowed = KV_LOOP_LOCAL_ACCESSES.get(name, 0)
    assert all(max(loop["local_loads"], loop["local_stores"]) <= allowed for loop in kv_loops), kv_loops


@pytest.mark.parametrize("name", BENCHMARK_CONFIGS)
def test_qk_and_pv_stay_in_flight(compiled, name):
    """The KV loop waits for QK^T only after issuing P·V, as written: the only waits for every wgmma
    right after an issue are each consumer's drain, the last tile's P·V with nothing left to hide it
    (two with half last tiles: the half tile's own). Triton's pipeliner adds one after every wgmma at
    num_stages >= 1 (`jagged_fwd.NUM_STAGES`)."""
    cfg = BENCHMARK_CONFIGS[name]
    head_dim, dtype, causal, window, broadcast_q, heads, half_tail, selection_width, short_kv, long_seqs = cfg
    consumers = jagged_fwd.kernel_config(head_dim, dtype, heads_per_tile=heads, selection_width=selection_width,
                                         short_kv=short_kv, long_seqs=long_seqs)["NUM_CONSUMERS"]
    assert compiled[cfg]["wgmma_waits"]["right_after_issue"] == consumers * (2 if half_tail else 1)


# The dQ fork (`jagged_fwd.jagged_attention_dq`, the backward's separate-mode dQ): D 64 and 128, one
# and two heads per tile, broadcast-Q's fp32 partials (`jagged_fwd.DQ_PARTIALS_TUNING`), masks, half
# last tiles.
DQ_FORK_CONFIGS = {
    "d128": dict(head_dim=128),
    "d128-fp16-causal-window": dict(head_dim=128, dtype=FP16, causal=True, window=32),
    "d128-bcastq": dict(head_dim=128, broadcast_q=True),
    "d128-bcastq-2heads-halftail": dict(head_dim=128, broadcast_q=True, heads_per_tile=2, entry_major=True,
                                        half_tail=True),
    "d128-2heads-halftail-causal": dict(head_dim=128, heads_per_tile=2, entry_major=True, half_tail=True,
                                        causal=True),
    "d64": dict(head_dim=64),
    "d64-bcastq-window": dict(head_dim=64, broadcast_q=True, window=8),
    "d64-bcastq-2heads-halftail": dict(head_dim=64, broadcast_q=True, heads_per_tile=2, entry_major=True,
                                       half_tail=True),
}


@pytest.mark.parametrize("name", DQ_FORK_CONFIGS)
def test_dq_fork_compiles_without_spills(name):
    """The dQ fork fits in shared memory, runs S, dP and dQ on wgmma in a warp-specialized kernel,
    and its KV loops neither load nor store local memory (with causal and window masks together
    ptxas spills a few values outside them, within the forward's budget)."""
    report = jinspect.inspect(jagged_fwd.inspect_spec(dq=True, **DQ_FORK_CONFIGS[name]), "sm_90", want_ptx=True)
    assert report.shared_bytes <= specs.SHARED_BYTES_PER_BLOCK["sm_90"]
    assert _count(report.ptx, "setmaxnreg.inc") >= 1 and _count(report.ptx, "wgmma.mma_async") > 0
    assert max(report.spill_bytes.values()) <= FORWARD_SPILL_BUDGET_BYTES, report.spill_bytes
    assert report.loops, "no wgmma loop found in the SASS"
    assert all(max(loop["local_loads"], loop["local_stores"]) == 0 for loop in report.loops), report.loops


def test_bad_config_raises():
    with pytest.raises(ValueError, match="head_dim"):
        jagged_fwd.kernel_config(96, torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        jagged_fwd.kernel_config(128, torch.float32)
    with pytest.raises(ValueError, match="heads_per_tile"):
        jagged_fwd.kernel_config(128, torch.bfloat16, heads_per_tile=4)
    with pytest.raises(ValueError, match="power of two"):
        jagged_fwd.kernel_config(128, torch.bfloat16, selection_width=12)
    with pytest.raises(ValueError, match="block-sparse"):
        jagged_fwd.kernel_config(128, torch.bfloat16, window=8, selection_width=16)
    with pytest.raises(ValueError, match="FP8"):
        jagged_fwd.kernel_config(128, FP8, heads_per_tile=2)
    with pytest.raises(ValueError, match="short-key"):
        jagged_fwd.kernel_config(128, torch.bfloat16, selection_width=16, short_kv=True)
    with pytest.raises(ValueError, match="short-key"):
        jagged_fwd.kernel_config(128, FP8, short_kv=True)
    with pytest.raises(ValueError, match="long-sequence"):
        jagged_fwd.kernel_config(64, torch.bfloat16, selection_width=16, long_seqs=True)
    with pytest.raises(ValueError, match="long-sequence"):
        jagged_fwd.kernel_config(64, FP8, long_seqs=True)
    with pytest.raises(ValueError, match="long_seqs"):
        jagged_fwd.kernel_config(64, torch.bfloat16, short_kv=True, long_seqs=True)
    with pytest.raises(ValueError, match="dQ fork"):
        jagged_fwd.kernel_config(128, FP8, dq=True)
    with pytest.raises(ValueError, match="dQ fork"):
        jagged_fwd.kernel_config(128, torch.bfloat16, selection_width=16, dq=True)


@pytest.mark.parametrize("flag,table", [("short_kv", "SHORT_KV_TUNING"), ("long_seqs", "LONG_TUNING")])
def test_length_tuning_applies_where_it_has_an_entry(flag, table):
    """Short key sequences take SHORT_KV_TUNING's entry for their key, long sequences LONG_TUNING's;
    keys without one keep TUNING's."""
    for key, entry in jagged_fwd.TUNING.items():
        config = jagged_fwd.kernel_config(key[0], torch.bfloat16, heads_per_tile=key[1], **{flag: True})
        expected = getattr(jagged_fwd, table).get(key, entry)
        assert {name: config[name] for name in expected} == expected


def test_length_tunings_change_the_tiles():
    """64-key tiles for short keys at D=128; three consumers, 192-row tiles, for long sequences at D=64."""
    assert jagged_fwd.kernel_config(128, torch.bfloat16, short_kv=True)["BLOCK_N"] == 64
    assert jagged_fwd.kernel_config(64, torch.bfloat16, long_seqs=True)["NUM_CONSUMERS"] == 3
    assert jagged_fwd.tile_rows(1, 3) == 192


def test_length_classes():
    """The tunings are chosen from the packed sizes: short keys, long queries and keys, or neither."""
    mean = jagged_fwd.LONG_MEAN_LEN
    assert jagged_fwd.is_long(4 * mean, 4 * mean, 4) and not jagged_fwd.is_long(4 * mean - 1, 4 * mean, 4)
    assert not jagged_fwd.is_long(4 * mean, 4 * mean - 1, 4)  # long queries over shorter keys
    short = jagged_fwd.SHORT_KV_MEAN_LEN
    assert jagged_fwd.is_short_kv(3 * short, 3) and not jagged_fwd.is_short_kv(3 * short + 1, 3)


def test_fp8_fork_multiplies_in_fp8(compiled):
    """Both GEMMs of the FP8 fork are E4M3 wgmma (QK^T and P·V), never a bf16 one."""
    for cfg in (c for c in CONFIGS if c[1] == FP8):
        ptx = compiled[cfg]["ptx"]
        assert _count(ptx, "wgmma.mma_async.sync.aligned") == _count(ptx, "wgmma.mma_async.sync.aligned.m64"), cfg
        assert re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx), cfg
        assert not re.search(r"wgmma\.mma_async\S*bf16", ptx), cfg


def test_short_queries_pair_heads():
    assert jagged_fwd.heads_per_tile(64, 4) == 2 and jagged_fwd.tile_rows(2) == 64
    assert jagged_fwd.heads_per_tile(65, 4) == 1 and jagged_fwd.tile_rows(1) == 128
    assert jagged_fwd.heads_per_tile(16, 3) == 1  # odd head count: no pairs


# ---- the schedule ----------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 40), (True, 200)])
def test_kv_tile_ranges_cover_exactly_the_visible_keys(causal, window):
    """Each query block's KV tile count spans its visible keys exactly.

    With causal and window together, a block's rows may each see nothing although the block-level
    range (earliest window start to latest diagonal) is not empty: the kernel then visits tiles
    that its masks zero out. That is allowed (a few extra tiles), so there the count may exceed.
    """
    combined = causal and window is not None
    gen = torch.Generator().manual_seed(0)
    block_m, block_n = 128, 128
    q_lens = torch.randint(0, 700, (24,), generator=gen)
    kv_lens = torch.randint(0, 700, (24,), generator=gen)
    q_lens[:3] = torch.tensor([0, 1, 129])
    kv_lens[:3] = torch.tensor([5, 0, 64])
    blocks = -(-int(q_lens.max()) // block_m)
    tiles = kv_tiles_per_entry(q_lens, kv_lens, blocks, block_m=block_m, block_n=block_n,
                               causal=causal, window=window)
    for b in range(len(q_lens)):
        lq, lk = int(q_lens[b]), int(kv_lens[b])
        vis = visible_mask(lq, lk, causal, window)
        for qb in range(blocks):
            if qb * block_m >= lq:
                assert tiles[b, qb] == -1
                continue
            cols = vis[qb * block_m:(qb + 1) * block_m].any(0).nonzero().flatten()
            if cols.numel() == 0:
                assert tiles[b, qb] == 0 or combined
                continue
            first_tile, last_tile = int(cols[0]) // block_n, int(cols[-1]) // block_n
            if combined:
                assert tiles[b, qb] >= last_tile - first_tile + 1
            else:
                assert tiles[b, qb] == last_tile - first_tile + 1


def test_schedule_sorted_longest_first_and_counts_real_entries():
    clear_cache()
    q_offsets = torch.tensor([0, 100, 100, 612, 613], dtype=torch.int32)
    schedule = build_tile_schedule(q_offsets, q_offsets, max_seq_len_q=512, block_m=128,
                                   block_n=128, causal=False, window=None, broadcast_q=False)
    assert schedule.num_entries.tolist() == [1 + 0 + 4 + 1]
    real = schedule.entries[:6].tolist()
    seqs = [e // schedule.q_blocks_per_seq for e in real]
    assert seqs[:4] == [2, 2, 2, 2]  # the 512-long sequence's 4 blocks (4 KV tiles each) first
    assert sorted(seqs[4:]) == [0, 3]
    # Cached on the same tensors; rebuilt when they change in place.
    assert build_tile_schedule(q_offsets, q_offsets, max_seq_len_q=512, block_m=128, block_n=128,
                               causal=False, window=None, broadcast_q=False) is schedule
    q_offsets[4] = 700
    assert build_tile_schedule(q_offsets, q_offsets, max_seq_len_q=512, block_m=128, block_n=128,
                               causal=False, window=None, broadcast_q=False) is not schedule


def test_schedule_from_host_offsets_matches_device_build():
    clear_cache()
    offsets = [0, 37, 300, 300, 1100]
    dev = torch.tensor(offsets, dtype=torch.int32)
    a = build_tile_schedule(dev, dev, max_seq_len_q=800, block_m=128, block_n=128, causal=True,
                            window=None, broadcast_q=False)
    clear_cache()
    b = build_tile_schedule(dev, dev, max_seq_len_q=800, block_m=128, block_n=128, causal=True,
                            window=None, broadcast_q=False, host_q_offsets=offsets,
                            host_kv_offsets=offsets)
    assert torch.equal(a.entries, b.entries) and torch.equal(a.num_entries, b.num_entries)


def test_broadcast_q_schedule_keeps_query_blocks_of_a_sequence_together():
    """PMA: equal-work entries keep their order, so a sequence's query blocks are neighbours."""
    clear_cache()
    q_offsets = torch.tensor([0, 256], dtype=torch.int32)
    kv_offsets = torch.tensor([0, 10, 900, 1200, 3200], dtype=torch.int32)
    schedule = build_tile_schedule(q_offsets, kv_offsets, max_seq_len_q=256, block_m=128,
                                   block_n=128, causal=False, window=None, broadcast_q=True)
    blocks = (schedule.entries % schedule.q_blocks_per_seq).tolist()
    seqs = (schedule.entries // schedule.q_blocks_per_seq).tolist()
    assert schedule.num_entries.tolist() == [8]
    assert blocks == [0, 1] * 4
    assert seqs == [3, 3, 1, 1, 2, 2, 0, 0]
