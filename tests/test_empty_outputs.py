"""Problems without a single score (no output row, or no key anywhere): the reference and every
dispatch path give a differentiable output, zeros (LSE -inf) and zero gradients for q, k and v."""
import pytest
import torch

from jfa import jagged, reference

HEADS, HEAD_DIM = (4, 2), 8
SCORELESS = [
    # (case id, query lengths (the shared query's with broadcast-Q), key lengths, broadcast_q)
    ("no-query-rows", [0, 0, 0], [3, 0, 5], False),
    ("no-query-rows-no-keys", [0, 0], [0, 0], False),
    ("empty-shared-query", [0], [3, 0, 5], True),
    ("no-keys-anywhere", [3, 0, 2], [0, 0, 0], False),
    ("shared-query-no-keys", [4], [0, 0], True),
]


def scoreless_call(q_lens, kv_lens, broadcast_q, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), heads, HEAD_DIM, generator=gen).to(dtype).requires_grad_()
               for lens, heads in ((q_lens, HEADS[0]), (kv_lens, HEADS[1]), (kv_lens, HEADS[1])))
    return q, k, v, jagged.lengths_to_offsets(q_lens), jagged.lengths_to_offsets(kv_lens)


def out_rows(q, kv_offsets, broadcast_q):
    return (kv_offsets.numel() - 1) * q.shape[0] if broadcast_q else q.shape[0]


def assert_scoreless_result(q, k, v, out, lse, rows):
    """Output zeros and LSE -inf of the right shapes, in autograd's graph, zero gradients."""
    assert out.shape == (rows, HEADS[0], HEAD_DIM) and lse.shape == (HEADS[0], rows)
    assert out.grad_fn is not None
    assert not out.any() and bool((lse == float("-inf")).all())
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for name, grad, t in zip("qkv", grads, (q, k, v)):
        assert grad.shape == t.shape and grad.dtype == t.dtype and not grad.any(), f"d{name}"


@pytest.mark.parametrize("q_lens,kv_lens,broadcast_q", [c[1:] for c in SCORELESS], ids=[c[0] for c in SCORELESS])
def test_reference_is_differentiable_without_scores(q_lens, kv_lens, broadcast_q):
    q, k, v, q_offsets, kv_offsets = scoreless_call(q_lens, kv_lens, broadcast_q)
    out, lse = reference.jagged_attention_ref(q, k, v, q_offsets, kv_offsets, causal=True, broadcast_q=broadcast_q)
    assert_scoreless_result(q, k, v, out, lse, out_rows(q, kv_offsets, broadcast_q))
