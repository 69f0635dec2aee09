"""The CSA2 decoder stack: embedding, pre-norm blocks (CSA2 attention + an FFN), final norm, LM head, and the
V4.1 parts around them (SPEC §5), each behind its switch:

- ``ffn``: the dense SwiGLU ``FeedForward`` or the Mixture-of-Experts of ``model/moe.py``;
- ``hc_mult > 1``: the residual stream is ``hc_mult`` hyper-connected copies (``model/hyper.py``); a block takes
  and returns the stream with its pending pre-mix (the previous block's FFN mixes), and the head collapses the
  stream with the last block's;
- ``engram.layers``: hashed n-gram memories added to the stream before those blocks (``model/engram.py``);
- ``dspark.blocks``: the draft head ``mtp`` (``model/dspark.py``) on detached features of the streams entering
  its target layers; it runs only when the job trains it (``run_dspark``), and is built (loadable, exportable)
  always.
With every switch off the stack is the plain pre-norm model, bit for bit.

The stream a slice of layers passes on is a pair ``(x, pre)``: ``x`` [B,T,D] (plain: fp32 in training) or
[B,T,hc,D] (the compute dtype: ``hyper.stream_dtype``), and ``pre`` [B,T,hc] fp32 (None for the plain stream). A
pipeline boundary carries both.
"""
import math
from functools import partial
from dataclasses import dataclass, field

import torch
from torch import nn

from model import hyper
from model.attention import Attention, linear
from model.config import ModelArgs
from model.dense import DenseAttention
from model.dspark import DSpark, DSparkOutput
from model.engram import Engram, EngramHash, EngramTable
from model.layout import Layout, LayerPlan
from model.moe import ROUTED_WEIGHTS, Expert, MoE, update_bias
from model.norm import RMSNorm
from model.qat import simulate_served
from model.seeding import seeded_generator
from model.state import LayerInputs, SharedState


class FeedForward(Expert):
    """The dense FFN: the SwiGLU of the MoE's shared expert, unclamped."""

    def __init__(self, dim: int, inter_dim: int, kernel_backend: str = "auto"):
        super().__init__(dim, inter_dim, 0.0, kernel_backend)


def make_ffn(args: ModelArgs, moe=None, dispatch=None) -> nn.Module:
    """The FFN of a block: dense SwiGLU, or the MoE of ``moe`` (default ``args.moe``) when ``args.ffn`` is moe; with
    an expert-parallel ``dispatch`` (``parallel/experts.py``) it holds only this rank's range of the experts."""
    if args.ffn == "moe":
        moe = moe or args.moe
        held = dispatch.experts_of(moe.n_routed_experts) if dispatch is not None else None
        return MoE(args.dim, moe, args.kernel_backend, held, dispatch)
    return FeedForward(args.dim, args.inter_dim, args.kernel_backend)


class Block(hyper.HyperConnected, nn.Module):
    """One layer: the Engram update (if any), then attention and FFN, each pre-normed between ``hc_pre`` and
    ``hc_post`` (``model/hyper.py``; the plain stream is the one-copy case). Recomputation and offloading wrap
    ``compute`` from ``parallel/recompute.py``; LoRA adapters are attached to the built model (``model/lora.py``)."""

    def __init__(self, args: ModelArgs, layout: Layout, plan: LayerPlan, engram: Engram | None = None,
                 dispatch=None):
        super().__init__()
        self.args, self.plan = args, plan
        self.feeds_dspark = args.dspark.blocks > 0 and plan.layer_id in args.dspark.target_layers
        if engram is not None:
            self.engram = engram
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, args.kernel_backend)
        attention = DenseAttention if args.attention == "dense" else Attention
        self.attn = attention(args, plan, layout.candidate_topk_blocks, layout.candidate_block_size)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.kernel_backend)
        self.ffn = make_ffn(args, dispatch=dispatch)
        if args.hc_mult > 1:
            hyper.add_mix_parameters(self, args.hc_mult, args.dim)

    def forward(self, x: torch.Tensor, pre: torch.Tensor | None, state: SharedState):
        """The layer on the forward's shared state: ``compute`` on what the state holds for it, and what it
        produced back into the state. Returns the stream ``(x, pre)``."""
        x, pre, produced = self.compute(x, pre, state.inputs(self.plan))
        state.write(self.plan, produced)
        return x, pre

    def compute(self, x: torch.Tensor, pre: torch.Tensor | None, inputs: LayerInputs):
        """The layer as a function of its explicit inputs (a recomputation re-runs it): the stream ``(x, pre)``
        in, the stream and the shared tensors it produced (``SharedState.write``) out."""
        if inputs.engram_ids is not None:
            x = self.engram_update(x, pre, inputs.engram_ids)
        draft = {"dspark_feature": hyper.mean_copy(x, pre).detach()} if self.feeds_dspark else {}
        h, attn_mix = self.hc_pre("attn", x, pre)
        h, produced = self.attn(self.attn_norm(h), inputs.geometry, inputs.reads)
        x = self.hc_post(h, x, attn_mix)
        h, ffn_mix = self.hc_pre("ffn", x, attn_mix.pre)
        x = self.hc_post(self.ffn(self.ffn_norm(h)), x, ffn_mix)
        return x, ffn_mix.pre, produced | draft

    def engram_update(self, x: torch.Tensor, pre: torch.Tensor | None, engram_ids: torch.Tensor) -> torch.Tensor:
        """The stream after this layer's Engram (which reads copies: the plain stream is one)."""
        return self.engram(x, engram_ids) if pre is not None else self.engram(x.unsqueeze(2), engram_ids).squeeze(2)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B,T,V] fp32 (fp64 in an fp64 model)
    indexer_losses: dict[int, torch.Tensor]  # index source layer -> KL of its selection (SPEC §2)
    draft_losses: dict[str, torch.Tensor] = field(default_factory=dict)  # the draft head's parts, when it trains


