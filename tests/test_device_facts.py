"""The GPU facts every launch asks for (`jfa.kernels.tiles.sm_major`, `num_sms`), read once per device,
and the persistent grid they size (`tiles.persistent_programs`).

Checked on the CPU with torch's property query replaced by a counting stand-in: the runner asks for the
compute capability and the SM count on every forward and backward (several times per training step),
and torch's own query costs several microseconds each time, twice that on autograd's device thread.
"""
from types import SimpleNamespace

import pytest
import torch

from jfa import specs
from jfa.kernels import tiles

HOPPER_MAJOR = 9


@pytest.fixture
def counted_properties(monkeypatch):
    """torch's device-property query replaced by a stand-in that records the device index of every call
    (device i has H200_SM_COUNT + i SMs), with the module's cache emptied before and after."""
    calls = []

    def fake_properties(index):
        calls.append(index)
        return SimpleNamespace(major=HOPPER_MAJOR, multi_processor_count=specs.H200_SM_COUNT + index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", fake_properties)
    monkeypatch.setattr(tiles, "_PROPERTIES", {})  # later tests see the real devices again
    return calls


def test_properties_are_read_once_per_device(counted_properties):
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    for _ in range(3):
        assert tiles.sm_major(first) == HOPPER_MAJOR
        assert tiles.num_sms(first) == specs.H200_SM_COUNT
        assert tiles.num_sms(second) == specs.H200_SM_COUNT + 1
    assert counted_properties == [0, 1]


def test_persistent_grid_is_one_program_per_sm_at_most_and_at_least_one():
    sms = specs.H200_SM_COUNT
    units = (0, 1, sms - 1, sms, 5000)
    assert [tiles.persistent_programs(sms, n) for n in units] == [1, 1, sms - 1, sms, sms]
