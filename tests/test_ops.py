"""The custom ops and `jfa.jagged_attention` on the CPU: reference results, autograd, opcheck, compile."""
import warnings

import pytest
import torch

import jfa
from jfa import dispatch, jagged, ops, reference

Q_LENS, KV_LENS = [5, 0, 7, 3], [6, 4, 0, 9]
CASES = [  # causal, window, broadcast_q
    (False, None, False), (True, None, False), (False, 2, False), (True, 3, False), (True, None, True),
]


def make_call(dtype=torch.float32, broadcast_q=False, heads=(4, 2), head_dim=16, q_lens=Q_LENS, kv_lens=KV_LENS,
              seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_rows = 4 if broadcast_q else sum(q_lens)
    q = torch.randn(q_rows, heads[0], head_dim, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(kv_lens), heads[1], head_dim, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(kv_lens), heads[1], head_dim, generator=gen, dtype=torch.float64).to(dtype)
    q_offsets = jagged.lengths_to_offsets([4] if broadcast_q else q_lens)
    return q, k, v, q_offsets, jagged.lengths_to_offsets(kv_lens)


@pytest.fixture(autouse=True)
def quiet_fallback():
    """On the CPU every call falls back to the reference by design; the warning is tested separately."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jfa.ReferenceFallbackWarning)
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal,window,broadcast_q", CASES)
def test_public_api_equals_reference(dtype, causal, window, broadcast_q):
    q, k, v, q_offsets, kv_offsets = make_call(dtype, broadcast_q)
    out, lse = jfa.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=causal, window=window,
                                    broadcast_q=broadcast_q, return_lse=True)
    want_out, want_lse = reference.jagged_attention_ref(q, k, v, q_offsets, kv_offsets, causal=causal, window=window,
                                                        broadcast_q=broadcast_q)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(out, want_out.to(dtype))
    assert torch.equal(lse, want_lse)


def test_sm_scale_max_len_and_int64_offsets_pass_through():
    q, k, v, q_offsets, kv_offsets = make_call()
    out = jfa.jagged_attention(q, k, v, q_offsets.long(), kv_offsets.long(), 64, 64, sm_scale=0.2)
    want, _ = reference.jagged_attention_ref(q, k, v, q_offsets, kv_offsets, sm_scale=0.2)
    assert torch.equal(out, want)


@pytest.mark.parametrize("causal,window,broadcast_q", CASES)
def test_gradients_through_the_op_equal_reference_autograd(causal, window, broadcast_q):
    q, k, v, q_offsets, kv_offsets = make_call(broadcast_q=broadcast_q)
    out_rows = q.shape[0] * len(KV_LENS) if broadcast_q else sum(Q_LENS)
    grad_out = torch.randn(out_rows, 4, 16, generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = jfa.jagged_attention(*leaves, q_offsets, kv_offsets, causal=causal, window=window, broadcast_q=broadcast_q)
    got = torch.autograd.grad(out, leaves, grad_out)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.jagged_attention_ref(*ref_leaves, q_offsets, kv_offsets, causal=causal, window=window,
                                                broadcast_q=broadcast_q)
    want = torch.autograd.grad(ref_out, ref_leaves, grad_out)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("causal,window,broadcast_q", [(True, 2, False), (False, None, True)])
def test_eager_path_equals_the_op_and_skips_it(causal, window, broadcast_q, monkeypatch):
    """Eager CPU/CUDA calls run the op's implementations through a plain autograd.Function: same
    outputs and gradients, bit for bit, as the op with its registered autograd, without the op."""
    q, k, v, q_offsets, kv_offsets = make_call(broadcast_q=broadcast_q)
    problem = jagged.validate_jagged_attention(q, k, v, q_offsets, kv_offsets, causal=causal, window=window,
                                               broadcast_q=broadcast_q)
    op_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    op_out, op_lse = ops.jagged_attention_fwd(*op_leaves, q_offsets, kv_offsets, problem.max_seq_len_q,
                                              problem.max_seq_len_kv, problem.sm_scale, causal,
                                              ops.NO_WINDOW if window is None else window, broadcast_q)
    grad_out = torch.randn_like(op_out)
    op_grads = torch.autograd.grad(op_out, op_leaves, grad_out)

    def op_called(*args, **kwargs):
        raise AssertionError("an eager CPU call went through the custom op")
    monkeypatch.setattr(ops, "jagged_attention_fwd", op_called)
    monkeypatch.setattr(ops, "jagged_attention_bwd", op_called)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ops.jagged_attention_validated(*leaves, q_offsets, kv_offsets, problem)
    grads = torch.autograd.grad(out, leaves, grad_out)
    assert torch.equal(out, op_out) and torch.equal(lse, op_lse) and not lse.requires_grad
    for name, g, w in zip("qkv", grads, op_grads):
        assert torch.equal(g, w), f"d{name} differs between the eager path and the op"


@pytest.mark.parametrize("causal,window,broadcast_q", [(True, 1, False), (False, None, True)])
def test_gradcheck_float64(causal, window, broadcast_q):
    q, k, v, q_offsets, kv_offsets = make_call(torch.float64, broadcast_q, heads=(2, 1), head_dim=4,
                                               q_lens=[3, 0, 2], kv_lens=[2, 3, 1])
    leaves = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: jfa.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=causal, window=window,
                                             broadcast_q=broadcast_q), leaves)


def test_lse_is_not_differentiable():
    q, k, v, q_offsets, kv_offsets = make_call()
    _, lse = jfa.jagged_attention(q.requires_grad_(), k, v, q_offsets, kv_offsets, return_lse=True)
    assert not lse.requires_grad


def op_args(broadcast_q=False, causal=True, window=2):
    q, k, v, q_offsets, kv_offsets = make_call(torch.float64, broadcast_q, heads=(2, 1), head_dim=8,
                                               q_lens=[3, 0, 2], kv_lens=[2, 3, 1])
    return (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), q_offsets, kv_offsets, 3, 3, 0.4, causal,
            window, broadcast_q)


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_opcheck_forward(broadcast_q):
    torch.library.opcheck(torch.ops.jfa.jagged_attention_fwd.default, op_args(broadcast_q))


def test_opcheck_backward():
    args = op_args()
    out, lse = ops.jagged_attention_fwd(*args)
    grad_out = torch.randn_like(out)
    q, k, v, q_offsets, kv_offsets, *params = (a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.jfa.jagged_attention_bwd.default,
                          (grad_out, q, k, v, out.detach(), lse, q_offsets, kv_offsets, *params))


def test_fake_shapes_for_broadcast_q():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(4, 8, 64, dtype=torch.bfloat16)
        k = v = torch.empty(100, 2, 64, dtype=torch.bfloat16)
        q_offsets, kv_offsets = torch.empty(2, dtype=torch.int32), torch.empty(6, dtype=torch.int32)
        out, lse = ops.jagged_attention_fwd(q, k, v, q_offsets, kv_offsets, 4, 40, 0.125, False, -1, True)
        assert out.shape == (5 * 4, 8, 64) and out.dtype == torch.bfloat16
        assert lse.shape == (8, 20) and lse.dtype == torch.float32


class TinyAttention(torch.nn.Module):
    """Projection -> jagged attention -> projection: enough graph around the op for the compiler."""

    def __init__(self, embed=16, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(embed, 3 * heads * head_dim)
        self.proj = torch.nn.Linear(heads * head_dim, embed)

    def forward(self, x, offsets):
        q, k, v = self.qkv(x).unflatten(1, (3, self.heads, self.head_dim)).unbind(1)
        out = jfa.jagged_attention(q.contiguous(), k.contiguous(), v.contiguous(), offsets, offsets, causal=True)
        return self.proj(out.flatten(1))


def test_torch_compile_fullgraph_matches_eager():
    """aot_eager: dynamo captures one graph, AOT autograd traces the fake impls and the autograd
    registration. Inductor also passes but spends ~45 s compiling C++ on a 2-core CPU."""
    torch.manual_seed(0)
    model = TinyAttention()
    offsets = jagged.lengths_to_offsets([5, 0, 3])
    x = torch.randn(8, 16, requires_grad=True)
    want = model(x, offsets)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = compiled(x, offsets)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def test_public_api_rejects_bad_input():
    q, k, v, q_offsets, kv_offsets = make_call()
    with pytest.raises(ValueError, match="^kv_offsets:"):
        jfa.jagged_attention(q, k, v, q_offsets, kv_offsets.flip(0))


def test_fallback_warns_once_and_backend_says_why(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    q, k, v, q_offsets, kv_offsets = make_call()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jfa.jagged_attention(q, k, v, q_offsets, kv_offsets)
        jfa.jagged_attention(q, k, v, q_offsets, kv_offsets)
    fallback = [w for w in caught if issubclass(w.category, jfa.ReferenceFallbackWarning)]
    assert len(fallback) == 1 and "cpu" in str(fallback[0].message)
    assert jfa.backend_for(q).startswith("reference (q is on cpu")


def test_package_exports():
    assert isinstance(jfa.__version__, str)
    assert jfa.reference is reference and jfa.jagged is jagged
    assert jfa.jagged_attention is ops.jagged_attention


class StubRunner:
    """Stands in for jfa.runner (its `forward` and `backward` signatures): records what the op hands it."""

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, causal, window,
                broadcast_q, *, out=None, lse=None, fork=None, qk_descale=1.0, out_dtype=None):
        self.calls.append(dict(offsets_dtype=(q_offsets.dtype, kv_offsets.dtype),
                               max_len=(max_seq_len_q, max_seq_len_kv), window=window))
        return ops._reference_fwd(q, k, v, q_offsets, kv_offsets, sm_scale, causal, ops.NO_WINDOW if window is None
                                  else window, broadcast_q)

    def backward(self, dout, q, k, v, out, lse, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, causal,
                 window, broadcast_q, *, deterministic=False, grads=None, fork=None, dq_strategy=None):
        self.calls.append(dict(offsets_dtype=(q_offsets.dtype, kv_offsets.dtype),
                               max_len=(max_seq_len_q, max_seq_len_kv), window=window, deterministic=deterministic))
        return tuple(torch.zeros_like(t) for t in (q, k, v))


@pytest.mark.parametrize("window", [None, 2])
def test_kernel_dispatch_plumbing(monkeypatch, window):
    """The CUDA implementations, called directly with a stub runner: what the kernels' runner receives."""
    stub = StubRunner()
    monkeypatch.setattr(dispatch, "why_not_kernel", lambda name, *tensors, **kwargs: None)
    monkeypatch.setattr(dispatch, "load_runner", lambda: (stub, ""))
    q, k, v, q_offsets, kv_offsets = make_call()
    op_window = ops.NO_WINDOW if window is None else window
    out, lse = ops._jagged_attention_fwd_cuda(q, k, v, q_offsets.long(), kv_offsets.long(), ops.UNKNOWN_MAX_LEN, 40,
                                              0.25, True, op_window, False)
    want, _ = reference.jagged_attention_ref(q, k, v, q_offsets, kv_offsets, sm_scale=0.25, causal=True, window=window)
    assert torch.equal(out, want)
    ops._jagged_attention_bwd_cuda(torch.ones_like(out), q, k, v, out, lse, q_offsets, kv_offsets, 7, 9, 0.25, True,
                                   op_window, False, True)
    # int32 offsets, max lengths resolved from the offsets when unknown, None for "no window".
    assert stub.calls == [dict(offsets_dtype=(torch.int32, torch.int32), max_len=(max(Q_LENS), 40), window=window),
                          dict(offsets_dtype=(torch.int32, torch.int32), max_len=(7, 9), window=window,
                               deterministic=True)]


def test_the_kernel_modules_dispatch_asks_define_is_supported():
    """`why_not_kernel` asks the modules FORWARD_KERNEL and BACKWARD_KERNEL whether they take q. On the
    CPU every call is answered before that question (the device), so this is where a module without
    `is_supported` shows up before a GPU run does."""
    for name in (dispatch.FORWARD_KERNEL, dispatch.BACKWARD_KERNEL):
        module, why = dispatch.load_kernel_module(name)
        assert module is not None, why
        assert callable(getattr(module, "is_supported", None)), f"jfa.kernels.{name} defines no is_supported(q)"
        assert module.is_supported(torch.empty(1, 1, 64, dtype=torch.bfloat16)) is False  # a CPU tensor


def test_backend_reasons():
    assert dispatch.why_not_kernel(dispatch.FORWARD_KERNEL, torch.empty(2, 1, 64)) == \
        "q is on cpu, the TLX kernels need a CUDA (sm_90) GPU"
    assert "did not import" in dispatch.load_kernel_module("no_such_kernel")[1]


class ShapeOnlyRunner:
    """A runner whose kernels read nothing but shapes: outputs and gradients of the right size."""

    def forward(self, q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, causal, window,
                broadcast_q, **options):
        rows = (kv_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]
        return q.new_zeros(rows, *q.shape[1:]), q.new_zeros(q.shape[1], rows, dtype=torch.float32)

    def backward(self, dout, q, k, v, *args, **options):
        return tuple(torch.zeros_like(t) for t in (q, k, v))


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_an_eager_call_reads_the_offsets_once(broadcast_q, monkeypatch):
    """Validation reads its one summary of the offsets (a sync for GPU offsets); the CUDA
    implementations, forward and backward, take the lengths it found and read nothing more."""
    from tests.test_validation import ReadCountingOffsets
    runner = ShapeOnlyRunner()
    monkeypatch.setattr(dispatch, "why_not_kernel", lambda name, *tensors, **kwargs: None)
    monkeypatch.setattr(dispatch, "load_runner", lambda: (runner, ""))
    monkeypatch.setitem(ops._FWD_BY_DEVICE, "cpu", ops._jagged_attention_fwd_cuda)
    monkeypatch.setitem(ops._BWD_BY_DEVICE, "cpu", ops._jagged_attention_bwd_cuda)
    monkeypatch.setattr(ReadCountingOffsets, "reads", [])
    q, k, v, q_offsets, kv_offsets = make_call(torch.bfloat16, broadcast_q, head_dim=64)
    q_offsets, kv_offsets = (o.as_subclass(ReadCountingOffsets) for o in (q_offsets, kv_offsets))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = jfa.jagged_attention(*leaves, q_offsets, kv_offsets, causal=True, broadcast_q=broadcast_q)
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert ReadCountingOffsets.reads == ["tolist"]
