"""`jfa.configs`: the one place that chooses every jagged kernel's configuration.

`select` on each benchmark suite case (`tests/suite_shapes.py`) gives the tunings the module's
comments name, and no other: short-key tiles on GEM batches averaging at most SHORT_KEYS_MEAN keys,
half last tiles only where no key sequence is longer than HALF_TAIL_MAX_KEYS, paired heads on PMA
q=64, three consumers on dense D=64; dQ fused where `FUSED` bounds its head dim's mode (DQ_SPLIT from
a mean of 512 queries at D=128, DQ_HANDOFF up to a mean of 4096 keys at D=64), summed in registers
(DQ_RESIDENT) on PMA q=64, by the dQ kernel (DQ_NONE) otherwise and wherever the call is deterministic,
except where DQ_RESIDENT applies; forks that take the base tiles (block-sparse, FP8, block masks) get
them. Feature flags pass through unchanged. And the space `reachable_configs()` enumerates is the
feature flags times a few tunings: the counts docs/decisions.md reports.
"""
import pytest

from jfa import configs, specs
from jfa.kernels import bwd_dkdv, bwd_dq, fwd_sm90
from jfa.kernels.bwd_dkdv import DQ_HANDOFF, DQ_NONE, DQ_RESIDENT, DQ_SPLIT
from jfa.kernels.tiles import ROWS_PER_CONSUMER
from tests.suite_shapes import mean_keys, mean_queries, suite_cases, suite_shape

# The constexpr sets one 16-bit dtype reaches (docs/decisions.md reports them against the old kernels'
# 352 forward, whose kernel was also the dQ kernel, and 60 backward).
REACHABLE_COUNTS = {"forward": 64, "dq": 56, "dkdv": 38}
FEATURE_SETS = len(specs.SUPPORTED_HEAD_DIMS) * 2 * 2 * 2  # head dim x causal x window x broadcast-Q
MAX_FORWARD_TUNINGS_PER_FEATURE_SET = 4  # base, short keys, short queries or long, each with or without half tails

GEM_D128 = [("gem", case) for _, case in suite_cases(("gem",))]
PMA_Q64 = ("pma", "q=64,kv<=2048")
PMA_Q256 = ("pma", "q=256,kv<=2048")
DENSE_D128 = ("dense", "B=4,H=32,N=4096,D=128")
DENSE_D64 = ("dense", "B=4,H=32,N=4096,D=64")
ALL_CASES = suite_cases()
GQA_KV_HEADS = 2  # of the suites' 4 query heads (dense has 32): groups of 2 and 16
WINDOW = 64
FEATURES = [dict(), dict(causal=True), dict(window=WINDOW), dict(causal=True, window=WINDOW)]


def _tuning(config, table_entry: dict) -> dict:
    return {name: getattr(config, name) for name in table_entry}


def _case_id(case):
    return " ".join(case)


# ---- the forward -----------------------------------------------------------------------------------------

def test_short_key_tiles_on_gem_batches_of_short_keys():
    """FWD_SHORT_KEYS where keys average at most SHORT_KEYS_MEAN per sequence (GEM L=256 and L=512 at
    s=0.5); the base tiles on the longer GEM batches."""
    short = []
    for case in GEM_D128:
        shape = suite_shape(*case)
        config = configs.select(shape).forward
        if mean_keys(shape) <= configs.SHORT_KEYS_MEAN:
            assert _tuning(config, configs.FWD_SHORT_KEYS[128]) == configs.FWD_SHORT_KEYS[128], case
            short.append(case[1])
        else:
            assert _tuning(config, configs.FWD_BASE[128]) == configs.FWD_BASE[128], case
    assert short == ["L=256,s=0.5", "L=256,s=1.0", "L=512,s=0.5"]


