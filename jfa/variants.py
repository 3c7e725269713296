"""Your own attention variant: a fork of the jagged kernels from `@triton.jit` hooks.

    @triton.jit
    def softcap(score, seq, head, q_idx, k_idx, params):
        return params[0] * (2 * tl.sigmoid(2 * score / params[0]) - 1)      # cap * tanh(score / cap)

    @triton.jit
    def softcap_grad(grad, score, seq, head, q_idx, k_idx, params):
        t = 2 * tl.sigmoid(2 * score / params[0]) - 1
        return grad * (1 - t * t)

    attention = jfa.variant("softcap", score_mod=softcap, score_grad=softcap_grad)
    out = attention(q, k, v, offsets, offsets, causal=True, params=(30.0,))   # jagged_attention's arguments
    ref = attention.reference(q, k, v, offsets, offsets, causal=True, params=(30.0,))
    specs = attention.kernel_specs(head_dim=128)        # compile-only: jfa.workbench.inspect.inspect(spec)

A variant is a `jfa.kernels.hooks.Fork` of the forward, dQ and dK/dV kernels: the warp roles,
rings, schedule and epilogues stay, and the hooks change the math. The hooks (their arguments are
`hooks`' docstring's):

- `score_mod(score, seq, head, q_idx, k_idx, params)`: the scaled logits, modified; with it,
  `score_grad(grad, score, seq, head, q_idx, k_idx, params)`, its derivative applied to `grad`;
- `mask_mod(seq, head, q_idx, k_idx, params)`: which pairs stay visible, on top of padding, causal
  and window; with it, optionally `block_mask(seq, head, q_lo, q_hi, k_lo, k_hi, params)`: whether a
  block of rows q_lo..q_hi and keys k_lo..k_hi (inclusive) may hold a visible pair. Key tiles it rules
  out are neither loaded nor computed, so it must never rule out a block that holds one
  (`check_block_mask` tests that).

`params` is a tuple of tensors and numbers the hooks read (`tl.load(params[0] + head)`); every call
passes its own. The hooks run in the kernels and, unchanged, as PyTorch in `reference` (through
`jfa.kernels.twin`, which says what they may use), which is also what runs off a Hopper GPU.

Three examples are defined below with this API: `ALIBI` (a distance bias), `GLOBAL_TOKENS` (the
first tokens are global, the rest see a band) and `SOFTCAP` (tanh soft-capping).
"""
from __future__ import annotations

import inspect as pyinspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from jfa import dispatch, jagged, reference
from jfa.kernels.hooks import DEFAULT_FORK, Fork
from jfa.kernels.twin import JIT_FUNCTION_TYPES, TwinPointer, torch_twin

__all__ = ["variant", "Variant", "ALIBI", "GLOBAL_TOKENS", "SOFTCAP"]

HOOK_ARGUMENTS = {"score_mod": ("score", "seq", "head", "q_idx", "k_idx", "params"),
                  "score_grad": ("grad", "score", "seq", "head", "q_idx", "k_idx", "params"),
                  "mask_mod": ("seq", "head", "q_idx", "k_idx", "params"),
                  "block_mask": ("seq", "head", "q_lo", "q_hi", "k_lo", "k_hi", "params")}
KERNELS = ("forward", "dq", "dkdv")  # the kernels a variant forks, for `kernel_specs`


