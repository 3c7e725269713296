import pytest
import torch


def _gpu_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA GPU on this machine (run `make gpu-test` on the GPU host)"
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return False, f"the sm90 kernels need a Hopper GPU, found sm_{major}x"
    try:
        import triton.language.extra.tlx  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the host
        return False, f"TLX is not importable: {exc}"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ok, why = _gpu_ready()
    if ok:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
