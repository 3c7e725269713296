"""`torch.library` custom ops for jagged attention, and the public `jagged_attention` entry point.

Two ops in the `jfa` namespace, `jagged_attention_fwd` -> (out, lse) and `jagged_attention_bwd` ->
(dq, dk, dv), each with a fake (meta) implementation so torch.compile can trace through them, and
autograd wired from the first to the second. Making them custom ops (rather than plain Python)
keeps them opaque to torch.compile: the graph holds one node per pass, never the kernel's
internals, and the same call works eagerly, compiled, on CPU and on GPU.

Eager calls on CPU or CUDA tensors skip the op layer: `jagged_attention` hands them to a plain
`torch.autograd.Function` running the same implementations, because the custom op's dispatch and
registered autograd cost ~75 µs of CPU per call (torch 2.11), as much as a short jagged batch takes
on the GPU. torch.compile, and tensors on other devices (meta, fake), go through the op.

Dispatch: on CUDA the TLX kernels run (`jfa.runner`: `jfa.kernels.fwd_sm90`, `bwd_dkdv`, `bwd_dq`)
when they import and accept the inputs; anywhere else, or when they decline, the PyTorch reference runs and a
`ReferenceFallbackWarning` says why, once per reason (`jfa.dispatch`, which every entry point shares,
imports the kernel modules lazily so a broken or missing kernel never breaks `import jfa`). A
problem where no query row meets a key (no output row, or no key in the batch) runs neither on
CUDA: its result is known from the shapes (zeros, LSE -inf, zero gradients, as the reference gives
on the CPU) and is made inside the autograd Function or op, so it is differentiable on every device.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from jfa import dispatch, jagged, reference

__all__ = ["jagged_attention", "jagged_attention_validated", "jagged_attention_fwd", "jagged_attention_bwd",
           "backend_for"]

# Op schemas have no Optional[int]; these sentinels stand for "no window" and "not given".
NO_WINDOW = -1
UNKNOWN_MAX_LEN = -1
KERNEL_BACKEND = "tlx-sm90"
EAGER_DEVICES = ("cpu", "cuda")  # devices whose eager calls bypass the op layer (module docstring)


def backend_for(q: Tensor) -> str:
    """What `jagged_attention` forward runs for q: "tlx-sm90" or "reference (why)"."""
    why = dispatch.why_not_kernel(dispatch.FORWARD_KERNEL, q)
    return KERNEL_BACKEND if why is None else f"reference ({why})"


def _longest(offsets: Tensor, given: int) -> int:
    """max_seq_len as given, or computed from the offsets (a sync if they are on the GPU)."""
    if given != UNKNOWN_MAX_LEN:
        return given
    lengths = jagged.offsets_to_lengths(offsets)
    return int(lengths.max()) if lengths.numel() else 0


def _window_or_none(window: int) -> int | None:
    return None if window == NO_WINDOW else window


def _out_rows(q: Tensor, kv_offsets: Tensor, broadcast_q: bool) -> int:
    """Output rows, from shapes alone: one per query row, or the shared query's once per KV sequence."""
    return (kv_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]


