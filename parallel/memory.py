"""Peak memory of a pipeline stage, estimated per layer: what the split balance and the schedule simulator use.

A stage's peak is modelled as (bytes) state + retained + max(casts, transient):
- state, per parameter: fp32 weight and gradient (8 B) and AdamW's two fp32 moments (8 B, divided by the data-parallel
  size under ZeRO-1), or Muon's one momentum (4 B) for the matrices it trains under ``train.optimizer=muon``
  (``model/matrices.py``: the routed experts and every layer matrix); under expert parallelism a rank holds 1/E of the
  routed experts, whose moments ZeRO-1 divides by the ranks holding the same experts; an Engram table's rows are
  sharded over the data-parallel ranks, with no dense gradient (it is sparse) and sparse Adam's two moments when it
  trains. Under LoRA (``model/lora.py``) the base is frozen: its weights only (no gradient, no moments), in bf16 for
  the matrices ``LOW_PRECISION`` names when the job computes in bf16, fp32 for the rest, and the adapters' state as
  above; with ``train.lora.quantized_base`` the matrices the stage holds as the release stores them
  (``model/quantized_base.py``'s ``base_targets``: the blocks' FP8 and FP4 ones, the draft head's routed experts) cost
  ``STORED_BYTES`` a value with the scales, and the Engram tables' rows FP8 with a scale per 32 (``table_bytes``)
  instead of fp32; the stage is built that way (``model/quantized_build.py``), so loading it peaks no higher;
- casts: under bf16 autocast the bf16 copy of every fp32 weight of the stage lives until its forward ends (2 B per
  parameter; none of a frozen weight kept in bf16); it is gone before a backward starts (a recomputed layer casts
  again, inside its transient);
- retained activations, per microbatch in flight: under 1F1B stage s holds min(M, P - s) microbatches between their
  forward and backward, so the first stage holds the most. Per layer: its input (what a recomputed layer's
  checkpoint keeps: the fp32 plain stream, or the hyper-connected copies in the compute dtype and the fp32 pending
  pre-mix) plus, for a layer that is not
  recomputed, the tensors its backward reads (``_saved_bytes``),
  plus the shared tensors it produces (``model/state.py``); per stage the payloads it received (the buffer and the
  copy DeepSpeed's forward makes) and sent (kept for the backward);
- kept attention: a recomputed layer that keeps its sparse-attention outputs (``parallel.keep_attention_layers``,
  the first k of a stage) holds them per microbatch in flight as well;
- a transient: the working set of one layer's backward (its recomputed forward's saved tensors, the kernels'
  workspace, the row's compressed entries rotated and their gradient), the largest over the stage's layers; under a
  quantised base, at least its products' largest transient dequantised copy, which lives inside one MoE product and
  not during the attention's backward, where the layer peaks (measured on a V4.1-width stage, one H100, 2026-12-07:
  the peak unchanged, 14.4 / 14.5 GiB, with a 2.1 GiB copy, ``bench/results/finetune/lora_slice.json``).

Context parallelism (C ranks a row, ``parallel/context.py``): a rank computes one chunk of ``seq_len / C`` tokens, so
every per-token figure above is the chunk's; the compressed entries a Full layer gathers (its latent, and the index
keys computed from it) stay the whole row's on every rank, and so do the all-gather's buffers. The ZeRO-1 state, the
tables' rows and the expert-data groups are partitioned over the C x D ranks of a stage (DeepSpeed's data-parallel
axis). ``context_bytes`` gives what crosses the context group per layer.

The analytic per-layer figures are estimates; a benchmark's measured figures (``LayerTimes.retained_bytes`` and
``backward_bytes`` per layer mode, ``parallel/balance.py``) replace them where given (on whole rows: not under
context parallelism, whose chunks they were not measured on).
"""
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from model.config import ModelArgs, ParallelConfig
from model.hyper import mix_width
from model.layout import Layout, Mode
from model.lora import FFN_MATRICES, LOW_PRECISION, Adapter, LoRA, targeted_modules
from model.matrices import matrix_shape
from model.quantized_base import DEQUANT_ROWS, STORED_BYTES, base_targets, quantized_form, table_bytes
from model.transformer import Transformer
from parallel.payload import Payload, boundary_fields, latent_dtype

