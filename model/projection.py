"""A bias-free projection ``x Wᵀ`` whose product its block may compute elsewhere and hand back to ``finish``.

Why it is built this way:
- A block multiplies the layers that read one input in one GEMM of their stacked weights (``model/weights.py``:
  wq_a over wkv, w1 over w3) and the grouped output projection by its own product; each layer then only finishes
  what was computed for it. ``finish`` is the identity here, so a plain model pays nothing for it.
- A converter applied to the built model (LoRA's ``attach``, ``model/lora.py``) gives a layer a class whose
  ``finish`` adds the layer's own term (its adapter's update), so the block's forward is one text with and without
  it. ``rebased`` hands such a term on to a layer that replaces this one (``quantize_base``'s frozen FP8 form).
"""
import torch
from torch import nn


class Projection:
    """The protocol of a projection layer (a mixin in front of ``nn.Linear`` or ``QuantizedLinear``)."""

    adds_term = False  # whether finish changes the product (a converter's class sets it)

    def finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """This layer's output from ``y``, the product of its weight with ``x`` (computed by the block)."""
        return y

    def rebased(self, replacement: nn.Module) -> nn.Module:
        """``replacement`` (a new form of this layer's weight) carrying what a converter added to this layer."""
        return replacement


class Linear(Projection, nn.Linear):
    """``nn.Linear`` without bias, finished by ``Projection``'s protocol."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__(dim_in, dim_out, bias=False)


def finish_parts(layers: tuple, y: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of ``layers`` that read ``x``, from ``y`` the product of their weights stacked by rows (one
    GEMM): its column blocks, each finished by its layer."""
    parts = y.split([layer.weight.shape[-2] for layer in layers], dim=-1)
    return [layer.finish(part, x) for layer, part in zip(layers, parts)]


def finish_stacked(layers: tuple, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``finish_parts`` joined by columns again: ``y`` itself (no copy) when no layer adds a term."""
    if not any(layer.adds_term for layer in layers):
        return y
    return torch.cat(finish_parts(layers, y, x), dim=-1)