@dataclass(frozen=True)
class Variant:
    """A user fork of the jagged kernels (module docstring); made by `jfa.variant`."""

    name: str
    fork: Fork

    # ---- running it ----------------------------------------------------------------------------------
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                 max_seq_len_q: int | None = None, max_seq_len_kv: int | None = None, *, sm_scale: float | None = None,
                 causal: bool = False, window: int | None = None, broadcast_q: bool = False, return_lse: bool = False,
                 deterministic: bool = False, params: tuple = ()):
        """`jfa.jagged_attention` with this variant's hooks; `params` is what the hooks read."""
        problem = jagged.validate_jagged_attention(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv,
                                                   sm_scale=sm_scale, causal=causal, window=window,
                                                   broadcast_q=broadcast_q)
        params = _checked_params(params, q)
        why = dispatch.why_not_kernel(dispatch.FORWARD_KERNEL, q, k, v)
        if why is not None:
            dispatch.warn_fallback(f"variant {self.name!r}: {why}")
            out, lse = self._reference(q, k, v, q_offsets, kv_offsets, problem, params)
            out = out.to(q.dtype)
        else:
            out, lse = _VariantAttention.apply(q, k, v, q_offsets, kv_offsets, self, problem, params, deterministic)
        return (out, lse) if return_lse else out

    def reference(self, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                  max_seq_len_q: int | None = None, max_seq_len_kv: int | None = None, *,
                  sm_scale: float | None = None, causal: bool = False, window: int | None = None,
                  broadcast_q: bool = False, return_lse: bool = False, params: tuple = (), upcast: bool = True):
        """The variant in PyTorch, fp32 (fp64 given fp64), differentiable: its hooks' twins in
        `jfa.reference.jagged_attention_ref`. The arguments are `__call__`'s; `upcast=False` computes
        in the inputs' dtype instead."""
        problem = jagged.validate_jagged_attention(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv,
                                                   sm_scale=sm_scale, causal=causal, window=window,
                                                   broadcast_q=broadcast_q)
        out, lse = self._reference(q, k, v, q_offsets, kv_offsets, problem, _checked_params(params, q), upcast)
        return (out, lse) if return_lse else out

    def _reference(self, q, k, v, q_offsets, kv_offsets, problem: jagged.JaggedProblem, params, upcast=True):
        twin_params = tuple(TwinPointer(p) if torch.is_tensor(p) else p for p in params)
        score_mod = mask_mod = None
        if self.fork.score_mod is not None:
            score_twin = torch_twin(self.fork.score_mod)

            def score_mod(score, seq, head, q_idx, k_idx):
                return score_twin(score, seq, head, q_idx, k_idx, twin_params)
        if self.fork.mask_mod is not None:
            mask_twin = torch_twin(self.fork.mask_mod)

            def mask_mod(seq, head, q_idx, k_idx):
                return mask_twin(seq, head, q_idx, k_idx, twin_params)
        return reference.jagged_attention_ref(q, k, v, q_offsets, kv_offsets, sm_scale=problem.sm_scale,
                                              causal=problem.causal, window=problem.window,
                                              broadcast_q=problem.broadcast_q, score_mod=score_mod,
                                              mask_mod=mask_mod, upcast=upcast)

    # ---- checking and inspecting it ------------------------------------------------------------------
    def check_block_mask(self, q_len: int, kv_len: int, *, params: tuple = (), heads: int = 1, block_m: int = 64,
                         block_n: int = 64) -> None:
        """Raise if `block_mask` rules out a block of a q_len x kv_len sequence that `mask_mod` says
        holds a visible pair (the blocks a kernel would skip wrongly). Runs the twins on the CPU."""
        if self.fork.block_mask is None:
            return
        twin_params = tuple(TwinPointer(p.cpu()) if torch.is_tensor(p) else p for p in params)
        mask = torch_twin(self.fork.mask_mod)
        block = torch_twin(self.fork.block_mask)
        for head in range(heads):
            visible = mask(0, head, torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :], twin_params)
            visible = torch.as_tensor(visible).expand(q_len, kv_len)
            for q_lo in range(0, q_len, block_m):
                for k_lo in range(0, kv_len, block_n):
                    q_hi, k_hi = min(q_lo + block_m, q_len) - 1, min(k_lo + block_n, kv_len) - 1
                    holds = bool(visible[q_lo:q_hi + 1, k_lo:k_hi + 1].any())
                    if holds and not bool(block(0, head, q_lo, q_hi, k_lo, k_hi, twin_params)):
                        raise ValueError(f"block_mask of variant {self.name!r} rules out rows {q_lo}..{q_hi} x keys "
                                         f"{k_lo}..{k_hi} (head {head}), where mask_mod sees a visible pair: the "
                                         "kernels would skip it; make block_mask return True there")

    def check_score_grad(self, *, params: tuple = (), samples: int = 64, tolerance: float = 1e-4) -> None:
        """Raise if `score_grad` is not the derivative of `score_mod` (central differences in float64)."""
        if self.fork.score_mod is None:
            return
        twin_params = tuple(TwinPointer(p.cpu().double()) if torch.is_tensor(p) else p for p in params)
        mod, grad = torch_twin(self.fork.score_mod), torch_twin(self.fork.score_grad)
        generator = torch.Generator().manual_seed(0)
        score = torch.randn(samples, dtype=torch.float64, generator=generator) * 4
        q_idx = torch.randint(0, 64, (samples,), generator=generator)
        k_idx = torch.randint(0, 64, (samples,), generator=generator)
        step = 1e-6
        numeric = (mod(score + step, 0, 0, q_idx, k_idx, twin_params)
                   - mod(score - step, 0, 0, q_idx, k_idx, twin_params)) / (2 * step)
        analytic = grad(torch.ones_like(score), score, 0, 0, q_idx, k_idx, twin_params)
        error = (torch.as_tensor(analytic) - numeric).abs().max().item()
        if error > tolerance:
            raise ValueError(f"score_grad of variant {self.name!r} differs from the derivative of score_mod by "
                             f"{error:.2e} (central differences): it must return grad * d score_mod / d score")

    def kernel_specs(self, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, *, causal: bool = False,
                     window: int | None = None, broadcast_q: bool = False, params: tuple = ()) -> dict:
        """Compile-only descriptions of the variant's kernels ("forward", "dq", "dkdv") for a GEM-like
        batch of that head dim: `jfa.workbench.inspect.inspect(spec)` compiles one on any machine.
        `params` gives the runtime arguments' types (tensors' dtypes, Python numbers)."""
        from jfa import configs
        from jfa.kernels import bwd_dkdv, bwd_dq, fwd_sm90

        shape = configs.gem_like_shape(head_dim, causal=causal, window=window, broadcast_q=broadcast_q,
                                       block_mask=self.fork.block_mask is not None)
        signature = _params_signature(params)
        plan = configs.select(shape)
        return {"forward": fwd_sm90.inspect_spec(plan.forward, dtype, self.fork, signature),
                "dq": bwd_dq.inspect_spec(configs.dq_config(shape), dtype, self.fork, signature),
                "dkdv": bwd_dkdv.inspect_spec(configs.dkdv_config(shape, bwd_dkdv.DQ_NONE.value), dtype, self.fork,
                                              signature)}


