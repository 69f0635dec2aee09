"""Projection weights in the dtype their matmuls run in, cast together: one launch per layer under autocast.

bf16 autocast casts each fp32 master weight on its own before its matmul (a launch per weight and forward);
``matmul_weights`` casts a layer's weights in one launch (``kernels``' ``cast``) and the matmuls then take them as
they are. Outside autocast, or for weights that are not fp32 (autocast leaves those alone), they pass through
(stacked ones copied together). Layers that read the same input are stacked into one operand: one GEMM, one
launch (and one cuBLAS workspace memset) fewer per stack. ``cast_stacked`` does the same for raw tensors in a
given dtype: the routed experts' stacks, ``[E, rows, cols]``, stacked expert by expert.

A frozen base kept in the released FP8/FP4 form (``model/quantized_base.py``) comes out of both as
``QuantizedRows``, which ``linear``, ``grouped_linear`` and ``grouped_low_rank`` multiply on its stored bytes; a
plain operand goes to ``F.linear`` / ``F.grouped_mm`` / ``GroupedLowRank``. The layer whose product it is finishes it
(``model/projection.py``).
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


def grouped_low_rank(x: torch.Tensor, weight: torch.Tensor | QuantizedRows, rank: int) -> torch.Tensor:
    """The grouped output projection's product ``[G, rank, N]`` of x ``[N, G, K]`` and a ``matmul_weights`` operand
    ``wo_a [G·rank, K]``: group g's rows of x times its own ``rank`` rows of the weight."""
    if isinstance(weight, QuantizedRows):  # a frozen base in the released form (model/quantized_base.py)
        return weight.grouped(x, rank)
    return GroupedLowRank.apply(x, weight, rank)


class GroupedLowRank(torch.autograd.Function):
    """``low^T[g] = wo_a[g] @ x[:, g]^T`` [G, R, N] for x [N, G, K] and wo_a [G*R, K], with a backward that writes
    dx in x's own layout.

    Computed transposed so that both matmuls of the projection read their operands in place (strided views a GEMM
    takes as they are). Autograd's backward of the same batched matmul returns dx as [G, K, N] permuted back, i.e.
    tokens fastest, and the consumers (RoPE, the attention backward) need tokens slowest: a transposing copy of the
    whole attention output's gradient (4.3 GB at 64K, 15 ms a layer on an H200). Here each group's dx is one GEMM
    writing its [N, K] slice of a [N, G, K] buffer (a GEMM output with a leading dimension of G*K)."""

    @staticmethod
    def forward(ctx, x, wo_a, rank: int):
        N, G, K = x.shape
        ctx.save_for_backward(x, wo_a)
        return torch.matmul(wo_a.view(G, rank, K), x.permute(1, 2, 0))

    @staticmethod
    def backward(ctx, grad_low_t):
        x, wo_a = ctx.saved_tensors
        N, G, K = x.shape
        dtype = grad_low_t.dtype  # the matmul's (autocast may have run it in another dtype than x's or wo_a's)
        w = wo_a.view(G, -1, K).to(dtype)
        dx = x.new_empty(x.shape, dtype=dtype)
        for g in range(G):
            torch.mm(grad_low_t[g].t(), w[g], out=dx[:, g])
        if not ctx.needs_input_grad[1]:  # a frozen wo_a (LoRA): no weight gradient to compute
            return dx.to(x.dtype), None, None
        dw = torch.matmul(grad_low_t, x.to(dtype).permute(1, 0, 2))
        return dx.to(x.dtype), dw.view(wo_a.shape).to(wo_a.dtype), None
