"""The tutorials on a machine without a GPU: each compiles for its target and reads as a lesson."""
import importlib
import inspect as pyinspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jfa.workbench.inspect import compile_spec, inspect

REPO = Path(__file__).resolve().parents[1]
TUTORIALS = ["t01_ws_producer_consumer", "t02_pipelined_ring", "t03_ws_wgmma_gemm",
             "t04_attention_pingpong", "t05_blackwell_tmem_gemm", "t06_blackwell_attention_tmem",
             "t07_consumer_handoff", "t08_consumer_exchange"]
BLACKWELL_TUTORIALS = ["t05_blackwell_tmem_gemm", "t06_blackwell_attention_tmem"]
MAX_LINES = 220  # a tutorial is read top to bottom in one sitting

# (tutorial, config) pairs that must compile: the defaults plus the variants each lesson compares.
CONFIGS = [(name, {}) for name in TUTORIALS] + [
    ("t02_pipelined_ring", {"NUM_STAGES": 1}),
    ("t02_pipelined_ring", {"NUM_STAGES": 4}),
    ("t04_attention_pingpong", {"PINGPONG": False}),
    ("t04_attention_pingpong", {"HEAD_DIM": 128, "BLOCK_N": 128}),
    ("t08_consumer_exchange", {"K": 64}),
]


def load(name):
    return importlib.import_module(f"tutorials.{name}")


@pytest.mark.parametrize("name, cfg", CONFIGS, ids=[f"{n}-{c}" for n, c in CONFIGS])
def test_compiles_for_its_target(name, cfg):
    spec = load(name).inspect_spec(**cfg)
    report = inspect(spec)
    assert report.target == spec.target
    assert len(report.roles) >= 2, "every tutorial is warp-specialized"
    assert report.shared_bytes > 0


@pytest.mark.parametrize("name", BLACKWELL_TUTORIALS)
def test_blackwell_tutorials_target_sm100(name):
    assert load(name).inspect_spec().target == "sm_100"


def test_blackwell_attention_keeps_s_p_and_o_in_tensor_memory():
    """t06: both GEMMs are tcgen05 MMAs into TMEM, and P·V reads its A operand (P) from TMEM too."""
    ptx = compile_spec(load("t06_blackwell_attention_tmem").inspect_spec(), "sm_100").asm["ptx"]
    mmas = re.findall(r"tcgen05\.mma\.\S+\s+\[[^\]]+\],\s*(\S)", ptx)
    assert "[" in mmas and "%" in mmas, mmas  # A from TMEM ([addr]) for P·V, a descriptor for QK^T
    assert "wgmma" not in ptx and re.search(r"tcgen05\.st\.", ptx) and re.search(r"tcgen05\.ld\.", ptx)


@pytest.mark.parametrize("name", TUTORIALS)
def test_reads_as_a_lesson(name):
    module = load(name)
    assert module.__doc__ and "Why." in module.__doc__ and "How." in module.__doc__
    for attr in ("inspect_spec", "run_check"):
        assert callable(getattr(module, attr)), f"{name} lacks {attr}()"
        assert getattr(module, attr).__doc__, f"{name}.{attr} has no docstring"
    lines = pyinspect.getsource(module).count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines; keep a tutorial under {MAX_LINES}"


def test_handoff_writes_each_tile_once_without_global_adds():
    """t07: one TMA store of C per program, and no atomics or reduce-adds: the partial goes through
    shared memory."""
    ptx = compile_spec(load("t07_consumer_handoff").inspect_spec(), "sm_90").asm["ptx"]
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)) == 1
    assert not re.search(r"\b(?:atom|red)\.|cp\.reduce\.async", ptx)


def test_exchange_meets_once_and_stores_each_half_once():
    """t08: each consumer waits once at the named barrier over both consumer warpgroups (256 threads)
    and TMA-stores its own half of the block: two stores per program, and no global adds."""
    module = load("t08_consumer_exchange")
    for k in module.INNER_DIMS:
        ptx = compile_spec(module.inspect_spec(K=k), "sm_90").asm["ptx"]
        named = rf"bar\.sync\s+{module.BOTH_STAGED.value},\s*{module.PAIR_THREADS.value};"
        assert len(re.findall(named, ptx)) == module.NUM_CONSUMERS.value
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)) == module.NUM_CONSUMERS.value
        assert not re.search(r"\b(?:atom|red)\.|cp\.reduce\.async", ptx)


def test_module_main_prints_the_report_on_cpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-m", "tutorials.t01_ws_producer_consumer"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "scale_tiles_kernel @ sm_90" in result.stdout
    assert "producer" in result.stdout and "GPU check skipped" in result.stdout


@pytest.mark.parametrize("name", BLACKWELL_TUTORIALS)
def test_blackwell_run_check_refuses_politely_off_blackwell(name):
    with pytest.raises(RuntimeError, match="compiled, not run here"):
        load(name).run_check()


def test_host_wrappers_reject_bad_input_before_launch():
    t01, t03, t04 = load("t01_ws_producer_consumer"), load("t03_ws_wgmma_gemm"), load("t04_attention_pingpong")
    with pytest.raises(ValueError, match="2-D"):
        t01.scale_tiles(torch.zeros(2, 3, 8, dtype=torch.float16), 2.0)
    with pytest.raises(ValueError, match="shape"):
        t01.scale_tiles(torch.zeros(4, 7, dtype=torch.float16), 2.0)
    for gemm in (t03.ws_gemm, load("t07_consumer_handoff").split_k_gemm):
        with pytest.raises(ValueError, match=r"a.shape\[1\] must equal b.shape\[0\]"):
            gemm(torch.zeros(8, 16, dtype=torch.float16), torch.zeros(24, 8, dtype=torch.float16))
    chain = load("t08_consumer_exchange").chain
    half = torch.zeros(8, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"a.shape\[1\] must be one of"):
        chain(torch.zeros(8, 96, dtype=torch.float16), half, half)
    with pytest.raises(ValueError, match="b must be"):
        chain(torch.zeros(8, 64, dtype=torch.float16), half, torch.zeros(128, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="float16"):
        chain(torch.zeros(8, 64), half, half)
    q = torch.zeros(2, 100, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="multiple of"):
        t04.attention_fwd(q, q, q)
    with pytest.raises(ValueError, match="multiple of"):
        load("t06_blackwell_attention_tmem").tmem_attention(q, q, q)
