"""Triton implementations of the CSA2 hot ops, with the signatures of ``kernels.reference``.

``sparse_attention`` (forward + backward), ``indexer_select`` (chunked scoring + top-k + candidate blocks,
no grad), ``index_logits``, ``rope``, ``rms_norm`` (optionally with RoPE) and ``cast`` (all forward + backward).
Design notes and measured speed: docs/KERNELS.md.
"""
from kernels.triton_attention import sparse_attention
from kernels.triton_cast import cast
from kernels.triton_indexer import index_logits, indexer_select
from kernels.triton_norm import rms_norm
from kernels.triton_rope import rope

__all__ = ["sparse_attention", "indexer_select", "index_logits", "rope", "rms_norm", "cast"]