class Transformer(nn.Module):
    """The CSA2 stack, or a contiguous slice of it (``layer_ids``) for a pipeline stage.

    A slice holds the embedding only if it starts at layer 0 and the final norm, head and draft head only if it
    ends at the last layer; its parameter names are the full model's (``layers.<id>.``, ``mtp.<k>.``), so a
    stage's state dict is a subset of the model's and checkpoints do not depend on the split. Initial values
    depend only on (seed, parameter name), so every split starts from the same weights.

    ``token_map`` (normalised ids of the data tokenizer and their count, ``model.engram.compressed_token_map``)
    feeds the Engram hashes; without it every token is its own normalised id. ``engram_rows``: how this process
    holds the Engram tables, ``(exchange, rank, world)`` of their row shards (default: whole, local).
    ``experts``: the expert-parallel dispatch of this rank (``parallel/experts.py``; default: every expert here)."""

    def __init__(self, args: ModelArgs, layout: Layout, layer_ids: range | None = None, seed: int = 0,
                 init: bool = True, token_map: tuple[list[int], int] | None = None, engram_rows=None,
                 run_dspark: bool = False, experts=None):
        super().__init__()
        layout.check_candidate_capacity(args.index_topk)
        args.check_stack(layout.n_layers)
        self.args, self.layout = args, layout
        self.moves_biases = True  # the balance steps move the routing biases (False: a frozen base, model/lora.py)
        layer_ids = range(layout.n_layers) if layer_ids is None else layer_ids
        self.has_embed, self.has_head = layer_ids.start == 0, layer_ids.stop == layout.n_layers
        if self.has_embed:
            self.embed = nn.Embedding(args.vocab_size, args.dim)
        engram_layers = [i for i in args.engram.layers if i in layer_ids]
        self.engram_hash = EngramHash(args.engram, *(token_map or identity_map(args.vocab_size))) \
            if engram_layers else None
        exchange, rank, world = engram_rows or (None, 0, 1)
        self.layers = nn.ModuleDict({str(i): Block(args, layout, layout.plan[i], Engram(
            args.dim, args.hc_mult, args.engram, self.engram_hash.table_rows(i), args.norm_eps, exchange, rank, world)
            if i in engram_layers else None, experts) for i in layer_ids})
        self.run_dspark = run_dspark and self.has_head and args.dspark.blocks > 0
        if self.has_head:
            self.norm = RMSNorm(args.dim, args.norm_eps, args.kernel_backend)
            self.head = linear(args.dim, args.vocab_size)
            if args.dspark.blocks:
                self.mtp = DSpark(args, partial(make_ffn, args, args.dspark_moe, experts))
        if args.qat:  # the attention activations on their served grids: a converter of the built stack
            simulate_served(self)
        if init:  # False: the caller draws the values (benchmarks drawing init_std's distribution on the GPU)
            init_parameters(self.state_dict(keep_vars=True).items(), args, layout.n_layers, seed, self.row_shards())

    def new_state(self, doc_ids: torch.Tensor, input_ids: torch.Tensor | None = None,
                  context=None) -> SharedState:
        """The forward's shared state; ``input_ids`` when this slice hashes n-grams or trains the draft head.
        ``context``: the forward computes one chunk of the rows (``model/context.py``); ``doc_ids`` and
        ``input_ids`` are the whole rows'."""
        if context is not None and (self.run_dspark or self.args.attention == "dense"):
            raise ValueError("a forward over one chunk of each row (context) runs CSA2 attention without the draft "
                             "head only (parallel/checks.py's check_context says why)")
        state = SharedState(self.layout, doc_ids, self.args.window_size, context)
        state.input_ids = input_ids
        if self.engram_hash is not None:  # look-back reaches into earlier chunks: hash the row, keep the chunk
            ids = state.geometry.chunk_of(self.engram_hash(input_ids, state.geometry.row_tokens.doc_start))
            state.engram_ids = {layer: ids[:, :, k] for k, layer in enumerate(self.args.engram.layers)}
        return state

    def embed_tokens(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stream entering layer 0: the embedding, repeated into the hyper-connected copies (with the one-hot
        first pre-mix) when there are several. An out-of-range id would index past the embedding (a device assert
        on GPU): fail with the id."""
        bad = (input_ids < 0) | (input_ids >= self.args.vocab_size)
        if bad.any():
            raise ValueError(f"token id {input_ids[bad][0].item()} is outside the model's vocabulary "
                             f"[0, {self.args.vocab_size})")
        return hyper.begin(self.embed(input_ids), self.args.hc_mult)

    def run_layers(self, x: torch.Tensor, pre: torch.Tensor | None, state: SharedState):
        for layer in self.layers.values():
            x, pre = layer(x, pre, state)
        return x, pre

    def logits(self, x: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
        return self.head_logits(self.features(x, pre))

    def features(self, x: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
        """What the LM head reads: the final norm of the (collapsed) stream [B,T,dim]."""
        return self.norm(hyper.end(x, pre, self.args.kernel_backend))

    def head_logits(self, features: torch.Tensor) -> torch.Tensor:
        logits = self.head(features)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def draft(self, state: SharedState, logits: torch.Tensor,
              embed_weight: torch.Tensor | None = None) -> DSparkOutput | None:
        """The draft head's output on this forward's features (None unless the job trains it). It shares the input
        embedding: this slice's, or ``embed_weight`` (a replica, on a last pipeline stage without it)."""
        if not self.run_dspark:
            return None
        features = [state.dspark_features[layer] for layer in self.args.dspark.target_layers]
        embed = self.embed.weight if self.has_embed else embed_weight
        return self.mtp(features, state.input_ids, state.geometry, embed, self.head.weight, logits)

    def row_shards(self) -> dict[str, tuple[int, int]]:
        """Parameters that hold a contiguous range of the rows of a larger table (the Engram tables, row-sharded
        over a stage's data-parallel ranks): name -> (first row held, rows of the whole table)."""
        return {f"{name}.weight": (module.start, module.rows) for name, module in self.named_modules()
                if isinstance(module, EngramTable)}

    def expert_shards(self) -> dict[str, tuple[int, int]]:
        """The stacked routed-expert parameters (their adapters too: ``model/lora.py``) when this process holds a
        range of the experts (expert parallelism): name -> (first expert held, experts of the MoE). Empty when every MoE holds all its experts."""
        return {f"{name}.experts.{w}": (moe.experts.expert_ids.start, moe.args.n_routed_experts)
                for name, moe in self.experts().items() for w, _ in moe.experts.named_parameters()
                if len(moe.experts.expert_ids) < moe.args.n_routed_experts}

    def experts(self) -> dict[str, MoE]:
        """The MoE FFNs of this slice by module name (``layers.3.ffn``, ``mtp.0.ffn``)."""
        return {name: module for name, module in self.named_modules() if isinstance(module, MoE)}

    def balance_experts(self, all_reduce, apply: bool = True) -> dict[str, torch.Tensor]:
        """The auxiliary-loss-free balance step (SPEC §5.1) of every MoE of this slice, after an optimizer step:
        the expert loads of the step's training forwards, summed over the data-parallel replicas by
        ``all_reduce`` (in place, one call for all layers, so every replica moves its bias alike), move each
        routing bias by ``rate * sign(mean load - load)`` when ``apply`` (not for a skipped step). Returns the
        summed loads by module name."""
        moes = self.experts()
        if not moes:
            return {}
        loads = torch.cat([moe.take_load() for moe in moes.values()])
        all_reduce(loads)
        loads = dict(zip(moes, loads.split([moe.gate.bias.numel() for moe in moes.values()])))
        if apply and self.moves_biases:
            for name, moe in moes.items():
                update_bias(moe.gate, loads[name], moe.args.bias_update_rate)
        return loads

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                context=None) -> ModelOutput:
        """Logits and per-source indexer losses (each reading layer's index recall: ``model.diagnostics``).
        With a ``context`` (``model/context.py``) the logits are those of its chunk's tokens and each indexer loss
        is the chunk's share of the rows' (the chunks' shares add up to it)."""
        state = self.new_state(torch.zeros_like(input_ids) if doc_ids is None else doc_ids, input_ids, context)
        x, pre = self.run_layers(*self.embed_tokens(state.geometry.chunk_of(input_ids)), state)
        logits = self.logits(x, pre)
        draft = self.draft(state, logits)
        return ModelOutput(logits, state.indexer_losses, draft.losses if draft else {})


