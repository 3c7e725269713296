"""Run one benchmark job for an isolated provider (FlexAttention) and write its rows as JSON.

    python -m jfa.workbench.flex_worker JOB.json ROWS.json

JOB.json is {"case": <a case dict of jfa.specs.BENCH_SUITES>, "provider": "flex", "passes": [...]}.
ROWS.json receives {"rows": [...], "triton": "<version>"} in the row format of jfa.workbench.bench.
With "compile_only": true the job only runs the provider once (filling the compile caches for a
later timed job, see `jfa.workbench.bench.warm_isolated`) and ROWS.json gets no rows.

`jfa.workbench.bench` starts this with the TLX bundles removed from the environment, so `import triton`
here is the Triton that torch ships, the one FlexAttention's compiled kernels are written for. Every row
says which Triton produced it (params.triton), since the results file's env block names the TLX one.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

USAGE = "usage: python -m jfa.workbench.flex_worker JOB.json ROWS.json"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(USAGE, file=sys.stderr)
        return 2
    job_path, rows_path = map(Path, argv)
    job = json.loads(job_path.read_text())
    import triton

    from jfa.workbench import bench

    if job.get("compile_only"):
        bench.compile_case_in_process(job["case"], job["provider"])
        rows_path.write_text(json.dumps({"rows": [], "triton": triton.__version__}))
        return 0
    rows = bench.measure_case_in_process(job["case"], [job["provider"]], job["passes"])
    for row in rows:
        row["params"]["triton"] = triton.__version__
    rows_path.write_text(json.dumps({"rows": rows, "triton": triton.__version__}, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
