"""Peak memory of a pipeline stage, estimated per layer: what the split balance and the schedule simulator use.

A stage's peak is modelled as (bytes) state + retained + max(casts, transient):
- state, per parameter: fp32 weight and gradient (8 B) and AdamW's two fp32 moments (8 B, divided by the
  data-parallel size under ZeRO-1); under expert parallelism a rank holds 1/E of the routed experts, whose
  moments ZeRO-1 divides by D / E (the ranks holding the same experts); an Engram table's rows are sharded over
  the data-parallel ranks, with no dense gradient (it is sparse) and sparse Adam's two moments when it trains;
- casts: under bf16 autocast the bf16 copy of every weight of the stage lives until its forward ends (2 B per
  parameter); it is gone before a backward starts (a recomputed layer casts again, inside its transient);
- retained activations, per microbatch in flight: under 1F1B stage s holds min(M, P - s) microbatches between their
  forward and backward, so the first stage holds the most. Per layer: its fp32 input (what a recomputed layer's
  checkpoint keeps; with hyper-connections its copies and pending pre-mix) plus, for a layer that is not
  recomputed, the tensors its backward reads (``_saved_bytes``),
  plus the shared tensors it produces (``model/state.py``); per stage the payloads it received (the buffer and the
  copy DeepSpeed's forward makes) and sent (kept for the backward);
- kept attention: a recomputed layer that keeps its sparse-attention outputs (``parallel.keep_attention_layers``,
  the first k of a stage) holds them per microbatch in flight as well;
- a transient: the working set of one layer's backward (its recomputed forward's saved tensors, the kernels'
  workspace), the largest over the stage's layers.

The analytic per-layer figures are estimates; a benchmark's measured figures (``LayerTimes.retained_bytes`` and
``backward_bytes`` per layer mode, ``parallel/balance.py``) replace them where given.
"""
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model.config import ModelArgs
from model.layout import Layout
from model.transformer import Transformer
from parallel.payload import Payload, boundary_fields

GIB = 2 ** 30
KERNEL_WORKSPACE = 4 * GIB  # the sparse-attention backward's chunk buffer (docs/KERNELS.md), on CUDA


@functools.cache
def parameter_counts(args: ModelArgs, layout: Layout) -> dict[str, tuple[int, ...]]:
    """Parameters of each layer by kind: ``tables`` (Engram tables), ``experts`` (routed experts, the stacked
    ``ffn.experts.w*`` of the layer's MoE and, in the last layer, of the draft head's), ``dense`` (the rest); the
    embedding counted in layer 0, the final norm, head and draft head in the last. Built once per model (meta)."""
    with torch.device("meta"):
        model = Transformer(args, layout, init=False)
    counts = {kind: [0] * layout.n_layers for kind in ("dense", "tables", "experts")}
    for name, p in model.named_parameters():
        kind = "tables" if ".engram.embed." in name else "experts" if ".ffn.experts." in name else "dense"
        layer = int(name.split(".")[1]) if name.startswith("layers.") else (0 if name.startswith("embed.") else -1)
        counts[kind][layer] += p.numel()
    return {kind: tuple(c) for kind, c in counts.items()}


def layer_parameters(args: ModelArgs, layout: Layout, tables: bool = False) -> list[int]:
    """Parameters of each layer (``parameter_counts``): the Engram tables only (``tables``), else everything but
    them."""
    counts = parameter_counts(args, layout)
    return list(counts["tables"]) if tables else [d + e for d, e in zip(counts["dense"], counts["experts"])]