def variant(name: str, *, score_mod=None, score_grad=None, mask_mod=None, block_mask=None) -> Variant:
    """A `Variant` of the jagged kernels from `@triton.jit` hooks (module docstring)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str naming the variant, got {name!r}")
    hooks = dict(score_mod=score_mod, score_grad=score_grad, mask_mod=mask_mod, block_mask=block_mask)
    for hook, fn in hooks.items():
        if fn is not None:
            _check_hook(hook, fn)
    if score_mod is None and mask_mod is None:
        raise ValueError("variant: give score_mod (with score_grad) or mask_mod: without either it is jfa.jagged_attention")
    if (score_mod is None) != (score_grad is None):
        raise ValueError("score_grad: score_mod and score_grad go together (the backward applies score_grad, the "
                         "derivative of score_mod); pass both, or neither")
    if block_mask is not None and mask_mod is None:
        raise ValueError("block_mask: it is the block-level form of mask_mod; pass mask_mod too")
    return Variant(name, DEFAULT_FORK._replace(**{k: v for k, v in hooks.items() if v is not None}))


def _check_hook(hook: str, fn) -> None:
    if not isinstance(fn, JIT_FUNCTION_TYPES):
        raise TypeError(f"{hook}: expected a @triton.jit function, got {type(fn).__name__}; decorate it with "
                        "@triton.jit")
    names = tuple(pyinspect.signature(fn.fn).parameters)
    if len(names) != len(HOOK_ARGUMENTS[hook]):
        raise TypeError(f"{hook}: {fn.fn.__name__}{pyinspect.signature(fn.fn)} takes {len(names)} arguments; a "
                        f"{hook} takes ({', '.join(HOOK_ARGUMENTS[hook])})")


def _checked_params(params, q: Tensor) -> tuple:
    if not isinstance(params, tuple):
        raise TypeError(f"params: expected a tuple of tensors and numbers (what the hooks read), got "
                        f"{type(params).__name__}; wrap a single value as (value,)")
    for i, p in enumerate(params):
        if torch.is_tensor(p):
            if p.device != q.device:
                raise ValueError(f"params[{i}]: is on {p.device} but q is on {q.device}; move it to q's device")
        elif isinstance(p, bool) or not isinstance(p, (int, float)):
            raise TypeError(f"params[{i}]: expected a tensor, int or float, got {type(p).__name__}")
    return params


_SIGNATURE_NAMES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
                    torch.int64: "*i64"}


def _params_signature(params: tuple):
    """Triton's types of a params tuple (None for an empty one: compiled as a constant)."""
    if not params:
        return None
    return tuple(_SIGNATURE_NAMES[p.dtype] if torch.is_tensor(p) else "fp32" if isinstance(p, float) else "i32"
                 for p in params)


