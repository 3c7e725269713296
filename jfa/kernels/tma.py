"""TMA views of packed jagged tensors.

A packed `[T, H, D]` tensor is viewed as the 2-D `[T, H*D]` tensor TMA addresses; a box is `rows`
rows of one head (`D` columns at column `head * D`). Boxes may run past a sequence into the next
one, or past the tensor's end, where TMA fills zeros: the kernels mask those keys and never store
those rows.
"""
import functools

import torch
from triton._utils import validate_block_shape
from triton.tools.tensor_descriptor import TensorDescriptor

from jfa import specs


class RowsDescriptor(TensorDescriptor):
    """The TMA descriptor `rows_descriptor` returns: a `TensorDescriptor` whose checks cost plain
    integer tests. The dataclass' own checks (block shape through Triton's constexpr helpers, the
    rank, the padding) cost more than the rest of building it, on every launch; here the block shape
    is checked once per shape and the rest is known from `rows_descriptor`'s `[T, H*D]` view."""

    def __post_init__(self):
        _check_box(tuple(self.block_shape))
        if self.base.data_ptr() % specs.TMA_ALIGN_BYTES:
            raise ValueError(f"a TMA view needs a {specs.TMA_ALIGN_BYTES}-byte aligned base address, got "
                             f"{self.base.data_ptr():#x}: pass a tensor that starts at an allocation (.contiguous())")
        if self.strides[0] * self.base.element_size() % specs.TMA_ALIGN_BYTES:
            raise ValueError(f"a TMA view needs rows {specs.TMA_ALIGN_BYTES}-byte aligned, got a row stride of "
                             f"{self.strides[0]} elements of {self.base.element_size()} bytes: pad the rows")


@functools.lru_cache(maxsize=None)
def _check_box(block_shape: tuple) -> None:
    validate_block_shape(list(block_shape))


def rows_descriptor(t: torch.Tensor, box_rows: int, box_cols: int | None = None) -> RowsDescriptor:
    """TMA view of a packed `[T, H, D]` tensor as `[T, H*D]`; one box = `box_rows` rows of one head
    (or `box_cols` of its columns), at column `head * D`.

    The row stride is the tensor's own, so a view of a buffer with padding rows around it (the gpu
    tests' poisoned outputs) or between rows is addressed as the register stores address it. Heads
    and head dim must be contiguous within a row: the `[T, H*D]` view depends on it.
    """
    rows, heads, dim = t.shape
    if t.stride(2) != 1 or (heads > 1 and t.stride(1) != dim):
        raise ValueError(f"a TMA view of a [T, H, D] tensor needs each row's heads and head dim contiguous "
                         f"(strides (row, {dim}, 1)), got strides {tuple(t.stride())} for shape {tuple(t.shape)}: "
                         "pass a tensor with contiguous rows (.contiguous())")
    if rows == 0:
        raise ValueError("a TMA view needs at least one row: callers return before launching on an empty batch")
    row_stride = t.stride(0) if rows > 1 else heads * dim
    return RowsDescriptor(t, shape=[rows, heads * dim], strides=[row_stride, 1],
                          block_shape=[box_rows, box_cols or dim])
