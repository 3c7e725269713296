"""CPU checks of `jfa.schedule`: the Triton builders give exactly the torch builders' lists.

The Triton builders run on the GPU in production; here they run in Triton's interpreter, which
`triton.jit` selects when `TRITON_INTERPRET=1` is set at decoration time, i.e. when `jfa.schedule`
is imported. So the comparisons run in a subprocess that imports it afresh with that variable set
(`_run_in_interpreter`); the `check_*` functions below are what that subprocess runs. Each draws
random offset sets whose lengths mix the block edges (0, 1, 63, 64, 65, 127, 128, 129, the max)
with uniform draws, and small chunk sizes so that a few dozen entries span many programs.
The same kernels are also compiled for sm_90, which checks what the lenient interpreter does not.
"""
import itertools
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from jfa import schedule

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
LENGTH_EDGES = (0, 1, 63, 64, 65, 127, 128, 129)
MAX_LENGTHS = (65, 130, 300, 700, 2200)  # 2200 / 64 keys: more work values than one bin block
LONG = 2200
WINDOWS = (None, 0, 1, 37, 64, 300)
CHUNKS = (8, 32, schedule.SORT_CHUNK)  # 8: a few dozen entries already span several programs
TABLE_CHUNKS = (4, 16, schedule.TABLE_CHUNK)
MAX_PROGRAMS = 8  # the interpreter runs programs one after another, ~10 ms each: keep it quick
INTERPRETER_TIMEOUT_S = 120


def random_lengths(gen: torch.Generator, batch: int, max_len: int, edges=LENGTH_EDGES) -> list[int]:
    """Lengths in [0, max_len]: a third block edges, a third the max, a third uniform."""
    edges = [e for e in edges if e <= max_len] + [max_len]
    kind = torch.randint(0, 3, (batch,), generator=gen).tolist()
    return [edges[int(torch.randint(0, len(edges), (1,), generator=gen))] if k == 0
            else max_len if k == 1 else int(torch.randint(0, max_len + 1, (1,), generator=gen))
            for k in kind]


def to_offsets(lengths: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=dtype)


def _offset_dtype(gen: torch.Generator) -> torch.dtype:
    """Offsets may be int32 or int64 (both are accepted by the APIs)."""
    return _pick(gen, (torch.int32, torch.int64))


def _pick(gen: torch.Generator, options):
    return options[int(torch.randint(0, len(options), (1,), generator=gen))]


def _batch(gen: torch.Generator, max_len: int) -> int:
    """1..16 sequences; 1..2 of the long ones (many blocks each, so few entries are enough)."""
    return int(torch.randint(1, 3 if max_len == LONG else 17, (1,), generator=gen))


def _programs_per_launch(gen: torch.Generator, items: int, sizes) -> int:
    """A random size from `sizes`, the next larger one when it would need too many programs."""
    size = _pick(gen, sizes)
    while triton.cdiv(items, size) > MAX_PROGRAMS and size < max(sizes):
        size *= 2
    return size


def _slack(gen: torch.Generator) -> int:
    """0 most of the time (the exact maximum); otherwise a looser bound, as callers may pass."""
    return _pick(gen, (0, 0, 0, 1, 100))


def _assert_same_list(got, expected, case):
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype == torch.int32 and g.shape == e.shape, case
        assert torch.equal(g, e), case


