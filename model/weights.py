"""Projection weights in the dtype their matmuls run in, cast together: one launch per layer under autocast.

bf16 autocast casts each fp32 master weight on its own before its matmul (a launch per weight and forward);
``matmul_weights`` casts a layer's weights in one launch (``kernels``' ``cast``) and the matmuls then take them as
they are. Outside autocast, or for weights that are not fp32 (autocast leaves those alone), they pass through
(stacked ones copied together). Layers that read the same input are stacked into one operand: one GEMM, one
launch (and one cuBLAS workspace memset) fewer per stack. ``cast_stacked`` does the same for raw tensors in a
given dtype: the routed experts' stacks, ``[E, rows, cols]``, stacked expert by expert.

A frozen base kept in the released FP8/FP4 form (``model/quantized_base.py``) comes out of both as
``QuantizedRows``, which ``linear`` and ``grouped_linear`` multiply on its stored bytes; a plain operand goes to
``F.linear`` / ``F.grouped_mm``.
"""
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from model.quantized_base import QuantizedMatrix, QuantizedRows


def matmul_weights(layers: list[nn.Linear | tuple[nn.Linear, ...]], kernel_backend: str) -> list[torch.Tensor]:
    """One matmul operand per item: a layer's weight, or for a tuple of layers that read the same input their
    weights stacked by rows, so that one GEMM computes all their outputs (split by columns after it)."""
    groups = [list(item) if isinstance(item, tuple) else [item] for item in layers]
    weights = [[layer.weight for layer in group] for group in groups]
    if _quantized(weights):
        return [QuantizedRows(group) for group in weights]
    device = weights[0][0].device
    if not torch.is_autocast_enabled(device.type) or any(w.dtype != torch.float32 for g in weights for w in g):
        return [kernels.reference.stack_rows(group) for group in weights]
    return cast_stacked(weights, torch.get_autocast_dtype(device.type), kernel_backend)


def cast_stacked(groups: list[list[torch.Tensor]], dtype: torch.dtype, kernel_backend: str) -> list[torch.Tensor]:
    """Each group's tensors in ``dtype``, stacked by rows (``kernels.reference.stack_rows``): fp32 masters cast down
    in one launch (the copy that stacks them is the cast); any other tensor cast (if it must be) on its own."""
    if _quantized(groups):
        return [QuantizedRows(group) for group in groups]
    tensors = [t for group in groups for t in group]
    if dtype == torch.float32 or any(t.dtype != torch.float32 for t in tensors):
        return kernels.reference.cast(groups, dtype)
    return kernels.ops(kernel_backend, tensors[0].device).cast(groups, dtype)


def _quantized(groups) -> bool:
    return any(isinstance(w, QuantizedMatrix) for group in groups for w in group)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedRows) -> torch.Tensor:
    """``x weightᵀ`` of a ``matmul_weights`` operand."""
    return weight.linear(x) if isinstance(weight, QuantizedRows) else F.linear(x, weight)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor | QuantizedRows, counts: torch.Tensor) -> torch.Tensor:
    """The rows of expert e (sorted by expert, ``counts[e]`` of them) times ``weight[e]ᵀ``, for every e at once: a
    ``cast_stacked`` operand ``[E, out, in]``."""
    if isinstance(weight, QuantizedRows):
        return weight.linear(rows, counts)
    return F.grouped_mm(rows, weight.transpose(-2, -1), offs=counts.cumsum(0, dtype=torch.int32))