def identity_map(vocab_size: int) -> tuple[list[int], int]:
    """Every token its own normalised id (no tokenizer given: tests, accounting)."""
    return list(range(vocab_size)), vocab_size


RESIDUAL_OUTPUTS = ("wo_b.weight", "attn.wo.weight")  # matrices that write the residual stream, with every FFN's w2


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
    writes_stream = name.endswith(RESIDUAL_OUTPUTS) or (".ffn." in name and name.endswith(".w2.weight"))
    return args.init_std / math.sqrt(2 * n_layers) if writes_stream else args.init_std


GAINS = ("engram.q_weight", "engram.k_weight")  # 2-D but elementwise gains: they keep their ones
TABLE_CHUNK = 1 << 16  # rows of a row-sharded table drawn from one generator


def init_parameters(named_parameters, args: ModelArgs, n_layers: int, seed: int,
                    row_shards: dict[str, tuple[int, int]] | None = None, rename=lambda name: name,
                    on_device: bool = False) -> None:
    """Normal(0, ``init_std(name)``) for matrices; norms and gains keep 1, sinks 0. Each tensor draws from a
    generator seeded by (seed, its name), so values do not depend on which other parameters a process builds
    (pipeline stages, shadow replicas under their owner's ``rename``). The names are the state dict's: a routed
    expert's matrices draw under their per-expert names, whichever experts a process holds. A row-sharded table
    (``row_shards``: name -> (first row, table rows)) draws in chunks of ``TABLE_CHUNK`` rows, each from its own
    generator, so a shard holds the rows of the whole table's draw, whatever the number of shards. ``on_device``:
    drawn where the parameter lives (benchmarks of 3 B models, whose CPU draw takes minutes: the same
    distribution, other values)."""
    for name, p in named_parameters:
        if p.dim() < 2 or p.is_meta or not p.is_floating_point() or name.endswith(GAINS):
            continue
        shard = (row_shards or {}).get(name)
        name = rename(name)
        std, device = init_std(name, args, n_layers), p.device if on_device else torch.device("cpu")
        with torch.no_grad():
            if shard is None:
                p.copy_(_normal(p.shape, std, seed, name, device))
            else:
                _draw_rows(p, *shard, std, seed, name, device)


def _normal(shape, std: float, seed: int, name: str, device: torch.device, chunk: int | None = None) -> torch.Tensor:
    generator = seeded_generator(seed, name if chunk is None else f"{name}#{chunk}", device)
    return torch.empty(shape, dtype=torch.float32, device=device).normal_(std=std, generator=generator)


def _draw_rows(p: torch.Tensor, start: int, rows: int, std: float, seed: int, name: str, device) -> None:
    """Rows ``start:start + len(p)`` of a table of ``rows`` rows drawn chunk by chunk; rows past the table (the
    last shard's padding) are zeros."""
    p.zero_()
    stop = min(start + p.shape[0], rows)
    for chunk in range(start // TABLE_CHUNK, -(-stop // TABLE_CHUNK)):
        lo, hi = chunk * TABLE_CHUNK, min((chunk + 1) * TABLE_CHUNK, rows)
        values = _normal((hi - lo, *p.shape[1:]), std, seed, name, device, chunk)
        a, b = max(lo, start), min(hi, stop)
        p[a - start:b - start].copy_(values[a - lo:b - lo])
