"""`jfa.jagged_attention` on the H200: it runs the TLX kernels through `jfa.runner` (no silent
fallback), matches the fp32 reference forward and backward, `deterministic=True` repeats its gradients
bit for bit, a validated step captures in a CUDA graph, torch.compile traces it, outputs without scores
are differentiable, and GPU offsets cost one sync per call."""
import warnings
from unittest import mock

import pytest
import torch

import jfa
from jfa import dispatch, ops, reference, runner, specs
from tests.test_empty_outputs import SCORELESS, assert_scoreless_result, out_rows, scoreless_call

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 65, 128, 300, 1031]
REPEATS = 3


def _inputs(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(LENGTHS)
    q, k, v = (torch.randn(rows, heads, 128, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
               for heads in (8, 2, 2))
    offsets = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    dout = torch.randn(rows, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    return q, k, v, offsets, dout


def _relerr(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def test_both_passes_have_their_kernels_here():
    """Neither pass has a reason to fall back on this GPU for bf16 at D=128."""
    q, k, v, _, _ = _inputs(seed=0)
    assert dispatch.why_not_kernel(dispatch.FORWARD_KERNEL, q, k, v) is None
    assert dispatch.why_not_kernel(dispatch.BACKWARD_KERNEL, q, k, v) is None


def test_public_api_runs_the_kernels_and_matches_the_reference():
    q, k, v, offsets, dout = _inputs(seed=torch.seed() % 2**31)
    assert jfa.backend_for(q) == ops.KERNEL_BACKEND
    with mock.patch.object(runner, "forward", wraps=runner.forward) as forward, \
            mock.patch.object(runner, "backward", wraps=runner.backward) as backward:
        with warnings.catch_warnings():
            warnings.simplefilter("error", jfa.ReferenceFallbackWarning)
            out, lse = jfa.jagged_attention(q, k, v, offsets, offsets, causal=True, return_lse=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
    assert forward.call_count == 1 and backward.call_count == 1
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference.jagged_attention_ref(*leaves, offsets, offsets, causal=True)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.float())
    assert _relerr(out, ref_out) <= specs.FWD_RELERR
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], **specs.FWD_TOL)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert _relerr(got, want) <= specs.GRAD_RELERR, f"d{name}"


def test_deterministic_gradients_repeat_bit_for_bit():
    q, k, v, offsets, dout = _inputs(seed=torch.seed() % 2**31)
    runs = []
    for _ in range(REPEATS):
        out = jfa.jagged_attention(q, k, v, offsets, offsets, window=100, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for later in runs[1:]:
        for first, again in zip(runs[0], later):
            assert torch.equal(first, again)


def test_a_validated_step_captures_in_a_cuda_graph():
    """Once the inputs are validated, forward and backward make no host sync and allocate only
    through torch, so a training step can be captured in a CUDA graph (what removes per-call CPU
    cost in production); replays on fresh inputs match eager calls bit for bit (deterministic)."""
    q, k, v, offsets, dout = _inputs(seed=torch.seed() % 2**31)
    problem = jfa.jagged.validate_jagged_attention(q, k, v, offsets, offsets, causal=True, window=300)

    def attention(q_, k_, v_):
        return ops.jagged_attention_validated(q_, k_, v_, offsets, offsets, problem, deterministic=True)[0]

    graphed = torch.cuda.make_graphed_callables(attention, (q, k, v))
    fresh = _inputs(seed=torch.seed() % 2**31)
    q2, k2, v2 = fresh[:3]
    out = graphed(q2, k2, v2)
    grads = torch.autograd.grad(out, (q2, k2, v2), fresh[4])
    want = attention(q2, k2, v2)
    want_grads = torch.autograd.grad(want, (q2, k2, v2), fresh[4])
    assert torch.equal(out, want)
    for name, got, expected in zip("qkv", grads, want_grads):
        assert torch.equal(got, expected), f"d{name}"


def _small_model_inputs(seed=6):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [3, 64, 129, 0, 70]
    rows, width, heads, head_dim = sum(lengths), 256, 2, 128
    x = torch.randn(rows, width, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(width, 3 * heads * head_dim, device="cuda", generator=gen) / width ** 0.5).to(torch.bfloat16)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return x, w, offsets, max(lengths), heads, head_dim


def _small_model(x, w, offsets, max_len, heads, head_dim):
    q, k, v = (x @ w).unflatten(1, (3, heads, head_dim)).unbind(1)
    out = jfa.jagged_attention(q.contiguous(), k.contiguous(), v.contiguous(), offsets, offsets, max_len, max_len,
                               causal=True)
    return out.float().square().mean()


def _grads_of_small_model(fn):
    x, w, offsets, max_len, heads, head_dim = _small_model_inputs()
    x.requires_grad_()
    w.requires_grad_()
    loss = fn(x, w, offsets, max_len, heads, head_dim)
    return (loss, *torch.autograd.grad(loss, (x, w)))


def test_torch_compile_aot_eager_matches_eager():
    """fullgraph torch.compile through the custom ops. backend="aot_eager" traces the graph (fake
    kernels, autograd) without Inductor codegen, which on the GPU host would need the stock Triton
    instead of the TLX one; the kernels themselves run eagerly inside the compiled graph."""
    eager = _grads_of_small_model(_small_model)
    with mock.patch.object(runner, "backward", wraps=runner.backward) as backward:
        compiled = _grads_of_small_model(torch.compile(_small_model, backend="aot_eager", fullgraph=True))
    assert backward.call_count == 1, "the compiled graph's backward did not run the kernels"
    for name, a, b in zip(("loss", "dx", "dw"), eager, compiled):
        torch.testing.assert_close(b.float(), a.float(), **specs.GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("q_lens,kv_lens,broadcast_q", [c[1:] for c in SCORELESS], ids=[c[0] for c in SCORELESS])
def test_an_output_without_scores_is_differentiable(q_lens, kv_lens, broadcast_q):
    """No output row, or no key anywhere: zeros and LSE -inf in autograd's graph, zero gradients,
    as on the CPU (the dispatch answers from the shapes; no kernel and no reference runs)."""
    q, k, v, q_offsets, kv_offsets = scoreless_call(q_lens, kv_lens, broadcast_q, torch.bfloat16, head_dim=128,
                                                    device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", jfa.ReferenceFallbackWarning)
        out, lse = jfa.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True, broadcast_q=broadcast_q,
                                        return_lse=True)
        assert_scoreless_result(q, k, v, out, lse, out_rows(q, kv_offsets, broadcast_q))


def _syncs(fn):
    """The synchronizing CUDA operations `fn` makes, as the "file:line" of the Python call that made each."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]


def test_offsets_on_the_gpu_cost_one_sync_per_call():
    """Validation reads one small summary of both offsets; the kernels take the maxima it found, so
    an eager forward and backward together sync once; CPU offsets need no sync at all."""
    q, k, v, offsets, dout = _inputs(seed=torch.seed() % 2**31)
    kv_offsets = offsets.clone()
    # The first sync that torch's debug mode sees in a process reads as two (torch 2.11): one read
    # goes first, outside the count, and the next must count one.
    _syncs(lambda: offsets.tolist())
    assert len(_syncs(lambda: offsets.tolist())) == 1
    syncs = _syncs(lambda: jfa.jagged.validate_jagged_attention(q, k, v, offsets, kv_offsets, causal=True))
    assert len(syncs) == 1, syncs
    cpu_offsets = offsets.cpu()
    syncs = _syncs(lambda: jfa.jagged.validate_jagged_attention(q, k, v, cpu_offsets, kv_offsets, causal=True))
    assert len(syncs) == 1, syncs
    assert _syncs(lambda: jfa.jagged.validate_jagged_attention(q, k, v, cpu_offsets, cpu_offsets.clone())) == []

    def step():
        out = jfa.jagged_attention(q, k, v, offsets, kv_offsets, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)
    step()  # compiles and caches outside the count
    syncs = _syncs(step)
    assert len(syncs) == 1, syncs
