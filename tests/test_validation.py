"""validate_jagged_attention: every bad input raises ValueError/TypeError naming the argument."""
import math
import time

import pytest
import torch

from jfa import jagged, specs

Q_LENS, KV_LENS, HEADS_Q, HEADS_KV, HEAD_DIM = [3, 0, 5], [4, 2, 0], 4, 2, 64


def good_call(dtype=torch.bfloat16):
    """Arguments of a valid kernel-eligible call; each case below breaks one thing."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(Q_LENS), HEADS_Q, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(sum(KV_LENS), HEADS_KV, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(sum(KV_LENS), HEADS_KV, HEAD_DIM, generator=gen).to(dtype)
    return dict(q=q, k=k, v=v, q_offsets=jagged.lengths_to_offsets(Q_LENS),
                kv_offsets=jagged.lengths_to_offsets(KV_LENS), max_seq_len_q=None, max_seq_len_kv=None, sm_scale=None, causal=False, window=None,
                broadcast_q=False, for_kernel=True)


def misaligned(t):
    """Contiguous, but one element into its storage: not 16-byte aligned."""
    return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)


def every_other_element(t):
    """Same values, but the head dim has stride 2."""
    return t.new_empty(*t.shape[:-1], 2 * t.shape[-1])[..., ::2].copy_(t)


def int32_overflow(call):
    """Shapes past int32 indexing on the meta device (no memory), with offsets known on the host."""
    rows = specs.INT32_MAX // (HEADS_Q * HEAD_DIM) + 1
    call["q"] = torch.empty(rows, HEADS_Q, HEAD_DIM, dtype=torch.bfloat16, device="meta")
    call["k"] = call["v"] = torch.empty(rows, HEADS_KV, HEAD_DIM, dtype=torch.bfloat16, device="meta")
    call["q_offsets"] = call["kv_offsets"] = torch.tensor([0, rows], dtype=torch.int32)


def set_(**changes):
    return lambda call: call.update(changes)


def with_(key, fn):
    return lambda call: call.update({key: fn(call)})


BAD_INPUTS = [
    # (case id, how to break the good call, expected exception, what the message starts with)
    ("q-not-tensor", with_("q", lambda c: c["q"].tolist()), TypeError, "q:"),
    ("q-2d", with_("q", lambda c: c["q"].flatten(1)), ValueError, "q:"),
    ("k-4d", with_("k", lambda c: c["k"][None]), ValueError, "k:"),
    ("q-int-dtype", with_("q", lambda c: c["q"].to(torch.int32)), TypeError, "q:"),
    ("q-fp32-for-kernel", with_("q", lambda c: c["q"].float()), TypeError, "q:"),
    ("k-dtype-mismatch", with_("k", lambda c: c["k"].half()), TypeError, "k:"),
    ("v-dtype-mismatch", with_("v", lambda c: c["v"].half()), TypeError, "v:"),
    ("k-other-device", with_("k", lambda c: c["k"].to("meta")), ValueError, "k:"),
    ("q-heads-major", with_("q", lambda c: c["q"].transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "q:"),
    ("v-strided-head-dim", with_("v", lambda c: every_other_element(c["v"])), ValueError, "v:"),
    ("q-misaligned", with_("q", lambda c: misaligned(c["q"])), ValueError, "q:"),
    ("v-shape-mismatch", with_("v", lambda c: c["v"][:, :1].contiguous()), ValueError, "v:"),
    ("head-dim-mismatch", lambda c: c.update({t: c[t][..., :32].contiguous() for t in "kv"}), ValueError, "k:"),
    ("unsupported-head-dim", lambda c: c.update({t: c[t][..., :32].contiguous() for t in "qkv"}), ValueError,
     "head_dim:"),
    ("gqa-not-dividing", with_("q", lambda c: c["q"][:, :3].contiguous()), ValueError, "heads:"),
    ("q-offsets-float", with_("q_offsets", lambda c: c["q_offsets"].float()), TypeError, "q_offsets:"),
    ("q-offsets-list", with_("q_offsets", lambda c: c["q_offsets"].tolist()), TypeError, "q_offsets:"),
    ("kv-offsets-2d", with_("kv_offsets", lambda c: c["kv_offsets"][None]), ValueError, "kv_offsets:"),
    ("q-offsets-empty", set_(q_offsets=torch.zeros(0, dtype=torch.int32)), ValueError, "q_offsets:"),
    ("q-offsets-not-from-0", set_(q_offsets=torch.tensor([1, 3, 3, 8], dtype=torch.int32)), ValueError,
     "q_offsets:.*start at 0"),
    ("kv-offsets-decreasing", set_(kv_offsets=torch.tensor([0, 4, 2, 6], dtype=torch.int32)), ValueError,
     "kv_offsets:.*decreases"),
    ("q-offsets-wrong-end", set_(q_offsets=torch.tensor([0, 3, 3, 7], dtype=torch.int32)), ValueError,
     "q_offsets:.*ends at"),
    ("kv-offsets-wrong-end", set_(kv_offsets=torch.tensor([0, 4, 6, 7], dtype=torch.int32)), ValueError,
     "kv_offsets:.*ends at"),
    ("q-offsets-other-device", with_("q_offsets", lambda c: c["q_offsets"].to("meta")), ValueError, "q_offsets:"),
    ("batch-mismatch", set_(kv_offsets=torch.tensor([0, 4, 6], dtype=torch.int32)), ValueError, "kv_offsets:"),
    ("broadcast-q-many-sequences", set_(broadcast_q=True), ValueError, "q_offsets:.*broadcast_q"),
    ("negative-window", set_(window=-1), ValueError, "window:"),
    ("float-window", set_(window=2.5), TypeError, "window:"),
    ("zero-scale", set_(sm_scale=0.0), ValueError, "sm_scale:"),
    ("negative-scale", set_(sm_scale=-0.1), ValueError, "sm_scale:"),
    ("nan-scale", set_(sm_scale=math.nan), ValueError, "sm_scale:"),
    ("inf-scale", set_(sm_scale=math.inf), ValueError, "sm_scale:"),
    ("causal-not-bool", set_(causal="yes"), TypeError, "causal:"),
    ("max-len-q-too-small", set_(max_seq_len_q=4), ValueError, "max_seq_len_q:"),
    ("max-len-kv-too-small", set_(max_seq_len_kv=3), ValueError, "max_seq_len_kv:"),
    ("max-len-not-int", set_(max_seq_len_q=5.0), TypeError, "max_seq_len_q:"),
    ("int32-overflow", int32_overflow, ValueError, "q:.*int32"),
]


@pytest.mark.parametrize("breaks,error,message", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_the_argument(breaks, error, message):
    call = good_call()
    jagged.validate_jagged_attention(**call)  # the unbroken call is valid
    breaks(call)
    with pytest.raises(error, match="^" + message):
        jagged.validate_jagged_attention(**call)


def test_good_call_describes_the_problem():
    problem = jagged.validate_jagged_attention(**good_call())
    assert problem == jagged.JaggedProblem(
        batch=3, heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=HEAD_DIM, total_q=8, total_kv=6, max_seq_len_q=5,
        max_seq_len_kv=4, sm_scale=1 / math.sqrt(HEAD_DIM), causal=False, window=None, broadcast_q=False, out_rows=8)
    with pytest.raises(AttributeError):
        problem.batch = 4  # frozen


def test_broadcast_q_problem_and_reference_dtypes():
    call = good_call(torch.float32)
    call.update(q=call["q"][:3].contiguous(), q_offsets=torch.tensor([0, 3], dtype=torch.int32), broadcast_q=True,
                for_kernel=False, sm_scale=0.5, window=0, causal=True, max_seq_len_kv=16)
    problem = jagged.validate_jagged_attention(**call)
    assert (problem.batch, problem.out_rows, problem.max_seq_len_q, problem.max_seq_len_kv) == (3, 9, 3, 16)
    assert (problem.sm_scale, problem.window, problem.causal) == (0.5, 0, True)


def test_reference_mode_accepts_any_head_dim_and_float64():
    call = good_call(torch.float64)
    call.update({t: call[t][..., :24].contiguous() for t in "qkv"}, for_kernel=False)
    assert jagged.validate_jagged_attention(**call).head_dim == 24


def test_check_jagged_tensors_reads_no_offset_values():
    """The compile-safe subset accepts meta offsets, whose values cannot be read."""
    call = good_call()
    for name in ("max_seq_len_q", "max_seq_len_kv", "causal"):
        del call[name]
    call.update(q_offsets=torch.empty(4, dtype=torch.int32, device="meta"),
                kv_offsets=torch.empty(4, dtype=torch.int32, device="meta"))
    call.update({t: call[t].to("meta") for t in "qkv"})
    jagged.check_jagged_tensors(**call)


OFFSET_MESSAGES = [
    # (case id, offsets keyword and value, the whole message)
    ("not-from-0", "q_offsets", [1, 3, 3, 8], "q_offsets: must start at 0, starts at 1"),
    ("decreasing", "kv_offsets", [0, 4, 2, 6],
     "kv_offsets: decreases at index 2 (4 -> 2); offsets are prefix sums of non-negative lengths"),
    # int32 steps of these values wrap around to positive ones: the negative value gives it away
    ("decreasing-past-int32", "q_offsets", [0, specs.INT32_MAX, -specs.INT32_MAX + 3, 8],
     f"q_offsets: decreases at index 2 ({specs.INT32_MAX} -> {-specs.INT32_MAX + 3}); offsets are prefix sums "
     "of non-negative lengths"),
    ("wrong-end", "q_offsets", [0, 3, 3, 7],
     "q_offsets: ends at 7 but the tensor has 8 rows; the last offset must equal the row count"),
]


@pytest.mark.parametrize("name,values,message", [c[1:] for c in OFFSET_MESSAGES], ids=[c[0] for c in OFFSET_MESSAGES])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_offset_value_errors_say_what_and_where(name, values, message, dtype):
    call = good_call()
    call[name] = torch.tensor(values, dtype=dtype)
    with pytest.raises(ValueError) as caught:
        jagged.validate_jagged_attention(**call)
    assert str(caught.value) == message


def test_huge_int64_steps_are_checked_exactly():
    """Values near int64's limit: the steps are computed without wrapping, or the decrease is found."""
    call = good_call()
    big = 2**62
    call["q_offsets"] = torch.tensor([0, big, -big, 8])
    with pytest.raises(ValueError, match=rf"^q_offsets: decreases at index 2 \({big} -> {-big}\)"):
        jagged.validate_jagged_attention(**call)


