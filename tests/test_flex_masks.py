"""CPU tests of the FlexAttention block masks that jfa.workbench.providers builds from the sequence offsets.

The reference is flex's own `create_block_mask`, which evaluates the mask_mod on every (q, k) pair:
fine for these few hundred rows, minutes for the GEM suite, which is why the provider avoids it. The
tile tables must agree exactly (partial and full, forward and transposed), and attention computed
through them must match jfa.reference.
"""
from __future__ import annotations

import itertools
import types

import pytest
import torch
from torch.nn.attention import flex_attention as flex

from jfa import reference
from jfa.workbench import bench, providers

TILE = providers.FLEX_SPARSE_BLOCK
# Lengths around the tile size (and the 64-token block of the block kind), zero included.
EDGE_LENGTHS = (0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 300)
RANDOM_CASES = 6


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def random_lengths(seed: int, batch: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(EDGE_LENGTHS), (batch,), generator=gen)
    return [EDGE_LENGTHS[i] for i in picks.tolist()]


# Query and key lengths per sequence; the named cases pin the layouts that break naive tiling.
LENGTH_CASES = {
    "edges": ([0, 1, 127, 128, 129, 300], [0, 1, 127, 128, 129, 300]),
    "q and kv differ": ([0, 1, 127, 128, 129, 300], [5, 0, 127, 128, 129, 300]),
    "kv-only gap between sequences": ([300, 0, 300], [1, 500, 2]),
    "tile-aligned, full tiles": ([256, 256], [128, 384]),
    "tiny sequences share a tile": ([1] * 7 + [129], [2] * 7 + [1]),
    **{f"random {seed}": (random_lengths(seed, 6), random_lengths(100 + seed, 6)) for seed in range(RANDOM_CASES)},
}


def problem_for(kind: str, q_lens: list[int], kv_lens: list[int]) -> providers.Problem:
    """A float32 benchmark problem with exactly these lengths (pma: one query of q_lens[0] rows)."""
    case = dict(kind=kind, batch=len(kv_lens), heads=2, head_dim=8, max_len=max(kv_lens), sparsity=1.0,
                kv_len=None, q_len=q_lens[0] if kind == "pma" else None, density=None, dtype="float32")
    if kind == "pma":
        q_lens = [q_lens[0]] * len(kv_lens)
    return bench.make_problem(case, "cpu", 0, lengths=(q_lens, kv_lens))


def cases() -> list:
    """(kind, q_lens, kv_lens) for every kind whose mask is built from the offsets."""
    return list(_cases())


def _cases():
    block_layouts = set()  # the block kind is self-attention: the query lengths only, each layout once
    for name, (q_lens, kv_lens) in LENGTH_CASES.items():
        yield pytest.param("jagged", q_lens, kv_lens, id=f"jagged-{name}")
        if tuple(q_lens) not in block_layouts:
            block_layouts.add(tuple(q_lens))
            yield pytest.param("block", q_lens, q_lens, id=f"block-{name}")
    for q_len in (1, 128, 200):
        yield pytest.param("pma", [q_len], [129, 0, 300, 1], id=f"pma-q{q_len}")
    yield pytest.param("dense", [200] * 3, [200] * 3, id="dense")


def flex_masks(problem: providers.Problem):
    """(ours, flex's reference BlockMask, q rows, kv rows), both built for the provider's mask_mod."""
    q, q_offsets, kv_offsets, _ = providers._flex_sequences(problem)
    q_rows, kv_rows = q.shape[0], problem.k.shape[0]
    mask_mod = providers._flex_mask_mod(problem, q_offsets, kv_offsets, q_rows)
    ours = providers._flex_block_mask(flex, problem, mask_mod, q_offsets, kv_offsets, q_rows)
    theirs = flex.create_block_mask(mask_mod, None, None, q_rows, kv_rows, device="cpu", _compile=False)
    return ours, theirs, q_rows, kv_rows


