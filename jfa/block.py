"""Block attention's public API: `block_attention` and `fused_projection_rotary_block_attention`.

Both are `torch.library` custom ops, so they work under `torch.compile` (fake impls give shapes
without running anything) and with autograd. On a Hopper GPU they run the TLX kernels of
`jfa.kernels.block_attn`; anywhere else they run the fp32 references of `jfa.reference` (and say so
once per reason, `jfa.dispatch`), so notebooks and user code behave the same on a laptop.

The fused path splits its work where each part is cheapest:
- forward: ``qkv = x @ w (+ bias)`` is a torch matmul; rotary on q, k, v (one Triton pass each,
  `jfa.kernels.rotary`), then the attention kernel;
- backward: the attention backward kernel applies the conjugate rotation in its epilogue and writes
  one tensor ``dz = d(qkv)``; autograd's matmul backward then gives ``dx = dz @ w^T``,
  ``dw = x^T @ dz`` and ``dbias = dz.sum(0)``. Only ``qkv`` is kept for the backward: the rotated
  q, k, v are recomputed there (three elementwise passes), which saves their memory.
"""
from __future__ import annotations

import torch

from jfa import configs, dispatch, reference, specs
from jfa.jagged import OFFSET_DTYPES, check_jagged_tensors
from jfa.kernels import rotary
from jfa.kernels.tiles import num_sms, persistent_programs
from jfa.schedule import build_block_table

__all__ = ["block_attention", "fused_projection_rotary_block_attention"]


# ---- validation -----------------------------------------------------------------------------

def _check_tensor(name: str, t, dims: int):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")


def _check_offsets(offsets, rows: int, device: torch.device):
    """Offsets: int [B+1] prefix sums. Values are checked only on the CPU (CUDA ones would need a sync)."""
    _check_tensor("offsets", offsets, 1)
    if offsets.dtype not in OFFSET_DTYPES:
        raise TypeError(f"offsets: dtype {offsets.dtype} is not an offset type; use .to(torch.int32)")
    if offsets.numel() < 1:
        raise ValueError("offsets: must hold B+1 >= 1 prefix sums starting at 0, got an empty tensor")
    if offsets.device != device and offsets.device.type != "cpu":
        raise ValueError(f"offsets: is on {offsets.device} but the data is on {device}; move it there")
    if rows > specs.INT32_MAX:
        raise ValueError(f"rows: at most {specs.INT32_MAX} rows are supported, got {rows}")
    if offsets.device.type == "cpu":
        values = offsets.tolist()
        if values[0] != 0 or values[-1] != rows or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"offsets: must be non-decreasing prefix sums from 0 to the row count {rows}, "
                             f"got {values[:4]}...{values[-2:]}")


def _check_attention_inputs(q, k, v, offsets):
    """Shapes, dtypes, devices (jfa.jagged's checks, worded for the single ``offsets`` argument)."""
    try:
        check_jagged_tensors(q, k, v, offsets, offsets, for_kernel=q.is_cuda if isinstance(q, torch.Tensor) else False)
    except (TypeError, ValueError) as error:
        raise type(error)(str(error).replace("kv_offsets", "offsets").replace("q_offsets", "offsets")) from None
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: has {k.shape[0]} rows but q has {q.shape[0]}; block attention is self-attention "
                         "over one set of offsets")
    _check_offsets(offsets, q.shape[0], q.device)