class _VariantAttention(torch.autograd.Function):
    """A variant's kernels with autograd: the forward kernel, then the dK/dV and dQ kernels."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, variant_: Variant, problem: jagged.JaggedProblem, params,
                deterministic):
        runner, _ = dispatch.load_runner()
        kernel_q_offsets, kernel_kv_offsets = dispatch.kernel_offsets(q, q_offsets, kv_offsets)
        fork = _fork_call(runner, variant_, params)
        out, lse = runner.forward(q, k, v, kernel_q_offsets, kernel_kv_offsets, problem.max_seq_len_q,
                                  problem.max_seq_len_kv, problem.sm_scale, problem.causal, problem.window,
                                  problem.broadcast_q, fork=fork)
        ctx.save_for_backward(q, k, v, out, lse, kernel_q_offsets, kernel_kv_offsets)
        ctx.problem, ctx.fork, ctx.deterministic = problem, fork, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        runner, _ = dispatch.load_runner()
        q, k, v, out, lse, q_offsets, kv_offsets = ctx.saved_tensors
        p = ctx.problem
        dq, dk, dv = runner.backward(grad_out.contiguous(), q, k, v, out, lse, q_offsets, kv_offsets, p.max_seq_len_q,
                                     p.max_seq_len_kv, p.sm_scale, p.causal, p.window, p.broadcast_q,
                                     deterministic=ctx.deterministic, fork=ctx.fork)
        return dq, dk, dv, None, None, None, None, None, None


def _fork_call(runner, variant_: Variant, params: tuple):
    return runner.ForkCall(fork=variant_.fork, forward_params=params or None, key_stationary_params=params or None,
                           block_mask=variant_.fork.block_mask is not None)


# ---- three variants, written with the API above ---------------------------------------------------------

@triton.jit
def _alibi(score, seq, head, q_idx, k_idx, params):
    return score - tl.load(params[0] + head) * tl.abs(q_idx - k_idx).to(tl.float32)


@triton.jit
def _additive_grad(grad, score, seq, head, q_idx, k_idx, params):
    return grad


# ALiBi-style: every head h subtracts slope[h] * |i - j| from its logits (params = (slopes fp32 [Hq],)).
ALIBI = variant("alibi", score_mod=_alibi, score_grad=_additive_grad)


def alibi_slopes(heads: int, device=None) -> Tensor:
    """ALiBi's geometric slopes 2^(-8 h / H), h = 1..H: the `params` of `ALIBI`."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32, device=device)


@triton.jit
def _global_tokens(seq, head, q_idx, k_idx, params):
    return (q_idx < params[0]) | (k_idx < params[0]) | (tl.abs(q_idx - k_idx) <= params[1])


@triton.jit
def _global_tokens_blocks(seq, head, q_lo, q_hi, k_lo, k_hi, params):
    return (q_lo < params[0]) | (k_lo < params[0]) | ((k_lo <= q_hi + params[1]) & (k_hi >= q_lo - params[1]))


# The first params[0] tokens of a sequence are global (they see and are seen by every token); the
# others see a band |i - j| <= params[1]. Key tiles outside both are skipped.
GLOBAL_TOKENS = variant("global tokens", mask_mod=_global_tokens, block_mask=_global_tokens_blocks)


@triton.jit
def _softcap(score, seq, head, q_idx, k_idx, params):
    return params[0] * (2 * tl.sigmoid(2 * score / params[0]) - 1)  # cap * tanh(score / cap)


@triton.jit
def _softcap_grad(grad, score, seq, head, q_idx, k_idx, params):
    t = 2 * tl.sigmoid(2 * score / params[0]) - 1
    return grad * (1 - t * t)


# tanh soft-capping of the logits at params[0] (Gemma-style).
SOFTCAP = variant("softcap", score_mod=_softcap, score_grad=_softcap_grad)