GIB = 2 ** 30
KERNEL_WORKSPACE = 4 * GIB  # the sparse-attention backward's chunk buffer (docs/KERNELS.md), on CUDA
# The LM head's logits work per token and vocabulary entry, at the loss's backward: the fp32 logits and the
# cross-entropy's saved log-softmax (4 + 4), their gradients (4 + 4); the bf16 head output is gone by then.
HEAD_BYTES = 16


def _layer_of(name: str) -> int:
    """The layer a parameter is counted in: its block's, the embedding's in layer 0, the rest (final norm, head,
    draft head) in the last (-1)."""
    return int(name.split(".")[1]) if name.startswith("layers.") else (0 if name.startswith("embed.") else -1)


def _meta_model(args: ModelArgs, layout: Layout) -> Transformer:
    with torch.device("meta"):
        return Transformer(args, layout, init=False)


@functools.cache
def parameter_counts(args: ModelArgs, layout: Layout) -> dict[str, tuple[int, ...]]:
    """Parameters of each layer by kind: ``tables`` (Engram tables), ``experts`` (routed experts, the stacked
    ``ffn.experts.w*`` of the layer's MoE and, in the last layer, of the draft head's), ``dense`` (the rest); the
    embedding counted in layer 0, the final norm, head and draft head in the last. ``dense_matrices``: those of
    ``dense`` that Muon trains under ``train.optimizer=muon``. Built once per model (meta)."""
    counts = {kind: [0] * layout.n_layers for kind in ("dense", "tables", "experts", "dense_matrices")}
    for name, p in _meta_model(args, layout).named_parameters():
        kind = "tables" if ".engram.embed." in name else "experts" if ".ffn.experts." in name else "dense"
        counts[kind][_layer_of(name)] += p.numel()
        if kind == "dense" and matrix_shape(name, tuple(p.shape), args) is not None:
            counts["dense_matrices"][_layer_of(name)] += p.numel()
    return {kind: tuple(c) for kind, c in counts.items()}


@functools.cache
def lora_counts(args: ModelArgs, layout: Layout, lora: LoRA) -> dict[str, tuple[int, ...]]:
    """Per layer under ``lora`` (``model/lora.py``): ``low`` the frozen base parameters ``attach`` keeps in bf16
    under bf16 autocast (``LOW_PRECISION``) outside the routed experts, ``low_experts`` the routed experts' of them;
    ``adapters`` the adapters' parameters outside the routed experts, ``adapter_experts`` the routed experts' (split
    over expert ranks with their experts). The adapters are ``Adapter``s of the shapes ``targeted_modules`` finds,
    built on the meta device (no draws). With ``lora.quantized_base`` the matrices the stage holds in the release's
    form (``model.quantized_base.base_targets``: the blocks' and the draft head's routed experts) are ``fp8`` and
    ``fp4`` (the routed experts) instead, whatever their kind above; the Engram tables are ``estimate``'s. Of them,
    ``fp8_largest`` is the layer's largest FP8 matrix and ``fp4_stack`` its largest stack of one routed matrix over
    all the experts (values): what the products' transient dequantised buffer holds at most."""
    model = _meta_model(args, layout)
    counts = {kind: [0] * layout.n_layers for kind in ("low", "low_experts", "adapters", "adapter_experts", "fp8",
                                                       "fp4", "fp8_largest", "fp4_stack")}
    held = {}  # parameter name -> fmt
    for owner, attribute, name, (fmt, _) in base_targets(model, quantized_form) if lora.quantized_base else ():
        target = getattr(owner, attribute)
        if isinstance(target, nn.Linear):
            held[f"{name}.weight"] = fmt
        elif not hasattr(target, "part_rows"):  # a routed stack (a table: not a matrix)
            held[name] = fmt
    for name, p in model.named_parameters():
        if name in held or LOW_PRECISION.fullmatch(name):
            routed = ".ffn.experts." in name
            kind = held[name] if name in held else "low_experts" if routed else "low"
            counts[kind][_layer_of(name)] += p.numel()
            if name in held:
                largest = counts["fp8_largest" if kind == "fp8" else "fp4_stack"]
                largest[_layer_of(name)] = max(largest[_layer_of(name)], p.numel())
    with torch.device("meta"):
        for name, module in targeted_modules(model, lora.targets):
            stacked = hasattr(module, "expert_ids")
            shapes = [getattr(module, w).shape for w in FFN_MATRICES] if stacked else [module.weight.shape]
            numel = sum(q.numel() for shape in shapes for q in Adapter(shape, lora.rank, lora.scale).parameters())
            counts["adapter_experts" if stacked else "adapters"][_layer_of(name)] += numel
    return {kind: tuple(c) for kind, c in counts.items()}