def _check_fused_inputs(x, w, sinu_pos, offsets, q_heads, kv_heads, bias):
    _check_tensor("x", x, 2)
    _check_tensor("w", w, 2)
    _check_tensor("sinu_pos", sinu_pos, 2)
    for name, n in (("q_heads", q_heads), ("kv_heads", kv_heads)):
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) (GQA)")
    if w.dtype != x.dtype:
        raise TypeError(f"w must have x's dtype {x.dtype}, got {w.dtype}")
    if w.shape[0] != x.shape[1]:
        raise ValueError(f"w must be [E, (q_heads + 2*kv_heads) * D] with E = x.shape[1] = {x.shape[1]}, "
                         f"got {tuple(w.shape)}")
    width = w.shape[1]
    heads = q_heads + 2 * kv_heads
    if width % heads or width // heads not in specs.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"w's {width} columns must be (q_heads + 2*kv_heads) * D = {heads} * D with D in "
                         f"{specs.SUPPORTED_HEAD_DIMS}")
    head_dim = width // heads
    if tuple(sinu_pos.shape) != (x.shape[0], head_dim):
        raise ValueError(f"sinu_pos must be [M, D] = [{x.shape[0]}, {head_dim}] (sin | cos halves), "
                         f"got {tuple(sinu_pos.shape)}")
    if bias is not None and tuple(bias.shape) != (width,):
        raise ValueError(f"bias must be [{width}] (one per column of w), got {tuple(bias.shape)}")
    for name, t in (("w", w), ("sinu_pos", sinu_pos), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    _check_offsets(offsets, x.shape[0], x.device)


# ---- dispatch -------------------------------------------------------------------------------

def _kernels_run(q: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the kernels of `jfa.kernels.block_attn` run on these tensors; where they do not, the
    reference runs (said once per reason)."""
    why = dispatch.why_not_kernel("block_attn", q, *others)
    if why is not None:
        dispatch.warn_fallback(f"block attention: {why}")
        return False
    return True


# ---- the kernels' launches ------------------------------------------------------------------

def _block_table_and_programs(q: torch.Tensor, offsets: torch.Tensor, units_per_block: int):
    """The block table on q's device (`schedule.build_block_table`) and a persistent grid for its units."""
    blocks = build_block_table(offsets.to(q.device), q.shape[0])
    return blocks, persistent_programs(num_sms(q.device), blocks[0].numel() * units_per_block)


def block_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """The forward kernel on validated inputs it runs on (`_kernels_run`): out [T, Hq, D] in q's dtype.

    `out` (contiguous, q's shape and dtype) lets the GPU tests pass a poisoned buffer.
    """
    block_attn = dispatch.load_kernel_module("block_attn")[0]
    rows, heads_q, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if rows == 0 or heads_q == 0:
        return out
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    blocks, programs = _block_table_and_programs(q, offsets, heads_q)
    block_attn.launch_forward(q, k, v, out, blocks, configs.block_attention_forward(head_dim, heads_q // k.shape[1]),
                              programs=programs)
    return out


def _launch_backward(q, k, v, offsets, dout, dq, dk, dv, sinu_pos=None):
    """The backward kernel into dq, dk, dv: [T, H, D] tensors, or with `sinu_pos` the column slices of dz."""
    block_attn = dispatch.load_kernel_module("block_attn")[0]
    heads_q, head_dim = q.shape[1:]
    heads_kv = k.shape[1]
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    blocks, programs = _block_table_and_programs(q, offsets, heads_kv)
    config = configs.block_attention_backward(head_dim, heads_q // heads_kv, rotary=sinu_pos is not None)
    block_attn.launch_backward(q, k, v, dout, dq, dk, dv, blocks, config, programs=programs, sinu_pos=sinu_pos)


def block_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                        dout: torch.Tensor, grads: tuple | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernel on validated inputs it runs on: (dq, dk, dv) in their dtype; P is recomputed.

    `grads` optionally gives the (dq, dk, dv) buffers to fill (contiguous; the GPU tests poison them).
    """
    dq, dk, dv = grads or tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if q.shape[0] and q.shape[1]:
        _launch_backward(q, k, v, offsets, dout, dq, dk, dv)
    return dq, dk, dv


def block_attention_rotary_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                               dout: torch.Tensor, sinu_pos: torch.Tensor,
                               dz: torch.Tensor | None = None) -> torch.Tensor:
    """Backward of rotary + block attention by the kernel's rotary epilogue: dz [M, (Hq + 2*Hkv) * D].

    q, k, v are the *rotated* tensors the forward attended with. The epilogue applies the conjugate
    rotation to dQ, dK, dV in fp32 and stores them side by side: columns [0, Hq*D) hold dQ, then
    Hkv*D columns of dK, then Hkv*D of dV, the layout of ``x @ w`` that produced q, k, v.
    """
    rows, heads_q, head_dim = q.shape
    heads_kv = k.shape[1]
    width = (heads_q + 2 * heads_kv) * head_dim
    dz = torch.empty(rows, width, dtype=q.dtype, device=q.device) if dz is None else dz
    if rows and heads_q:
        _launch_backward(q, k, v, offsets, dout, dz, dz[:, heads_q * head_dim:],
                         dz[:, (heads_q + heads_kv) * head_dim:], sinu_pos)
    return dz


def _split_heads(qkv: torch.Tensor, q_heads: int, kv_heads: int):
    rows = qkv.shape[0]
    head_dim = qkv.shape[1] // (q_heads + 2 * kv_heads)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return (t.reshape(rows, -1, head_dim) for t in (q, k, v))


def _rotated_heads(qkv, sinu_pos, q_heads, kv_heads):
    """q, k, v of the projection with rotary applied (fp32 math, stored in qkv's dtype).

    On a GPU one Triton pass per tensor (`jfa.kernels.rotary`); elsewhere the PyTorch reference.
    """
    heads = _split_heads(qkv, q_heads, kv_heads)
    if qkv.is_cuda:
        return tuple(rotary.rotate(t, sinu_pos) for t in heads)
    return tuple(reference.rotary_ref(t, sinu_pos).to(qkv.dtype) for t in heads)


def _reference_grads(fn, inputs, grad_out):
    """Gradients of the reference `fn(*inputs)` (fp32, fp64 for fp64 inputs), cast to the inputs' dtypes.

    A custom op's body runs with the autograd dispatch key excluded (the op is a leaf to autograd),
    so the reference's graph is recorded only after re-enabling that key for this block.
    """
    autograd_key = torch._C.DispatchKey.AutogradFunctionality
    with torch.enable_grad(), torch._C._SetExcludeDispatchKeyGuard(autograd_key, False):
        leaves = [t.detach().to(torch.promote_types(t.dtype, torch.float32)).requires_grad_() for t in inputs]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return tuple(g.to(t.dtype) for g, t in zip(grads, inputs))


# ---- block attention ------------------------------------------------------------------------

@torch.library.custom_op("jfa::block_attention", mutates_args=())
def _block_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if _kernels_run(q, k, v):
        return block_attention_fwd(q, k, v, offsets)
    return reference.block_attention_ref(q, k, v, offsets).to(q.dtype)


@_block_attention_op.register_fake
def _(q, k, v, offsets):
    return torch.empty_like(q)


@torch.library.custom_op("jfa::block_attention_backward", mutates_args=())
def _block_attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                                 dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _kernels_run(q, k, v, dout):
        return block_attention_bwd(q, k, v, offsets, dout)
    return _reference_grads(lambda q_, k_, v_: reference.block_attention_ref(q_, k_, v_, offsets), (q, k, v), dout)


@_block_attention_backward_op.register_fake
def _(q, k, v, offsets, dout):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _block_attention_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _block_attention_backward(ctx, dout):
    q, k, v, offsets = ctx.saved_tensors
    dq, dk, dv = _block_attention_backward_op(q, k, v, offsets, dout)
    return dq, dk, dv, None


_block_attention_op.register_autograd(_block_attention_backward, setup_context=_block_attention_setup)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Block-diagonal self-attention over packed sequences: each 64-token block attends only to itself.

    q [T, Hq, D], k and v [T, Hkv, D] (Hq = G*Hkv; D 64 or 128; bf16/fp16 for the kernels), offsets
    int32/int64 [B+1] prefix sums. The last block of a sequence is masked to its real size.
    sm_scale is 1/sqrt(D). Returns out [T, Hq, D] in q's dtype; differentiable in q, k, v.
    """
    _check_attention_inputs(q, k, v, offsets)
    return _block_attention_op(q, k, v, offsets)


# ---- projection + rotary + block attention --------------------------------------------------

@torch.library.custom_op("jfa::rotary_block_attention", mutates_args=())
def _rotary_block_attention_op(qkv: torch.Tensor, sinu_pos: torch.Tensor, offsets: torch.Tensor,
                               q_heads: int, kv_heads: int) -> torch.Tensor:
    q, k, v = _rotated_heads(qkv, sinu_pos, q_heads, kv_heads)
    out = block_attention_fwd(q, k, v, offsets) if _kernels_run(q, k, v) else \
        reference.block_attention_ref(q, k, v, offsets).to(q.dtype)
    return out.reshape(qkv.shape[0], -1)


@_rotary_block_attention_op.register_fake
def _(qkv, sinu_pos, offsets, q_heads, kv_heads):
    head_dim = qkv.shape[1] // (q_heads + 2 * kv_heads)
    return qkv.new_empty(qkv.shape[0], q_heads * head_dim)


@torch.library.custom_op("jfa::rotary_block_attention_backward", mutates_args=())
def _rotary_block_attention_backward_op(qkv: torch.Tensor, sinu_pos: torch.Tensor, offsets: torch.Tensor,
                                        dout: torch.Tensor, q_heads: int, kv_heads: int) -> torch.Tensor:
    q, k, v = _rotated_heads(qkv, sinu_pos, q_heads, kv_heads)
    if _kernels_run(q, k, v):
        return block_attention_rotary_bwd(q, k, v, offsets, dout.reshape(q.shape), sinu_pos)

    def rotary_attention(qkv_):
        q_, k_, v_ = (reference.rotary_ref(t, sinu_pos) for t in _split_heads(qkv_, q_heads, kv_heads))
        return reference.block_attention_ref(q_, k_, v_, offsets).reshape(qkv_.shape[0], -1)

    return _reference_grads(rotary_attention, (qkv,), dout)[0]


@_rotary_block_attention_backward_op.register_fake
def _(qkv, sinu_pos, offsets, dout, q_heads, kv_heads):
    return torch.empty_like(qkv)


def _rotary_setup(ctx, inputs, output):
    qkv, sinu_pos, offsets, q_heads, kv_heads = inputs
    ctx.save_for_backward(qkv, sinu_pos, offsets)
    ctx.heads = (q_heads, kv_heads)


def _rotary_backward(ctx, dout):
    qkv, sinu_pos, offsets = ctx.saved_tensors
    dz = _rotary_block_attention_backward_op(qkv, sinu_pos, offsets, dout, *ctx.heads)
    return dz, None, None, None, None


_rotary_block_attention_op.register_autograd(_rotary_backward, setup_context=_rotary_setup)


def fused_projection_rotary_block_attention(x: torch.Tensor, w: torch.Tensor, sinu_pos: torch.Tensor,
                                            offsets: torch.Tensor, q_heads: int, kv_heads: int,
                                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Projection, rotary and block attention: the seed's fused path, with its fused rotary backward.

    x [M, E], w [E, (q_heads + 2*kv_heads) * D], optional bias [(q_heads + 2*kv_heads) * D];
    sinu_pos [M, D] (sin in the first D/2 columns, cos in the last D/2, one angle per column pair);
    offsets [B+1]. ``qkv = x @ w + bias`` is split into q, k, v heads; rotary is applied to all three;
    then block attention. Returns [M, q_heads * D]; differentiable in x, w and bias.
    """
    _check_fused_inputs(x, w, sinu_pos, offsets, q_heads, kv_heads, bias)
    qkv = x @ w if bias is None else torch.addmm(bias, x, w)
    return _rotary_block_attention_op(qkv, sinu_pos, offsets, q_heads, kv_heads)
