"""Rotary position embedding on the last ``rope_head_dim`` dims, adjacent element pairs rotated together.

Compressed layers use ``compress_rope_theta`` with YaRN frequency interpolation (DeepSeek's formula: frequencies
below the slow correction dim are divided by ``rope_factor``, above the fast one kept, linearly blended between);
window-only layers use plain ``rope_theta``.
"""
import math

import torch
from torch import nn

from model.config import ModelArgs


def _correction_dim(rotations: float, dim: int, base: float, max_seq_len: int) -> float:
    """Rotary dim index whose wavelength fits ``rotations`` times into ``max_seq_len``."""
    return dim * math.log(max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_frequencies(dim: int, base: float, yarn: ModelArgs | None = None) -> torch.Tensor:
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if yarn is not None:
        low = max(math.floor(_correction_dim(yarn.beta_fast, dim, base, yarn.original_seq_len)), 0)
        high = min(math.ceil(_correction_dim(yarn.beta_slow, dim, base, yarn.original_seq_len)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / yarn.rope_factor * ramp + freqs * (1 - ramp)
    return freqs


class Rotary(nn.Module):
    """Rotates the last ``dim`` features of a tensor by doc-relative positions (forward or inverse).

    Angles are formed in float64 (an fp32 ``pos * freq`` is off by ~4e-3 rad at position 65,536). The
    frequencies are a per-device cache, not a buffer, so that casting the model to bf16 cannot round them."""

    def __init__(self, dim: int, base: float, yarn: ModelArgs | None = None):
        super().__init__()
        self.dim = dim
        self._freqs = {torch.device("cpu"): rope_frequencies(dim, base, yarn)}

    @classmethod
    def for_layer(cls, args: ModelArgs, compressed: bool) -> "Rotary":
        """Compressed layers (any mode) rotate with compress_rope_theta and YaRN, window-only layers without."""
        if compressed:
            return cls(args.rope_head_dim, args.compress_rope_theta, args)
        return cls(args.rope_head_dim, args.rope_theta)

    def _freqs_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._freqs:
            self._freqs[device] = self._freqs[torch.device("cpu")].to(device)
        return self._freqs[device]

    def forward(self, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [B,N,(H,)D], pos [B,N] -> x with its last ``dim`` features rotated by ``pos`` (or ``-pos``)."""
        angle = pos.unsqueeze(-1).double() * self._freqs_on(pos.device)
        if inverse:
            angle = -angle
        if x.dim() == 4:
            angle = angle.unsqueeze(2)
        compute = torch.promote_types(x.dtype, torch.float32)
        cos, sin = angle.cos().to(compute), angle.sin().to(compute)
        rest, tail = x[..., : -self.dim], x[..., -self.dim:].to(compute)
        even, odd = tail[..., 0::2], tail[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
        return torch.cat([rest, rotated.to(x.dtype)], dim=-1)
