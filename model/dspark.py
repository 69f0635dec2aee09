"""DSpark, V4.1's speculative draft head (``mtp.*``, SPEC §5.4), trained by teacher forcing.

At decode step i the main model has read t_0 .. t_i and sampled t_{i+1}; DSpark drafts the tokens after it in
one pass. Its blocks read ``main_x``, a projection of the main model's streams entering the target layers
(detached: DSpark learns only from its own loss), and a draft block of ``block_size`` slots: t_{i+1} and
``block_size - 1`` noise tokens at positions i+1 .. i+block_size. Each slot's query attends to the main KV of the
last ``window_size`` positions ending at i and to every slot of its block (no causal mask inside it), with the
per-head sink; window-only attention (``rope_theta``, no YaRN). Slot j predicts t_{i+2+j}: the main head on the
normalised collapsed stream plus a low-rank Markov bias from the token before the slot (t_{i+1+j}, the previous
draft at decode); the confidence head reads the collapsed stream before the norm and that token's Markov
embedding. The main embedding and head are shared and frozen: they come in as tensors and are detached here.

Training makes every position i of the packed rows an anchor (N = B*T blocks, one per position) with the true
tokens as the previous drafts. Slot j's target is t_{i+2+j}, -100 past the row's end or in another document, so
an anchor whose next token starts another document (or lies past the row) has no valid slot; its block still runs
and stays isolated (it reads its own document's window and its own slots only). Positions are doc-relative.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference
from model.attention import Attention, linear
from model.config import ModelArgs
from model.geometry import Geometry, TokenGeometry
from model.hyper import HyperConnected, add_mix_parameters, begin, end
from model.layout import LayerPlan, Mode
from model.norm import RMSNorm
from model.weights import matmul_weights

IGNORE = -100  # target of a slot with nothing to predict (F.cross_entropy's ignore_index)
DRAFT_PARTS = ("ce", "l1", "confidence")  # the loss parts of ``draft_losses``, in their order


@dataclass(frozen=True)
class Anchors:
    """The draft blocks of a packed batch: anchor i of row b is block ``b*T + i``, its slot j at ``[b, i, j]``."""

    inputs: torch.Tensor  # [B,T,bs] draft tokens: t_{i+1} (the noise token past the row's end), then the noise token
    before: torch.Tensor  # [B,T,bs] row position i+1+j of the token before slot j (clamped to the row)
    prev: torch.Tensor  # [B,T,bs] that token, t_{i+1+j}: its Markov bias (the noise token past the row's end)
    targets: torch.Tensor  # [B,T,bs] t_{i+2+j}; IGNORE past the row's end or in another document
    slots: TokenGeometry  # the T*bs draft slots of each row, anchor after anchor: positions pos_i + 1 + j
    block: torch.Tensor  # [B,T,bs] row of each slot of anchor i among its row's T*bs slots: i*bs + j

    @classmethod
    def of(cls, geometry: Geometry, input_ids: torch.Tensor, block_size: int, noise_id: int) -> "Anchors":
        B, T = input_ids.shape
        i = torch.arange(T, device=input_ids.device).view(T, 1)
        ahead = i + 1 + torch.arange(block_size + 1, device=i.device)  # [T, bs+1]: positions i+1 .. i+1+bs
        inside, ahead = ahead < T, ahead.clamp(max=T - 1)
        tokens = torch.where(inside, input_ids[:, ahead], noise_id)  # [B,T,bs+1]: t_{i+1} .. t_{i+1+bs}
        same_doc = inside & (geometry.doc_ids[:, ahead] == geometry.doc_ids.unsqueeze(-1))
        prev, targets = tokens[..., :-1], tokens[..., 1:].masked_fill(~same_doc[..., 1:], IGNORE)
        inputs = torch.full_like(prev, noise_id)
        inputs[..., 0] = prev[..., 0]
        slot = torch.arange(block_size, device=i.device)
        tokens_geometry = geometry.tokens
        slots = TokenGeometry(tokens_geometry.doc_start.repeat_interleave(block_size, dim=1),
                              (tokens_geometry.pos.unsqueeze(-1) + 1 + slot).flatten(1))
        block = (i * block_size + slot).expand(B, T, block_size)
        return cls(inputs, ahead[:, :-1].expand(B, T, block_size), prev, targets, slots, block)


class DSparkAttention(Attention):
    """A window-only layer's attention (its parameters, built by ``Attention`` with a window plan: ``wq_a, q_norm,
    wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink``) whose queries are draft slots reading main KV and their block.

    One call of the PyTorch reference ``sparse_attention`` does it, with the bs slots of an anchor as bs groups of
    heads of one query at the anchor's position: the window of the anchor is then the main window, and the
    "selected entries" are the block's bs draft KV rows (``Anchors.block`` into the row's T*bs slot rows), the
    same for every slot. RoPE is applied outside (``rotation=None``), each slot at its own position: q and the
    slots' KV at pos_i + 1 + j, the main KV at its token's position, the output rotated back per slot. The window
    keys are gathered once per anchor, not once per slot (what a loop over slots would copy bs times). The
    reference, not ``kernels.ops``: the Triton kernels are built for the model's index_topk, not for bs."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, LayerPlan(-1, 0, Mode.WINDOW), 0, 0)

    def forward(self, x: torch.Tensor, main_x: torch.Tensor, anchors: Anchors, geometry: Geometry) -> torch.Tensor:
        """x [N=B*T, bs, D] the normed draft stream, main_x [B,T,D] -> [N, bs, D]."""
        args = self.args
        N, bs, _ = x.shape
        B, T, _ = main_x.shape
        H, Dh = args.n_heads, args.head_dim
        w_in, wq_b, wo_a, wo_b = matmul_weights([(self.wq_a, self.wkv), self.wq_b, self.wo_a, self.wo_b],
                                                args.kernel_backend)
        q_low, kv = F.linear(x.view(B, T * bs, -1), w_in).split([args.q_lora_rank, Dh], dim=-1)
        q = self.rotary(F.linear(self.q_norm(q_low), wq_b).view(B, T * bs, H, Dh), anchors.slots)
        kv_slots = self.kv_norm(kv, self.rotary, anchors.slots)
        kv_main = self.kv_norm(F.linear(main_x, w_in[args.q_lora_rank:]), self.rotary, geometry.tokens)
        out, _ = reference.sparse_attention(q.view(B, T, bs * H, Dh), kv_main, geometry.window_lo, kv_slots,
                                            anchors.block, self.attn_sink.repeat(bs), Dh ** -0.5, args.window_size,
                                            with_mass=False)
        out = self.rotary(out.view(B, T * bs, H, Dh), anchors.slots, inverse=True)
        return self._project_out(out, wo_a, wo_b).view(N, bs, -1)


