"""jfa.workbench.inspect on the tutorials: compile-only reports, no GPU needed (compiles are cached on disk)."""
import dataclasses

import pytest

from jfa.kernels.spec import KernelSpec
from jfa.workbench import inspect as jfa_inspect
from jfa.workbench.inspect import KernelCompileError, inspect
from tutorials import t01_ws_producer_consumer as t01
from tutorials import t03_ws_wgmma_gemm as t03
from tutorials import t04_attention_pingpong as t04
from tutorials import t05_blackwell_tmem_gemm as t05


@pytest.fixture(scope="module")
def t01_report():
    return inspect(t01.inspect_spec(), target="sm_90", want_ptx=True, want_ttgir=True)


def test_t01_has_a_producer_and_a_consumer(t01_report):
    roles = {role.name: role for role in t01_report.roles}
    assert list(roles) == ["producer", "consumer"]
    assert roles["producer"].warps == 4 and roles["consumer"].warps == 4
    assert roles["consumer"].requested_registers == 232
    assert roles["consumer"].registers == 232
    assert roles["producer"].registers is not None and roles["producer"].registers > 0
    assert t01_report.total_warps == 8 and t01_report.threads == 256


def test_t01_pipeline_instructions_and_shared_memory(t01_report):
    assert t01_report.instructions["TMA load (cp.async.bulk.tensor g->s)"] > 0
    assert t01_report.instructions["mbarrier.try_wait"] > 0
    assert t01_report.instructions["mbarrier.arrive (all)"] > 0
    assert t01_report.instructions["mbarrier.init"] > 0
    assert t01_report.instructions["wgmma.mma_async"] == 0
    ring_bytes = 2 * 64 * 128 * 2  # two fp16 64x128 slots
    assert t01_report.shared_bytes >= ring_bytes
    assert t01_report.tmem_columns is None


def test_t01_report_text_dict_and_artifacts(t01_report):
    text = t01_report.to_text()
    assert "scale_tiles_kernel @ sm_90" in text and "producer" in text and "consumer" in text
    as_dict = t01_report.to_dict()
    assert as_dict["threads"] == 256 and as_dict["roles"][1]["name"] == "consumer"
    assert ".entry scale_tiles_kernel" in t01_report.ptx
    assert "ttg.warp_specialize" in t01_report.ttgir
    assert inspect(t01.inspect_spec()).ptx is None  # text only on request


def test_t03_wgmma_and_register_budgets():
    report = inspect(t03.inspect_spec(), target="sm_90")
    assert [r.name for r in report.roles] == ["producer", "consumer0", "consumer1"]
    assert [r.registers for r in report.roles[1:]] == [232, 232]
    assert report.roles[0].registers < 232  # the producer runs on what the consumers left
    assert report.instructions["wgmma.mma_async"] > 0
    assert report.instructions["setmaxnreg"] > 0
    assert any(k.startswith("dec") for k in report.setmaxnreg)
    assert any(k.startswith("inc") for k in report.setmaxnreg)
    # The GEMM's K loop is an innermost SASS loop issuing HGMMAs, one per consumer, free of spills.
    assert report.loops and all(loop["mma"] > 0 for loop in report.loops)
    assert all(loop["local_loads"] == loop["local_stores"] == 0 for loop in report.loops)
    assert set(report.spill_bytes) == {"stores", "loads"}
    text = report.to_text()
    assert "register spills (ptxas)" in text and "MMA loops (SASS, innermost)" in text


def test_t04_pingpong_adds_a_consumer_and_named_barrier_arrives():
    single = inspect(t04.inspect_spec(PINGPONG=False))
    pingpong = inspect(t04.inspect_spec(PINGPONG=True))
    assert [r.name for r in single.roles] == ["producer", "consumer"]
    assert [r.name for r in pingpong.roles] == ["producer", "consumer0", "consumer1"]
    assert single.instructions["bar.arrive / barrier.arrive"] == 0
    assert pingpong.instructions["bar.arrive / barrier.arrive"] > 0
    assert pingpong.instructions["wgmma.mma_async"] == 2 * single.instructions["wgmma.mma_async"]


