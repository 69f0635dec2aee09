"""CSA2 hot ops with one interface and two implementations: Triton (GPU) and the PyTorch reference.

``ops(backend, device)`` returns the module implementing ``sparse_attention``, ``indexer_select``,
``index_logits``, ``rope``, ``rms_norm`` and ``cast`` (signatures in docs/DESIGN.md). ``auto`` picks Triton on CUDA devices, the
reference elsewhere.
"""
from types import ModuleType

import torch
from torch.utils.checkpoint import CheckpointPolicy

from kernels import reference

BACKENDS = ("auto", "torch", "triton")
# The Triton sparse attention is this torch custom op (kernels/triton_attention.py): a dispatcher-visible op, so a
# selective checkpoint can keep its outputs.
SPARSE_ATTENTION_OP = "csa2::sparse_attention"


def keep_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the sparse
    attention op's outputs (out, LSE, selected mass) are saved by the forward, everything else is recomputed, so
    the backward of a checkpointed layer does not re-run attention. The PyTorch reference path has no such op
    and is recomputed whole: same gradients, no saving."""
    return CheckpointPolicy.MUST_SAVE if op.name() == SPARSE_ATTENTION_OP else CheckpointPolicy.PREFER_RECOMPUTE


def ops(backend: str, device: torch.device) -> ModuleType:
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is not one of {BACKENDS}")
    if backend == "torch" or (backend == "auto" and torch.device(device).type != "cuda"):
        return reference
    from kernels import triton_ops  # imported lazily: Triton is only needed where it runs

    return triton_ops
