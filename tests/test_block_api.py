"""The public block attention API on the CPU: it runs the reference, with autograd, fake impls and
validation errors that name the argument. (The kernels themselves: tests/gpu/test_block_attn.py.)
"""
import math
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from jfa import block, dispatch, reference, specs
from jfa.block import block_attention, fused_projection_rotary_block_attention

LENGTHS = [1, 63, 64, 65, 0, 130]

pytestmark = pytest.mark.filterwarnings("ignore::jfa.dispatch.ReferenceFallbackWarning")


def offsets_of(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def make_inputs(dtype=torch.float32, heads_q=4, heads_kv=2, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(LENGTHS)
    return tuple(torch.randn(rows, h, head_dim, generator=gen).to(dtype) for h in (heads_q, heads_kv, heads_kv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_reference(dtype):
    q, k, v = make_inputs(dtype)
    offsets = offsets_of(LENGTHS)
    out = block_attention(q, k, v, offsets)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, reference.block_attention_ref(q, k, v, offsets).to(dtype))


def test_gradients_equal_reference_gradients():
    q, k, v = (t.requires_grad_() for t in make_inputs(torch.float32))
    offsets = offsets_of(LENGTHS)
    dout = torch.randn_like(q)
    block_attention(q, k, v, offsets).backward(dout)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    reference.block_attention_ref(*leaves, offsets).backward(dout)
    for got, want in zip((q.grad, k.grad, v.grad), leaves):
        torch.testing.assert_close(got, want.grad)


def test_gradcheck_float64():
    lengths = [3, 0, 5]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(8, h, 64, generator=gen, dtype=torch.float64, requires_grad=True) for h in (2, 1, 1))
    assert torch.autograd.gradcheck(lambda a, b, c: block_attention(a, b, c, offsets_of(lengths)), (q, k, v), fast_mode=True)


@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_projection_rotary_equals_reference_with_gradients(with_bias):
    q_heads, kv_heads, head_dim, embed = 4, 2, 64, 32
    offsets = offsets_of(LENGTHS)
    rows, width = sum(LENGTHS), (q_heads + 2 * kv_heads) * head_dim
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, embed, generator=gen, requires_grad=True)
    w = (torch.randn(embed, width, generator=gen) / math.sqrt(embed)).requires_grad_()
    bias = torch.randn(width, generator=gen, requires_grad=True) if with_bias else None
    sinu_pos = reference.make_sinu_pos(offsets, head_dim)
    dout = torch.randn(rows, q_heads * head_dim, generator=gen)

    out = fused_projection_rotary_block_attention(x, w, sinu_pos, offsets, q_heads, kv_heads, bias=bias)
    out.backward(dout)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w) + ((bias,) if with_bias else ())]
    expected = reference.fused_projection_rotary_block_attention_ref(
        leaves[0], leaves[1], sinu_pos, offsets, q_heads, kv_heads, bias=leaves[2] if with_bias else None)
    expected.backward(dout)
    torch.testing.assert_close(out, expected)
    for got, want in zip((x.grad, w.grad) + ((bias.grad,) if with_bias else ()), leaves):
        torch.testing.assert_close(got, want.grad)


def test_custom_ops_pass_opcheck():
    q, k, v = make_inputs(torch.float32)
    offsets = offsets_of(LENGTHS)
    torch.library.opcheck(block._block_attention_op, (q, k, v, offsets))
    torch.library.opcheck(block._block_attention_backward_op, (q, k, v, offsets, torch.randn_like(q)))
    qkv = torch.randn(q.shape[0], 8 * 64)
    sinu_pos = reference.make_sinu_pos(offsets, 64)
    torch.library.opcheck(block._rotary_block_attention_op, (qkv, sinu_pos, offsets, 4, 2))


def test_fake_tensors_give_shapes_without_running():
    real_offsets = offsets_of([100, 200])
    with FakeTensorMode() as mode:
        q = torch.empty(300, 4, 128, dtype=torch.bfloat16)
        k = v = torch.empty(300, 2, 128, dtype=torch.bfloat16)
        offsets = mode.from_tensor(real_offsets)
        out = block._block_attention_op(q, k, v, offsets)
        assert out.shape == (300, 4, 128) and out.dtype == torch.bfloat16
        qkv = torch.empty(300, 8 * 128, dtype=torch.bfloat16)
        sinu_pos = torch.empty(300, 128)
        assert block._rotary_block_attention_op(qkv, sinu_pos, offsets, 4, 2).shape == (300, 4 * 128)
        dz = block._rotary_block_attention_backward_op(qkv, sinu_pos, offsets, out.reshape(300, -1), 4, 2)
        assert dz.shape == qkv.shape


def test_reference_fallback_is_announced_once(monkeypatch):
    q, k, v = make_inputs(torch.float32)
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block_attention(q, k, v, offsets_of(LENGTHS))
        block_attention(q, k, v, offsets_of(LENGTHS))
    assert sum("reference" in str(w.message) for w in caught) == 1


def _bad_inputs():
    q, k, v = make_inputs(torch.float32)
    good = offsets_of(LENGTHS)
    yield "q", TypeError, (q.tolist(), k, v, good)
    yield "q", ValueError, (q[0], k, v, good)
    yield "k", TypeError, (q, k.double(), v, good)
    yield "v", ValueError, (q, k, v[:, :1].contiguous(), good)
    yield "head_dim", ValueError, (q, k[..., :32].contiguous(), v[..., :32].contiguous(), good)
    yield "heads", ValueError, (q[:, :3].contiguous(), k, v, good)
    yield "k", ValueError, (q, k[:-1], v[:-1], good)
    yield "offsets", TypeError, (q, k, v, good.float())
    yield "offsets", ValueError, (q, k, v, good[:-1])
    yield "offsets", ValueError, (q, k, v, good.flip(0))


@pytest.mark.parametrize("name, error, args", list(_bad_inputs()))
def test_bad_input_names_the_argument(name, error, args):
    with pytest.raises(error, match=name):
        block_attention(*args)


def test_fused_bad_input_names_the_argument():
    offsets = offsets_of([10])
    x, w, sinu_pos = torch.randn(10, 32), torch.randn(32, 8 * 64), torch.randn(10, 64)
    with pytest.raises(ValueError, match="q_heads"):
        fused_projection_rotary_block_attention(x, w, sinu_pos, offsets, 0, 2)
    with pytest.raises(ValueError, match="w"):
        fused_projection_rotary_block_attention(x, w[:, :-1], sinu_pos, offsets, 4, 2)
    with pytest.raises(ValueError, match="sinu_pos"):
        fused_projection_rotary_block_attention(x, w, sinu_pos[:, :32], offsets, 4, 2)
    with pytest.raises(ValueError, match="bias"):
        fused_projection_rotary_block_attention(x, w, sinu_pos, offsets, 4, 2, bias=torch.randn(3))
    with pytest.raises(ValueError, match="offsets"):
        fused_projection_rotary_block_attention(x, w, sinu_pos, offsets_of([9]), 4, 2)


def test_supported_head_dims_come_from_specs():
    assert specs.BLOCK_ATTENTION_BLOCK == 64
