"""kernels/l2_window.py on a machine without a GPU: the structures it hands the CUDA runtime have the runtime's
layout, the share of a window marked persisting is what the set-aside holds, and nothing touches the runtime for
tensors off the GPU (every CPU path of the attention goes through the window)."""
import ctypes

import pytest
import torch

from kernels import l2_window


def test_access_policy_window_has_the_runtime_layout():
    # cudaAccessPolicyWindow (driver_types.h): void *base_ptr; size_t num_bytes; float hitRatio;
    # enum hitProp; enum missProp. cudaStreamAttrValue is the 64-byte cudaLaunchAttributeValue union.
    window = l2_window.AccessPolicyWindow
    offsets = {name: getattr(window, name).offset for name, _ in window._fields_}
    assert offsets == {"base_ptr": 0, "num_bytes": 8, "hitRatio": 16, "hitProp": 20, "missProp": 24}
    assert ctypes.sizeof(window) == 32
    assert ctypes.sizeof(l2_window.StreamAttrValue) == 64


def test_hit_ratio_is_the_share_the_set_aside_holds():
    set_aside = 39321600  # an H200's largest set-aside (37.5 MiB)
    assert l2_window.hit_ratio(set_aside, 64 << 20) == pytest.approx(0.5859375)  # kv_comp at m = 1, T = 64K
    assert l2_window.hit_ratio(set_aside, 32 << 20) == 1.0  # m = 2 fits whole
    assert l2_window.hit_ratio(set_aside, 0) == 0.0


def test_no_runtime_call_off_the_gpu(monkeypatch):
    def no_runtime():
        raise AssertionError("the CUDA runtime was asked for on a CPU tensor")

    monkeypatch.setattr(l2_window, "_runtime", no_runtime)
    for tensor in (None, torch.zeros(4, 8), torch.zeros(0)):
        with l2_window.persisting(tensor):
            pass
