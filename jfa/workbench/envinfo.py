"""What machine and software a result came from: the environment block of every results JSON.

Recorded numbers are only worth something next to the GPU, driver and versions that produced them, so
benchmarks, the GPU test run and the notebooks all take this block from one function.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import os
import platform
import subprocess
from pathlib import Path

import torch

# git runs in the package's own directory: inside a checkout it finds that checkout's HEAD; an
# installed copy outside any repository has no commit (unless JFA_COMMIT names it).
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """HEAD of the checkout holding this package; JFA_COMMIT names it where the tree travelled without
    .git (the GPU host)."""
    if os.environ.get("JFA_COMMIT"):
        return os.environ["JFA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE_DIR, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PACKAGE_DIR,
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def tlx_status() -> tuple[bool, str]:
    """Whether TLX imports here, and the reason when it does not."""
    try:
        import triton.language.extra.tlx  # noqa: F401
    except Exception as exc:  # any import failure means "no TLX"; say why
        return False, f"{type(exc).__name__}: {exc}"
    return True, "importable"


def gpu_status() -> tuple[bool, str]:
    """Whether the sm90 TLX kernels can run live on this machine, and why not."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return False, f"GPU is sm_{major}{minor}; the runnable kernels target Hopper (sm_90)"
    ok, why = tlx_status()
    return (True, torch.cuda.get_device_name()) if ok else (False, f"TLX unavailable ({why})")


def environment() -> dict:
    """The environment block: gpu, driver, cuda, torch, triton, tlx, fa4, commit, date, host."""
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "sm": "sm_%d%d" % torch.cuda.get_device_capability() if gpu else None,
        "driver": _nvidia_driver() if gpu else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tlx": _version("triton-utlx") or ("bundled" if tlx_status()[0] else None),
        "fa4": _version("flash-attn-4"),
        "python": platform.python_version(),
        "commit": _git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
    }