class MarkovHead(nn.Module):
    """Low-rank logit bias from the token before a slot: ``embed[prev] head^T`` (the logits' dtype, >= fp32)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = linear(rank, vocab_size)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.embed(prev)
        bias = self.head(embed)
        return bias.to(torch.promote_types(bias.dtype, torch.float32)), embed


class ConfidenceHead(nn.Module):
    """Logit of "the slot's draft is right" from the collapsed stream (before the norm) and the Markov embedding,
    in fp32 (the reference keeps ``proj`` in fp32 for an fp32 score)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = linear(dim, 1)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            features = torch.cat([hidden.to(dtype), markov_embed.to(dtype)], dim=-1)
            return F.linear(features, self.proj.weight.to(dtype)).squeeze(-1)


class DSparkBlock(HyperConnected, nn.Module):
    """One draft block: mHC (``hc_pre``, ``hc_post``) around window attention on main KV + block, and an FFN from
    ``make_ffn`` (the MoE with DSpark's expert counts, or the dense FFN). The first block also projects the main
    features (``main_proj``, ``main_norm``); the last holds the output norm, the Markov and confidence heads."""

    def __init__(self, args: ModelArgs, make_ffn, first: bool, last: bool):
        super().__init__()
        self.args = args
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, args.kernel_backend)
        self.attn = DSparkAttention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.kernel_backend)
        self.ffn = make_ffn()
        if args.hc_mult > 1:
            add_mix_parameters(self, args.hc_mult, args.dim)
        if first:
            self.main_proj = linear(len(args.dspark.target_layers) * args.dim, args.dim)
            self.main_norm = RMSNorm(args.dim, args.norm_eps, args.kernel_backend)
        if last:
            self.norm = RMSNorm(args.dim, args.norm_eps, args.kernel_backend)
            self.markov_head = MarkovHead(args.vocab_size, args.dspark.markov_rank)
            self.confidence_head = ConfidenceHead(args.dim + args.dspark.markov_rank)

    def forward(self, x, pre, main_x, anchors: Anchors, geometry: Geometry):
        """The stream x [N, bs, hc, D] and its pending pre-mix [N, bs, hc] -> both after this block."""
        h, attn_mix = self.hc_pre("attn", x, pre)
        x = self.hc_post(self.attn(self.attn_norm(h), main_x, anchors, geometry), x, attn_mix)
        h, ffn_mix = self.hc_pre("ffn", x, attn_mix.pre)
        return self.hc_post(self.ffn(self.ffn_norm(h)), x, ffn_mix), ffn_mix.pre


