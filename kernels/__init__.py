"""CSA2 hot ops with one interface and two implementations: Triton (GPU) and the PyTorch reference.

``ops(backend, device)`` returns the module implementing ``sparse_attention``, ``indexer_select``,
``index_logits`` and ``rope`` (signatures in docs/DESIGN.md). ``auto`` picks Triton on CUDA devices, the
reference elsewhere.
"""
from types import ModuleType

import torch

from kernels import reference

BACKENDS = ("auto", "torch", "triton")


def ops(backend: str, device: torch.device) -> ModuleType:
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is not one of {BACKENDS}")
    if backend == "torch" or (backend == "auto" and torch.device(device).type != "cuda"):
        return reference
    from kernels import triton_ops  # imported lazily: Triton is only needed where it runs

    return triton_ops
