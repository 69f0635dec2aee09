"""The CSA2 decoder stack: embedding, pre-norm blocks (CSA2 attention + dense SwiGLU FFN), final norm, LM head."""
import math
import zlib
from functools import partial
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import kernels

from model.attention import Attention, linear
from model.config import ModelArgs
from model.dense import DenseAttention
from model.layout import Layout, LayerPlan
from model.norm import RMSNorm
from model.state import SharedState
from model.weights import matmul_weights


class FeedForward(nn.Module):
    def __init__(self, dim: int, inter_dim: int, kernel_backend: str = "auto"):
        super().__init__()
        self.kernel_backend = kernel_backend
        self.w1, self.w2, self.w3 = linear(dim, inter_dim), linear(inter_dim, dim), linear(dim, inter_dim)

    def forward(self, x):
        w13, w2 = matmul_weights([(self.w1, self.w3), self.w2], self.kernel_backend)
        swiglu = kernels.ops(self.kernel_backend, x.device).swiglu
        return F.linear(swiglu(F.linear(x, w13)), w2)  # w1 and w3: one GEMM, [gate | up]


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layout: Layout, plan: LayerPlan):
        super().__init__()
        self.recompute = False  # set by the parallel config (activation checkpointing of this layer)
        self.keep_attention = False  # with recompute: keep the sparse attention's outputs instead of re-running it
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, args.kernel_backend)
        attention = DenseAttention if args.attention == "dense" else Attention
        self.attn = attention(args, plan, layout.candidate_topk_blocks, layout.candidate_block_size)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.kernel_backend)
        self.ffn = FeedForward(args.dim, args.inter_dim, args.kernel_backend)

    def forward(self, x: torch.Tensor, state: SharedState) -> torch.Tensor:
        """Runs the layer on the forward's shared state. With ``recompute`` the layer is a non-reentrant
        checkpoint: its shared inputs are explicit arguments, so recomputation in backward sees the same tensors
        even after the state has dropped them. The checkpoint is selective (``kernels.checkpoint_contexts``): the
        indexer's selection is saved, and with ``keep_attention`` the sparse-attention op's outputs too; the rest of
        the layer is recomputed, without the selected mass (only the forward reads it)."""
        plan = self.attn.plan
        run = self._compute
        if self.recompute:
            contexts = partial(kernels.checkpoint_contexts, self.keep_attention)
            run = partial(checkpoint, self._compute, use_reentrant=False, context_fn=contexts)
        x, produced = run(x, state.geometry, state.reads(plan), state.collect_recall)
        state.write(plan, produced)
        return x

    def _compute(self, x, geometry, reads, collect_recall):
        attn_out, produced = self.attn(self.attn_norm(x), geometry, reads, collect_recall)
        x = x + attn_out
        return x + self.ffn(self.ffn_norm(x)), produced


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B,T,V] fp32 (fp64 in an fp64 model)
    indexer_losses: dict[int, torch.Tensor]  # index source layer -> KL of its selection (SPEC §2)
    index_recall: dict[int, torch.Tensor]  # reading layer -> recall vs its dense attention (collect_recall only)


class Transformer(nn.Module):
    """The CSA2 stack, or a contiguous slice of it (``layer_ids``) for a pipeline stage.

    A slice holds the embedding only if it starts at layer 0 and the final norm and head only if it ends at the
    last layer; its parameter names are the full model's (``layers.<id>.``), so a stage's state dict is a subset
    of the model's and checkpoints do not depend on the split. Initial values depend only on (seed, parameter
    name), so every split starts from the same weights."""

    def __init__(self, args: ModelArgs, layout: Layout, layer_ids: range | None = None, seed: int = 0,
                 init: bool = True):
        super().__init__()
        layout.check_candidate_capacity(args.index_topk)
        self.args, self.layout = args, layout
        layer_ids = range(layout.n_layers) if layer_ids is None else layer_ids
        self.has_embed, self.has_head = layer_ids.start == 0, layer_ids.stop == layout.n_layers
        if self.has_embed:
            self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args, layout, layout.plan[i]) for i in layer_ids})
        if self.has_head:
            self.norm = RMSNorm(args.dim, args.norm_eps, args.kernel_backend)
            self.head = linear(args.dim, args.vocab_size)
        if init:  # False: the caller draws the values (benchmarks drawing init_std's distribution on the GPU)
            init_parameters(self.named_parameters(), args, layout.n_layers, seed)

    def new_state(self, doc_ids: torch.Tensor, collect_recall: bool = False) -> SharedState:
        return SharedState(self.layout, doc_ids, self.args.window_size, collect_recall)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """An out-of-range id would index past the embedding (a device assert on GPU): fail with the id."""
        bad = (input_ids < 0) | (input_ids >= self.args.vocab_size)
        if bad.any():
            raise ValueError(f"token id {input_ids[bad][0].item()} is outside the model's vocabulary "
                             f"[0, {self.args.vocab_size})")
        return self.embed(input_ids)

    def run_layers(self, h: torch.Tensor, state: SharedState) -> torch.Tensor:
        for layer in self.layers.values():
            h = layer(h, state)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(h))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                collect_recall: bool = False) -> ModelOutput:
        """Logits and per-source indexer losses; ``collect_recall`` adds each reading layer's index recall."""
        state = self.new_state(torch.zeros_like(input_ids) if doc_ids is None else doc_ids, collect_recall)
        h = self.run_layers(self.embed_tokens(input_ids), state)
        return ModelOutput(self.logits(h), state.indexer_losses, state.index_recall)


RESIDUAL_OUTPUTS = ("wo_b.weight", "ffn.w2.weight", "attn.wo.weight")  # matrices that write the residual stream


def init_std(name: str, args: ModelArgs, n_layers: int) -> float:
    """Standard deviation of the normal draw of matrix ``name`` (full-model name).

    The embedding has its own scale (``embed_init_std``): it sets the residual stream's scale, which every
    pre-norm layer divides by, and so how far one optimizer step moves the function (docs/TRAINING_HEALTH.md).
    The LM head has ``head_init_std``. Other matrices draw from ``init_std``, the residual-branch outputs scaled
    by 1/sqrt(2 * n_layers)."""
    if name == "embed.weight":
        return args.embed_init_std
    if name == "head.weight":
        return args.head_init_std
    return args.init_std / math.sqrt(2 * n_layers) if name.endswith(RESIDUAL_OUTPUTS) else args.init_std


def init_parameters(named_parameters, args: ModelArgs, n_layers: int, seed: int, rename=lambda name: name) -> None:
    """Normal(0, ``init_std(name)``) for matrices; norms keep 1, sinks 0. Each tensor draws from a generator
    seeded by (seed, its name), so values do not depend on which other parameters a process builds (pipeline
    stages, shadow replicas under their owner's ``rename``)."""
    for name, p in named_parameters:
        if p.dim() < 2 or p.is_meta:
            continue
        name = rename(name)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        values = torch.empty(p.shape, dtype=torch.float32, device="cpu").normal_(
            std=init_std(name, args, n_layers), generator=generator)
        with torch.no_grad():
            p.copy_(values)
