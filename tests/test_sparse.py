"""`jfa.block_sparse_attention` on the CPU: the selection the kernel reads, argument checks, the
reference path, its gradients, and tracing under torch.compile (the kernel itself: tests/gpu)."""
import pytest
import torch

import jfa
from jfa import dispatch, reference, sparse
from jfa.dispatch import ReferenceFallbackWarning
from jfa.jagged import lengths_to_offsets

LENGTHS = [300, 1, 0, 129, 256, 77]
HEADS = 2


def inputs(dtype=torch.float64, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(LENGTHS)
    return [torch.randn(rows, HEADS, head_dim, generator=gen, dtype=dtype) for _ in range(3)]


def raw_selection(max_sel=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 5, (len(LENGTHS), HEADS, 3, max_sel), generator=gen, dtype=torch.int32)


def test_canonical_selection_is_sorted_distinct_and_in_range():
    idx = raw_selection(max_sel=5)
    selection = sparse.canonical_selection(idx, lengths_to_offsets(LENGTHS), 128)
    assert selection.width == 8 and selection.blocks.dtype == torch.int32 and selection.row_blocks == 3
    for b, length in enumerate(LENGTHS):
        key_blocks = -(-length // 128)
        for h in range(HEADS):
            for i in range(3):
                want = sorted({int(x) for x in idx[b, h, i] if 0 <= x < key_blocks})
                count = int(selection.counts[b, h, i])
                assert selection.blocks[b, h, i, :count].tolist() == want
                assert not selection.blocks[b, h, i, count:].any()


def test_transposed_selection_lists_the_selecting_query_blocks():
    idx = raw_selection(max_sel=5, seed=3)
    selection = sparse.canonical_selection(idx, lengths_to_offsets(LENGTHS), 128)
    key_blocks = 3
    by_key = sparse.transposed_selection(selection, key_blocks)
    assert by_key.blocks.shape[:3] == (len(LENGTHS), HEADS, key_blocks) and by_key.width == 4
    for b in range(len(LENGTHS)):
        for h in range(HEADS):
            for j in range(key_blocks):
                want = [i for i in range(3)
                        if j in selection.blocks[b, h, i, :int(selection.counts[b, h, i])].tolist()]
                count = int(by_key.counts[b, h, j])
                assert by_key.blocks[b, h, j, :count].tolist() == want
                assert not by_key.blocks[b, h, j, count:].any()


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_runs_the_reference_and_says_so(causal, monkeypatch):
    monkeypatch.setattr(dispatch, "_warned_reasons", set())  # each reason is told once per process
    q, k, v = inputs()
    off = lengths_to_offsets(LENGTHS)
    idx = raw_selection()
    with pytest.warns(ReferenceFallbackWarning, match="block-sparse"):
        out, lse = jfa.block_sparse_attention(q, k, v, off, off, idx, causal=causal, return_lse=True)
    ref_out, ref_lse = reference.block_sparse_attention_ref(q, k, v, off, off, idx, 128, 128, causal=causal)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse.float(), atol=0, rtol=0)


def test_gradients_match_finite_differences():
    lengths = [5, 3]
    off = lengths_to_offsets(lengths)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(8, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    idx = torch.tensor([[[[0, -1]], [[-1, -1]]], [[[0, 0]], [[0, -1]]]], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, b, c: jfa.block_sparse_attention(a, b, c, off, off, idx, 8, 8),
                                    (q, k, v))


def test_compiles_with_fullgraph():
    q, k, v = inputs(dtype=torch.float32)
    off = lengths_to_offsets(LENGTHS)
    idx = raw_selection()
    args = (q, k, v, off, off, idx, 128, 128, 300, 300, 0.25, False)
    eager, _ = sparse.block_sparse_attention_fwd(*args)
    compiled, _ = torch.compile(sparse.block_sparse_attention_fwd, fullgraph=True, backend="eager")(*args)
    torch.testing.assert_close(compiled, eager)


def test_gradients_under_torch_compile_match_eager():
    """fwd+bwd through the two custom ops under torch.compile(fullgraph=True) equals eager."""
    off = lengths_to_offsets(LENGTHS)
    idx = raw_selection()
    q, k, v = inputs(dtype=torch.float32)

    def loss(q, k, v):
        return sparse.block_sparse_attention_fwd(q, k, v, off, off, idx, 128, 128, 300, 300, 0.25, True)[0].square().sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="eager")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("change, match", [
    (dict(kv_block_idx=torch.zeros(6, 2, 3, 2)), "kv_block_idx: dtype"),
    (dict(kv_block_idx=[[0]]), "kv_block_idx: expected an integer torch.Tensor"),
    (dict(kv_block_idx=torch.zeros(6, 2, 2, 2, dtype=torch.int32)), r"n_q_blocks>=3"),
    (dict(kv_block_idx=torch.zeros(6, 4, 3, 2, dtype=torch.int32)), r"Hq=2"),
    (dict(block_m=0), "block_m: must be > 0"),
    (dict(block_n=1.5), "block_n: expected an int"),
    (dict(causal="yes"), "causal: expected a bool"),
])
def test_bad_arguments_name_themselves(change, match):
    q, k, v = inputs()
    off = lengths_to_offsets(LENGTHS)
    call = dict(kv_block_idx=raw_selection(), block_m=128, block_n=128, causal=False) | change
    with pytest.raises((TypeError, ValueError), match=match):
        jfa.block_sparse_attention(q, k, v, off, off, call["kv_block_idx"], call["block_m"], call["block_n"],
                                   causal=call["causal"])