def _scoreless_fwd(q: Tensor, out_rows: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of a problem where no query row meets a key: zeros and LSE -inf, as the reference gives.

    Made here, fresh, inside the autograd Function or op that called, so autograd takes it as an
    output like any other, whatever a kernel wrapper would hand back for a problem without work.
    """
    return (q.new_zeros(out_rows, q.shape[1], q.shape[2]),
            q.new_full((q.shape[1], out_rows), float("-inf"), dtype=torch.float32))


# ---- forward -----------------------------------------------------------------------------------
def _jagged_attention_fwd_default(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                                  max_seq_len_q: int, max_seq_len_kv: int, sm_scale: float, causal: bool,
                                  window: int, broadcast_q: bool, deterministic: bool = False
                                  ) -> tuple[Tensor, Tensor]:
    """Jagged attention forward -> (out [Tq_out, Hq, D] in q's dtype, lse float32 [Hq, Tq_out]).

    Inputs are already validated (`jfa.jagged.validate_jagged_attention`); window -1 means none,
    max_seq_len -1 means "compute from the offsets". `deterministic` is for the backward (the
    forward always is); it rides here so autograd hands it over. This default implementation is
    the reference.
    """
    dispatch.warn_fallback(f"q is on {q.device.type}, the TLX kernels need a CUDA (sm_90) GPU")
    return _reference_fwd(q, k, v, q_offsets, kv_offsets, sm_scale, causal, window, broadcast_q)


jagged_attention_fwd = torch.library.custom_op("jfa::jagged_attention_fwd", mutates_args=())(
    _jagged_attention_fwd_default)


def _reference_fwd(q, k, v, q_offsets, kv_offsets, sm_scale, causal, window, broadcast_q):
    out, lse = reference.jagged_attention_ref(q, k, v, q_offsets, kv_offsets, sm_scale=sm_scale, causal=causal,
                                              window=_window_or_none(window), broadcast_q=broadcast_q)
    return out.to(q.dtype), lse.to(torch.float32)


def _jagged_attention_fwd_cuda(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, causal,
                               window, broadcast_q, deterministic=False):
    out_rows = _out_rows(q, kv_offsets, broadcast_q)
    if out_rows == 0 or k.shape[0] == 0:
        return _scoreless_fwd(q, out_rows)
    why = dispatch.why_not_kernel(dispatch.FORWARD_KERNEL, q, k, v)
    if why is not None:
        dispatch.warn_fallback(why)
        return _reference_fwd(q, k, v, q_offsets, kv_offsets, sm_scale, causal, window, broadcast_q)
    runner, _ = dispatch.load_runner()
    # Read the bounds before moving the offsets: offsets kept on the CPU need no sync for this.
    max_q, max_kv = _longest(q_offsets, max_seq_len_q), _longest(kv_offsets, max_seq_len_kv)
    q_offsets, kv_offsets = dispatch.kernel_offsets(q, q_offsets, kv_offsets)
    return runner.forward(q, k, v, q_offsets, kv_offsets, max_q, max_kv, sm_scale, causal, _window_or_none(window),
                          broadcast_q)


@jagged_attention_fwd.register_fake
def _jagged_attention_fwd_fake(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, causal,
                               window, broadcast_q, deterministic=False):
    out_rows = _out_rows(q, kv_offsets, broadcast_q)
    return q.new_empty(out_rows, q.shape[1], q.shape[2]), q.new_empty(q.shape[1], out_rows, dtype=torch.float32)


# ---- backward ----------------------------------------------------------------------------------
def _jagged_attention_bwd_default(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  q_offsets: Tensor, kv_offsets: Tensor, max_seq_len_q: int,
                                  max_seq_len_kv: int, sm_scale: float, causal: bool, window: int,
                                  broadcast_q: bool, deterministic: bool = False
                                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Jagged attention backward -> (dq, dk, dv) in the dtypes of q, k, v.

    `deterministic=True` asks the kernel for bitwise-repeatable gradients (no float atomics).

    The default implementation is `reference.jagged_attention_bwd_ref`, which recomputes P itself;
    `out` and `lse` are what a kernel backward needs and are unused there.
    """
    return _reference_bwd(grad_out, q, k, v, q_offsets, kv_offsets, sm_scale, causal, window, broadcast_q)


jagged_attention_bwd = torch.library.custom_op("jfa::jagged_attention_bwd", mutates_args=())(
    _jagged_attention_bwd_default)


def _reference_bwd(grad_out, q, k, v, q_offsets, kv_offsets, sm_scale, causal, window, broadcast_q):
    grads = reference.jagged_attention_bwd_ref(grad_out, q, k, v, q_offsets, kv_offsets, sm_scale=sm_scale,
                                               causal=causal, window=_window_or_none(window),
                                               broadcast_q=broadcast_q)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def _jagged_attention_bwd_cuda(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv,
                               sm_scale, causal, window, broadcast_q, deterministic=False):
    if grad_out.shape[0] == 0 or k.shape[0] == 0:  # no score, so no gradient (see the forward)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    why = dispatch.why_not_kernel(dispatch.BACKWARD_KERNEL, q, k, v, grad_out)
    if why is not None:
        dispatch.warn_fallback(f"backward: {why}")
        return _reference_bwd(grad_out, q, k, v, q_offsets, kv_offsets, sm_scale, causal, window, broadcast_q)
    runner, _ = dispatch.load_runner()
    max_q, max_kv = _longest(q_offsets, max_seq_len_q), _longest(kv_offsets, max_seq_len_kv)
    q_offsets, kv_offsets = dispatch.kernel_offsets(q, q_offsets, kv_offsets)
    return runner.backward(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, max_q, max_kv, sm_scale, causal,
                           _window_or_none(window), broadcast_q, deterministic=deterministic)


@jagged_attention_bwd.register_fake
def _jagged_attention_bwd_fake(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv,
                               sm_scale, causal, window, broadcast_q, deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ---- autograd ----------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, kv_offsets, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, kv_offsets)
    ctx.params = params  # max_seq_len_q, max_seq_len_kv, sm_scale, causal, window, broadcast_q, deterministic
    # The backward (reference or kernel) has no LSE term: a loss on lse would get no gradient.
    ctx.mark_non_differentiable(lse)


def _backward_with(bwd, ctx, grad_out):
    q, k, v, out, lse, q_offsets, kv_offsets = ctx.saved_tensors
    dq, dk, dv = bwd(grad_out.contiguous(), q, k, v, out, lse, q_offsets, kv_offsets, *ctx.params)
    return (dq, dk, dv) + (None,) * (2 + len(ctx.params))


def _backward(ctx, grad_out, grad_lse):
    return _backward_with(jagged_attention_bwd, ctx, grad_out)


torch.library.register_autograd("jfa::jagged_attention_fwd", _backward, setup_context=_setup_context)

# Each op's per-device implementations (the default one runs elsewhere): registered with the op
# here, and read by the eager path below, so the two cannot disagree.
_FWD_BY_DEVICE = {"cuda": _jagged_attention_fwd_cuda}
_BWD_BY_DEVICE = {"cuda": _jagged_attention_bwd_cuda}
for _device, _kernel in _FWD_BY_DEVICE.items():
    jagged_attention_fwd.register_kernel(_device)(_kernel)
for _device, _kernel in _BWD_BY_DEVICE.items():
    jagged_attention_bwd.register_kernel(_device)(_kernel)


def _fwd_eager(q, *args):
    return _FWD_BY_DEVICE.get(q.device.type, _jagged_attention_fwd_default)(q, *args)


def _bwd_eager(grad_out, q, *args):
    return _BWD_BY_DEVICE.get(q.device.type, _jagged_attention_bwd_default)(grad_out, q, *args)


class _EagerJaggedAttention(torch.autograd.Function):
    """The op's forward and autograd without the op layer (see the module docstring for why)."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, *params):
        output = _fwd_eager(q, k, v, q_offsets, kv_offsets, *params)
        _setup_context(ctx, (q, k, v, q_offsets, kv_offsets, *params), output)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _backward_with(_bwd_eager, ctx, grad_out)


# ---- public entry point ------------------------------------------------------------------------
def jagged_attention(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                     max_seq_len_q: int | None = None, max_seq_len_kv: int | None = None, *,
                     sm_scale: float | None = None, causal: bool = False, window: int | None = None,
                     broadcast_q: bool = False, return_lse: bool = False, deterministic: bool = False):
    """Softmax attention over packed variable-length sequences (semantics: docs/CONTRACTS.md).

    q [Tq, Hq, D], k/v [Tk, Hkv, D] (Hq a multiple of Hkv), offsets int [B+1]. Returns out
    [Tq_out, Hq, D] in q's dtype, and lse float32 [Hq, Tq_out] when `return_lse`. Differentiable
    in q, k, v; `deterministic=True` makes the gradients bitwise repeatable run to run (without it
    dQ may be summed by fp32 adds in arrival order: `jfa.configs.dq_strategy`). Offsets
    kept on the CPU are read without a GPU sync. Under torch.compile only the
    checks that need no offset values run (reading values would break the graph).
    """
    if torch.compiler.is_compiling():
        jagged.check_jagged_tensors(q, k, v, q_offsets, kv_offsets, sm_scale=sm_scale, window=window,
                                    broadcast_q=broadcast_q)
        max_q = UNKNOWN_MAX_LEN if max_seq_len_q is None else max_seq_len_q
        max_kv = UNKNOWN_MAX_LEN if max_seq_len_kv is None else max_seq_len_kv
        scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
        out, lse = jagged_attention_fwd(q, k, v, q_offsets, kv_offsets, max_q, max_kv, scale, causal,
                                        NO_WINDOW if window is None else window, broadcast_q, deterministic)
    else:
        problem = jagged.validate_jagged_attention(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv,
                                                   sm_scale=sm_scale, causal=causal, window=window,
                                                   broadcast_q=broadcast_q)
        out, lse = jagged_attention_validated(q, k, v, q_offsets, kv_offsets, problem, deterministic=deterministic)
    return (out, lse) if return_lse else out


def jagged_attention_validated(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                               problem: jagged.JaggedProblem, *, deterministic: bool = False
                               ) -> tuple[Tensor, Tensor]:
    """(out, lse) of `jagged_attention` for inputs already checked by `jagged.validate_jagged_attention`.

    For callers that call many times with the same offsets (benchmarks, a training loop that
    validates once): the check reads the offsets' values, a GPU sync when they live on the GPU.
    Eager calls on CPU and CUDA tensors bypass the op layer (module docstring).
    """
    args = (q, k, v, q_offsets, kv_offsets, problem.max_seq_len_q, problem.max_seq_len_kv, problem.sm_scale,
            problem.causal, NO_WINDOW if problem.window is None else problem.window, problem.broadcast_q,
            deterministic)
    if torch.compiler.is_compiling() or q.device.type not in EAGER_DEVICES:
        return jagged_attention_fwd(*args)
    return _EagerJaggedAttention.apply(*args)
