"""Evaluation-only diagnostics of the sparse selection (no gradients, dense: use at evaluation lengths)."""
import torch


@torch.no_grad()
def index_recall(q, kv_comp, vis_lo, vis_hi, topk_idx, scale: float) -> torch.Tensor:
    """Share of the selected entries that are also among the top-k of the layer's own dense attention.

    The dense attention is this layer's query against every visible compressed entry, summed over heads; k is
    the selection's width. Averaged over the queries that have a selection."""
    S, K = kv_comp.shape[1], topk_idx.shape[-1]
    s = torch.arange(S, device=q.device)
    visible = (s >= vis_lo.unsqueeze(-1)) & (s < vis_hi.unsqueeze(-1))  # [B,T,S]
    scores = torch.einsum("bthd,bsd->bths", q.float(), kv_comp.float()) * scale
    probs = scores.masked_fill(~visible.unsqueeze(2), float("-inf")).softmax(-1).nan_to_num(0.0).sum(2)
    probs = probs.masked_fill(~visible, -1.0)
    dense_top = probs.topk(min(K, S), dim=-1).indices  # [B,T,K]
    dense_set = torch.zeros_like(visible).scatter_(-1, dense_top, True) & visible
    selected = topk_idx >= 0
    hit = dense_set.gather(-1, topk_idx.clamp(min=0)) & selected
    has = selected.any(-1)
    per_query = hit.sum(-1).float() / selected.sum(-1).clamp(min=1)
    return per_query[has].mean() if has.any() else per_query.new_tensor(float("nan"))