def test_max_len_errors_name_the_bound_and_the_longest_sequence():
    with pytest.raises(ValueError) as caught:
        jagged.validate_jagged_attention(**{**good_call(), "max_seq_len_kv": 3})
    assert str(caught.value) == ("max_seq_len_kv: 3 is smaller than the longest sequence (4); pass None to compute "
                                 "it or a bound >= the real maximum")


def test_meta_offsets_cannot_be_checked():
    call = good_call()
    call.update({t: call[t].to("meta") for t in ("q", "k", "v", "kv_offsets")})
    with pytest.raises(ValueError, match="^kv_offsets: is a meta tensor, so its values cannot be checked"):
        jagged.validate_jagged_attention(**call)


def test_no_sequences_and_one_offsets_tensor_for_both():
    empty = torch.zeros(0, HEADS_Q, HEAD_DIM)
    problem = jagged.validate_jagged_attention(empty, empty, empty, torch.zeros(1, dtype=torch.int32),
                                               torch.zeros(1, dtype=torch.int64))
    assert (problem.batch, problem.max_seq_len_q, problem.max_seq_len_kv, problem.out_rows) == (0, 0, 0, 0)
    call = good_call()
    call.update(k=call["q"][:, :HEADS_KV].contiguous(), v=call["q"][:, :HEADS_KV].contiguous())
    call["kv_offsets"] = call["q_offsets"]
    problem = jagged.validate_jagged_attention(**call)
    assert (problem.max_seq_len_q, problem.max_seq_len_kv) == (5, 5)


HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__,
              torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.numpy}


class ReadCountingOffsets(torch.Tensor):
    """Offsets that record every read of their values (or of values derived from them) on the host:
    each such read of GPU offsets is a device-to-host sync."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("same_tensor", [False, True])
def test_validation_reads_the_offsets_once(same_tensor, monkeypatch):
    monkeypatch.setattr(ReadCountingOffsets, "reads", [])
    call = good_call()
    call["q_offsets"] = call["q_offsets"].as_subclass(ReadCountingOffsets)
    if same_tensor:
        call.update(k=call["q"][:, :HEADS_KV].contiguous(), v=call["q"][:, :HEADS_KV].contiguous(),
                    kv_offsets=call["q_offsets"])
    else:
        call["kv_offsets"] = call["kv_offsets"].as_subclass(ReadCountingOffsets)
    problem = jagged.validate_jagged_attention(**call)
    assert ReadCountingOffsets.reads == ["tolist"]
    assert problem.max_seq_len_q == 5


@pytest.mark.timing
def test_validating_16k_short_sequences_takes_microseconds():
    """16,384 sequences of at most 32 rows: the value checks are a few tensor reductions, not a
    Python loop over the offsets. The bound is ten times the 100 µs budget, for loaded CI machines;
    a loop over the offsets takes tens of times longer."""
    offsets = jagged.lengths_to_offsets(jagged.gem_lengths(16384, 32, 0.5, seed=0))
    rows = int(offsets[-1])
    q = torch.empty(rows, HEADS_Q, HEAD_DIM, dtype=torch.bfloat16, device="meta")
    k = torch.empty(rows, HEADS_KV, HEAD_DIM, dtype=torch.bfloat16, device="meta")
    kv_offsets = offsets.clone()
    for _ in range(20):
        jagged.validate_jagged_attention(q, k, k, offsets, kv_offsets, causal=True)
    per_call = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(50):
            jagged.validate_jagged_attention(q, k, k, offsets, kv_offsets, causal=True)
        per_call.append((time.perf_counter() - start) / 50)
    assert sorted(per_call)[len(per_call) // 2] < 1e-3
