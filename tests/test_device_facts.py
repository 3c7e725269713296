"""The GPU facts every launch asks for (`jfa.kernels.common.sm_major`, `num_sms`), read once per device.

Checked on the CPU with torch's property query replaced by a counting stand-in: the kernels ask for
the compute capability and the SM count on every forward and backward (five times per training step),
and torch's own query costs several microseconds each time, twice that on autograd's device thread.
"""
from types import SimpleNamespace

import torch

from jfa.kernels import common


def test_properties_are_read_once_per_device(monkeypatch):
    calls = []

    def fake_properties(index):
        calls.append(index)
        return SimpleNamespace(major=9, multi_processor_count=132 + index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", fake_properties)
    common._device_properties.cache_clear()
    try:
        first, second = torch.device("cuda", 0), torch.device("cuda", 1)
        for _ in range(3):
            assert common.sm_major(first) == 9
            assert common.num_sms(first) == 132
            assert common.num_sms(second) == 133
        assert calls == [0, 1]
    finally:
        common._device_properties.cache_clear()  # later tests see the real devices


def test_persistent_grid_is_one_program_per_sm_at_most_and_at_least_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(major=9, multi_processor_count=132))
    common._device_properties.cache_clear()
    try:
        device = torch.device("cuda", 0)
        assert [common.persistent_programs(device, units) for units in (0, 1, 131, 132, 5000)] == [1, 1, 131, 132, 132]
    finally:
        common._device_properties.cache_clear()
