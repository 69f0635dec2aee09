"""Projection weights in the dtype their matmuls run in, cast together: one launch per layer under autocast.

bf16 autocast casts each fp32 master weight on its own before its matmul (a launch per weight and forward);
``matmul_weights`` casts a layer's weights in one launch (``kernels``' ``cast``) and the matmuls then take them as
they are. Outside autocast, or for weights that are not fp32 (autocast leaves those alone), they pass through.
"""
import torch
from torch import nn

import kernels


def matmul_weights(layers: list[nn.Linear], kernel_backend: str) -> list[torch.Tensor]:
    weights = [layer.weight for layer in layers]
    device = weights[0].device
    if not torch.is_autocast_enabled(device.type) or any(w.dtype != torch.float32 for w in weights):
        return weights
    return kernels.ops(kernel_backend, device).cast(weights, torch.get_autocast_dtype(device.type))