def dense_tiles(num: torch.Tensor, indices: torch.Tensor, n_cols: int) -> torch.Tensor:
    """[rows, n_cols] bool of the listed tiles; our index tables are narrower than n_cols, so
    BlockMask.to_dense() (which takes the table width as n_cols) cannot be used here."""
    num, indices = num[0, 0].long(), indices[0, 0].long()
    listed = torch.arange(indices.shape[-1]) < num[:, None]
    dense = torch.zeros(indices.shape[0], n_cols + 1, dtype=torch.bool)  # the extra column takes the padding
    dense.scatter_(1, torch.where(listed, indices, n_cols), True)
    return dense[:, :n_cols]


def tile_tables(mask, n_q_tiles: int, n_kv_tiles: int) -> dict[str, torch.Tensor]:
    return {"partial kv": dense_tiles(mask.kv_num_blocks, mask.kv_indices, n_kv_tiles),
            "full kv": dense_tiles(mask.full_kv_num_blocks, mask.full_kv_indices, n_kv_tiles),
            "partial q": dense_tiles(mask.q_num_blocks, mask.q_indices, n_q_tiles),
            "full q": dense_tiles(mask.full_q_num_blocks, mask.full_q_indices, n_q_tiles)}


def reference_out(problem: providers.Problem) -> torch.Tensor:
    if problem.kind == "block":
        return reference.block_attention_ref(problem.q, problem.k, problem.v, problem.q_offsets)
    out, _ = reference.jagged_attention_ref(problem.q, problem.k, problem.v, problem.q_offsets, problem.kv_offsets,
                                            broadcast_q=problem.kind == "pma")
    return out


