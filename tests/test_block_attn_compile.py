"""Every block attention kernel configuration compiles for sm_90 into the intended machine code.

No GPU needed: the kernels are compiled with `jfa.workbench.inspect` and the PTX is checked for what the
design promises (wgmma GEMMs, TMA loads into an mbarrier ring, per-role register budgets via
setmaxnreg) and the shared memory is checked against the SM's capacity.
"""
import re

import pytest
import torch

from jfa import configs, specs
from jfa.kernels import block_attn
from jfa.schedule import build_block_table
from jfa.workbench.inspect import inspect

CONFIGS = [
    (configs.block_attention_forward(64), torch.bfloat16),
    (configs.block_attention_forward(128), torch.bfloat16),
    (configs.block_attention_forward(64, group=2), torch.float16),
    (configs.block_attention_forward(128, group=4), torch.bfloat16),
    (configs.block_attention_backward(64), torch.bfloat16),
    (configs.block_attention_backward(128), torch.bfloat16),
    (configs.block_attention_backward(64, group=2), torch.float16),
    (configs.block_attention_backward(64, rotary=True), torch.bfloat16),
    (configs.block_attention_backward(128, group=2, rotary=True), torch.bfloat16),
]


def _id(case):
    config, dtype = case
    fields = "-".join(f"{k}={v}" for k, v in config._asdict().items())
    return f"{type(config).__name__}-{fields}-{str(dtype).split('.')[-1]}"


@pytest.mark.parametrize("case", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_kernel_compiles_for_sm90(case):
    report = inspect(block_attn.inspect_spec(*case), target="sm_90")
    counts = report.instructions
    assert counts["wgmma.mma_async"] > 0
    assert counts["TMA load (cp.async.bulk.tensor g->s)"] > 0
    assert counts["mbarrier.try_wait"] > 0
    assert counts["setmaxnreg"] > 0
    assert report.shared_bytes <= specs.SHARED_BYTES_PER_BLOCK["sm_90"]
    roles = {role.name: role for role in report.roles}
    assert roles["consumer_wg0"].registers == block_attn.CONSUMER_REGISTERS.value


@pytest.mark.parametrize("head_dim", specs.SUPPORTED_HEAD_DIMS)
def test_rotary_epilogue_stays_in_registers(head_dim):
    """The conjugate rotation works on the fp32 accumulators where wgmma left them.

    No fp32 tile changes layout (the only conversions are the bf16 tiles' on their way to the
    masked stores, as without rotary), and nothing spills.
    """
    report = inspect(block_attn.inspect_spec(configs.block_attention_backward(head_dim, rotary=True)), want_ttgir=True)
    converted = re.findall(r"ttg\.convert_layout %\S+ : tensor<[\dx]+x(\w+),", report.ttgir)
    assert converted and set(converted) == {"bf16"}
    assert report.spill_bytes == {"stores": 0, "loads": 0}


def test_inspect_spec_names_what_it_takes():
    with pytest.raises(TypeError, match="ForwardConfig or a BackwardConfig"):
        block_attn.inspect_spec(dict(HEAD_DIM=64))


@pytest.mark.parametrize("lengths", [[0, 1, 63, 64, 65, 128, 0, 2, 127, 129], [5], [0, 0], [64] * 7])
def test_block_table_lists_every_block_once(lengths):
    """The GPU-built block list (run here on the CPU: same torch ops) names each block exactly once."""
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    start, rows, count = build_block_table(offsets, sum(lengths))
    n = int(count.item())
    expected = [(o + s, min(64, length - s)) for o, length in zip(offsets.tolist(), lengths)
                for s in range(0, length, 64)]
    assert list(zip(start[:n].tolist(), rows[:n].tolist())) == expected
    assert start.numel() >= n


def test_ring_depth_fits_shared_memory():
    for head_dim in specs.SUPPORTED_HEAD_DIMS:
        assert configs.block_attention_forward(head_dim).RING_DEPTH >= 2
        assert configs.block_attention_backward(head_dim).RING_DEPTH >= 2
