"""CPU checks of the Blackwell jagged forward (`jfa.kernels.fwd_sm100`): compiled for sm_100, never
run here (the GPU host is a Hopper H200).

What a compile can show is checked: every configuration builds into three roles around tensor
memory; both GEMMs are `tcgen05.mma` (no wgmma), P·V reads its A operand (P) from TMEM, S and O
move through `tcgen05.ld` / `tcgen05.st`, and the CTA fits in shared memory. The schedule and the
tile geometry it shares with the Hopper kernel are tested in tests/test_jagged_fwd_geometry.py.
"""
import itertools
import re

import pytest
import torch

from jfa import specs
from jfa.kernels import fwd_sm100
from jfa.workbench import inspect as jinspect

CONFIGS = [dict(head_dim=d, dtype=t, causal=c, window=w, broadcast_q=b)
           for d, t, (c, w, b) in itertools.product(
               specs.SUPPORTED_HEAD_DIMS, specs.SUPPORTED_DTYPES,
               [(False, None, False), (True, None, False), (False, 32, False), (False, None, True)])]


def _id(cfg):
    flags = [name for name, on in (("causal", cfg["causal"]), ("window", cfg["window"] is not None),
                                   ("bcastq", cfg["broadcast_q"])) if on]
    return "-".join([f"d{cfg['head_dim']}", str(cfg["dtype"]).split(".")[-1]] + flags)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_compiles_for_sm100_around_tensor_memory(cfg):
    spec = fwd_sm100.inspect_spec(fwd_sm100.forward_config(cfg["head_dim"], causal=cfg["causal"], window=cfg["window"],
                                                           broadcast_q=cfg["broadcast_q"]), cfg["dtype"])
    kernel = jinspect.compile_spec(spec, "sm_100")
    ptx = kernel.asm["ptx"]
    assert "wgmma" not in ptx
    # The first operand after the [D] address: a descriptor (%rd, Q from shared memory) for QK^T,
    # a TMEM address ([...]) for P·V.
    a_operands = set(re.findall(r"tcgen05\.mma\.\S+\s+\[[^\]]+\],\s*(\S)", ptx))
    assert a_operands == {"%", "["}, a_operands
    assert re.search(r"tcgen05\.ld\.", ptx) and re.search(r"tcgen05\.st\.", ptx)
    assert kernel.metadata.shared <= specs.SHARED_BYTES_PER_BLOCK["sm_100"]
    report = jinspect.inspect(spec)
    assert [role.name for role in report.roles][:3] == ["softmax", "mma", "load"]


def test_launch_refuses_to_run_off_blackwell():
    q = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 10)
    offsets = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="compiled, not run here"):
        fwd_sm100.launch(q, q, q, torch.empty_like(q), lse, offsets, offsets, None, fwd_sm100.forward_config(64),
                         programs=1, qk_scale_log2=0.125, window=None)


def test_bad_configuration_names_the_argument():
    with pytest.raises(ValueError, match="head_dim"):
        fwd_sm100.forward_config(96)
    with pytest.raises(TypeError, match="dtype"):
        fwd_sm100.inspect_spec(dtype=torch.float32)