def _saved_bytes(args: ModelArgs, layout: Layout, layer: int, tokens: int, itemsize: int,
                 routed_rows: float = 1.0) -> float:
    """Tensors a layer's backward reads when it is not recomputed (inputs of its matmuls, norms and activations):
    the normed inputs (2 x dim), the low-rank query (q_lora), q and the attention output (2 x heads x head_dim),
    the window latent (head_dim), the grouped output's input (o_groups x o_lora) and the FFN's three hidden tensors
    (3 x inter_dim), in the compute dtype; the indexer's query side for a selecting layer. ``routed_rows``: the
    routed rows a rank's experts compute, per token and activated expert (1 on average, under expert parallelism
    too: a rank receives as many rows as its tokens send out; more on a rank whose experts are the busiest)."""
    width = (2 * args.dim + args.q_lora_rank + 2 * args.n_heads * args.head_dim + args.head_dim
             + args.o_groups * args.o_lora_rank)
    if layout.plan[layer].selects:
        width += args.index_n_heads * args.index_head_dim + args.index_n_heads
    fp32 = 0  # per token, fp32 values
    if args.ffn == "dense":
        width += 3 * args.inter_dim
    else:  # per activated expert: its sorted input and hidden output, the fp32 gate and up values; the scores
        moe = args.moe
        active = moe.n_activated_experts * routed_rows + moe.n_shared_experts
        width += active * (args.dim + moe.inter_dim)
        fp32 += active * 2 * moe.inter_dim + moe.n_routed_experts
    if args.hc_mult > 1:  # the normalised stream of each sublayer's mixes, and what expand reads of the stream
        fp32 += 2 * 2 * args.hc_mult * args.dim
    if layer in args.engram.layers:  # the looked-up rows, the keys and value, the stream the gate reads
        engram = args.engram
        width += (engram.max_ngram_size - 1) * engram.n_heads * engram.head_dim
        fp32 += (args.hc_mult + 1) * args.dim + args.hc_mult * args.dim
    return tokens * (width * itemsize + fp32 * 4)


