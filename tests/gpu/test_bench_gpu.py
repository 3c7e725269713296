"""The benchmark on a Hopper GPU, at --quick sizes: real providers, real do_bench, real reference checks.

These check the benchmark, not the kernels: PyTorch's own FlashAttention-2 varlen and SDPA must come
out ok (built, checked against the fp32 reference, timed), and every other row must be either ok or
carry its reason. The rows are printed so the GPU log shows what each provider did.
"""
import json

import pytest
import torch

from jfa import specs
from jfa.workbench import bench

pytestmark = [pytest.mark.gpu, pytest.mark.timing]  # the benchmark subtracts medians

ALWAYS_PRESENT = {"fa2"}  # ships with torch on the GPU host; a failure here is the benchmark's fault
DENSE_ALWAYS_PRESENT = {"fa2", "sdpa_flash", "sdpa_cudnn"}


def run_quick(tmp_path, suites, providers, passes=("fwd", "bwd")) -> list[dict]:
    out = tmp_path / "bench.json"
    assert bench.run_bench(list(suites), list(providers), list(passes), out, quick=True)
    data = json.loads(out.read_text())
    assert data["env"]["gpu"] == torch.cuda.get_device_name()
    for row in data["rows"]:
        print(f"{row['suite']:>12} {row['case']:<24} {row['provider']:<10} {row['pass']:<7} "
              f"{'ok' if row['ok'] else 'FAIL'} {row['tflops'] or '':<10} {row['error'] or ''}")
    return data["rows"]


def assert_rows(rows, must_pass):
    assert rows
    for row in rows:
        if row["provider"] in must_pass:
            assert row["ok"], row
            assert row["params"]["checked_rows"] > 0 and row["tflops"] > 0
        else:
            assert row["ok"] or row["error"], row


def test_quick_jagged_suites(tmp_path):
    providers = ["jfa", "fa2", "fa3", "fa4"]
    rows = run_quick(tmp_path, ["gem", "cross", "pma", "block"], providers)
    assert len(rows) == sum(len(specs.BENCH_QUICK_SUITES[s]) for s in ("gem", "cross", "pma", "block")) * 4 * 2
    assert_rows(rows, ALWAYS_PRESENT)


def test_quick_dense_suite(tmp_path):
    rows = run_quick(tmp_path, ["dense"], ["jfa", "fa2", "sdpa_flash", "sdpa_cudnn"])
    assert_rows(rows, DENSE_ALWAYS_PRESENT)


def test_quick_sdpa_on_jagged_suites(tmp_path):
    """SDPA through nested jagged tensors: its flash backend must run and match the reference; cuDNN's
    nested path is experimental (forward-only, behind an environment switch), so its rows may say why not."""
    rows = run_quick(tmp_path, ["gem", "pma"], ["sdpa_flash", "sdpa_cudnn"])
    assert_rows(rows, {"sdpa_flash"})


def test_quick_flex_runs_in_its_own_process(tmp_path):
    rows = run_quick(tmp_path, ["gem"], ["flex"], passes=("fwd",))
    assert rows and all(r["params"].get("triton") or r["error"] for r in rows)
    assert_rows(rows, {"flex"})