def _dequantized_copies(args: ModelArgs, layout: Layout, lora: LoRA | None, tokens: int, expert_parallel: int,
                        dtype: torch.dtype) -> list[float]:
    """Per layer, the bytes of the largest transient dequantised copy a quantised base's product makes
    (``model.quantized_base.DEQUANT_ROWS``): the largest FP8 matrix where a rank's chunk has that many tokens, the
    rank's stack of w1 over w3 (twice its largest routed stack, ``QuantizedRows``' one buffer) where its experts
    receive that many rows each on average (its tokens x top-k over its experts); 0 without a quantised base. The
    model's matrices are taken as aligned for torch's GEMM, and wq_a over wkv as smaller than the largest FP8 one."""
    if lora is None or not lora.quantized_base:
        return [0.0] * layout.n_layers
    low = lora_counts(args, layout, lora)
    local = max(args.moe.n_routed_experts // expert_parallel, 1) if args.ffn == "moe" else 1
    routed_rows = tokens * args.moe.n_activated_experts / local if args.ffn == "moe" else 0
    return [max(f8 if tokens >= DEQUANT_ROWS else 0,
                2 * f4 / expert_parallel if routed_rows >= DEQUANT_ROWS else 0) * dtype.itemsize
            for f8, f4 in zip(low["fp8_largest"], low["fp4_stack"])]


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
    if args.hc_mult > 1:  # the stream between the sublayers; each sublayer's mixes (projection, statistic, split)
        width += args.hc_mult * args.dim
        fp32 += 2 * (2 * mix_width(args.hc_mult) + 1)
    if layer in args.engram.layers:  # the looked-up rows, the keys and value, the stream the gate reads
        engram = args.engram
        width += (engram.max_ngram_size - 1) * engram.n_heads * engram.head_dim
        fp32 += (args.hc_mult + 1) * args.dim + args.hc_mult * args.dim
    return tokens * (width * itemsize + fp32 * 4)


def _produced_bytes(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, dtype: torch.dtype,
                    context: int = 1) -> list[float]:
    """Shared tensors each layer produces (``model/state.py``), at their model dtypes: latents as
    ``parallel.payload.latent_dtype`` says and index keys in the compute dtype, the whole row's under context
    parallelism too (gathered); selections and candidate blocks int64, indexer logits and targets fp32, per query of
    the ``context`` chunk."""
    B, T = micro_batch, seq_len // context
    blocks = min(layout.candidate_topk_blocks, -(-seq_len // layout.candidate_block_size))
    produced = [0.0] * layout.n_layers
    for name, source in layout.last_use:
        ratio = layout.compress_ratios[source]
        entries = B * (seq_len // ratio)
        produced[source] += {"kv": entries * args.head_dim * latent_dtype(ratio, dtype).itemsize,
                             "index_k": entries * args.index_head_dim * dtype.itemsize,
                             "topk": B * T * args.index_topk * 8,
                             "candidates": B * T * blocks * 8,
                             "index_logits": B * T * args.index_topk * 4,
                             "index_target": B * T * args.index_topk * 4}[name]
    return produced


def _entry_bytes(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, dtype: torch.dtype,
                 context: int = 1) -> list[float]:
    """The whole row's compressed entries in a layer's working set, C or not: a compressed layer rotates the latent
    into the compute dtype for the kernels and gets its gradient back in it (2 copies); under context parallelism a
    Full layer's all-gather also holds every chunk's part and their concatenation (2 copies in the latent's dtype)."""
    working = [0.0] * layout.n_layers
    for i, plan in enumerate(layout.plan):
        if plan.mode is Mode.WINDOW:
            continue
        entries = micro_batch * (seq_len // plan.ratio) * args.head_dim
        working[i] = 2 * entries * dtype.itemsize
        if plan.mode is Mode.FULL and context > 1:
            working[i] += 2 * entries * latent_dtype(plan.ratio, dtype).itemsize
    return working


def context_bytes(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int,
                  dtype: torch.dtype) -> tuple[list[float], list[float]]:
    """Per layer and microbatch, what a context group exchanges (``model/context.py``, ``parallel/context.py``):
    ``gathered``, the row's compressed latent a Full layer all-gathers (every chunk's entries; its gradient comes back
    by reduce-scatter), and ``halo``, the tail of one chunk that every rank all-gathers: the window's ``window - 1``
    rows of window KV (compute dtype, every layer) and for a Full layer of ratio m > 1 the ``m - 1`` fp32 input rows of
    a group that straddles the border. A rank receives (C - 1) / C of ``gathered`` and C - 1 tails. Index keys are
    not sent: every rank computes them from the gathered latent."""
    gathered, halo = [0.0] * layout.n_layers, [0.0] * layout.n_layers
    for i, plan in enumerate(layout.plan):
        halo[i] = micro_batch * (args.window_size - 1) * args.head_dim * dtype.itemsize
        if plan.mode is Mode.FULL:
            entries = micro_batch * (seq_len // plan.ratio)
            gathered[i] = entries * args.head_dim * latent_dtype(plan.ratio, dtype).itemsize
            halo[i] += micro_batch * (plan.ratio - 1) * args.dim * 4
    return gathered, halo


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


def recomputed_layers(parallel: ParallelConfig, n_layers: int) -> int:
    """``parallel.recompute`` as a count of each stage's leading layers that recompute: ``layer`` all of them,
    ``block`` the first ``parallel.recompute_layers``."""
    return {"none": 0, "layer": n_layers, "block": parallel.recompute_layers}[parallel.recompute]


def kept_per_stage(keep, n_stages: int) -> tuple[int, ...]:
    """``parallel.keep_attention_layers`` per stage: one integer for every stage, or a list with one per stage."""
    return tuple(int(k) for k in keep) if isinstance(keep, Sequence) else (int(keep),) * n_stages


def estimate(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, dtype: torch.dtype,
             recompute_layers: int, data_parallel: int = 1, zero_stage: int = 1, cuda: bool = True,
             index_k: str = "shadow", measured=None, expert_parallel: int = 1, routed_rows: float = 1.0,
             context_parallel: int = 1, lora: LoRA | None = None, offload_inputs: bool = False,
             head_chunk: int = 0, muon: bool = False) -> MemoryModel:
    """The analytic model of a job's layers. ``recompute_layers`` counts from each stage's first layer; since the
    split is not known yet, layers are treated as recomputed when every layer is (``recompute=layer``) and as not
    recomputed otherwise (an upper bound for ``block``). ``measured``: a ``LayerTimes`` whose per-mode bytes
    replace the analytic retained and transient figures (at ``context_parallel`` 1 only: they are whole rows').

    ``data_parallel`` is D, the replicas of a stage, and ``context_parallel`` C the ranks that split each row: a
    stage has C x D ranks, over which ZeRO-1 partitions the dense AdamW state and the Engram tables' rows.
    ``expert_parallel`` (E, ``parallel/experts.py``, over those C x D ranks): a rank holds the dense parameters and
    1/E of every MoE's routed experts, whose AdamW state is partitioned over the C x D / E ranks holding the same
    experts. Its routed rows are on average its own tokens x top-k (``routed_rows`` times that on the busiest rank);
    with E > 1 the all-to-all's two receive buffers (the rows from the other ranks, their outputs back), in the
    compute dtype, live while a MoE layer's forward or backward runs (transient). ``lora``: the base is frozen and
    only the adapters train (the module docstring). ``offload_inputs`` (``parallel.recompute_offload``): a
    recomputed layer's input waits on the host, so it is not retained; the backward holds two (the layer's, back,
    and the previous one's, on its way) in its transient. ``head_chunk``: tokens per chunk of the LM head and loss
    (0: all of them), whose logits work (``HEAD_BYTES`` per token and vocabulary entry) is the last layer's
    transient when it is larger. ``muon`` (``train.optimizer=muon``): the matrices keep one moment, not two."""
    counts = parameter_counts(args, layout)
    tables = counts["tables"]  # row-sharded over the stage's ranks
    ranks, E = data_parallel * context_parallel, expert_parallel
    if ranks % E:
        raise ValueError(f"parallel.expert_parallel={E} does not divide the {ranks} ranks of a stage "
                         f"({data_parallel} data-parallel replica(s) x {context_parallel} context-parallel)")
    dense_shards, expert_shards = (ranks, ranks // E) if zero_stage == 1 else (1, 1)

    def trained(dense: float, experts: float, matrices: float = 0.0) -> float:
        """fp32 weight and gradient, and the moments partitioned: Muon's one for ``matrices`` of ``dense`` and the
        experts under ``muon``, AdamW's two otherwise."""
        expert_moments = 4 if muon else 8
        return (dense * (8 + 8 / dense_shards) - matrices * 4 / dense_shards
                + experts / E * (8 + expert_moments / expert_shards))

    cast = 2 if dtype == torch.bfloat16 else 0  # bytes of the bf16 copy autocast makes of an fp32 weight
    if lora is None:
        per_row = 4 + (8 if args.engram.train else 0)  # fp32 weight, sparse Adam's moments (no dense gradient)
        matrices = counts["dense_matrices"] if muon else [0] * layout.n_layers
        state = [trained(n, e, m) + t * per_row / ranks
                 for n, e, m, t in zip(counts["dense"], counts["experts"], matrices, tables)]
        casts = [(n + e / E) * cast for n, e in zip(counts["dense"], counts["experts"])]
    else:  # frozen base: weights only, bf16 where attach keeps them so; tables fp32 (as released: FP8 rows), frozen
        low = lora_counts(args, layout, lora)
        per_value = table_bytes(args.engram.head_dim) if lora.quantized_base else 4
        w = dtype.itemsize if dtype == torch.bfloat16 else 4
        fp32 = [(n - ln - f8, (e - le - f4) / E) for n, e, ln, le, f8, f4 in
                zip(counts["dense"], counts["experts"], low["low"], low["low_experts"], low["fp8"], low["fp4"])]
        stored = [f8 * STORED_BYTES["fp8"] + f4 / E * STORED_BYTES["fp4"] for f8, f4 in zip(low["fp8"], low["fp4"])]
        state = [4 * (n + e) + w * (ln + le / E) + q + t * per_value / ranks + trained(an, ae)
                 for (n, e), ln, le, q, t, an, ae in zip(fp32, low["low"], low["low_experts"], stored, tables,
                                                         low["adapters"], low["adapter_experts"])]
        casts = [(n + e + an + ae / E) * cast for (n, e), an, ae in zip(fp32, low["adapters"], low["adapter_experts"])]
    tokens = micro_batch * seq_len // context_parallel  # a rank's chunk of each row
    produced = _produced_bytes(args, layout, micro_batch, seq_len, dtype, context_parallel)
    entries = _entry_bytes(args, layout, micro_batch, seq_len, dtype, context_parallel)
    all_recomputed = recompute_layers >= layout.n_layers
    exchange = 0.0
    if E > 1 and args.ffn == "moe":
        exchange = 2 * tokens * args.moe.n_activated_experts * routed_rows * args.dim * dtype.itemsize
    copies = _dequantized_copies(args, layout, lora, tokens, E, dtype)
    retained, transient = [], []
    stream = tokens * (4 * args.dim if args.hc_mult == 1  # the plain stream is fp32, the copies the compute dtype
                       else args.hc_mult * (args.dim * dtype.itemsize + 4))  # with the fp32 pre-mix
    on_host = offload_inputs and all_recomputed
    for i in range(layout.n_layers):
        saved = _saved_bytes(args, layout, i, tokens, dtype.itemsize, routed_rows)
        retained.append((0 if on_host else stream) + produced[i] + (0 if all_recomputed else saved))
        transient.append(max((saved if all_recomputed else 0) + entries[i] + exchange
                             + (KERNEL_WORKSPACE if cuda else 0) + (2 * stream if on_host else 0), copies[i]))
    head = HEAD_BYTES * min(head_chunk or tokens, tokens) * args.vocab_size
    transient[-1] = max(transient[-1], head)
    if measured is not None and context_parallel == 1:
        retained, transient = measured.memory(layout, retained, transient)
    boundary = [0.0] * layout.n_layers
    for i in range(layout.n_layers - 1):
        payload = Payload(boundary_fields(args, layout, i, micro_batch, seq_len, dtype, index_k,
                                          context=context_parallel))
        floats, raw = payload.wire_sizes()
        boundary[i] = floats * payload.float_dtype.itemsize + raw
    # out in the compute dtype, LSE and selected mass in fp32, per head; under recompute=block the not-recomputed
    # bound above already counts the output among the saved tensors
    kept = tokens * args.n_heads * (args.head_dim * dtype.itemsize + 2 * 4) if all_recomputed else 0
    return MemoryModel(tuple(state), tuple(casts), tuple(retained), tuple(transient), tuple(boundary),
                       (kept,) * layout.n_layers)
