"""The Hopper tutorials' self-checks on the GPU host (fresh random inputs, poisoned outputs)."""
import importlib

import pytest

HOPPER_TUTORIALS = ["t01_ws_producer_consumer", "t02_pipelined_ring", "t03_ws_wgmma_gemm",
                    "t04_attention_pingpong", "t07_consumer_handoff", "t08_consumer_exchange"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", HOPPER_TUTORIALS)
def test_run_check_passes_on_hopper(name):
    importlib.import_module(f"tutorials.{name}").run_check()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["t05_blackwell_tmem_gemm", "t06_blackwell_attention_tmem"])
def test_blackwell_tutorial_gives_a_reason_instead_of_running(name):
    from tutorials import blackwell_tlx_available

    ready, why = blackwell_tlx_available()
    assert not ready and "sm_90" in why  # the GPU host is an H200
    with pytest.raises(RuntimeError, match="compiled, not run here"):
        importlib.import_module(f"tutorials.{name}").run_check()
