"""Problems without a single score (no output row, or no key anywhere): the reference and every
dispatch path give a differentiable output, zeros (LSE -inf) and zero gradients for q, k and v."""
import warnings

import pytest
import torch

import jfa
from jfa import dispatch, jagged, ops, reference

HEADS, HEAD_DIM = (4, 2), 8
SCORELESS = [
    # (case id, query lengths (the shared query's with broadcast-Q), key lengths, broadcast_q)
    ("no-query-rows", [0, 0, 0], [3, 0, 5], False),
    ("no-query-rows-no-keys", [0, 0], [0, 0], False),
    ("empty-shared-query", [0], [3, 0, 5], True),
    ("no-keys-anywhere", [3, 0, 2], [0, 0, 0], False),
    ("shared-query-no-keys", [4], [0, 0], True),
]


def scoreless_call(q_lens, kv_lens, broadcast_q, dtype=torch.float32, head_dim=HEAD_DIM, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), heads, head_dim, generator=gen).to(device, dtype).requires_grad_()
               for lens, heads in ((q_lens, HEADS[0]), (kv_lens, HEADS[1]), (kv_lens, HEADS[1])))
    return q, k, v, jagged.lengths_to_offsets(q_lens, device), jagged.lengths_to_offsets(kv_lens, device)


def out_rows(q, kv_offsets, broadcast_q):
    return (kv_offsets.numel() - 1) * q.shape[0] if broadcast_q else q.shape[0]


def assert_scoreless_result(q, k, v, out, lse, rows):
    """Output zeros and LSE -inf of the right shapes, in autograd's graph, zero gradients."""
    assert out.shape == (rows, *q.shape[1:]) and lse.shape == (q.shape[1], rows)
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


class RunnerThatMustNotRun:
    """Stands in for jfa.runner (`forward`, `backward`): a problem without scores never reaches it."""

    def forward(self, *args, **kwargs):
        raise AssertionError("the forward kernel was called on a problem without scores")

    def backward(self, *args, **kwargs):
        raise AssertionError("the backward kernels were called on a problem without scores")


@pytest.fixture
def cuda_dispatch_on_cpu(monkeypatch):
    """Eager CPU calls take the CUDA implementations, with kernels that must not run."""
    runner = RunnerThatMustNotRun()
    monkeypatch.setattr(dispatch, "why_not_kernel", lambda name, *tensors, **kwargs: None)
    monkeypatch.setattr(dispatch, "load_runner", lambda: (runner, ""))
    monkeypatch.setitem(ops._FWD_BY_DEVICE, "cpu", ops._jagged_attention_fwd_cuda)
    monkeypatch.setitem(ops._BWD_BY_DEVICE, "cpu", ops._jagged_attention_bwd_cuda)


@pytest.mark.parametrize("q_lens,kv_lens,broadcast_q", [c[1:] for c in SCORELESS], ids=[c[0] for c in SCORELESS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_dispatch_answers_without_a_kernel(q_lens, kv_lens, broadcast_q, dtype, cuda_dispatch_on_cpu):
    q, k, v, q_offsets, kv_offsets = scoreless_call(q_lens, kv_lens, broadcast_q, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jfa.ReferenceFallbackWarning)  # neither a kernel nor the reference
        out, lse = jfa.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True, window=2,
                                        broadcast_q=broadcast_q, return_lse=True, deterministic=True)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert_scoreless_result(q, k, v, out, lse, out_rows(q, kv_offsets, broadcast_q))


@pytest.mark.parametrize("q_lens,kv_lens,broadcast_q", [c[1:] for c in SCORELESS], ids=[c[0] for c in SCORELESS])
def test_every_path_gives_the_same_scoreless_result(q_lens, kv_lens, broadcast_q, monkeypatch):
    """The CPU path (the reference inside the Function), the CUDA implementations and the op agree."""
    q, k, v, q_offsets, kv_offsets = scoreless_call(q_lens, kv_lens, broadcast_q)
    problem = jagged.validate_jagged_attention(q, k, v, q_offsets, kv_offsets, broadcast_q=broadcast_q)
    args = (q_offsets, kv_offsets, problem.max_seq_len_q, problem.max_seq_len_kv, problem.sm_scale, False,
            ops.NO_WINDOW, broadcast_q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jfa.ReferenceFallbackWarning)
        results = [ops.jagged_attention_validated(q, k, v, q_offsets, kv_offsets, problem),
                   ops.jagged_attention_fwd(q, k, v, *args)]
    results.append(ops._jagged_attention_fwd_cuda(q.detach(), k.detach(), v.detach(), *args))
    for out, lse in results:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    grad_out = torch.ones_like(results[0][0])
    grads = ops._jagged_attention_bwd_cuda(grad_out, q.detach(), k.detach(), v.detach(), *results[0], *args)
    for grad, t in zip(grads, (q, k, v)):
        assert grad.shape == t.shape and not grad.any()
