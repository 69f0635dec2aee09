"""The PyTorch reference's attention and indexer ops, one block of queries at a time (``bench/context_check.py``'s
yardstick at rows of 16K-64K tokens).

``kernels/reference.py`` writes each op as the formula over the whole row: at 16K its sparse attention gathers
``T x (window + top-k) x D`` key rows (20 GiB) and the indexer scores ``T x S x heads`` (32 GiB in fp32), and autograd
keeps them for the backward. Every one of these ops is per query: query ``t``'s outputs read only its own
operands and the shared rows (window KV, compressed entries, indexer keys). So the same formula run on queries
``[a, b)`` at a time gives the same values with one block's intermediates alive: ``by_query_blocks`` swaps the
three ops of ``kernels.reference`` for blocked ones (the rest of the reference is per token already). The
differentiable two keep only their inputs for the backward and recompute each block's graph there
(``_ByQueryBlocks``), in the autocast state of the forward. Nothing here comes from the Triton kernels or from the
context-parallel code under check: the window of a block is the reference's own slot list with global positions.
"""
import contextlib
from functools import partial

import torch

from kernels import reference

_INDEXER_SELECT, _INDEX_LOGITS = reference.indexer_select, reference.index_logits  # before by_query_blocks swaps them


class _ByQueryBlocks(torch.autograd.Function):
    """``part(a, b, *inputs)``'s outputs for every block ``[a, b)`` of ``rows`` queries, concatenated along dim 1.
    The first output is differentiable, the others are not. The backward runs each block again with grad and
    back-propagates its slice of the output gradient, so no block's intermediates outlive it."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, part, rows: int, block: int, *inputs):
        ctx.part, ctx.blocks = part, [(a, min(a + block, rows)) for a in range(0, rows, block)]
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            outs = [part(a, b, *inputs) for a, b in ctx.blocks]
        results = tuple(torch.cat(parts, dim=1) for parts in zip(*outs))
        ctx.mark_non_differentiable(*results[1:])
        return results

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad, *_):
        needs = ctx.needs_input_grad[3:]
        leaves = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad():
            for a, b in ctx.blocks:
                torch.autograd.backward(ctx.part(a, b, *leaves)[0], grad[:, a:b])
        return None, None, None, *(t.grad if need else None for t, need in zip(leaves, needs))


def _attention_block(scale: float, window: int, with_mass: bool, a: int, b: int, q, kv_window, win_lo, kv_comp,
                     topk_idx, sink, rotation):
    """``reference.sparse_attention`` of queries [a, b): the whole-row slot list (window positions t, ..., t -
    window + 1, then ``T + `` the selected entries) for those queries, attended in the reference's gathered form."""
    q = q[:, a:b]
    if rotation is not None:
        rope_dim, rotation = 2 * rotation.shape[-1], rotation[:, a:b]
        q = reference.rope(q, rotation, rope_dim)
    positions, valid = reference.window_slots(win_lo[:, a:b] - a, window)
    slots, rows = positions + a, kv_window
    if topk_idx is not None:
        picks = topk_idx[:, a:b]
        slots = torch.cat([slots, kv_window.shape[1] + picks], dim=2)
        valid = torch.cat([valid, picks >= 0], dim=2)
        rows = torch.cat([kv_window, kv_comp], dim=1)
    out, probs = reference._attend_gathered_rows(q, rows, slots, valid, sink, scale)
    if rotation is not None:
        out = reference.rope(out, rotation.conj(), rope_dim)
    return (out, probs[..., window:]) if with_mass else (out,)


def sparse_attention(budget: int, q, kv_window, win_lo, kv_comp, topk_idx, sink, scale: float, window: int,
                     rotation=None, with_mass: bool = True):
    H, D = q.shape[2:]
    slots = window + (0 if topk_idx is None else topk_idx.shape[-1])
    block = _queries(budget, slots * (8 * D + 12 * H))  # fp32 keys and their gradient; scores, probabilities
    part = partial(_attention_block, scale, window, with_mass and topk_idx is not None)
    out = _ByQueryBlocks.apply(part, q.shape[1], block, q, kv_window, win_lo, kv_comp, topk_idx, sink, rotation)
    return out[0], (out[1] if len(out) > 1 else None)


def _logits_block(a: int, b: int, q, w, k, topk_idx):
    return (_INDEX_LOGITS(q[:, a:b], w[:, a:b], k, topk_idx[:, a:b]),)


def index_logits(budget: int, q, w, k, topk_idx):
    block = _queries(budget, topk_idx.shape[-1] * (8 * k.shape[-1] + 12 * q.shape[2]))  # keys, grad; dots, ReLU
    return _ByQueryBlocks.apply(_logits_block, q.shape[1], block, q, w, k, topk_idx)[0]


def indexer_select(budget: int, q, w, k, vis_lo, vis_hi, topk: int, cand_blocks=None, block_size: int = 8,
                   keep_blocks: int = 0):
    """No gradient: the blocks' selections, concatenated (the reference breaks ties by index, per query). The
    reference scores every entry for every head (fp32 dots, ReLU, weighted: 12 bytes a head) and matches every
    entry's block against every candidate block (a byte each)."""
    candidates = 0 if cand_blocks is None else cand_blocks.shape[-1]
    block = _queries(budget, k.shape[1] * (12 * q.shape[2] + candidates + 24))
    picks = [_INDEXER_SELECT(q[:, a:a + block], w[:, a:a + block], k, vis_lo[:, a:a + block], vis_hi[:, a:a + block],
                             topk, None if cand_blocks is None else cand_blocks[:, a:a + block], block_size,
                             keep_blocks)
             for a in range(0, q.shape[1], block)]
    topk_idx = torch.cat([p[0] for p in picks], dim=1)
    return topk_idx, (torch.cat([p[1] for p in picks], dim=1) if keep_blocks else None)


def _queries(budget: int, per_query: int) -> int:
    """Queries of a block whose intermediates take about ``budget`` bytes at ``per_query`` bytes each."""
    return max(1, budget // max(1, per_query))


@contextlib.contextmanager
def by_query_blocks(budget: int):
    """Inside, ``kernels.reference``'s sparse attention, indexer selection and indexer logits run as many queries
    at a time as hold about ``budget`` bytes of intermediates (each op's count of bytes a query is an estimate from
    its shapes, within a small factor)."""
    blocked = {"sparse_attention": sparse_attention, "indexer_select": indexer_select, "index_logits": index_logits}
    saved = {name: getattr(reference, name) for name in blocked}
    for name, op in blocked.items():
        setattr(reference, name, partial(op, budget))
    try:
        yield
    finally:
        for name, op in saved.items():
            setattr(reference, name, op)
