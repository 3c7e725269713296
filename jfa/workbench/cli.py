"""`python -m jfa COMMAND`: check the environment, benchmark, compare head to head, render a report,
inspect a kernel. Each command but `check` is a workbench module's `main(argv)`, imported on use."""
from __future__ import annotations

import argparse
import sys


def _check(_argv: list[str]) -> int:
    """Print versions, the GPU if any, and what will run live here versus from recorded results."""
    from jfa.workbench import envinfo

    env = envinfo.environment()
    for key in ("python", "torch", "cuda", "triton", "tlx", "fa4", "gpu", "sm", "driver", "commit"):
        print(f"{key:>8}: {env[key] if env[key] is not None else '-'}")
    tlx_ok, tlx_why = envinfo.tlx_status()
    gpu_ok, gpu_why = envinfo.gpu_status()
    print(f"     TLX: {'yes' if tlx_ok else 'no'} ({tlx_why}); kernels compile for sm_90/sm_100 here"
          if tlx_ok else f"     TLX: no ({tlx_why})")
    if gpu_ok:
        print(f"    live: TLX kernels run on {gpu_why}")
    else:
        print(f"    live: references only ({gpu_why}); notebooks show recorded H200 results")
    return 0


def _delegate(module: str):
    def run(argv: list[str]) -> int:
        import importlib

        return importlib.import_module(module).main(argv)
    return run


COMMANDS = {
    "check": (_check, "versions, GPU, and what runs live"),
    "bench": (_delegate("jfa.workbench.bench"), "run a benchmark suite into a results JSON"),
    "head-to-head": (_delegate("jfa.workbench.head_to_head"),
                     "time jfa against its peers, interleaved in one process"),
    "report": (_delegate("jfa.workbench.report"), "render results JSON files as an HTML report"),
    "inspect": (_delegate("jfa.workbench.inspect"),
                "compile a kernel for sm_90/sm_100 and report roles, registers, instructions"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m jfa", description=__doc__)
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in sorted(COMMANDS.items())))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command = parser.parse_args(argv[:1]).command  # each command parses its own arguments
    return COMMANDS[command][0](argv[1:])
