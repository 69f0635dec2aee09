"""A LoRA stage built without its full-precision base (``train.lora.quantized_base``): the frozen matrices and tables
the release stores quantised never exist in bf16 or fp32, not even while the model is built or loaded.

Why it is built this way:
- The stack is built as always (``Transformer``), but every tensor ``torch.empty`` makes while it is built goes to the
  meta device (``EmptyOnMeta``). An empty tensor holds no value until the initial draw (``init_parameters``) writes
  one, so nothing is lost by not allocating it: every matrix, stack, table and embedding is born empty, while the
  tensors born with a value (norms' ones, sinks' zeros, the routing biases, the Engram hashes' constants) are made
  where they belong as before. No list of module classes is kept here: what is deferred is what has no value yet.
- ``hold_base`` then replaces the frozen base targets by their quantised modules, with empty buffers on the device
  (``stored_slots``: a released source copies the stored bytes in); the other empty tensors are allocated, and the
  stage is drawn by name as ``Transformer`` draws itself, so it is the ordinary build's but for the base.
- ``torch.empty`` is the one constructor ``nn.Linear``, ``nn.Embedding`` and the model's own stacks and tables use
  for their weights; a buffer born empty would be left on meta with no value, and is an error.
"""
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from model.config import ModelArgs
from model.layout import Layout
from model.quantized_base import QuantizedMatrix, QuantizedTable, hold_base
from model.transformer import Transformer, init_parameters


class EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` makes meta tensors (any device asked for, or the ambient one, is overridden)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def quantized_transformer(formats, args: ModelArgs, layout: Layout, layer_ids: range | None = None, seed: int = 0,
                          **kwargs) -> Transformer:
    """``Transformer(args, layout, layer_ids, seed, **kwargs)`` (its seeded draws included), frozen, with the base
    targets that ``formats`` gives a quantised form (``model.quantized_base.base_targets``) held as ``hold_base``
    makes them, their buffers to be filled; built on the ambient default device."""
    device = torch.get_default_device()
    with EmptyOnMeta():
        model = Transformer(args, layout, layer_ids, seed, init=False, **kwargs)
    model.requires_grad_(False)  # the base of a LoRA run (model/lora.py's attach freezes it all the same)
    hold_base(model, formats, args.kernel_backend, device)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), False))
    held = {id(t) for m in model.modules() if isinstance(m, (QuantizedMatrix, QuantizedTable)) for t in m.buffers()}
    init_parameters([(n, t) for n, t in model.state_dict(keep_vars=True).items() if id(t) not in held], args,
                    layout.n_layers, seed, model.row_shards())  # as Transformer draws them, by name
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"built without its base, the stage still has tensors with no value: {left[:3]}")
    return model