def test_t05_tcgen05_and_tmem_on_sm100():
    report = inspect(t05.inspect_spec(), target="sm_100")
    assert report.instructions["tcgen05.mma"] > 0
    assert report.instructions["tcgen05.* (all)"] >= report.instructions["tcgen05.mma"]
    assert report.tmem_columns == 128  # one 128x128 fp32 accumulator
    assert [r.name for r in report.roles][:3] == ["epilogue", "mma", "load"]
    assert report.instructions["wgmma.mma_async"] == 0


def test_bad_target_names_the_argument():
    with pytest.raises(ValueError, match="target"):
        inspect(t01.inspect_spec(), target="sm_80")


def test_failed_compile_names_kernel_and_target():
    spec = t03.inspect_spec(BLOCK_K=8)  # wgmma needs K >= 16: the compiler rejects it
    with pytest.raises(KernelCompileError, match=r"ws_gemm_kernel.*sm_90"):
        inspect(spec)


def test_missing_signature_entry_names_the_argument():
    spec = t01.inspect_spec()
    spec = KernelSpec(fn=spec.fn, signature={k: v for k, v in spec.signature.items() if k != "scale"},
                      constexprs=spec.constexprs)
    with pytest.raises(ValueError, match="scale"):
        inspect(spec)


def test_compiler_diagnostic_reaches_the_error():
    spec = dataclasses.replace(t01.inspect_spec(), num_warps=2)  # roles need whole warpgroups
    with pytest.raises(KernelCompileError, match=r"(?s)scale_tiles_kernel.*sm_90.*multiple of 4"):
        inspect(spec)


def test_cli_lists_modules_and_inspects_by_prefix(capsys):
    from jfa.workbench.inspect import main

    assert main([]) == 0
    listing = capsys.readouterr().out
    assert "tutorials.t01_ws_producer_consumer" in listing and "tutorials.t05_blackwell_tmem_gemm" in listing
    assert main(["t04", "PINGPONG=False"]) == 0
    report = capsys.readouterr().out
    assert "attention_fwd_kernel @ sm_90" in report and "consumer1" not in report


