"""Dense causal multi-head attention: the baseline CSA2 is measured against (``model.attention=dense``).

Same interface as ``model.attention.Attention`` (a pure function of x and the geometry, nothing shared), so the
stack, the trainer and the pipeline run it unchanged on a layout without shared state (``layout=window_only``).
Heads: ``n_heads`` of ``dense_head_dim`` (64 x 128 at V4.1 width), one fused QKV projection, RoPE on the last
``rope_head_dim`` dims of q and k (``rope_theta``, like a window-only layer), output ``n_heads*dense_head_dim ->
dim``. Attention never crosses a document of a packed row (SPEC §4): a row holding one document runs plain causal
SDPA (cuDNN on the GPU); a packed row runs FlexAttention with a document-causal block mask on the GPU and SDPA
with the explicit mask on the CPU.
"""
import functools

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelArgs
from model.geometry import Geometry
from model.layout import LayerPlan, LayoutError, Mode
from model.rope import Rotary


class DenseAttention(nn.Module):
    def __init__(self, args: ModelArgs, plan: LayerPlan, candidate_topk_blocks: int = 0, candidate_block_size: int = 0):
        super().__init__()
        if plan.mode is not Mode.WINDOW:
            raise LayoutError(f"layer {plan.layer_id}: model.attention=dense needs a layout without compressed "
                              f"layers (every layer attends densely); use layout=window_only")
        self.plan, self.args = plan, args
        self.heads, self.head_dim = args.n_heads, args.dense_head_dim
        self.wqkv = nn.Linear(args.dim, 3 * self.heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, args.dim, bias=False)
        self.rotary = Rotary.for_layer(args, compressed=False)

    def forward(self, x: torch.Tensor, geometry: Geometry, reads: dict):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)
        q, k = (self.rotary(t, geometry.tokens) for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B,H,T,Dh]
        out = document_causal_attention(q, k, v, geometry)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1)), {}


def document_causal_attention(q, k, v, geometry: Geometry) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over the earlier tokens of each query's own document."""
    if geometry.single_document:
        if q.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                              SDPBackend.EFFICIENT_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.is_cuda:
        return _flex_attention()(q, k, v, block_mask=_document_block_mask(geometry))
    doc, T = geometry.doc_ids, q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    mask = (doc.unsqueeze(2) == doc.unsqueeze(1)) & causal  # [B,T,T]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))


def _document_block_mask(geometry: Geometry):
    """FlexAttention's block mask of a packed batch, made once per forward and kept in the geometry."""
    if "dense_block_mask" not in geometry.cache:
        from torch.nn.attention.flex_attention import create_block_mask

        doc = geometry.doc_ids
        B, T = doc.shape

        def document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

        geometry.cache["dense_block_mask"] = create_block_mask(document_causal, B, None, T, T, device=doc.device)
    return geometry.cache["dense_block_mask"]


@functools.cache
def _flex_attention():
    """FlexAttention compiled once per process (uncompiled, it materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