def _produced_bytes(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, dtype: torch.dtype) -> list[float]:
    """Shared tensors each layer produces (``model/state.py``), at their model dtypes: latents and index keys in
    the compute dtype, selections and candidate blocks int64, indexer logits and targets fp32."""
    B, T = micro_batch, seq_len
    blocks = min(layout.candidate_topk_blocks, -(-T // layout.candidate_block_size))
    produced = [0.0] * layout.n_layers
    for name, source in layout.last_use:
        entries = B * (T // layout.compress_ratios[source])
        produced[source] += {"kv": entries * args.head_dim * dtype.itemsize,
                             "index_k": entries * args.index_head_dim * dtype.itemsize,
                             "topk": B * T * args.index_topk * 8,
                             "candidates": B * T * blocks * 8,
                             "index_logits": B * T * args.index_topk * 4,
                             "index_target": B * T * args.index_topk * 4}[name]
    return produced


@dataclass(frozen=True)
class MemoryModel:
    """Per-layer figures (bytes) from which any contiguous stage's peak follows (``stage_peak``)."""
    state: tuple[float, ...]  # weights, gradients and optimizer state
    casts: tuple[float, ...]  # bf16 weight copies during the forward
    retained: tuple[float, ...]  # per microbatch in flight
    transient: tuple[float, ...]  # while the layer's backward runs
    boundary: tuple[float, ...]  # payload bytes of the boundary after each layer (0 after the last)
    kept: tuple[float, ...]  # attention outputs a layer keeps per microbatch when it keeps them (0: not recomputed)

    def stage_peak(self, stage: int, layers: range, n_stages: int, microbatches: int, keep: int = 0) -> float:
        """``keep``: how many of the stage's leading layers keep their attention outputs."""
        in_flight = min(microbatches, n_stages - stage)
        payloads = (2 * self.boundary[layers.start - 1] if layers.start > 0 else 0.0) + self.boundary[layers.stop - 1]
        retained = sum(self.retained[i] for i in layers) + sum(self.kept[i] for i in layers[:keep])
        return (sum(self.state[i] for i in layers) + in_flight * (retained + payloads)
                + max(sum(self.casts[i] for i in layers), max(self.transient[i] for i in layers)))

    def peaks(self, stages: tuple[range, ...], microbatches: int, keep: tuple[int, ...] | None = None) -> list[float]:
        keep = keep or (0,) * len(stages)
        return [self.stage_peak(s, layers, len(stages), microbatches, keep[s]) for s, layers in enumerate(stages)]


def kept_per_stage(keep, n_stages: int) -> tuple[int, ...]:
    """``parallel.keep_attention_layers`` per stage: one integer for every stage, or a list with one per stage."""
    return tuple(int(k) for k in keep) if isinstance(keep, Sequence) else (int(keep),) * n_stages


def estimate(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, dtype: torch.dtype,
             recompute_layers: int, data_parallel: int = 1, zero_stage: int = 1, cuda: bool = True,
             index_k: str = "shadow", measured=None, expert_parallel: int = 1, routed_rows: float = 1.0) -> MemoryModel:
    """The analytic model of a job's layers. ``recompute_layers`` counts from each stage's first layer; since the
    split is not known yet, layers are treated as recomputed when every layer is (``recompute=layer``) and as not
    recomputed otherwise (an upper bound for ``block``). ``measured``: a ``LayerTimes`` whose per-mode bytes
    replace the analytic retained and transient figures.

    ``expert_parallel`` (E, ``parallel/experts.py``): a rank holds the dense parameters and 1/E of every MoE's
    routed experts; ZeRO-1 partitions the dense AdamW state over the D data-parallel ranks and the experts' over the
    D / E ranks holding the same experts. Its routed rows are on average its own tokens x top-k (``routed_rows``
    times that on the busiest rank); with E > 1 the all-to-all's two receive buffers (the rows from the other ranks,
    their outputs back), in the compute dtype, live while a MoE layer's forward or backward runs (transient)."""
    counts = parameter_counts(args, layout)
    tables = counts["tables"]  # row-sharded over the stage's data-parallel ranks
    if data_parallel % expert_parallel:
        raise ValueError(f"parallel.expert_parallel={expert_parallel} does not divide the {data_parallel} "
                         "data-parallel replicas of a stage")
    held = [e / expert_parallel for e in counts["experts"]]
    per_row = 4 + (8 if args.engram.train else 0)  # fp32 weight, sparse Adam's moments (no dense gradient)
    dense_shards, expert_shards = (data_parallel, data_parallel // expert_parallel) if zero_stage == 1 else (1, 1)
    state = [n * (8 + 8 / dense_shards) + e * (8 + 8 / expert_shards) + t * per_row / data_parallel
             for n, e, t in zip(counts["dense"], held, tables)]
    casts = [(n + e) * 2 if dtype == torch.bfloat16 else 0 for n, e in zip(counts["dense"], held)]
    tokens = micro_batch * seq_len
    produced = _produced_bytes(args, layout, micro_batch, seq_len, dtype)
    all_recomputed = recompute_layers >= layout.n_layers
    exchange = 0.0
    if expert_parallel > 1 and args.ffn == "moe":
        exchange = 2 * tokens * args.moe.n_activated_experts * routed_rows * args.dim * dtype.itemsize
    retained, transient = [], []
    for i in range(layout.n_layers):
        saved = _saved_bytes(args, layout, i, tokens, dtype.itemsize, routed_rows)
        stream = 4 * tokens * args.dim * args.hc_mult + (4 * tokens * args.hc_mult if args.hc_mult > 1 else 0)
        retained.append(stream + produced[i] + (0 if all_recomputed else saved))
        transient.append((saved if all_recomputed else 0) + exchange + (KERNEL_WORKSPACE if cuda else 0))
    if measured is not None:
        retained, transient = measured.memory(layout, retained, transient)
    boundary = [0.0] * layout.n_layers
    for i in range(layout.n_layers - 1):
        payload = Payload(boundary_fields(args, layout, i, micro_batch, seq_len, dtype, index_k))
        floats, raw = payload.wire_sizes()
        boundary[i] = floats * payload.float_dtype.itemsize + raw
    # out in the compute dtype, LSE and selected mass in fp32, per head; under recompute=block the not-recomputed
    # bound above already counts the output among the saved tensors
    kept = tokens * args.n_heads * (args.head_dim * dtype.itemsize + 2 * 4) if all_recomputed else 0
    return MemoryModel(tuple(state), tuple(casts), tuple(retained), tuple(transient), tuple(boundary),
                       (kept,) * layout.n_layers)