def check_forward(cases: int, seed: int) -> int:
    """The forward tile list (`entries="fwd"`) against `kv_tiles_per_entry` + a stable argsort."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(cases):
        max_len = _pick(gen, MAX_LENGTHS)
        batch = _batch(gen, max_len)
        broadcast_q = bool(torch.randint(0, 2, (1,), generator=gen))
        kv_lens = random_lengths(gen, batch, max_len)
        q_lens = random_lengths(gen, 1 if broadcast_q else batch, max_len)
        block_m, block_n = _pick(gen, (64, 128)), _pick(gen, (64, 128))
        causal, window = bool(torch.randint(0, 2, (1,), generator=gen)), _pick(gen, WINDOWS)
        # broadcast-Q: max_seq_len_q is the query length itself, not a bound
        max_q = max(q_lens) + (0 if broadcast_q else _slack(gen))
        max_kv = max(kv_lens) + _slack(gen)
        case = dict(q_lens=q_lens, kv_lens=kv_lens, block_m=block_m, block_n=block_n, causal=causal,
                    window=window, broadcast_q=broadcast_q, max_q=max_q, max_kv=max_kv)
        blocks = max(1, triton.cdiv(max_q, block_m))
        q_len_per_seq = torch.tensor(q_lens * batch if broadcast_q else q_lens)
        work = schedule.kv_tiles_per_entry(q_len_per_seq, torch.tensor(kv_lens), blocks,
                                           block_m=block_m, block_n=block_n, causal=causal,
                                           window=window)
        dtype = _offset_dtype(gen)
        got = schedule.sort_entries_by_work_triton(
            to_offsets(q_lens, dtype), to_offsets(kv_lens, dtype), entries="fwd", blocks_per_seq=blocks,
            max_work=triton.cdiv(max_kv, block_n), broadcast_q_len=max_q if broadcast_q else None,
            block_m=block_m, block_n=block_n, causal=causal, window=window,
            chunk=_programs_per_launch(gen, work.numel(), CHUNKS))
        _assert_same_list(got, schedule.sort_entries_by_work_torch(work), case)
    return cases


def check_backward(cases: int, seed: int) -> int:
    """The backward KV-tile list (`entries="bwd"`) against `q_blocks_per_kv_tile` + a stable argsort."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(cases):
        max_len = _pick(gen, MAX_LENGTHS)
        batch = _batch(gen, max_len)
        broadcast_q = bool(torch.randint(0, 2, (1,), generator=gen))
        kv_lens = random_lengths(gen, batch, max_len)
        q_lens = [max(1, n) for n in random_lengths(gen, 1, max_len)] if broadcast_q else \
            random_lengths(gen, batch, max_len)
        block_m, block_n = _pick(gen, (64, 128)), _pick(gen, (64, 128))
        causal, window = bool(torch.randint(0, 2, (1,), generator=gen)), _pick(gen, WINDOWS)
        max_q, max_kv = max(q_lens) + _slack(gen), max(kv_lens) + _slack(gen)
        case = dict(q_lens=q_lens, kv_lens=kv_lens, block_m=block_m, block_n=block_n, causal=causal,
                    window=window, broadcast_q=broadcast_q, max_q=max_q, max_kv=max_kv)
        blocks = max(1, triton.cdiv(max_kv, block_n))
        q_len_per_seq = torch.tensor(q_lens * batch if broadcast_q else q_lens)
        work = schedule.q_blocks_per_kv_tile(q_len_per_seq, torch.tensor(kv_lens), blocks,
                                             block_m=block_m, block_n=block_n, causal=causal,
                                             window=window)
        dtype = _offset_dtype(gen)
        got = schedule.sort_entries_by_work_triton(
            to_offsets(q_lens, dtype), to_offsets(kv_lens, dtype), entries="bwd", blocks_per_seq=blocks,
            max_work=triton.cdiv(q_lens[0] if broadcast_q else max_q, block_m),
            broadcast_q_len=q_lens[0] if broadcast_q else None, block_m=block_m, block_n=block_n,
            causal=causal, window=window, chunk=_programs_per_launch(gen, work.numel(), CHUNKS))
        _assert_same_list(got, schedule.sort_entries_by_work_torch(work), case)
    return cases


def check_block_table(cases: int, seed: int) -> int:
    """`block_table_triton` against `block_table_torch`, padding slots included."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(cases):
        max_len = _pick(gen, MAX_LENGTHS)
        lengths = random_lengths(gen, int(torch.randint(1, 40, (1,), generator=gen)), max_len)
        total_rows = sum(lengths) + _slack(gen)
        offsets = to_offsets(lengths, _offset_dtype(gen))
        got = schedule.block_table_triton(
            offsets, total_rows, seqs_per_program=_programs_per_launch(gen, len(lengths), TABLE_CHUNKS))
        _assert_same_list(got, schedule.block_table_torch(offsets, total_rows),
                          dict(lengths=lengths, total_rows=total_rows))
    return cases


def check_too_small_bound(cases: int, seed: int) -> int:
    """A work bound below the real maximum still gives a permutation with the real entries first."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(cases):
        batch = int(torch.randint(1, 17, (1,), generator=gen))
        lengths = random_lengths(gen, batch, 700)
        blocks = triton.cdiv(max(lengths), 64)
        work = schedule.kv_tiles_per_entry(torch.tensor(lengths), torch.tensor(lengths), blocks,
                                           block_m=64, block_n=64, causal=True, window=None)
        entries, num_real = schedule.sort_entries_by_work_triton(
            to_offsets(lengths), to_offsets(lengths), entries="fwd", blocks_per_seq=blocks,
            max_work=blocks // 2, broadcast_q_len=None, block_m=64, block_n=64, causal=True,
            window=None, chunk=32)
        real = (work.reshape(-1) >= 0).nonzero().flatten()
        assert sorted(entries.tolist()) == list(range(work.numel())), lengths
        assert num_real.tolist() == [real.numel()], lengths
        assert sorted(entries[:real.numel()].tolist()) == real.tolist(), lengths
    return cases


