"""RMSNorm computed in fp32 whatever the activation dtype (the V4.1 config's epsilon is 1e-20)."""
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(dtype), self.weight.shape, self.weight.to(dtype), self.eps).to(x.dtype)
