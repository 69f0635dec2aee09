"""Triton implementations of the CSA2 hot ops, with the signatures of ``kernels.reference``.

``sparse_attention`` (forward + backward), ``indexer_select`` (chunked scoring + top-k + candidate blocks,
no grad), ``index_logits``, ``rope``, ``rms_norm`` (optionally with RoPE), ``cast``, ``swiglu`` (optionally clamped
and weighted), the MoE's ``permute_rows`` and ``unpermute_rows``, and the hyper-connected stream's ``hc_pre``,
``hc_post`` and ``hc_collapse`` (all forward + backward).
Design notes and measured speed: docs/KERNELS.md.
"""
from typing import Optional

import torch

from kernels.op_names import INDEXER_SELECT_OP
from kernels import triton_indexer
from kernels.triton_attention import sparse_attention
from kernels.triton_cast import cast
from kernels.triton_hyper import hc_collapse, hc_post, hc_pre
from kernels.triton_indexer import index_logits
from kernels.triton_moe import permute_rows, unpermute_rows
from kernels.triton_norm import rms_norm
from kernels.triton_rope import rope
from kernels.triton_swiglu import swiglu

__all__ = ["sparse_attention", "indexer_select", "index_logits", "rope", "rms_norm", "cast", "swiglu", "permute_rows",
           "unpermute_rows", "hc_pre", "hc_post", "hc_collapse"]


@torch.library.custom_op(INDEXER_SELECT_OP, mutates_args=())
def _indexer_select(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, vis_lo: torch.Tensor, vis_hi: torch.Tensor,
                    topk: int, cand_blocks: Optional[torch.Tensor], block_size: int,
                    keep_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dispatcher-visible op, so that a recomputed layer's checkpoint can save the selection (its integer outputs
    are small) instead of scoring every entry again (``kernels.checkpoint_policy``). No candidate blocks come back
    as a [B,T,0] tensor (an op returns tensors)."""
    topk_idx, blocks = triton_indexer.indexer_select(q, w, k, vis_lo, vis_hi, topk, cand_blocks, block_size,
                                                     keep_blocks)
    return topk_idx, blocks if blocks is not None else topk_idx.new_empty((*topk_idx.shape[:2], 0))


@_indexer_select.register_fake
def _(q, w, k, vis_lo, vis_hi, topk, cand_blocks, block_size, keep_blocks):
    B, T = q.shape[:2]
    return q.new_empty((B, T, topk), dtype=torch.long), q.new_empty((B, T, keep_blocks), dtype=torch.long)


def indexer_select(q, w, k, vis_lo, vis_hi, topk: int, cand_blocks=None, block_size: int = 8, keep_blocks: int = 0):
    """``kernels.reference.indexer_select``'s contract through the custom op."""
    topk_idx, blocks = _indexer_select(q, w, k, vis_lo, vis_hi, topk, cand_blocks, block_size, keep_blocks)
    return topk_idx, blocks if keep_blocks else None
