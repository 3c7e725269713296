"""The TMA view every kernel cuts its row boxes from (`jfa.kernels.common.rows_descriptor`).

Checked on the CPU: a descriptor is host data (shape, strides, box); the GPU only sees it at launch.
The forward's TMA-store epilogue writes through this view, so its row stride must be the tensor's
own: a view with padding rows between rows must be addressed as the masked register store addresses
it, and a layout the `[T, H*D]` view cannot describe must be refused rather than read or written
wrongly.
"""
import pytest
import torch

from jfa.kernels.common import rows_descriptor


def test_contiguous_tensor_is_viewed_as_rows_of_heads():
    t = torch.zeros(300, 4, 128, dtype=torch.bfloat16)
    desc = rows_descriptor(t, 64)
    assert list(desc.shape) == [300, 4 * 128]
    assert list(desc.strides) == [4 * 128, 1]
    assert list(desc.block_shape) == [64, 128]
    assert list(rows_descriptor(t, 64, 32).block_shape) == [64, 32]


def test_row_stride_is_the_tensors_own():
    """A view of every other row of a buffer (row stride twice the row) keeps its stride."""
    buffer = torch.zeros(200, 2, 64, dtype=torch.float16)
    view = buffer[::2]
    desc = rows_descriptor(view, 64)
    assert list(desc.shape) == [100, 2 * 64]
    assert list(desc.strides) == [2 * 2 * 64, 1]


def test_single_row_takes_the_packed_stride():
    """A one-row tensor's row stride is arbitrary in torch; the view uses the packed one."""
    row = torch.zeros(2, 128, dtype=torch.bfloat16).expand(1, 2, 128)
    assert list(rows_descriptor(row, 64).strides) == [2 * 128, 1]


def test_heads_not_contiguous_within_a_row_is_refused():
    t = torch.zeros(4, 32, 128, dtype=torch.bfloat16).transpose(0, 1)  # [32 rows, 4 heads, 128]
    with pytest.raises(ValueError, match="contiguous"):
        rows_descriptor(t, 64)
