"""Evaluation-only diagnostics of the sparse selection (no gradients, dense: use at evaluation lengths).

They are applied to a built model from outside, as wrappers of a layer's ``attend`` step (``recording_index_recall``)
for the forwards of an evaluation, so that the attention's own forward holds its formula and nothing else.
"""
import contextlib

import torch
from torch import nn

from model.attention import Attention
from model.layout import Mode

RECALL_CHUNK_BYTES = 1 << 30  # fp32 dense scores of one chunk of queries: memory stays linear in T


@torch.no_grad()
def index_recall(q, kv_comp, vis_lo, vis_hi, topk_idx, scale: float) -> torch.Tensor:
    """Share of the selected entries that are also among the top-k of the layer's own dense attention.

    The dense attention is this layer's query against every visible compressed entry, summed over heads; k is
    the selection's width. Averaged over the queries that have a selection. Queries run in chunks whose
    [B, chunk, H, S] scores fit ``RECALL_CHUNK_BYTES`` (a 16K row of 64 heads would need 64 GB at once)."""
    B, T, H, _ = q.shape
    rows = max(1, RECALL_CHUNK_BYTES // (4 * B * H * max(kv_comp.shape[1], 1)))
    per_query, has = zip(*(_recall_of_queries(q[:, i:i + rows], kv_comp, vis_lo[:, i:i + rows],
                                              vis_hi[:, i:i + rows], topk_idx[:, i:i + rows], scale)
                           for i in range(0, T, rows)))
    per_query, has = torch.cat(per_query, 1), torch.cat(has, 1)
    return per_query[has].mean() if has.any() else per_query.new_tensor(float("nan"))


def _recall_of_queries(q, kv_comp, vis_lo, vis_hi, topk_idx, scale: float):
    """(recall per query, whether the query has a selection) for a chunk of queries [B, rows, ...]."""
    S, K = kv_comp.shape[1], topk_idx.shape[-1]
    s = torch.arange(S, device=q.device)
    visible = (s >= vis_lo.unsqueeze(-1)) & (s < vis_hi.unsqueeze(-1))  # [B,rows,S]
    scores = torch.einsum("bthd,bsd->bths", q.float(), kv_comp.float()) * scale
    probs = scores.masked_fill(~visible.unsqueeze(2), float("-inf")).softmax(-1).nan_to_num(0.0).sum(2)
    probs = probs.masked_fill(~visible, -1.0)
    dense_top = probs.topk(min(K, S), dim=-1).indices  # [B,rows,K]
    dense_set = torch.zeros_like(visible).scatter_(-1, dense_top, True) & visible
    selected = topk_idx >= 0
    hit = dense_set.gather(-1, topk_idx.clamp(min=0)) & selected
    return hit.sum(-1).float() / selected.sum(-1).clamp(min=1), selected.any(-1)


class RecallProbe:
    """A sparse attention layer's ``attend`` that also records the layer's ``index_recall`` (under its layer id in
    ``recall``): its RoPE'd queries against the compressed entries it read, through the selection it read them by."""

    def __init__(self, attention: Attention, recall: dict[int, torch.Tensor]):
        self.attention, self.attend, self.recall = attention, attention.attend, recall

    def __call__(self, q, kv_window, kv_comp, topk, geometry):
        result = self.attend(q, kv_window, kv_comp, topk, geometry)
        layer = self.attention
        entries = geometry.entries(layer.plan.ratio)
        self.recall[layer.plan.layer_id] = index_recall(layer.rotary(q, geometry.tokens), kv_comp, entries.vis_lo,
                                                        entries.vis_hi, topk, layer.args.head_dim ** -0.5)
        return result


@contextlib.contextmanager
def recording_index_recall(model: nn.Module):
    """Within it, every forward of ``model`` records each layer that reads a selection (every layer but the
    window-only ones) into the yielded dict, layer id -> recall, the latest forward's value."""
    recall: dict[int, torch.Tensor] = {}
    layers = [m for m in model.modules() if isinstance(m, Attention) and m.plan.mode is not Mode.WINDOW]
    for layer in layers:
        layer.attend = RecallProbe(layer, recall)
    try:
        yield recall
    finally:
        for layer in layers:
            del layer.attend
