"""The CSA2 decoder stack: embedding, pre-norm blocks (CSA2 attention + dense SwiGLU FFN), final norm, LM head."""
import math
from functools import partial
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.attention import Attention, linear
from model.config import ModelArgs
from model.layout import Layout, LayerPlan
from model.norm import RMSNorm
from model.state import SharedState


class FeedForward(nn.Module):
    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1, self.w2, self.w3 = linear(dim, inter_dim), linear(inter_dim, dim), linear(dim, inter_dim)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layout: Layout, plan: LayerPlan):
        super().__init__()
        self.recompute = False  # set by the parallel config (activation checkpointing of this layer)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, plan, layout.candidate_topk_blocks, layout.candidate_block_size)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn = FeedForward(args.dim, args.inter_dim)

    def forward(self, x: torch.Tensor, state: SharedState) -> torch.Tensor:
        """Runs the layer on the forward's shared state. With ``recompute`` the layer is a non-reentrant
        checkpoint: its shared inputs are explicit arguments, so recomputation in backward sees the same tensors
        even after the state has dropped them."""
        plan = self.attn.plan
        run = partial(checkpoint, self._compute, use_reentrant=False) if self.recompute else self._compute
        x, produced = run(x, state.geometry, state.reads(plan), state.collect_recall)
        state.write(plan, produced)
        return x

    def _compute(self, x, geometry, reads, collect_recall):
        attn_out, produced = self.attn(self.attn_norm(x), geometry, reads, collect_recall)
        x = x + attn_out
        return x + self.ffn(self.ffn_norm(x)), produced


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B,T,V] fp32
    indexer_losses: dict[int, torch.Tensor]  # index source layer -> KL of its selection (SPEC §2)
    index_recall: dict[int, torch.Tensor]  # reading layer -> recall vs its dense attention (collect_recall only)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, layout: Layout):
        super().__init__()
        self.args, self.layout = args, layout
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, layout, plan) for plan in layout.plan)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = linear(args.dim, args.vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for matrices; residual-branch outputs scaled by 1/sqrt(2 * n_layers)."""
        std = self.args.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2 or p.is_meta:
                continue
            scale = 1 / math.sqrt(2 * len(self.layers)) if name.endswith(("wo_b.weight", "ffn.w2.weight")) else 1
            nn.init.normal_(p, std=std * scale)

    def new_state(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None,
                  collect_recall: bool = False) -> SharedState:
        if doc_ids is None:
            doc_ids = torch.zeros_like(input_ids)
        return SharedState(self.layout, doc_ids, self.args.window_size, collect_recall)

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                collect_recall: bool = False) -> ModelOutput:
        """Logits and per-source indexer losses; ``collect_recall`` adds each reading layer's index recall."""
        self.check_token_ids(input_ids)
        state = self.new_state(input_ids, doc_ids, collect_recall)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, state)
        return ModelOutput(self.head(self.norm(h)).float(), state.indexer_losses, state.index_recall)

    def check_token_ids(self, input_ids: torch.Tensor) -> None:
        """An out-of-range id would index past the embedding (a device assert on GPU): fail with the id."""
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.args.vocab_size):
            bad = input_ids[(input_ids < 0) | (input_ids >= self.args.vocab_size)][0].item()
            raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {self.args.vocab_size})")
