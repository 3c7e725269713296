"""The `jfa.configs.Shape` of each benchmark suite case, for the tests that ask what `jfa.configs.select`
gives the suites and compile what it gives.

A case of `jfa.specs.BENCH_SUITES` names its sizes; `jfa.workbench.bench.case_lengths` draws its
sequence lengths, and the Shape is what `jfa.runner.call_shape` forms from tensors of those lengths
(packed rows, sequences, the longest sequence, the flags), on an H200's SM count.
"""
from __future__ import annotations

import functools

from jfa import configs, specs
from jfa.workbench.bench import case_lengths

# The suites the jagged kernels run as they are (block-sparse, FP8 and block attention are forks or
# other kernels, with their own tests).
JAGGED_SUITES = ("gem", "pma", "dense", "cross")


def suite_case(suite: str, case: str) -> dict:
    """The case named `case` (its `case` field, e.g. "L=256,s=0.5") of suite `suite`."""
    for entry in specs.BENCH_SUITES[suite]:
        if entry["case"] == case:
            return entry
    raise KeyError(f"{suite} has no case {case!r}: {[entry['case'] for entry in specs.BENCH_SUITES[suite]]}")


@functools.cache
def _lengths(suite: str, case: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    q_lens, kv_lens = case_lengths(suite_case(suite, case))
    return tuple(q_lens), tuple(kv_lens)


def suite_shape(suite: str, case: str, *, causal: bool = False, window: int | None = None, kv_heads: int | None = None,
                deterministic: bool = False, base_tiles: bool = False, block_sparse: bool = False,
                block_mask: bool = False) -> configs.Shape:
    """The Shape of one suite case, with the given features (kv_heads < heads: GQA)."""
    entry = suite_case(suite, case)
    q_lens, kv_lens = _lengths(suite, case)
    broadcast_q = entry["kind"] == "pma"
    return configs.Shape(head_dim=entry["head_dim"], q_heads=entry["heads"], kv_heads=kv_heads or entry["heads"],
                         total_q=q_lens[0] if broadcast_q else sum(q_lens), total_kv=sum(kv_lens),
                         num_seqs=len(kv_lens), max_seq_len_q=max(q_lens), max_seq_len_kv=max(kv_lens),
                         causal=causal, window=window, broadcast_q=broadcast_q, deterministic=deterministic,
                         base_tiles=base_tiles, block_sparse=block_sparse, block_mask=block_mask)


def suite_cases(suites=JAGGED_SUITES) -> list[tuple[str, str]]:
    """(suite, case) of every case of the suites."""
    return [(suite, entry["case"]) for suite in suites for entry in specs.BENCH_SUITES[suite]]


def mean_queries(shape: configs.Shape) -> float:
    """Query rows per sequence: the shared query's with broadcast-Q."""
    return shape.total_q if shape.broadcast_q else shape.total_q / shape.num_seqs


def mean_keys(shape: configs.Shape) -> float:
    return shape.total_kv / shape.num_seqs
