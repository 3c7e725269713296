"""The TMA view every kernel cuts its row boxes from (`jfa.kernels.tma.rows_descriptor`).

Checked on the CPU: a descriptor is host data (shape, strides, box); the GPU only sees it at launch.
The forward's TMA-store epilogue writes through this view, so its row stride must be the tensor's
own: a view with padding rows between rows must be addressed as the masked register store addresses
it, and a layout the `[T, H*D]` view cannot describe must be refused rather than read or written
wrongly.
"""
import pytest
import torch

from jfa.kernels.tma import rows_descriptor


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


def test_is_a_triton_tensor_descriptor():
    """Triton specializes and launches it as its own descriptor type (`tensordesc<...>`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    assert isinstance(rows_descriptor(torch.zeros(8, 1, 64, dtype=torch.bfloat16), 64), TensorDescriptor)


def test_misaligned_base_is_refused():
    buffer = torch.zeros(9 * 64, dtype=torch.bfloat16)
    view = buffer[1:].unfold(0, 64, 64).unsqueeze(1)  # rows of 64 starting 2 bytes into the buffer
    with pytest.raises(ValueError, match="aligned base address"):
        rows_descriptor(view, 64)


def test_misaligned_row_stride_is_refused():
    t = torch.zeros(16, 1, 4, dtype=torch.bfloat16)  # 8-byte rows
    with pytest.raises(ValueError, match="row stride"):
        rows_descriptor(t, 16)


def test_box_that_tma_cannot_move_is_refused():
    with pytest.raises(Exception, match="power of 2|power of two"):
        rows_descriptor(torch.zeros(96, 1, 64, dtype=torch.bfloat16), 48)


def test_empty_tensor_is_refused():
    with pytest.raises(ValueError, match="at least one row"):
        rows_descriptor(torch.zeros(0, 2, 64, dtype=torch.bfloat16), 64)
