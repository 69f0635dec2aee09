"""Keep the rows the sparse attention gathers in L2: the CUDA stream's access-policy window.

The attention's kernels read kv_comp's rows in the order of the picks, each row hundreds of times a call. At m = 1
and 64K tokens kv_comp is 64 MB, more than the H200's 50 MB of L2 holds beside what the kernels stream past it (q,
dO, the output, the partial dKV rows): v17's Nsight Compute found 37% of the forward's requests going to HBM. The
CUDA runtime can set aside part of L2 (``cudaLimitPersistingL2CacheSize``, at most 37.5 MiB on an H200) for the
accesses a stream's access-policy window marks persisting; other lines use the set-aside only where persisting ones
leave it free, so neither the streamed tensors nor the gathers' own misses evict them. ``persisting(kv_comp)``
marks the set-aside's worth of kv_comp's lines persisting (a fixed share of its lines, the window's hit ratio) for
the kernels launched inside the block, and leaves the rest normal. A cache policy changes no result. In-kernel
hints cannot do this: the gathers are ``cp.async`` copies, which take no cache hint in Triton 3.6.

The runtime reads the window from the stream at each launch, so it covers exactly the launches made inside the
block (the backward's run on the stream autograd gives them, which is current there). Lines it made persisting stay
so until the next window's persisting lines replace them; ``cudaCtxResetPersistingL2Cache`` (``reset``) acts when the
host calls it, not in stream order, so only the benchmark calls it, between runs with and without the window.
"""
import contextlib
import ctypes
import ctypes.util
import functools
from typing import Optional

import torch

# Switch for the benchmark (the attention with and without the window in one process); on in real use.
ENABLED = True

# CUDA runtime enums (driver_types.h)
_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_ATTR_MAX_PERSISTING_L2_CACHE_SIZE = 108
_ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
_NORMAL, _PERSISTING = 0, 2


class AccessPolicyWindow(ctypes.Structure):
    """``cudaAccessPolicyWindow``."""
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class StreamAttrValue(ctypes.Union):
    """``cudaStreamAttrValue`` (``cudaLaunchAttributeValue``: 64 bytes)."""
    _fields_ = [("accessPolicyWindow", AccessPolicyWindow), ("pad", ctypes.c_char * 64)]


def hit_ratio(set_aside: int, window_bytes: int) -> float:
    """The share of a window's lines to mark persisting: as many as the set-aside holds, all when they fit (more
    would have the window's persisting lines evict each other)."""
    return min(1.0, set_aside / window_bytes) if window_bytes else 0.0


@functools.cache
def _runtime() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (found in this process's memory map), else the system's."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                return ctypes.CDLL(line.split()[-1])
    name = ctypes.util.find_library("cudart")
    if name is None:
        raise RuntimeError("l2_window: no CUDA runtime library (libcudart.so) is loaded or installed")
    return ctypes.CDLL(name)


def _call(what: str, err: int) -> None:
    if err != 0:
        raise RuntimeError(f"l2_window: {what} failed with cudaError {err}")


@functools.cache
def _limits(device: int) -> tuple[int, int]:
    """(set-aside bytes, largest window) of ``device``, the set-aside raised to its maximum on first use (0: the
    device has none, e.g. before Ampere or under MIG)."""
    rt = _runtime()
    rt.cudaDeviceSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
    values = []
    with torch.cuda.device(device):
        for attr in (_ATTR_MAX_PERSISTING_L2_CACHE_SIZE, _ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE):
            value = ctypes.c_int()
            _call(f"cudaDeviceGetAttribute({attr})", rt.cudaDeviceGetAttribute(ctypes.byref(value), attr, device))
            values.append(value.value)
        if values[0] > 0:
            _call("cudaDeviceSetLimit(persisting L2)",
                  rt.cudaDeviceSetLimit(_LIMIT_PERSISTING_L2_CACHE_SIZE, values[0]))
            set_aside = ctypes.c_size_t()
            _call("cudaDeviceGetLimit(persisting L2)",
                  rt.cudaDeviceGetLimit(ctypes.byref(set_aside), _LIMIT_PERSISTING_L2_CACHE_SIZE))
            values[0] = set_aside.value
    return values[0], values[1]


def _set_window(stream: torch.cuda.Stream, tensor: Optional[torch.Tensor], set_aside: int, max_window: int) -> None:
    """``stream``'s window over ``tensor`` (hits persisting, the rest normal), or none when ``tensor`` is None."""
    value = StreamAttrValue()
    if tensor is not None:
        window = value.accessPolicyWindow
        window.base_ptr = tensor.data_ptr()
        window.num_bytes = min(tensor.numel() * tensor.element_size(), max_window)
        window.hitRatio = hit_ratio(set_aside, window.num_bytes)
        window.hitProp, window.missProp = _PERSISTING, _NORMAL
    err = _runtime().cudaStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), _STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW,
                                            ctypes.byref(value))
    _call("cudaStreamSetAttribute(access-policy window)", err)


def reset() -> None:
    """Every persisting line back to normal, when the host calls it (not in stream order: call it on an idle
    device). Without it a window's lines outlive it, and a run without the window that follows one is not one."""
    _call("cudaCtxResetPersistingL2Cache", _runtime().cudaCtxResetPersistingL2Cache())


@contextlib.contextmanager
def persisting(tensor: Optional[torch.Tensor]):
    """Kernels launched inside the block keep (part of) ``tensor`` in L2's set-aside; a no-op for None, a CPU
    tensor, a device without a set-aside, or with ``ENABLED`` off."""
    if not ENABLED or tensor is None or not tensor.is_cuda or tensor.numel() == 0:
        yield
        return
    set_aside, max_window = _limits(tensor.device.index)
    if set_aside == 0:
        yield
        return
    stream = torch.cuda.current_stream(tensor.device)
    _set_window(stream, tensor, set_aside, max_window)
    try:
        yield
    finally:
        _set_window(stream, None, set_aside, max_window)