@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
def test_half_tails_only_where_no_key_sequence_is_longer_than_the_bound(case):
    """HALF_TAIL in the forward and the dQ kernel exactly where the longest key sequence has at most
    HALF_TAIL_MAX_KEYS keys (one head per tile; a half tile is at least a wgmma's MIN_HALF_TILE_KEYS)."""
    shape = suite_shape(*case, deterministic=True)  # deterministic: the dQ kernel runs everywhere but PMA q=64
    bounded = shape.max_seq_len_kv <= configs.HALF_TAIL_MAX_KEYS
    forward = configs.forward_config(shape)
    assert forward.HALF_TAIL == (bounded and forward.HEADS_PER_TILE == 1), case
    dq = configs.dq_config(shape)
    assert dq.HALF_TAIL == (bounded and dq.BLOCK_N // 2 >= configs.MIN_HALF_TILE_KEYS), case


def test_half_tails_are_taken_on_the_short_suites():
    """Not vacuous: GEM L=256 and every cross case (256 keys) take half tails forward."""
    takers = [case for case in ALL_CASES if configs.forward_config(suite_shape(*case)).HALF_TAIL]
    assert takers == [("gem", "L=256,s=0.5"), ("gem", "L=256,s=1.0")] + [c for c in ALL_CASES if c[0] == "cross"]


@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
def test_paired_heads_on_pma_q64_only(case):
    """Two heads per tile where every query sequence fits one consumer's rows: PMA q=64, forward and dQ."""
    shape = suite_shape(*case)
    paired = case == PMA_Q64
    assert (shape.max_seq_len_q <= ROWS_PER_CONSUMER.value) == paired
    forward, dq = configs.forward_config(shape), configs.dq_config(shape)
    assert (forward.HEADS_PER_TILE, dq.HEADS_PER_TILE) == ((2, 2) if paired else (1, 1)), case
    if paired:
        assert _tuning(forward, configs.FWD_SHORT_QUERIES[128]) == configs.FWD_SHORT_QUERIES[128]
        assert dq.BLOCK_N == configs.DQ_SHORT_QUERIES_BLOCK_N[128]
        assert fwd_sm90.tile_rows(forward) == bwd_dq.tile_rows(dq) == ROWS_PER_CONSUMER.value


def test_odd_head_counts_do_not_pair():
    shape = suite_shape(*PMA_Q64)._replace(q_heads=3, kv_heads=3)
    assert configs.heads_per_tile(shape) == 1


@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
def test_three_consumers_on_dense_d64_only(case):
    """FWD_LONG (three consumers, 192-row tiles) where queries and keys both average LONG_MEAN at D=64."""
    config = configs.forward_config(suite_shape(*case))
    if case == DENSE_D64:
        assert _tuning(config, configs.FWD_LONG[64]) == configs.FWD_LONG[64]
        assert fwd_sm90.tile_rows(config) == configs.FWD_LONG[64]["CONSUMERS"] * ROWS_PER_CONSUMER.value
    else:
        assert config.CONSUMERS == configs.FWD_BASE[128]["CONSUMERS"], case


def test_the_base_tiles_where_no_tuning_applies():
    """Long GEM, PMA q=256 and dense D=128 run FWD_BASE; the forward's tile is 128 query rows."""
    for case in [("gem", "L=2048,s=1.0"), PMA_Q256, DENSE_D128]:
        config = configs.forward_config(suite_shape(*case))
        assert _tuning(config, configs.FWD_BASE[128]) == configs.FWD_BASE[128], case
        assert not config.HALF_TAIL and fwd_sm90.tile_rows(config) == 2 * ROWS_PER_CONSUMER.value


# ---- the backward's dQ strategy --------------------------------------------------------------------------

# The suite cases whose dQ the dQ kernel forms (DQ_NONE): the short GEM and cross batches, whose query
# rows average less than FUSED[128]'s bound; every other case fuses it.
DQ_KERNEL_CASES = [("gem", "L=256,s=0.5"), ("gem", "L=256,s=1.0"), ("gem", "L=512,s=0.5"),
                   ("cross", "L=256,s=0.5"), ("cross", "L=256,s=1.0"), ("cross", "L=512,s=0.5")]


@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
def test_dq_strategy_of_each_suite_case(case):
    """DQ_RESIDENT on PMA q=64 (one query block, as many query as key heads); the dQ kernel on the short
    batches; elsewhere the head dim's fused mode: DQ_SPLIT at D=128 (broadcast-Q over at least as many
    sequences as SMs among them), DQ_HANDOFF at D=64."""
    shape = suite_shape(*case)
    plan = configs.select(shape)
    if case == PMA_Q64:
        expected = DQ_RESIDENT.value
    elif case in DQ_KERNEL_CASES:
        expected = DQ_NONE.value
        assert mean_queries(shape) < configs.FUSED[shape.head_dim]["min_mean_queries"], case
    else:
        expected = configs.FUSED[shape.head_dim]["strategy"]
    assert configs.dq_strategy(shape) == plan.dkdv.DQ == expected, case
    assert (plan.dq is None) == (expected != DQ_NONE.value)
    assert configs.FUSED[128]["strategy"] == DQ_SPLIT.value and configs.FUSED[64]["strategy"] == DQ_HANDOFF.value


def test_fused_dq_from_the_mean_query_bound_at_d128():
    """GEM L=512 s=1 averages exactly FUSED[128]'s min_mean_queries: fused; one query row fewer: not."""
    shape = suite_shape("gem", "L=512,s=1.0")
    assert mean_queries(shape) == configs.FUSED[128]["min_mean_queries"]
    assert configs.dq_strategy(shape) == DQ_SPLIT.value
    assert configs.dq_strategy(shape._replace(total_q=shape.total_q - 1)) == DQ_NONE.value


def test_fused_dq_up_to_the_mean_key_bound_at_d64():
    """Dense D=64 averages exactly FUSED[64]'s max_mean_keys: DQ_HANDOFF; one key more, or causal (whose
    bound is max_mean_keys_causal), the dQ kernel."""
    shape = suite_shape(*DENSE_D64)
    fused = configs.FUSED[64]
    assert mean_keys(shape) == fused["max_mean_keys"]
    assert configs.dq_strategy(shape) == DQ_HANDOFF.value
    assert configs.dq_strategy(shape._replace(total_kv=shape.total_kv + shape.num_seqs)) == DQ_NONE.value
    causal = shape._replace(causal=True)
    assert configs.dq_strategy(causal) == DQ_NONE.value
    short = fused["max_mean_keys_causal"] * shape.num_seqs
    assert configs.dq_strategy(causal._replace(total_q=short, total_kv=short)) == DQ_HANDOFF.value


@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
def test_deterministic_runs_the_dq_kernel_except_where_resident_dq_applies(case):
    """DQ_RESIDENT adds nothing (each program stores its dQ once), so it stays; every other case runs the
    dQ kernel, never a TMA reduce-add."""
    strategy = configs.dq_strategy(suite_shape(*case, deterministic=True))
    assert strategy == (DQ_RESIDENT.value if case == PMA_Q64 else DQ_NONE.value), case


def test_resident_dq_needs_one_query_block_per_key_head_and_enough_sequences():
    pma = suite_shape(*PMA_Q64)
    assert configs.dq_strategy(pma) == DQ_RESIDENT.value
    gqa = suite_shape(*PMA_Q64, kv_heads=GQA_KV_HEADS)
    assert configs.dq_strategy(gqa) == DQ_SPLIT.value  # query heads share a key tile: no resident block
    assert configs.dq_strategy(gqa._replace(deterministic=True)) == DQ_NONE.value
    few = pma._replace(num_seqs=pma.num_sms - 1, total_kv=pma.total_kv // pma.num_seqs * (pma.num_sms - 1))
    assert configs.dq_strategy(few) == DQ_NONE.value  # more dQ copies (one per program) than sequences
    two_blocks = pma._replace(total_q=configs.DKDV_BASE[128]["BLOCK_M"] + 1)
    assert configs.dq_strategy(two_blocks) == DQ_SPLIT.value
    for head_dim in specs.SUPPORTED_HEAD_DIMS:
        resident = configs.dq_strategy(pma._replace(head_dim=head_dim)) == DQ_RESIDENT.value
        assert resident == (head_dim in configs.RESIDENT), head_dim


def test_dkdv_configuration_follows_the_strategy():
    """The fused modes take FUSED's K/V slots, DQ_SPLIT frees V early with broadcast-Q only; DQ_RESIDENT
    takes its own ring and frees V early; DQ_NONE the base; the mask-free bulk at D=64 only. The
    launch's num_stages is 1 without fused dQ, 0 with it."""
    gem_split = configs.select(suite_shape("gem", "L=2048,s=1.0")).dkdv
    pma_split = configs.select(suite_shape(*PMA_Q256)).dkdv
    resident = configs.select(suite_shape(*PMA_Q64)).dkdv
    handoff = configs.select(suite_shape(*DENSE_D64)).dkdv
    base = configs.select(suite_shape("gem", "L=256,s=0.5")).dkdv
    base_d64 = configs.select(suite_shape(*DENSE_D64, causal=True)).dkdv
    for config in (gem_split, pma_split, handoff):
        assert config.DQ == configs.FUSED[config.HEAD_DIM]["strategy"]
        assert config.KV_BUFFERS == config.V_BUFFERS == configs.FUSED[config.HEAD_DIM]["kv_buffers"]
    assert pma_split.EARLY_V_RELEASE and not (gem_split.EARLY_V_RELEASE or handoff.EARLY_V_RELEASE)
    assert resident.EARLY_V_RELEASE and _tuning(resident, configs.RESIDENT[128]) == configs.RESIDENT[128]
    for config in (base, base_d64):
        assert config.DQ == DQ_NONE.value and not config.EARLY_V_RELEASE
        assert _tuning(config, configs.DKDV_BASE[config.HEAD_DIM]) == configs.DKDV_BASE[config.HEAD_DIM]
    assert handoff.MASK_FREE_BULK and base_d64.MASK_FREE_BULK and not (base.MASK_FREE_BULK or gem_split.MASK_FREE_BULK)
    assert [bwd_dkdv.num_stages(c) for c in (base, base_d64, gem_split, resident, handoff)] == [1, 1, 0, 0, 0]


def test_dq_kernel_ring_with_broadcast_partials():
    """The dQ kernel's fp32 partials (broadcast-Q) leave room for DQ_PARTIALS_KV_BUFFERS K/V slots at D=128."""
    pma = suite_shape(*PMA_Q256, deterministic=True)
    assert configs.dq_config(pma).KV_BUFFERS == configs.DQ_PARTIALS_KV_BUFFERS[128]
    assert configs.dq_config(suite_shape("gem", "L=256,s=0.5")).KV_BUFFERS == configs.DQ_BASE[128]["KV_BUFFERS"]


# ---- forks -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
@pytest.mark.parametrize("fork", ["base_tiles", "block_mask"])
def test_forks_that_ask_for_the_base_tiles_get_them(case, fork):
    """Block-sparse and FP8 (base_tiles) and a variant's block mask: FWD_BASE and DQ_BASE, one head per
    tile, whole last tiles, whatever the batch."""
    shape = suite_shape(*case, **{fork: True}, deterministic=True)
    forward, dq = configs.forward_config(shape), configs.dq_config(shape)
    d = shape.head_dim
    assert _tuning(forward, configs.FWD_BASE[d]) == configs.FWD_BASE[d], case
    assert forward.HEADS_PER_TILE == dq.HEADS_PER_TILE == 1 and not forward.HALF_TAIL and not dq.HALF_TAIL
    assert dq.BLOCK_N == configs.DQ_BASE[d]["BLOCK_N"]


def test_block_sparse_runs_the_dq_kernel():
    """The block-sparse suite (GEM L=2048 at D=128) never fuses dQ: its iteration is per query block."""
    for case in specs.BENCH_SUITES["block_sparse"]:
        shape = suite_shape("gem", "L=2048,s=1.0", base_tiles=True, block_sparse=True)
        assert case["max_len"] == shape.max_seq_len_kv and case["head_dim"] == shape.head_dim
        plan = configs.select(shape)
        assert plan.dkdv.DQ == DQ_NONE.value and plan.dq is not None


# ---- feature flags ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
def test_feature_flags_pass_through_to_every_kernel(features):
    for case in ALL_CASES:
        shape = suite_shape(*case, **features)
        plan = configs.select(shape)
        dq = plan.dq or configs.dq_config(shape)
        for config in (plan.forward, plan.dkdv, dq):
            assert (config.CAUSAL, config.HAS_WINDOW, config.BROADCAST_Q) == (
                shape.causal, shape.window is not None, shape.broadcast_q), (case, type(config).__name__)
            assert config.HEAD_DIM == shape.head_dim


def test_gqa_changes_no_forward_configuration():
    """The group is a runtime argument of the kernels; it only decides whether DQ_RESIDENT applies."""
    for case in ALL_CASES:
        plain, grouped = suite_shape(*case), suite_shape(*case, kv_heads=GQA_KV_HEADS)
        assert configs.forward_config(plain) == configs.forward_config(grouped), case
        assert configs.dq_config(plain) == configs.dq_config(grouped), case


# ---- the size of the space -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reachable():
    return configs.reachable_configs()


def test_the_reachable_counts_are_the_reported_ones(reachable):
    assert {kernel: len(found) for kernel, found in reachable.items()} == REACHABLE_COUNTS


def _features(config) -> tuple:
    return config.HEAD_DIM, config.CAUSAL, config.HAS_WINDOW, config.BROADCAST_Q


def test_feature_flags_multiply_and_tunings_are_few(reachable):
    """Every feature set is reachable; each has at most a few forward and dQ tunings, and the dK/dV
    kernel has exactly one configuration per feature set, dQ strategy and query iteration (the
    block-sparse fork's selected blocks run no mask-free bulk)."""
    for kernel in ("forward", "dq"):
        per_features = {}
        for config in reachable[kernel]:
            per_features.setdefault(_features(config), []).append(config)
        assert len(per_features) == FEATURE_SETS, kernel
        assert max(map(len, per_features.values())) <= MAX_FORWARD_TUNINGS_PER_FEATURE_SET, kernel
    strategies = {_features(c) + (c.DQ, c.MASK_FREE_BULK) for c in reachable["dkdv"]}
    assert len(strategies) == len(reachable["dkdv"])


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
def test_the_suites_configurations_are_among_the_reachable(reachable, features):
    """`reachable_configs` enumerates shapes that tell `select`'s choices apart: the suites add none."""
    for case in ALL_CASES:
        for deterministic in (False, True):
            shape = suite_shape(*case, deterministic=deterministic, **features)
            plan = configs.select(shape)
            assert plan.forward in reachable["forward"] and plan.dkdv in reachable["dkdv"], case
            assert plan.dq is None or plan.dq in reachable["dq"], case


def test_every_reachable_configuration_is_consistent(reachable):
    """Half tiles are at least a wgmma's N; paired heads have one consumer per head."""
    for config in reachable["forward"] | reachable["dq"]:
        assert not config.HALF_TAIL or config.BLOCK_N // 2 >= configs.MIN_HALF_TILE_KEYS, config
        assert config.HEADS_PER_TILE in (1, 2)
    for config in reachable["forward"]:
        assert config.HEADS_PER_TILE == 1 or config.CONSUMERS == config.HEADS_PER_TILE, config
    assert {c.DQ for c in reachable["dkdv"]} == {DQ_NONE.value, DQ_SPLIT.value, DQ_RESIDENT.value, DQ_HANDOFF.value}


def test_the_resident_grid_keeps_one_key_head_per_program():
    from jfa.runner import dkdv_programs

    resident = DQ_RESIDENT.value
    assert dkdv_programs(resident, 132, 10**6, 4) == 132
    assert dkdv_programs(resident, 132, 10**6, 5) == 130  # a multiple of the key heads
    assert dkdv_programs(resident, 132, 10**6, 67) == 67
    assert dkdv_programs(resident, 132, 2, 4) == 8  # no more programs than tiles
    assert dkdv_programs(resident, 132, 10**6, 200) == 200  # at least one program per key head
    assert dkdv_programs(DQ_SPLIT.value, 132, 2, 4) == 8


def test_forks_that_skip_query_blocks_take_the_dq_kernel():
    """A block mask or a selection skips query blocks, which DQ_SPLIT's look-ahead and DQ_RESIDENT's
    single block do not follow: such forks always get the dQ kernel, even where a plain call fuses."""
    for case in ALL_CASES:
        for flags in (dict(block_mask=True), dict(block_sparse=True, base_tiles=True)):
            shape = suite_shape(*case, **flags)
            assert configs.dq_strategy(shape) == DQ_NONE.value, (case, flags)
            if shape.block_sparse:
                assert not configs.select(shape).dkdv.MASK_FREE_BULK, case


@pytest.mark.parametrize("shape_flags, strategy, message", [
    (dict(block_mask=True), DQ_SPLIT.value, "takes the dQ kernel"),
    (dict(head_dim=128), DQ_HANDOFF.value, "head dim 64 only"),
    (dict(head_dim=128), DQ_RESIDENT.value, "DQ_RESIDENT needs"),
    (dict(head_dim=128), 7, "dq_strategy: one of"),
])
def test_a_forced_dq_strategy_the_kernel_cannot_run_is_refused(shape_flags, strategy, message):
    shape = configs.gem_like_shape(**shape_flags)
    with pytest.raises(ValueError, match=message):
        configs.check_dq_strategy(shape, strategy)


def test_every_strategy_the_configs_choose_passes_the_check():
    for case in ALL_CASES:
        for flags in ({}, dict(deterministic=True), dict(causal=True)):
            shape = suite_shape(*case, **flags)
            configs.check_dq_strategy(shape, configs.dq_strategy(shape))
