"""Rotary position embedding on the last ``rope_head_dim`` dims, adjacent element pairs rotated together.

Compressed layers use ``compress_rope_theta`` with YaRN frequency interpolation (DeepSeek's formula: frequencies
below the slow correction dim are divided by ``rope_factor``, above the fast one kept, linearly blended between;
``original_seq_len: 0`` turns it off); window-only layers use plain ``rope_theta``.
"""
import math

import torch
from torch import nn

import kernels

from model.config import ModelArgs


def _correction_dim(rotations: float, dim: int, base: float, max_seq_len: int) -> float:
    """Rotary dim index whose wavelength fits ``rotations`` times into ``max_seq_len``."""
    return dim * math.log(max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_frequencies(dim: int, base: float, yarn: ModelArgs | None = None) -> torch.Tensor:
    """Plain RoPE frequencies, YaRN-interpolated when ``yarn`` is given with ``original_seq_len > 0`` (0 means
    no YaRN, as in the reference config)."""
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if yarn is not None and yarn.original_seq_len > 0:
        low = max(math.floor(_correction_dim(yarn.beta_fast, dim, base, yarn.original_seq_len)), 0)
        high = min(math.ceil(_correction_dim(yarn.beta_slow, dim, base, yarn.original_seq_len)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / yarn.rope_factor * ramp + freqs * (1 - ramp)
    return freqs


class Rotary(nn.Module):
    """Rotates the last ``dim`` features of a tensor by doc-relative positions (forward or inverse).

    Each adjacent pair is a complex number multiplied by ``e^(i pos freq)`` (``kernels``' ``rope``: one launch
    per call with Triton), with the rotation made once per forward and set of positions and kept in the
    geometry's ``rotations``, shared by every layer with the same frequencies. Angles are formed in float64 (an
    fp32 ``pos * freq`` is off by ~4e-3 rad at position 65,536). The frequencies are a per-device cache, not a
    buffer, so that casting the model to bf16 cannot round them."""

    def __init__(self, dim: int, base: float, yarn: ModelArgs | None = None, kernel_backend: str = "auto"):
        super().__init__()
        self.dim, self.kernel_backend = dim, kernel_backend
        self.key = (dim, base) + ((yarn.rope_factor, yarn.beta_fast, yarn.beta_slow, yarn.original_seq_len)
                                  if yarn is not None else ())
        self._freqs = {torch.device("cpu"): rope_frequencies(dim, base, yarn)}

    @classmethod
    def for_layer(cls, args: ModelArgs, compressed: bool) -> "Rotary":
        """Compressed layers (any mode) rotate with compress_rope_theta and YaRN, window-only layers without."""
        if compressed:
            return cls(args.rope_head_dim, args.compress_rope_theta, args, args.kernel_backend)
        return cls(args.rope_head_dim, args.rope_theta, kernel_backend=args.kernel_backend)

    def _freqs_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._freqs:
            self._freqs[device] = self._freqs[torch.device("cpu")].to(device)
        return self._freqs[device]

    def rotation(self, where, dtype: torch.dtype, inverse: bool = False) -> torch.Tensor:
        """``e^(+-i pos freq)`` [B,N,dim/2] in ``dtype``'s complex type for the positions ``where.pos``, made once
        per ``where`` (a TokenGeometry or EntryGeometry) and kept in its ``rotations``."""
        key = (self.key, dtype, inverse)
        if key not in where.rotations:
            angle = where.pos.unsqueeze(-1).double() * self._freqs_on(where.pos.device)
            rotation = torch.polar(torch.ones_like(angle), -angle if inverse else angle)
            where.rotations[key] = rotation.to(dtype.to_complex())
        return where.rotations[key]

    def forward(self, x: torch.Tensor, where, inverse: bool = False, out_dtype: torch.dtype | None = None):
        """x [B,N,(H,)D] -> x with its last ``dim`` features rotated by the positions of ``where`` (or back), in
        ``out_dtype`` (default x's)."""
        rotation = self.rotation(where, torch.promote_types(x.dtype, torch.float32), inverse)
        return kernels.ops(self.kernel_backend, x.device).rope(x, rotation, self.dim, out_dtype)