@dataclass
class DSparkOutput:
    logits: torch.Tensor  # [N=B*T, bs, V] draft logits (>= fp32): main head on the normed stream + Markov bias
    confidence: torch.Tensor  # [N, bs] logit of P(slot's argmax == target)
    targets: torch.Tensor  # [N, bs] t_{i+2+j}, IGNORE where the slot has nothing to predict
    losses: dict[str, torch.Tensor] | None  # "ce", "l1", "confidence" (means over valid slots), given main_logits


class DSpark(nn.ModuleList):
    """The ``args.dspark.blocks`` draft blocks; a ModuleList itself, so that registered as ``mtp`` its parameters
    read ``mtp.0.attn.wq_a.weight``, ``mtp.2.markov_head.embed.weight``, ... as in the released checkpoint."""

    def __init__(self, args: ModelArgs, make_ffn):
        d = args.dspark
        if d.blocks < 1:
            raise ValueError(f"model.dspark.blocks={d.blocks}: DSpark needs >= 1 block (0 means no draft head)")
        super().__init__(DSparkBlock(args, make_ffn, first=i == 0, last=i == d.blocks - 1) for i in range(d.blocks))
        self.args = args

    def forward(self, features: list[torch.Tensor], input_ids: torch.Tensor, geometry: Geometry,
                embed_weight: torch.Tensor, head_weight: torch.Tensor,
                main_logits: torch.Tensor | None = None) -> DSparkOutput:
        """Drafts of every anchor of the batch. ``features``: per target layer the mean over copies of the stream
        entering it [B,T,D]; ``embed_weight``/``head_weight`` the main model's (frozen here); ``main_logits``
        [B,T,V] the teacher of the L1 loss, which with it comes back with the CE and confidence losses."""
        args, d = self.args, self.args.dspark
        if len(features) != len(d.target_layers):
            raise ValueError(f"DSpark got {len(features)} feature tensors for model.dspark.target_layers="
                             f"{list(d.target_layers)}")
        first, last = self[0], self[-1]
        anchors = Anchors.of(geometry, input_ids, d.block_size, d.noise_token_id)
        main_x = first.main_norm(first.main_proj(torch.cat([f.detach() for f in features], dim=-1)))
        x, pre = begin(F.embedding(anchors.inputs.flatten(0, 1), embed_weight.detach()), args.hc_mult)
        for block in self:
            x, pre = block(x, pre, main_x, anchors, geometry)
        hidden = end(x, pre, args.kernel_backend)
        logits = F.linear(last.norm(hidden), head_weight.detach())
        bias, markov_embed = last.markov_head(anchors.prev.flatten(0, 1))
        logits = logits.to(bias.dtype) + bias
        confidence = last.confidence_head(hidden, markov_embed)
        targets = anchors.targets.flatten(0, 1)
        losses = None
        if main_logits is not None:
            rows = torch.arange(input_ids.shape[0], device=input_ids.device).view(-1, 1, 1)
            teacher = main_logits[rows, anchors.before].flatten(0, 1)  # position i+1+j predicts t_{i+2+j}
            losses = draft_losses(logits, confidence, targets, teacher)
        return DSparkOutput(logits, confidence, targets, losses)


def draft_losses(logits: torch.Tensor, confidence: torch.Tensor, targets: torch.Tensor,
                 teacher_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means over the valid slots (0 when there are none) of: the drafts' cross-entropy; the L1 distance of the
    draft distribution to the teacher's (the main model's at the same target, detached); the binary cross-entropy
    of the confidence logit against "the draft's argmax is the target"."""
    valid = targets != IGNORE
    count = valid.sum().clamp(min=1)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum") / count
    l1 = (logits.softmax(-1) - teacher_logits.detach().softmax(-1)).abs().sum(-1)
    hit = (logits.detach().argmax(-1) == targets).to(confidence.dtype)
    bce = F.binary_cross_entropy_with_logits(confidence, hit, reduction="none")
    return {"ce": ce, "l1": (l1 * valid).sum() / count, "confidence": (bce * valid).sum() / count}
