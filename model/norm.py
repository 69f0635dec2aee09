"""RMSNorm computed in fp32 whatever the activation dtype (the V4.1 config's epsilon is 1e-20), optionally
followed by RoPE on its output: one kernel launch with the Triton backend (``kernels``' ``rms_norm``)."""
import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernel_backend: str = "auto"):
        super().__init__()
        self.eps, self.kernel_backend = eps, kernel_backend
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, rotary=None, where=None) -> torch.Tensor:
        """x normalised; with ``rotary`` (a ``model.rope.Rotary``) its last features then rotated by the positions
        of ``where``, rounded to x's dtype once."""
        ops = kernels.ops(self.kernel_backend, x.device)
        if rotary is None:
            return ops.rms_norm(x, self.weight, self.eps)
        rotation = rotary.rotation(where, torch.promote_types(x.dtype, torch.float32))
        return ops.rms_norm(x, self.weight, self.eps, rotation, rotary.dim)
