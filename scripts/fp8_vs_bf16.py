"""The FP8 forward kernel alone against the bf16 kernel on the same inputs, and the V^T copy alone.

`jfa.jagged_attention_fp8` times the whole call: validation, the transposed V (`transposed_values`)
and the kernel. Here V^T is made once beforehand so that the kernel is timed by itself, next to the
bf16 kernel on the same (E4M3-valued) inputs cast to bf16; do_bench medians, one line of JSON per
case of the `fp8` benchmark suite named on the command line.

    python scripts/fp8_vs_bf16.py "L=2048,s=1.0" ["L=1024,s=0.5" ...]     (GPU host, .gpu-bundle)
"""
import json
import sys

import torch

from jfa import specs
from jfa.kernels import jagged_fwd
from jfa.workbench import bench


def measure(case_name: str) -> dict:
    case = next(c for c in specs.BENCH_SUITES["fp8"] if c["case"] == case_name)
    problem = bench.make_problem(case, "cuda", 0)
    args = (problem.q_offsets, problem.kv_offsets, problem.max_q, problem.max_kv, None, False, None, False)
    q, k, v = (t.detach() for t in (problem.q, problem.k, problem.v))
    row = dict(case=f"fp8 {case_name}")
    row["transpose_ms"] = bench.do_bench_median(lambda: jagged_fwd.transposed_values(v, problem.kv_offsets), [])
    v_t = jagged_fwd.transposed_values(v, problem.kv_offsets)
    made_per_call = jagged_fwd.transposed_values
    jagged_fwd.transposed_values = lambda *_: v_t
    try:
        row["fp8_kernel_ms"] = bench.do_bench_median(lambda: jagged_fwd.jagged_attention_fwd(q, k, v, *args), [])
    finally:
        jagged_fwd.transposed_values = made_per_call
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    row["bf16_kernel_ms"] = bench.do_bench_median(lambda: jagged_fwd.jagged_attention_fwd(q16, k16, v16, *args), [])
    flops = bench.case_flops(case, problem, "fwd")
    row["fp8_kernel_tflops"] = flops / row["fp8_kernel_ms"] / 1e9
    row["bf16_kernel_tflops"] = flops / row["bf16_kernel_ms"] / 1e9
    return row


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(json.dumps(measure(name)), flush=True)
