"""Activation recomputation of whole layers (``parallel.recompute``), wrapped around a block's ``compute``.

A recomputed layer runs as a non-reentrant checkpoint: its shared inputs are explicit arguments (``LayerInputs``),
so the recomputation in the backward sees the same tensors even after the forward's state has dropped them. The
checkpoint is selective (``kernels.checkpoint_contexts``): the indexer's selection is saved, and with
``keep_attention`` the sparse-attention op's outputs too; the rest of the layer is recomputed, without the selected
mass (only the forward reads it). With ``offload`` the checkpoint holds the input as a ``HostCopy``
(``model/offload.py``), which the recomputation reads back. Recomputing changes no value: the loss and every
gradient are bitwise those of the plain layer.
"""
from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint

import kernels
from model.offload import HostCopy
from model.state import LayerInputs


class Recomputed:
    """A block's ``compute`` as a checkpoint (a plain callable, not a module: the block's parameter names stay)."""

    def __init__(self, compute, keep_attention: bool, offload: bool):
        self.compute, self.keep_attention, self.offload = compute, keep_attention, offload

    def __call__(self, x, pre, inputs: LayerInputs):
        run, first = self.compute, x
        if self.offload:
            run, first = self._compute_from_host, inputs.host_stash.keep(x)
        contexts = partial(kernels.checkpoint_contexts, self.keep_attention)
        x, pre, produced = checkpoint(run, first, pre, inputs, use_reentrant=False, context_fn=contexts)
        if self.offload:
            first.release(x)
        return x, pre, produced

    def _compute_from_host(self, held: HostCopy, pre, inputs: LayerInputs):
        return self.compute(held.tensor(), pre, inputs)


def recompute(block: nn.Module, keep_attention: bool = False, offload: bool = False) -> None:
    """Make ``block`` (a ``model.transformer.Block``) recompute its layer in the backward: ``keep_attention``
    keeps its sparse-attention outputs, ``offload`` parks its input in host memory until then. Replaces an earlier
    recomputation of the block."""
    run_plainly(block)
    block.compute = Recomputed(block.compute, keep_attention, offload)


def run_plainly(block: nn.Module) -> None:
    """Undo ``recompute``: ``block`` keeps its activations for the backward again."""
    wrapper = recomputation(block)
    if wrapper is not None:
        del block.compute
        if wrapper.compute != block.compute:  # something else wrapped it before the recomputation: keep that
            block.compute = wrapper.compute


def recomputation(block: nn.Module) -> Recomputed | None:
    """The recomputation wrapped around ``block``, None when it runs plainly."""
    wrapper = vars(block).get("compute")
    return wrapper if isinstance(wrapper, Recomputed) else None


def recompute_leading(blocks, layers: int, keep_attention_layers: int = 0, offload: bool = False) -> None:
    """Recompute the first ``layers`` of ``blocks``, the first ``keep_attention_layers`` of those keeping their
    attention outputs (``parallel.recompute_layers``, ``parallel.keep_attention_layers``)."""
    for i, block in enumerate(list(blocks)[:layers]):
        recompute(block, i < keep_attention_layers, offload)