def check_many_programs(cases: int, seed: int) -> int:
    """More chunks than one block of per-chunk counts (`CHUNK_BLOCK`), and a 20-program table."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(cases):
        lengths = random_lengths(gen, 40, 300)
        blocks = triton.cdiv(max(lengths), 64)
        work = schedule.kv_tiles_per_entry(torch.tensor(lengths), torch.tensor(lengths), blocks,
                                           block_m=64, block_n=64, causal=False, window=37)
        chunk = 2
        assert triton.cdiv(work.numel(), chunk) > schedule.CHUNK_BLOCK
        got = schedule.sort_entries_by_work_triton(
            to_offsets(lengths), to_offsets(lengths), entries="fwd", blocks_per_seq=blocks,
            max_work=blocks, broadcast_q_len=None, block_m=64, block_n=64, causal=False, window=37,
            chunk=chunk)
        _assert_same_list(got, schedule.sort_entries_by_work_torch(work), lengths)
        got = schedule.block_table_triton(to_offsets(lengths), sum(lengths), seqs_per_program=2)
        _assert_same_list(got, schedule.block_table_torch(to_offsets(lengths), sum(lengths)), lengths)
    return cases


# (check, offset sets, seed): ~40 ms per set in the interpreter, so ~1000 sets take ~50 CPU seconds;
# the checks run as concurrent subprocesses.
INTERPRETER_CHECKS = (("check_forward", 400, 1), ("check_backward", 300, 2), ("check_block_table", 300, 3),
                      ("check_too_small_bound", 20, 4), ("check_many_programs", 2, 5))


def test_triton_builders_equal_torch_builders_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    runs = {}
    for check, cases, seed in INTERPRETER_CHECKS:
        code = f"from tests.test_schedule import {check}; print('checked', {check}({cases}, {seed}))"
        runs[check, cases] = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True)
    failures = []
    for (check, cases), run in runs.items():
        output, _ = run.communicate(timeout=INTERPRETER_TIMEOUT_S)
        if run.returncode != 0 or f"checked {cases}" not in output:
            failures.append(f"{check}:\n{output[-3000:]}")
    assert not failures, "\n".join(failures)


def test_kernels_compile_for_hopper():
    """The interpreter runs numpy; compiling for sm_90 checks types, layouts and loop-carried values."""
    target = GPUTarget("cuda", 90, 32)
    options = {"num_warps": schedule.SORT_WARPS}
    pointers = ("q_offsets_ptr", "kv_offsets_ptr", "bins_ptr", "counts_ptr")
    scalars = ("num_entries", "blocks_per_seq", "broadcast_q_len", "window", "max_work", "num_bins")
    for entries, causal, has_window, broadcast_q in itertools.product(
            (schedule.FWD_ENTRIES.value, schedule.BWD_ENTRIES.value), *[(False, True)] * 3):
        constexprs = dict(ENTRIES=entries, BLOCK_M=64, BLOCK_N=128, CAUSAL=causal,
                          HAS_WINDOW=has_window, BROADCAST_Q=broadcast_q,
                          CHUNK=schedule.SORT_CHUNK, BINS=schedule.BIN_BLOCK)
        offsets_type = "*i64" if causal else "*i32"  # both offset dtypes, without doubling the count
        signature = {**{p: "*i32" for p in pointers}, **{s: "i32" for s in scalars},
                     **{c: "constexpr" for c in constexprs},
                     "q_offsets_ptr": offsets_type, "kv_offsets_ptr": offsets_type}
        triton.compile(ASTSource(fn=schedule._bin_entries_kernel, signature=signature,
                                 constexprs=constexprs), target=target, options=options)
    constexprs = dict(CHUNK=schedule.SORT_CHUNK, BINS=schedule.BIN_BLOCK, CHUNKS=schedule.CHUNK_BLOCK)
    signature = dict(bins_ptr="*i32", counts_ptr="*i32", entries_ptr="*i32", num_real_ptr="*i32",
                     num_entries="i32", num_chunks="i32", num_bins="i32",
                     **{c: "constexpr" for c in constexprs})
    triton.compile(ASTSource(fn=schedule._scatter_entries_kernel, signature=signature,
                             constexprs=constexprs), target=target, options=options)
    constexprs = dict(BLOCK=64, SEQS=schedule.TABLE_CHUNK)
    for offsets_type in ("*i32", "*i64"):
        signature = dict(offsets_ptr=offsets_type, block_start_ptr="*i32", block_rows_ptr="*i32",
                         num_blocks_ptr="*i32", num_seqs="i32", capacity="i32",
                         **{c: "constexpr" for c in constexprs})
        triton.compile(ASTSource(fn=schedule._block_table_kernel, signature=signature,
                                 constexprs=constexprs), target=target, options=options)


def test_cpu_offsets_build_with_torch_and_are_cached():
    """On the CPU the builders run the torch ops; a second call on the same tensors is a cache hit."""
    schedule.clear_cache()
    gen = torch.Generator().manual_seed(7)
    lengths = random_lengths(gen, 30, 300)
    offsets = to_offsets(lengths)
    kv = schedule.build_kv_tile_schedule(offsets, offsets, max_seq_len_kv=300, broadcast_q_len=0,
                                         block_m=64, block_n=128, causal=True, window=None,
                                         max_seq_len_q=300)
    work = schedule.q_blocks_per_kv_tile(torch.tensor(lengths), torch.tensor(lengths), 3, block_m=64,
                                         block_n=128, causal=True, window=None)
    _assert_same_list((kv.entries, kv.num_entries), schedule.sort_entries_by_work_torch(work), lengths)
    assert (kv.kv_blocks_per_seq, kv.max_entries) == (3, 90)
    assert schedule.build_kv_tile_schedule(offsets, offsets, max_seq_len_kv=300, broadcast_q_len=0,
                                           block_m=64, block_n=128, causal=True, window=None,
                                           max_seq_len_q=300) is kv
    table = schedule.build_block_table(offsets, sum(lengths))
    _assert_same_list(table, schedule.block_table_torch(offsets, sum(lengths)), lengths)
    assert schedule.build_block_table(offsets, sum(lengths)) is table
    offsets[-1] += 1  # changed in place: rebuilt
    assert schedule.build_block_table(offsets, sum(lengths)) is not table


def test_longest_first_and_stable():
    """The reference order itself: non-increasing work, ties in entry order, real entries first."""
    gen = torch.Generator().manual_seed(3)
    lengths = random_lengths(gen, 50, 700)
    work = schedule.kv_tiles_per_entry(torch.tensor(lengths), torch.tensor(lengths), 6, block_m=128,
                                       block_n=128, causal=True, window=None).reshape(-1)
    entries, num_real = schedule.sort_entries_by_work_torch(work)
    ordered = work[entries.long()]
    assert torch.all(ordered[:-1] >= ordered[1:])
    for value in ordered.unique():
        same = entries[ordered == value]
        assert torch.all(same[:-1] < same[1:])
    assert num_real.tolist() == [int((work >= 0).sum())]


def test_empty_batch_gives_empty_lists():
    """No sequences: nothing is launched, and the counts are still one-element tensors holding 0."""
    offsets = torch.zeros(1, dtype=torch.int32)
    for build in (schedule.block_table_torch, schedule.block_table_triton):
        start, rows, count = build(offsets, 0)
        assert start.numel() == rows.numel() == 0 and count.tolist() == [0]
    entries, num_real = schedule.sort_entries_by_work_triton(
        offsets, offsets, entries="fwd", blocks_per_seq=2, max_work=1, broadcast_q_len=None,
        block_m=64, block_n=64, causal=False, window=None)
    assert entries.numel() == 0 and num_real.dtype == torch.int32 and num_real.tolist() == [0]


def test_sort_rejects_unknown_entry_kind():
    offsets = to_offsets([3, 5])
    with pytest.raises(ValueError, match="entries"):
        schedule.sort_entries_by_work_triton(offsets, offsets, entries="both", blocks_per_seq=1,
                                             max_work=1, broadcast_q_len=None, block_m=64,
                                             block_n=64, causal=False, window=None)
