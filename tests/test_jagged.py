"""Offsets helpers, nested-tensor interop, padding and the GEM-like length generator."""
import pytest
import torch

from jfa import jagged, specs


def test_lengths_offsets_round_trip_with_empty_sequences():
    lengths = [3, 0, 5, 0, 1]
    offsets = jagged.lengths_to_offsets(lengths)
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [0, 3, 3, 8, 8, 9]
    assert jagged.offsets_to_lengths(offsets).tolist() == lengths
    assert jagged.lengths_to_offsets([]).tolist() == [0]


def test_lengths_to_offsets_accepts_integer_tensors_arrays_and_tuples():
    import numpy as np
    for lengths in (torch.tensor([3, 0, 2], dtype=torch.uint8), np.array([3, 0, 2]), (3, 0, 2)):
        assert jagged.lengths_to_offsets(lengths).tolist() == [0, 3, 3, 5]
    assert jagged.lengths_to_offsets(torch.zeros(0, dtype=torch.int32)).tolist() == [0]
    assert jagged.lengths_to_offsets([specs.INT32_MAX]).tolist() == [0, specs.INT32_MAX]


BAD_LENGTHS = [
    # (case id, lengths, expected exception, what the message says after "lengths: ")
    ("negative", [5, -2, 3], ValueError, r"length -2 at index 1 is negative"),
    ("fractional", [5, 2.5], TypeError, r"dtype torch.float32 is not an integer type.*\.round\(\)\.long\(\)"),
    ("whole-valued-float-tensor", torch.tensor([5.0, 3.0], dtype=torch.float64), TypeError,
     "dtype torch.float64 is not an integer type"),
    ("bool-tensor", torch.tensor([True, False]), TypeError, "dtype torch.bool is not an integer type"),
    ("bool-in-list", [True, 3], TypeError, "contains bools"),
    ("2-d", [[1, 2], [3, 4]], ValueError, r"expected a 1-D sequence of B lengths, got shape \(2, 2\)"),
    ("scalar", 5, ValueError, r"expected a 1-D sequence of B lengths, got shape \(\)"),
    ("not-numbers", ["a", "b"], TypeError, "expected a 1-D integer tensor or a sequence of ints"),
    ("total-past-int32", [specs.INT32_MAX, 1], ValueError, "2147483648 rows in total exceed int32 offsets"),
    ("sum-wraps-int64", torch.tensor([2**62] * 4), ValueError, f"{2**64} rows in total exceed int32 offsets"),
]


@pytest.mark.parametrize("lengths,error,message", [case[1:] for case in BAD_LENGTHS], ids=[c[0] for c in BAD_LENGTHS])
def test_lengths_to_offsets_rejects_bad_lengths(lengths, error, message):
    with pytest.raises(error, match="^lengths: " + message):
        jagged.lengths_to_offsets(lengths)


def test_nested_round_trip_from_both_constructors():
    gen = torch.Generator().manual_seed(1)
    pieces = [torch.randn(n, 2, 4, generator=gen) for n in (3, 0, 5)]
    nested = torch.nested.nested_tensor(pieces, layout=torch.jagged)
    packed, offsets = jagged.from_nested(nested)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 3, 8]
    torch.testing.assert_close(packed, torch.cat(pieces), rtol=0, atol=0)

    rebuilt = jagged.to_nested(packed, offsets)
    for got, want in zip(rebuilt.unbind(), pieces):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert rebuilt.values().data_ptr() == packed.data_ptr()  # a view, no copy


def test_from_nested_rejects_plain_tensors():
    with pytest.raises(TypeError, match="nested"):
        jagged.from_nested(torch.randn(3, 4))


def test_pad_and_unpad():
    offsets = jagged.lengths_to_offsets([2, 0, 3])
    packed = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(2))
    padded, mask = jagged.pad(packed, offsets, value=float("nan"))
    assert padded.shape == (3, 3, 2, 4)
    assert mask.tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    torch.testing.assert_close(padded[0, :2], packed[:2], rtol=0, atol=0)
    torch.testing.assert_close(padded[2], packed[2:], rtol=0, atol=0)
    assert torch.isnan(padded[~mask]).all()
    torch.testing.assert_close(jagged.unpad(padded, offsets), packed, rtol=0, atol=0)
    assert jagged.pad(packed, offsets, max_len=6)[0].shape == (3, 6, 2, 4)
    with pytest.raises(ValueError, match="max_len"):
        jagged.pad(packed, offsets, max_len=2)


def test_gem_lengths_ranges_and_determinism():
    lengths = jagged.gem_lengths(1152, 256, 0.5, seed=0)
    assert lengths.dtype == torch.int32 and lengths.shape == (1152,)
    assert lengths.min() >= 1 and lengths.max() <= 256
    assert lengths.float().mean().sub(128.5).abs() < 8  # U[1, 256] has mean 128.5, std of mean ~2.2
    assert torch.equal(lengths, jagged.gem_lengths(1152, 256, 0.5, seed=0))
    assert not torch.equal(lengths, jagged.gem_lengths(1152, 256, 0.5, seed=1))
    assert jagged.gem_lengths(8, 512, 1.0, seed=3).tolist() == [512] * 8
    three_quarters = jagged.gem_lengths(1000, 1024, 0.75, seed=4)
    assert three_quarters.min() >= 512 and three_quarters.max() <= 1024
    with pytest.raises(ValueError, match="sparsity"):
        jagged.gem_lengths(4, 16, 1.5, seed=0)