def attention_through_tiles(mask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Packed attention the way flex's kernels read the mask: full tiles unmasked, partial tiles under
    mask_mod, unlisted tiles skipped. (Eager flex_attention ignores the tiles, so it cannot show this.)"""
    q_rows, kv_rows = q.shape[0], k.shape[0]
    n_q_tiles, n_kv_tiles = -(-q_rows // TILE), -(-kv_rows // TILE)
    tables = tile_tables(mask, n_q_tiles, n_kv_tiles)

    def per_row(tiles: torch.Tensor) -> torch.Tensor:
        return tiles.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[:q_rows, :kv_rows]

    q_idx, kv_idx = torch.arange(q_rows)[:, None], torch.arange(kv_rows)[None, :]
    zero = torch.zeros((), dtype=torch.int64)
    pairs = mask.mask_mod(zero, zero, q_idx, kv_idx)
    visible = per_row(tables["full kv"]) | (per_row(tables["partial kv"]) & pairs)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


# ---- the tile tables ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind,q_lens,kv_lens", cases())
def test_tiles_match_create_block_mask(kind, q_lens, kv_lens):
    ours, theirs, q_rows, kv_rows = flex_masks(problem_for(kind, q_lens, kv_lens))
    assert ours.seq_lengths == theirs.seq_lengths == (q_rows, kv_rows)
    assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    n_q_tiles, n_kv_tiles = theirs.kv_indices.shape[-2], theirs.kv_indices.shape[-1]
    mine, flexs = tile_tables(ours, n_q_tiles, n_kv_tiles), tile_tables(theirs, n_q_tiles, n_kv_tiles)
    for table in mine:
        assert torch.equal(mine[table], flexs[table]), table


@pytest.mark.parametrize("kind,q_lens,kv_lens", cases())
def test_index_tables_are_what_flex_kernels_expect(kind, q_lens, kv_lens):
    """int32, listed tiles ascending, and the padding past each count still a valid tile index:
    flex's max-autotune benchmarking runs every row to the table's full width."""
    ours, _, q_rows, kv_rows = flex_masks(problem_for(kind, q_lens, kv_lens))
    n_q_tiles, n_kv_tiles = -(-q_rows // TILE), -(-kv_rows // TILE)
    for num, indices, rows, n_cols in ((ours.kv_num_blocks, ours.kv_indices, n_q_tiles, n_kv_tiles),
                                       (ours.full_kv_num_blocks, ours.full_kv_indices, n_q_tiles, n_kv_tiles),
                                       (ours.q_num_blocks, ours.q_indices, n_kv_tiles, n_q_tiles),
                                       (ours.full_q_num_blocks, ours.full_q_indices, n_kv_tiles, n_q_tiles)):
        assert num.dtype == indices.dtype == torch.int32
        assert num.shape == (1, 1, rows) and indices.shape[:3] == (1, 1, rows)
        assert indices.min() >= 0 and indices.max() < n_cols
        listed = torch.arange(indices.shape[-1]) < num[0, 0, :, None].long()
        steps = indices[0, 0, :, 1:] - indices[0, 0, :, :-1]
        assert bool((steps > 0)[listed[:, 1:]].all())


def test_tables_stay_narrow_for_many_sequences():
    """The point of the builder: a tile's table row is as wide as the tiles its (at most two) sequences
    span, not the whole pack, and no mask_mod evaluation over the pack is needed to get there."""
    lengths = [300] * 200
    pack = offsets(lengths)
    rows = int(pack[-1])
    mask = providers.document_block_mask(None, pack, pack, rows, rows)
    two_sequences_span = -(-2 * 300 // TILE) + 1
    assert mask.kv_indices.shape == (1, 1, -(-rows // TILE), two_sequences_span)
    assert mask.q_indices.shape[-1] == two_sequences_span


def test_block_sparse_still_uses_create_block_mask():
    """Its selection differs per head, which the document builder does not model."""
    problem = bench.make_problem(dict(kind="block_sparse", batch=3, heads=2, head_dim=8, max_len=200, sparsity=1.0,
                                      kv_len=None, q_len=None, density=0.5, dtype="float32"), "cpu", 0)
    calls = []
    fake_flex = types.SimpleNamespace(create_block_mask=lambda *args, **kw: calls.append((args, kw)))
    q, q_offsets, kv_offsets, _ = providers._flex_sequences(problem)
    mask_mod = providers._flex_mask_mod(problem, q_offsets, kv_offsets, q.shape[0])
    providers._flex_block_mask(fake_flex, problem, mask_mod, q_offsets, kv_offsets, q.shape[0])
    [(args, kw)] = calls
    assert args == (mask_mod, None, problem.heads, problem.q.shape[0], problem.k.shape[0])
    assert kw["_compile"] is True


# ---- attention through the masks ----------------------------------------------------------------
@pytest.mark.parametrize("kind,q_lens,kv_lens", cases())
def test_attention_through_tiles_matches_reference(kind, q_lens, kv_lens):
    problem = problem_for(kind, q_lens, kv_lens)
    ours, _, _, _ = flex_masks(problem)
    q, _, _, _ = providers._flex_sequences(problem)
    out = attention_through_tiles(ours, q.detach(), problem.k.detach(), problem.v.detach())
    expected = reference_out(problem).detach()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,q_lens,kv_lens", [c for c in cases() if "random" not in c.id])
def test_eager_flex_attention_matches_reference(kind, q_lens, kv_lens):
    """flex_attention itself accepts the narrow tables; eager it applies mask_mod to every pair."""
    problem = problem_for(kind, q_lens, kv_lens)
    ours, _, _, _ = flex_masks(problem)
    q, _, _, _ = providers._flex_sequences(problem)

    def to_1htd(t: torch.Tensor) -> torch.Tensor:
        return t.detach().transpose(0, 1).unsqueeze(0)

    out = flex.flex_attention(to_1htd(q), to_1htd(problem.k), to_1htd(problem.v), block_mask=ours)
    torch.testing.assert_close(out[0].transpose(0, 1), reference_out(problem).detach(), rtol=1e-5, atol=1e-5)