def test_cli_json_and_errors(capsys):
    import json

    from jfa.workbench.inspect import main

    assert main(["t05", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tmem_columns"] == 128
    assert main(["t0"]) == 2  # ambiguous: every tutorial starts with t0
    assert "matches" in capsys.readouterr().err


def test_cli_takes_an_exact_module_name_over_the_names_it_prefixes(monkeypatch):
    from jfa.workbench import inspect as inspect_module
    from jfa.workbench.inspect import _resolve_module

    assert _resolve_module("fwd_sm90") == "jfa.kernels.fwd_sm90"
    assert _resolve_module("fwd_sm1") == "jfa.kernels.fwd_sm100"
    assert _resolve_module("t04") == "tutorials.t04_attention_pingpong"
    assert _resolve_module("jfa.kernels.bwd_dq") == "jfa.kernels.bwd_dq"
    with pytest.raises(ValueError, match="matches"):
        _resolve_module("fwd_sm")  # fwd_sm90 and fwd_sm100
    # a name that is one module's whole name and the start of another's picks the first
    monkeypatch.setattr(inspect_module, "_inspectable_modules", lambda: ["jfa.kernels.bwd_dq", "jfa.kernels.bwd_dq2"])
    assert _resolve_module("bwd_dq") == "jfa.kernels.bwd_dq"


def test_cli_reports_a_module_that_does_not_import(capsys):
    from jfa.workbench.inspect import main

    assert main(["tutorials.no_such_tutorial"]) == 2
    assert "no_such_tutorial" in capsys.readouterr().err


def test_sm100_uses_the_host_ptxas_where_the_wheel_lacks_ptxas_blackwell(monkeypatch):
    """The offline GPU bundle strips Triton's binaries: a CUDA >= 12.8 ptxas named by TRITON_PTXAS_PATH
    then assembles sm_100a for the compile-only views."""
    import os

    import triton
    from triton.knobs import NvidiaTool

    import jfa.workbench.inspect as inspect_module

    shipped = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
    monkeypatch.setenv("TRITON_PTXAS_PATH", shipped)  # any CUDA >= 12.8 ptxas stands for the host's
    real_exists = os.path.exists
    monkeypatch.setattr(inspect_module.os.path, "exists", lambda p: False if p == shipped else real_exists(p))
    inspect_module._fall_back_to_host_ptxas_for_blackwell()
    assert os.environ["TRITON_PTXAS_BLACKWELL_PATH"] == shipped
    assert NvidiaTool.from_path(shipped) is not None


def test_mma_loops_without_nvdisasm_is_none(monkeypatch):
    """The GPU bundle drops Triton's binaries; the report then says the loops are unknown."""
    from triton import knobs

    def missing(self, path):
        raise RuntimeError(f"Cannot find {self.binary}")

    monkeypatch.setattr(knobs.env_nvidia_tool, "transform", missing)
    assert jfa_inspect.mma_loops(b"") is None


def test_wgmma_waits_counts_the_waits_for_all_right_after_an_issue():
    ttgir = "\n".join([
        "%s = ttng.warp_group_dot %q, %k, %zero {isAsync = true}",
        "%s_0 = ttng.warp_group_dot_wait %s, %q, %k {pendings = 0 : i32}",  # the pipeliner's kind
        "%o = ttng.warp_group_dot %p, %v, %acc {isAsync = true}",
        "%m = arith.maxnumf %x, %y",
        "%o_1 = ttng.warp_group_dot_wait %o {pendings = 0 : i32}",  # not right after: work in between
        "%t = ttng.warp_group_dot %q, %k, %zero {isAsync = true}",
        "%t_2 = ttng.warp_group_dot_wait %t {pendings = 1 : i32}",  # leaves one in flight
    ])
    assert jfa_inspect.wgmma_waits(ttgir) == {"total": 3, "right_after_issue": 1}


def test_spec_default_num_stages_is_tritons():
    """A spec that names no num_stages describes a kernel launched without one."""
    from triton.backends.nvidia.compiler import CUDAOptions

    assert KernelSpec(fn=None, signature={}, name="any").num_stages == CUDAOptions.num_stages


def test_cli_configures_the_jagged_kernels_from_a_calls_options():
    """The production kernels' inspect_spec takes a configuration; the CLI selects it from a call's
    options as jfa.configs does, then UPPER-CASE keys replace its fields."""
    from jfa import configs
    from jfa.kernels import bwd_dkdv
    from jfa.workbench.inspect import _spec_arguments

    forward = _spec_arguments("jfa.kernels.fwd_sm90", {"head_dim": 64, "causal": True, "dtype": "x"})
    assert forward == {"dtype": "x",
                       "config": configs.forward_config(configs.gem_like_shape(64, causal=True))}
    split = _spec_arguments("jfa.kernels.bwd_dkdv", {"dq": "split", "BLOCK_M": 32})["config"]
    assert split.DQ == bwd_dkdv.DQ_SPLIT.value and split.BLOCK_M == 32
    assert _spec_arguments("jfa.kernels.block_attn", {"direction": "backward", "rotary": True})["config"].ROTARY
    assert _spec_arguments("tutorials.t04_attention_pingpong", {"PINGPONG": False}) == {"PINGPONG": False}


@pytest.mark.parametrize("options, message", [
    ({"FOO": 1}, "not fields of DKDVConfig"),
    ({"dq": "atomic"}, "dq: one of"),
])
def test_cli_names_a_wrong_option(options, message):
    from jfa.workbench.inspect import _spec_arguments

    with pytest.raises(ValueError, match=message):
        _spec_arguments("jfa.kernels.bwd_dkdv", options)


def test_cli_inspects_the_production_forward(capsys):
    from jfa.workbench.inspect import main

    assert main(["fwd_sm90", "head_dim=64"]) == 0
    assert "@ sm_90" in capsys.readouterr().out
    assert main(["block_attn", "direction=sideways"]) == 2
    assert "direction" in capsys.readouterr().err
