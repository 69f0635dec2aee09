"""Quantisation-aware training (SPEC §6): the attention's served numerics simulated in the forward.

DeepSeek serves V4.1-Flash with three activations quantised, each in blocks along its last dimension:
- the sliding window's KV (after its norm and RoPE): FP8 e4m3, one power-of-two (e8m0) scale per 32 values;
- the compressed KV (after RoPE): FP4 e2m1, one e4m3 scale per 16 values;
- the indexer's queries and keys (after RoPE): FP4 e2m1, one e8m0 scale per 32 values.
``model.qat=true`` rounds each of them to that grid in the forward and lets the gradient through unchanged (the
straight-through estimator), so that fine-tuned weights meet the numerics they are served with.

A converter of the built model, ``simulate_served``: the attention reads each of these activations through an
identity module named for it (``served_window_kv``, ``served_compressed_kv``, ``served_index``), which the
converter replaces by ``Served`` of that kind; the attention's forward does not change, and no state-dict name does.

The scale rules are the served kernels' (the reference inference code's ``act_quant`` and ``fp4_act_quant``), not the
weight codec's (``model/quant.py``, whose rule is chosen to round-trip released weights byte for byte):
``2^⌈log2(amax / qmax)⌉`` for e8m0 (amax at least 1e-4 for FP8, ``6·2^-126`` for FP4), ``amax / 6`` rounded to e4m3
for the compressed KV's scales (amax at least ``6·2^-9``, the smallest e4m3 subnormal times 6); values divided by
the scale, clamped to ``±qmax``, rounded to the nearest code (ties to even) and multiplied back.
"""
import torch
from torch import nn

from model.quant import E2M1_MAX, E4M3_MAX, e2m1_to_float, round_e2m1

# What each simulated activation is served as: (grid, values per scale, scale format).
SERVED = {"window_kv": ("fp8", 32, "e8m0"), "compressed_kv": ("fp4", 16, "e4m3"), "index": ("fp4", 32, "e8m0")}


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def served_values(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x (last dim a multiple of the block) rounded to the grid ``kind`` is served on (``SERVED``), in x's dtype."""
    grid, block, scale_format = SERVED[kind]
    if x.shape[-1] % block:
        raise ValueError(f"model.qat: the {kind.replace('_', ' ')} width {x.shape[-1]} is not a multiple of its "
                         f"quantisation block ({block}); use model.qat=false for this shape")
    blocks = x.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(-1, keepdim=True)
    qmax = E4M3_MAX if grid == "fp8" else E2M1_MAX
    if scale_format == "e4m3":
        scale = (amax.clamp_min(qmax * 2.0 ** -9) / qmax).to(torch.float8_e4m3fn).float()
    else:
        scale = _pow2_ceil(amax.clamp_min(1e-4 if grid == "fp8" else qmax * 2.0 ** -126) / qmax)
    scaled = (blocks / scale).clamp(-qmax, qmax)
    codes = scaled.to(torch.float8_e4m3fn).float() if grid == "fp8" else e2m1_to_float(round_e2m1(scaled))
    return (codes * scale).flatten(-2).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """The served values forward, exactly (``x + (q - x).detach()`` would round), the gradient unchanged back."""

    @staticmethod
    def forward(ctx, x, kind: str):
        return served_values(x, kind)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def simulate(x: torch.Tensor, kind: str, enabled: bool) -> torch.Tensor:
    """``served_values`` in the forward, the identity in the backward (straight through); x itself when off."""
    return _StraightThrough.apply(x, kind) if enabled else x


class Served(nn.Module):
    """An activation as it is served (``simulate``, on): the forward on the served grid, the gradient straight
    through."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return simulate(x, self.kind, True)

    def extra_repr(self) -> str:
        return self.kind


def simulate_served(model: nn.Module) -> int:
    """Replace every ``served_<kind>`` identity of ``model``'s modules by ``Served(kind)``; returns how many."""
    converted = 0
    for module in list(model.modules()):
        for kind in SERVED:
            if isinstance(getattr(module, f"served_{kind}", None), nn.Identity):
                setattr(module, f"served_{kind}", Served(kind))
                converted += 1
    return converted
