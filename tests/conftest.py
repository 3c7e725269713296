import pytest

from jfa.workbench.envinfo import gpu_status


def pytest_collection_modifyitems(config, items):
    ok, why = gpu_status()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"{why} (run `make gpu-test` on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
