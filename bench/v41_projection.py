"""Projection of V4.1-Flash at 64K tokens a row on 64 to 512 H200s (issues 35, 36, 37): pretraining, full fine-tuning
and LoRA, on pipeline stages P x context-parallel ranks C x data-parallel replicas D, the routed experts split over
expert groups of E of a stage's C x D ranks, from the 1F1B simulator (``parallel/simulate.py``, the all-to-alls and
the context collectives in the passes) and the memory model (``parallel/memory.py``).

    python bench/v41_projection.py [--gpus 64,128,256,512] [--global-rows 1024] [--finetune-rows 256]
                                   [--lora-rank 16] [--slice v41_slice.json]
                                   [--out bench/results/projection_v41/projection.json] [--docs docs/projection_v41.md]

Jobs: pretraining (``--global-rows`` a step) and full fine-tuning (``--finetune-rows``: the same memory, fewer
microbatches) train every weight, the Engram tables included; LoRA (``train.lora.rank``, on the attention projections,
the shared and the routed experts: ``LORA_TARGETS``, as measured) keeps the frozen base's weights only (bf16 matrices)
and trains the adapters, its layers' times those of full fine-tuning x the LoRA / full step ratio measured on
small_moe at 64K (``LORA_FT`` / ``FULL_FT``), its optimizer's time per trained parameter.

Context parallelism (C): a rank computes its chunk of 65,536 / C tokens (``Layers.chunk_fwd_s``: the indexer's
scoring over every visible entry, ``growing_seconds``, weighs (2C - 1) / C^2 on the last chunk), the grouped GEMMs at
the chunk's tokens per expert, its payloads per chunk, the latents' all-gathers and halos over NVLink (C <= 8: in a
node); the state is partitioned over the C x D ranks of a stage.

Model: ``model=v41_flash layout=v41`` (40 layers, 384 experts top-6 + 1 shared, dim 5,120, hc 4, Engram before
layers 1 and 14 with its tables trained and row-sharded over each stage's D replicas), ``parallel.recompute=layer``
and ``parallel.head_chunk=4096`` (the LM head's logits 4,096 tokens at a time),
one row of 65,536 tokens a microbatch, bf16 autocast over fp32 masters, ZeRO-1. The draft head (3 DSpark blocks) is
held (its weights, gradients and state, its experts split by E) but not trained: at 64K its activations do not fit
(docs/V41.md), so ``train.dspark_loss_coef=0`` and it costs no time.

Per-layer times (seconds, forward; backward with the recomputed forward), ``derived`` unless a slice is given:
- from ``small_moe`` at 64K on one H200 (``SMALL_MOE``): each layer's probed forward and backward, scaled so that
  they sum to the step's parts (attention, mhc, engram, moe), less its MoE part (per layer: the part / 40);
- the attention kernels are V4.1's already (same heads, head dim, indexer, layout); the projections' extra
  parameters at V4.1's width (q_lora 1,280, o_lora 1,024, dim 5,120) cost 2 x params x T forward, 6 x backward, at
  ``MATMUL_EFFICIENCY`` of the measured bf16 matmul rate;
- the hyper-connections' part (memory-bound over the 4 fp32 copies of the stream) x 5 (dim 5,120 / 1,024); Engram's
  part x 10 (its projection's FLOPs: head dim 256 / 128, dim x 5);
- V4.1's MoE per layer at E: the routed GEMMs (18 x rows x dim x inter, rows = T x 6 on average on every rank:
  a rank receives as many rows as its tokens send out) at the grouped-GEMM rate ``moe_ffn.json`` measured at the
  tokens per expert of that E (T x 6 / (384 / E): 1,024 E; interpolated in log tokens, the last measured, 4,096,
  held above it), the shared expert at the dense rate, the gate's extra experts (384 instead of the benchmark's 24)
  at the split-bf16 gate's rate ``moe_ffn.json`` measured (``gate_tflops``), and the rest (gate, sort,
  permutations, combine) per token from ``moe_ffn.json``'s whole
  layer (its ms less its routed and shared parts); a third of each forward, two thirds backward, plus the
  recomputed forward;
- the LM head's FLOPs at the dense rate on the last layer; the step's remainder (optimizer, embedding, loss) per
  parameter from ``small_moe``'s ``rest`` part.
With ``--slice`` (``bench/v41_slice.py``'s JSON: layers 20-23 and 24-27 at V4.1's width on an E = 16 rank, 393,216
routed rows a layer), every layer's time is the derived one plus the slice's mean residual: measured (its runs at
``recompute=layer``, split ``uniform``, scaled to the step less the all-to-all stand-in) minus derived at E = 16.

Links (8 H200s a node): NVLink 4, 900 GB/s bidirectional per GPU, all-to-all taken at ``ALLTOALL_NVLINK_GBPS``
effective per direction; InfiniBand 8 x 400 Gb/s per node = 50 GB/s per GPU and direction, all-to-all at
``ALLTOALL_IB_FRACTION`` of it, all-reduce at ``ALLREDUCE_IB_FRACTION`` when a stage's replicas span nodes, pipeline
boundaries at 50 GB/s. Routing uniform (every rank sends (E-1)/E of its rows away and gets as many); the all-to-alls
not overlapped unless the ``overlap`` columns say so (hidden behind the shared expert, up to its time).
"""
import argparse
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from pipeline_projection import (GPU_BYTES, MATMUL_EFFICIENCY, T, boundary_bytes, head_s, model, project,  # noqa: E402
                                 replace_block)
from model.lora import LoRA  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from parallel.context import chunk_length  # noqa: E402
from parallel.experts import routed_bytes  # noqa: E402
from parallel.memory import context_bytes, estimate, layer_parameters, lora_counts, parameter_counts  # noqa: E402
from parallel.simulate import Cluster, Layers  # noqa: E402
from result_meta import result_meta  # noqa: E402

SMALL_MOE = ROOT / "bench/results/train/train_step_small_moe_65536.json"
SMALL = ROOT / "bench/results/train/train_step_small_65536.json"
MOE_FFN = ROOT / "bench/results/kernels/moe_ffn.json"
INDEXER = ROOT / "bench/results/kernels/bench.json"  # indexer_64k: the selection's growing part
FULL_FT = ROOT / "bench/results/finetune/train_step_small_moe_full_65536.json"
LORA_FT = ROOT / "bench/results/finetune/train_step_small_moe_lora_65536.json"
LORA_TARGETS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts", "experts")  # those LORA_FT measured
NAME = "v41_flash"
ALLTOALL_NVLINK_GBPS = 350.0  # of 450 GB/s per direction (900 bidirectional): the low end of the 350-400 brief
IB_GBPS = 50.0  # 8 x 400 Gb/s per node / 8 GPUs, per direction
ALLTOALL_IB_FRACTION, ALLREDUCE_IB_FRACTION = 0.7, 0.8
PARTS = ("attention", "engram", "mhc", "moe")
MHC_SCALE, ENGRAM_SCALE = 5.0, 10.0  # dim 5120 / 1024; Engram head dim 256 / 128 x dim 5120 / 1024


@functools.cache
def attention_params(name: str) -> tuple[int, ...]:
    """Matrix parameters of each layer's attention (``layers.i.attn.*``): what the width changes there."""
    args, layout = model(name)
    with torch.device("meta"):
        net = Transformer(args, layout, init=False)
    counts = [0] * layout.n_layers
    for n, p in net.named_parameters():
        if n.startswith("layers.") and ".attn." in n and p.dim() >= 2:
            counts[int(n.split(".")[1])] += p.numel()
    return tuple(counts)


def small_moe_layers(step: dict) -> tuple[list[float], list[float]]:
    """``small_moe``'s per-layer forward and backward seconds without its MoE: the probed times scaled so that they
    sum to the step's parts, less the MoE part per layer."""
    per_mode = step["per_mode"]
    n = sum(len(m["layers"]) for m in per_mode.values())
    fwd, bwd = [0.0] * n, [0.0] * n
    for m in per_mode.values():
        for i, f, b in zip(m["layers"], m["fwd_ms"], m["bwd_ms"]):
            fwd[i], bwd[i] = f / 1e3, b / 1e3
    parts = step["parts"]["parts"]
    target_f = sum(parts[p]["forward_ms"] for p in PARTS) / 1e3
    target_b = sum(parts[p]["recompute_ms"] + parts[p]["backward_ms"] for p in PARTS) / 1e3
    moe = parts["moe"]
    sf, sb = target_f / sum(fwd), target_b / sum(bwd)
    return ([f * sf - moe["forward_ms"] / 1e3 / n for f in fwd],
            [b * sb - (moe["recompute_ms"] + moe["backward_ms"]) / 1e3 / n for b in bwd])


def routed_tflops(moe_ffn: dict, tokens_per_expert: float) -> float:
    """The routed experts' rate (forward + backward, bf16 autocast over fp32 weights) at ``tokens_per_expert``:
    ``moe_ffn.json``'s uniform cases interpolated in log tokens, the ends held."""
    cases = sorted((c["tokens_per_expert"], c["routed_tflops"]) for c in moe_ffn["cases"] if c["routing"] == "uniform")
    if tokens_per_expert <= cases[0][0]:
        return cases[0][1]
    for (t0, r0), (t1, r1) in zip(cases, cases[1:]):
        if tokens_per_expert <= t1:
            w = math.log(tokens_per_expert / t0) / math.log(t1 / t0)
            return r0 + w * (r1 - r0)
    return cases[-1][1]


def gate_tflops(moe_ffn: dict) -> float:
    """The gate's rate, forward + backward counted as 6 x tokens x dim x experts: ``moe_ffn.json``'s split-bf16 GEMMs
    (``model/split_gemm.py``) at V4.1's 384 experts."""
    gate = moe_ffn["gate"]
    return 6 * gate["tokens"] * moe_ffn["shape"]["dim"] * gate["experts"] / (gate["split_bf16"]["fwd_bwd_ms"] / 1e3) / 1e12


def moe_seconds(moe_ffn: dict, expert_parallel: int, dense_tflops: float, chunk: int = T) -> dict:
    """V4.1's MoE layer on one rank at E, forward + backward without recompute (seconds), by part, for a row of T
    tokens of which a rank routes ``chunk`` (T / C under context parallelism), at the grouped GEMM's rate for the
    chunk's tokens per expert (the seconds are the row's: the simulator divides them by C)."""
    args, _ = model(NAME)
    moe, dim = args.moe, args.dim
    rows = T * moe.n_activated_experts
    per_expert = chunk * moe.n_activated_experts / (moe.n_routed_experts // expert_parallel)
    routed = 18 * rows * dim * moe.inter_dim / (routed_tflops(moe_ffn, per_expert) * 1e12)
    shared = 18 * T * dim * moe.inter_dim * moe.n_shared_experts / (dense_tflops * 1e12)
    layer = max(moe_ffn["moe_layer"], key=lambda c: c["tokens"])  # the whole layer, 24 experts, largest count
    bench_rows = layer["tokens"] * moe_ffn["shape"]["topk"]
    bench_routed = 18 * bench_rows * dim * moe.inter_dim / (
        routed_tflops(moe_ffn, layer["tokens_per_expert"]) * 1e12)
    bench_shared = 18 * layer["tokens"] * dim * moe.inter_dim / (dense_tflops * 1e12)
    rest = max(0.0, layer["ms"] / 1e3 - bench_routed - bench_shared) * T / layer["tokens"]
    gate = 6 * T * dim * (moe.n_routed_experts - moe_ffn["shape"]["local_experts"]) / (gate_tflops(moe_ffn) * 1e12)
    return {"routed": routed, "shared": shared, "rest": rest, "gate": gate, "tokens_per_expert": per_expert,
            "routed_tflops": routed_tflops(moe_ffn, per_expert)}


def growing_seconds(indexer: dict, layout) -> list[float]:
    """Per layer, the forward seconds at T that grow with a query's position: the selection of an index source
    without candidate blocks scores every visible entry. ``indexer`` is ``kernels/bench.json``'s ``indexer_64k``
    (T = 65,536, m = 1, 32 x 128 heads): the candidate source's selection with its blocks (``select_blocks_ms``),
    another Full layer's plain selection (``select_ms``), both over m (1 / m of the entries)."""
    seconds = [0.0] * layout.n_layers
    for i, p in enumerate(layout.plan):
        if p.selects and p.candidate_source is None:
            seconds[i] = indexer["select_blocks_ms" if p.makes_candidates else "select_ms"] / 1e3 / p.ratio
    return seconds


def layer_inputs(step: dict, moe_ffn: dict, expert_parallel: int, correction=(0.0, 0.0), context: int = 1,
                 indexer: dict | None = None, scale: float = 1.0, chunk: int | None = None) -> tuple[Layers, dict]:
    """V4.1's per-layer seconds, bytes and parameters at E (see the docstring); ``correction``: seconds added to
    every layer's forward and backward (the slice's residual); ``context``: C ranks a row (the MoE's rate at a
    chunk's rows, a rank's payloads, the context exchanges; ``indexer``: ``growing_seconds``'s source); ``scale``:
    on every layer's time (LoRA's measured step over full fine-tuning's); ``chunk``: the tokens a rank routes, when
    not T / C (a longer row's chunk, ``bench/context_projection.py``)."""
    args, layout = model(NAME)
    base_args, _ = model("small_moe")
    dense = MATMUL_EFFICIENCY * step["matmul_tflops"]
    fwd, bwd = small_moe_layers(step)
    parts, n = step["parts"]["parts"], layout.n_layers
    extra = [a - b for a, b in zip(attention_params(NAME), attention_params("small_moe"))]
    moe = moe_seconds(moe_ffn, expert_parallel, dense, chunk or T // context)
    moe_t = moe["routed"] + moe["shared"] + moe["rest"] + moe["gate"]

    def part(name, scale, layers):
        p = parts[name]
        return ((scale - 1) * p["forward_ms"] / 1e3 / len(layers),
                (scale - 1) * (p["recompute_ms"] + p["backward_ms"]) / 1e3 / len(layers))
    mhc, engram = part("mhc", MHC_SCALE, range(n)), part("engram", ENGRAM_SCALE, args.engram.layers)
    for i in range(n):
        fwd[i] += mhc[0] + 2 * extra[i] * T / (dense * 1e12) + moe_t / 3 + correction[0]
        bwd[i] += mhc[1] + 6 * extra[i] * T / (dense * 1e12) + moe_t + correction[1]
        if i in args.engram.layers:
            fwd[i], bwd[i] = fwd[i] + engram[0], bwd[i] + engram[1]
    bwd[-1] += head_s(args, base_args, dense * 1e12)
    counts = parameter_counts(args, layout)
    params = [d + e for d, e in zip(counts["dense"], counts["experts"])]
    rest_per_param = parts["rest"]["other_ms"] / 1e3 / step["params"]
    boundary, gradient = boundary_bytes(NAME, context)
    gathered, halo = context_bytes(args, layout, 1, T, torch.bfloat16)
    layers = Layers([f * scale for f in fwd], [b * scale for b in bwd], boundary, gradient, params, rest_per_param,
                    routed_bytes=routed_bytes(args, layout, 1, T, 2), shared_fwd_s=[moe["shared"] / 3] * n,
                    shared_bwd_s=[moe["shared"]] * n, expert_params=list(counts["experts"]), recomputed=True,
                    growing_fwd_s=[g * scale for g in growing_seconds(indexer, layout)] if indexer else None,
                    gathered_bytes=gathered, halo_bytes=halo)
    return layers, moe


def slice_correction(slice_json: dict, step: dict, moe_ffn: dict) -> dict:
    """The slice's mean residual per layer (measured minus derived at E = 16), forward and backward, from its runs
    at ``recompute=layer``, split ``uniform``; raises ValueError when it has none."""
    derived, _ = layer_inputs(step, moe_ffn, 16)
    residual_f, residual_b, mfu, used = [], [], [], []
    for entry in slice_json.get("slices", []):
        for run in entry.get("runs", []):
            if run.get("recompute") != "layer" or run.get("split") != "uniform" or "step_ms" not in run:
                continue
            rows = [r for r in run.get("per_layer", []) if r.get("fwd_ms") is not None and r.get("bwd_ms") is not None]
            if not rows:
                continue
            standin = run.get("summary", {}).get("all_to_all_standin_ms", 0.0)
            scale = (run["step_ms"] - standin) / sum(r["fwd_ms"] + r["bwd_ms"] for r in rows)
            for r in rows:
                residual_f.append(r["fwd_ms"] * scale / 1e3 - derived.fwd_s[r["layer"]])
                residual_b.append(r["bwd_ms"] * scale / 1e3 - derived.bwd_s[r["layer"]])
            mfu.append(run.get("mfu_vs_measured_matmul"))
            used.append(f"layers {entry['layers'][0]}-{entry['layers'][-1]}")
    if not residual_f:
        raise ValueError("no run at recompute=layer, split uniform with per-layer times")
    return {"fwd_s": sum(residual_f) / len(residual_f), "bwd_s": sum(residual_b) / len(residual_b),
            "slices": used, "mfu": mfu}


def configurations(gpus: int, stages=(4, 8, 16, 32), experts=(8, 16, 32, 64, 128),
                   contexts=(1, 2, 4, 8, 16)) -> list[tuple[int, int, int, int]]:
    """(P, E, D, C) with P x C x D = ``gpus``, C splitting a row into chunks of whole groups (``chunk_length``) and E
    dividing a stage's C x D ranks and both expert counts (384, 128), as the engine requires."""
    args, layout = model(NAME)
    found = []
    for P in stages:
        for C in contexts:
            if gpus % (P * C):
                continue
            try:
                chunk_length(C, T, args.window_size, layout.compress_ratios, layout.candidate_block_size)
            except ValueError:
                continue
            D = gpus // (P * C)
            found += [(P, E, D, C) for E in experts if (C * D) % E == 0 and 384 % E == 0 and 128 % E == 0]
    return found


def cluster(gpus: int, ranks: int) -> Cluster:
    """8 GPUs a node, DeepSpeed's rank order (stage x C x D + replica x C + chunk): a stage's ``ranks`` (C x D) fill
    whole nodes once there are 8 or more (its boundaries then cross nodes, its all-reduce too when more than 8); a
    context group of C <= 8 consecutive ranks stays in a node."""
    spans = ranks > 8
    return Cluster(nodes=max(1, gpus // 8), internode_gbps=IB_GBPS, pipeline_across_nodes=ranks >= 8,
                   allreduce_gbps=ALLREDUCE_IB_FRACTION * IB_GBPS if spans else Cluster.allreduce_gbps,
                   alltoall_gbps=ALLTOALL_NVLINK_GBPS, alltoall_internode_gbps=ALLTOALL_IB_FRACTION * IB_GBPS)


@dataclasses.dataclass(frozen=True)
class Job:
    """What is trained: ``rows`` of 64K a step; ``lora`` None trains every weight (the Engram tables included)."""
    name: str
    rows: int
    lora: LoRA | None = None


def lora_time_scale(full: dict, lora: dict) -> float:
    """LoRA's step over full fine-tuning's, measured in one call on small_moe at 64K (the adapters' GEMMs against the
    frozen base's skipped weight gradients): what every layer's time is scaled by for LoRA."""
    return lora["step_s"] / full["step_s"]


def memory_check(full: dict, lora: dict) -> list[dict]:
    """The memory model against the measured one-GPU peaks of small_moe at 64K, full fine-tuning and LoRA."""
    args, layout = model("small_moe")
    checked = []
    for job, step, settings in (("full", full, None), ("LoRA", lora, LoRA(16, 16.0, LORA_TARGETS))):
        memory = estimate(args, layout, 1, T, torch.bfloat16, layout.n_layers, lora=settings)
        checked.append({"job": job, "measured_gib": step["peak_alloc_gib"],
                        "estimated_gib": memory.peaks((range(layout.n_layers),), 1)[0] / 2 ** 30})
    return checked


def projection(gpus: list[int], jobs: list[Job], step: dict, moe_ffn: dict, indexer: dict | None = None,
               correction=(0.0, 0.0), lora_scale: float = 1.0) -> list[dict]:
    """Every configuration of every job and GPU count, simulated without and with the all-to-alls overlapped."""
    args, layout = model(NAME)
    rows, inputs = [], {}
    for job in jobs:
        scale = lora_scale if job.lora else 1.0
        share = 1.0
        if job.lora:  # the optimizer steps the adapters only
            counts = lora_counts(args, layout, job.lora)
            share = (sum(counts["adapters"]) + sum(counts["adapter_experts"])) / sum(layer_parameters(args, layout))
        for n in gpus:
            for P, E, D, C in configurations(n):
                if job.rows % D or job.rows // D < P:
                    continue
                key = (E, C, scale)
                if key not in inputs:
                    layers, moe = layer_inputs(step, moe_ffn, E, correction, C, indexer, scale)
                    inputs[key] = dataclasses.replace(layers, optimizer_s_per_param=layers.optimizer_s_per_param
                                                      * share), moe
                layers, moe = inputs[key]
                place = cluster(n, C * D)
                row = project(NAME, layers, P, D, job.rows // D, place, expert_parallel=E, context_parallel=C,
                              lora=job.lora)
                hidden = project(NAME, layers, P, D, job.rows // D, place, cuts=row["cuts"], expert_parallel=E,
                                 overlap=True, context_parallel=C, lora=job.lora)
                row.update(job=job.name, expert_parallel=E, overlap_tokens_per_s_per_gpu=hidden["tokens_per_s_per_gpu"],
                           overlap_all_to_all_share=hidden["all_to_all_share"],
                           tokens_per_expert=moe["tokens_per_expert"], routed_tflops=moe["routed_tflops"],
                           peak_gib_max=max(row["peak_gib"]), bubble_max=max(row["bubble"]))
                rows.append(row)
    return rows


def best(rows: list[dict]) -> list[dict]:
    """Per job and GPU count: the fastest configuration that fits; when none does, the fastest and the one needing
    the least memory."""
    chosen = []
    for job in dict.fromkeys(r["job"] for r in rows):
        for n in sorted({r["gpus"] for r in rows if r["job"] == job}):
            mine = [r for r in rows if r["gpus"] == n and r["job"] == job]
            fitting = [r for r in mine if r["fits"]]
            fastest = max(fitting or mine, key=lambda r: r["tokens_per_s_per_gpu"])
            smallest = min(mine, key=lambda r: r["peak_gib_max"])
            chosen += [fastest] if fitting or smallest is fastest else [fastest, smallest]
    return chosen


def shape(r: dict) -> str:
    return f"{r['stages']} x {r['expert_parallel']} x {r['data_parallel']} x {r['context_parallel']}"


def table(rows: list[dict]) -> str:
    lines = ["| job | GPUs | P x E x D x C | M | cuts | tokens/s per GPU (overlapped) | est. peak GiB per GPU, max "
             "stage (of it weights, gradients, AdamW, tables) | bubble (max stage) | all-to-all share (overlapped) | "
             "context collectives share |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fit = "" if r["fits"] else " **does not fit**"
        worst = r["peak_gib"].index(max(r["peak_gib"]))
        lines.append(f"| {r['job']} | {r['gpus']} | {shape(r)} | "
                     f"{r['microbatches']} | {r['cuts']} | {r['tokens_per_s_per_gpu']:,.0f} "
                     f"({r['overlap_tokens_per_s_per_gpu']:,.0f}) | {r['peak_gib_max']:.0f} "
                     f"(state {r['state_gib'][worst]:.0f}){fit} | "
                     f"{r['bubble_max']:.1%} | {r['all_to_all_share']:.1%} ({r['overlap_all_to_all_share']:.1%}) | "
                     f"{r['context_share']:.1%} |")
    return "\n".join(lines)


def fit_table(rows: list[dict]) -> str:
    """Per job and GPU count, every (P, E, D, C) that fits, by C: the memory verdict at a glance."""
    jobs, gpus = list(dict.fromkeys(r["job"] for r in rows)), sorted({r["gpus"] for r in rows})
    contexts = sorted({r["context_parallel"] for r in rows})
    lines = ["| job | GPUs | " + " | ".join(f"C = {c}" for c in contexts) + " |", "|---|---|" + "---|" * len(contexts)]
    for job in jobs:
        for n in gpus:
            cells = []
            for c in contexts:
                mine = [r for r in rows if r["job"] == job and r["gpus"] == n and r["context_parallel"] == c]
                fitting = [f"{r['stages']}x{r['expert_parallel']}x{r['data_parallel']} ({r['peak_gib_max']:.0f})"
                           for r in mine if r["fits"]]
                least = min((r["peak_gib_max"] for r in mine), default=None)
                cells.append(", ".join(fitting) if fitting else "-" if least is None else f"none (least {least:.0f})")
            lines.append(f"| {job} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fastest(rows: list[dict], per: int = 3) -> list[dict]:
    """Per job and GPU count, the ``per`` fastest configurations that fit."""
    chosen = []
    for job in dict.fromkeys(r["job"] for r in rows):
        for n in sorted({r["gpus"] for r in rows}):
            fitting = [r for r in rows if r["job"] == job and r["gpus"] == n and r["fits"]]
            chosen += sorted(fitting, key=lambda r: -r["tokens_per_s_per_gpu"])[:per]
    return chosen


def markdown(result: dict) -> str:
    """docs/projection_v41.md: what is projected, the assumptions, what fits, the tables, the calibration, its error."""
    a, c = result["assumptions"], result["calibration"]
    jobs = {j["name"]: j for j in result["jobs"]}

    def spread(low: int, high: int) -> str:  # the all-to-all shares of the rows with E in [low, high]
        shares = [r["all_to_all_share"] for r in result["rows"] if low <= r["expert_parallel"] <= high]
        return f"{min(shares):.0%}-{max(shares):.0%}"
    lora = jobs["LoRA"]["lora"]
    source = (f"the V4.1-width slice `{c['slice']['file']}` (mean residual per layer forward "
              f"{c['slice']['fwd_s'] * 1e3:+.1f} ms, backward {c['slice']['bwd_s'] * 1e3:+.1f} ms over the derived "
              f"times, {', '.join(c['slice']['slices'])})" if c.get("slice") else
              f"**derived rates only** ({c['slice_note']})")
    return "\n".join([
        "# Projection: V4.1-Flash at 64K on 64-512 H200s: pretraining, full fine-tuning, LoRA (issues 35-37)", "",
        f"Written by `{result['command']}` ({result['date']}, code {result['code']}; "
        "[projection.json](../bench/results/projection_v41/projection.json), every configuration). A projection, "
        "not a measurement: the 1F1B simulator (`parallel/simulate.py`, the expert all-to-alls and the context "
        "collectives inside the passes) and the memory model (`parallel/memory.py`) on per-layer times calibrated on "
        "one H200. `python -m parallel.plan` prints the same estimates for one configuration (commands in "
        "[FINETUNING.md](FINETUNING.md#plans-for-deepseek-v41-flash)).", "",
        f"**Jobs.** {result['model']}, one 64K row a microbatch, bf16 autocast, ZeRO-1. *Pretraining*: "
        f"{jobs['pretraining']['rows']} rows ({jobs['pretraining']['rows'] * T / 1e6:.0f} M tokens) a step; *full "
        f"fine-tuning*: {jobs['full fine-tuning']['rows']} rows "
        f"({jobs['full fine-tuning']['rows'] * T / 1e6:.1f} M tokens) a step: the same memory as pretraining (every "
        "weight trains: fp32 masters and gradients, AdamW partitioned over a stage's C x D ranks, the Engram tables "
        "row-sharded and trained), fewer microbatches; *LoRA*: the same batch, `train.lora.rank="
        f"{lora['rank']}` on {', '.join(lora['targets'])}: the base frozen (its weights only, bf16 for the matrices "
        "autocast reads, fp32 for the rest and the tables, no gradients or AdamW state: `model/lora.py`), the "
        "adapters' fp32 state, each layer's time full fine-tuning's x "
        f"{c['lora_time_scale']:.3f} (LoRA's step over full fine-tuning's on small_moe at 64K, "
        f"`{c['lora_steps'][1]}` / `{c['lora_steps'][0]}`). The draft head is held, not trained (at 64K its "
        "activations do not fit: docs/V41.md; context parallelism refuses it). P x E x D x C: P stages, C ranks a "
        "row (`parallel.context_parallel`), D data-parallel replicas, expert groups of E of a stage's C x D ranks; "
        "the split is the engine's (`balanced_cuts` on these times, memory-aware, under the GPU's "
        f"{a['gpu_gib']:.1f} GiB, what torch reports of an H200).", "",
        "**Assumptions.** 8 H200s a node. Expert all-to-all within a node over NVLink 4 (900 GB/s bidirectional per "
        f"GPU) at {a['alltoall_nvlink_gbps']:.0f} GB/s effective per direction; between nodes InfiniBand "
        f"8 x 400 Gb/s a node = {a['ib_gbps_per_gpu']:.0f} GB/s per GPU and direction, all-to-all at "
        f"{a['alltoall_ib_gbps']:.0f} GB/s (70%), gradient all-reduce at {a['allreduce_ib_gbps']:.0f} GB/s (80%) "
        f"when a stage's ranks span nodes, pipeline boundaries at {a['ib_gbps_per_gpu']:.0f} GB/s across nodes, "
        f"{a['p2p_nvlink_gbps']:.0f} within; the context group's ring all-gathers and reduce-scatters over NVLink "
        f"({a['p2p_nvlink_gbps']:.0f} GB/s, C consecutive ranks <= 8 in a node), between nodes at C = 16. No NCCL "
        "bandwidth measured: published link figures. Routing uniform: each exchange moves a rank's tokens x 6 x "
        "5120 x 2 B x (E-1)/E, six exchanges a layer and microbatch under recompute. \"Overlapped\" hides the "
        "all-to-alls behind the shared expert of the same pass, up to its time (an optimistic bound). Dense matmuls "
        f"at {a['matmul_efficiency']:.0%} of the measured bf16 rate, the gate at the {a['gate_tflops']:.0f} "
        "TFLOP/s its split-bf16 GEMMs measured, the hyper-connections' time x 5 and Engram's x 10 of small_moe's.", "",
        "## What fits", "",
        "Every (P x E x D) that fits, by C, with its estimated peak GiB per GPU (the largest stage); \"none\": the "
        "least any configuration of that C needs; \"-\": no configuration (too few rows a step for D replicas of P "
        "stages).", "", fit_table(result["rows"]), "",
        "## Best configuration per GPU count", "",
        "The fastest that fits; where none fits, the fastest and the one needing the least memory.", "",
        table(result["best"]), "",
        "## The three fastest that fit", "", table(fastest(result["rows"])), "",
        "## Calibration", "",
        f"- Per-layer times: {source}.",
        f"- `{c['small_moe_step']}`: small_moe at 64K on one H200, step {c['small_moe_step_s']:.2f} s, MFU "
        f"{c['small_moe_mfu']:.1%} of the measured {c['matmul_tflops']:.0f} TFLOP/s: its probed layer times scaled "
        "to its parts (attention, mhc, engram, moe), its MoE part replaced, its `rest` as the optimizer's time per "
        "parameter.",
        f"- `{c['moe_ffn']}`: the grouped GEMMs of 24 V4.1 experts at 256-4,096 tokens per expert (fwd + bwd, "
        "autocast) give the routed rate at a rank's tokens per expert (65,536 / C x 6 / (384 / E); 4,096's rate held "
        "above it), the whole MoE layer there the gate/sort/gather/combine cost per token.",
        f"- `{c['indexer']}`: the indexer's selection at 64K ({c['indexer_select_ms']:.1f} ms, "
        f"{c['indexer_select_blocks_ms']:.1f} ms with the candidate blocks, m = 1): the part of layers 2, 8, 14 (/ 2) "
        "and 20 that grows with a query's position, whose last chunk's share is (2C - 1) / C^2.",
        f"- `{c['lora_steps'][0]}`, `{c['lora_steps'][1]}`: LoRA's time scale; the memory model against their peaks "
        "(`tests/parallel/test_context_plan.py`): " + ", ".join(
            f"{m['job']} {m['estimated_gib']:.1f} GiB estimated against {m['measured_gib']:.1f} measured"
            for m in c["memory_check"]) + ".",
        f"- `bench/results/train/train_step_small_65536.json`: small (dense FFN, no hc) at MFU "
        f"{c.get('small_mfu') or 0:.1%}, the attention kernels' share without MoE or hc: context, not fitted.", "",
        "## Reading it, and its likely error", "",
        "- **Context parallelism is what makes V4.1 fit at 64K.** Without it (C = 1) nothing fits: each stage keeps, "
        "per microbatch in flight, every layer's 4 fp32 copies of the stream (65,536 x 4 x 5,120 x 4 B = 5.4 GB a "
        "layer) and its boundary payloads, and the first stage holds P microbatches. C divides all of it by C (the "
        "gathered latents and index keys stay whole rows, 8-64 MiB each a Full layer) and spreads ZeRO-1's AdamW "
        "state and the tables over C times more ranks.",
        "- **What is left is the state.** fp32 weights and gradients are never partitioned by ZeRO-1 (8 B a "
        "parameter: 552 B x 8 B = 4.4 TB over the stages), so full training needs a rank's share of the routed "
        "experts small, 1 / (E x P): E x P >= " + str(min(r["expert_parallel"] * r["stages"] for r in result["rows"]
                                                           if r["fits"] and r["job"] == "pretraining"))
        + " in every configuration that fits; 64 GPUs cannot hold it at any C. LoRA's frozen base is 2 B a matrix "
        "parameter with no gradient or AdamW state, which is why it fits from 64 GPUs.",
        f"- The all-to-all share is small while the expert group stays in a node (E = 8: {spread(8, 8)}) and "
        f"{spread(16, 128)} once it spans nodes (E >= 16) at the assumed 35 GB/s; the context collectives take at "
        f"most {max(r['context_share'] for r in result['rows']):.1%} of a step (a Full layer's latent is 64 MiB at "
        "64K); more stages raise the bubble at a fixed batch, and a memory-aware split that gives the first "
        "stages one layer each leaves them idle (the bubble column).",
        "- Error: the per-layer times are derived, not measured at V4.1's width (unless the slice line above says "
        "otherwise): the hyper-connections' x 5 scaling and the fp32 gate are the largest unknowns (+-30% on the "
        "layer time is plausible); the all-to-all bandwidths are published figures with assumed efficiencies "
        "(+-30%), and uniform routing understates the busiest rank. The memory model was within 2-10% of one-GPU "
        "steps (small, small_moe full and LoRA) but missed 21-25 GiB per stage on two pipeline stages (the engine's "
        "pipeline buffers are the suspect: docs/PARALLELISM.md), so a configuration estimated above ~115 GiB may not "
        "fit until a multi-GPU run says otherwise. Its context terms are checked against hand numbers "
        "(`tests/parallel/test_context_plan.py`), not against a multi-GPU run.", ""])


HEADROOM_GIB = 115.0  # the two-stage run's peaks were 21-25 GiB over the memory model's (docs/PARALLELISM.md)
PLANS_BEGIN = "<!-- plans: written by bench/v41_projection.py --finetuning -->"
PLANS_END = "<!-- plans: end -->"


def plan_command(r: dict, lora: dict | None) -> str:
    """The ``python -m parallel.plan`` command that prints row ``r``'s plan (the engine's own split, on FLOPs)."""
    memory = f"{GPU_BYTES / 2 ** 30:.1f}GiB"
    words = [f"python -m parallel.plan --world-size {r['gpus']} --memory {memory} train.device=cuda "
             "parallel.head_chunk=4096",
             "model=v41_flash layout=v41 data.seq_len=65536 data.micro_batch_size=1 parallel.recompute=layer",
             f"parallel.pipeline_stages={r['stages']} parallel.expert_parallel={r['expert_parallel']} "
             f"parallel.context_parallel={r['context_parallel']} "
             f"train.global_batch_size={r['microbatches'] * r['data_parallel']}"]
    if lora:
        words.append(f"train.lora.rank={lora['rank']} 'train.lora.targets=[{','.join(lora['targets'])}]'")
    return " \\\n  ".join(words)


def finetuning_block(result: dict) -> str:
    """docs/FINETUNING.md's plans: per fine-tuning job and GPU count the fastest configuration that fits and the
    fastest with ``HEADROOM_GIB`` to spare, and the plan commands of the latter at the fewest GPUs."""
    rows = [r for r in result["rows"] if r["job"] != "pretraining"]
    lora = next(j["lora"] for j in result["jobs"] if j["name"] == "LoRA")

    def cell(r):
        return "-" if r is None else f"{shape(r)}: {r['peak_gib_max']:.0f} GiB, {r['tokens_per_s_per_gpu']:,.0f}"

    summary = []
    for job in ("full fine-tuning", "LoRA"):
        mine = [r for r in rows if r["job"] == job]
        fewest = min((r["gpus"] for r in mine if r["fits"]), default=None)
        alone = min((r["peak_gib_max"] for r in mine if r["context_parallel"] == 1), default=None)
        least_c = min((r["context_parallel"] for r in mine if r["fits"] and r["gpus"] == fewest), default=None)
        summary.append(f"{job} fits from {fewest} GPUs (there with C >= {least_c})" if fewest else
                       f"{job} fits on none of these GPU counts")
        summary[-1] += f", at C = 1 on none (the least it needs is {alone:.0f} GiB)" if alone and not any(
            r["fits"] for r in mine if r["context_parallel"] == 1) else ""
    lines = [PLANS_BEGIN, f"Written from [projection.json](../bench/results/projection_v41/projection.json) "
             f"(`{result['command']}`, {result['date']}, code {result['code']}): " + "; ".join(summary) + ".", "",
             "| job | GPUs | configurations that fit | fastest that fits: P x E x D x C, est. GiB per GPU, "
             f"tokens/s per GPU | fastest under {HEADROOM_GIB:.0f} GiB |", "|---|---|---|---|---|"]
    commands = {}  # per job: the plan of the fewest GPUs with headroom
    for job in ("full fine-tuning", "LoRA"):
        for n in sorted({r["gpus"] for r in rows}):
            fitting = [r for r in rows if r["job"] == job and r["gpus"] == n and r["fits"]]
            roomy = [r for r in fitting if r["peak_gib_max"] <= HEADROOM_GIB]
            top = max(fitting, key=lambda r: r["tokens_per_s_per_gpu"], default=None)
            safe = max(roomy, key=lambda r: r["tokens_per_s_per_gpu"], default=None)
            lines.append(f"| {job} | {n} | {len(fitting)} | {cell(top)} | {cell(safe)} |")
            if safe is not None and job not in commands:
                commands[job] = plan_command(safe, lora if job == "LoRA" else None)
    lines += ["", f"The plans of the fewest GPUs with that headroom ({' then '.join(commands)}; each prints its "
              "stages, boundaries, context and expert exchanges, and its memory verdict):", "", "```bash cpu",
              *commands.values(), "```", PLANS_END]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="64,128,256,512", help="GPU counts, comma-separated (multiples of 8)")
    p.add_argument("--global-rows", type=int, default=1024, help="rows of 64K tokens per pretraining step")
    p.add_argument("--finetune-rows", type=int, default=256, help="rows of 64K tokens per fine-tuning step")
    p.add_argument("--lora-rank", type=int, default=16, help="train.lora.rank of the LoRA job")
    p.add_argument("--slice", help="bench/v41_slice.py's JSON (default: the derived rates, said in the output)")
    p.add_argument("--out", default=str(ROOT / "bench/results/projection_v41/projection.json"))
    p.add_argument("--docs", help="Markdown file to write (docs/projection_v41.md)")
    p.add_argument("--finetuning", type=Path, help="Markdown file whose marked block gets the fine-tuning plans "
                                                    "(docs/FINETUNING.md)")
    opts = p.parse_args(argv)
    gpus = [int(g) for g in opts.gpus.split(",")]
    step, moe_ffn = json.loads(SMALL_MOE.read_text()), json.loads(MOE_FFN.read_text())
    indexer = json.loads(INDEXER.read_text())["indexer_64k"]
    full_ft, lora_ft = (json.loads(f.read_text()) for f in (FULL_FT, LORA_FT))
    calibration = {"small_moe_step": str(SMALL_MOE.relative_to(ROOT)), "moe_ffn": str(MOE_FFN.relative_to(ROOT)),
                   "small_moe_step_s": step["step_s"], "small_moe_mfu": step["mfu_vs_measured_matmul"],
                   "matmul_tflops": step["matmul_tflops"], "slice": None,
                   "indexer": str(INDEXER.relative_to(ROOT)), "indexer_select_ms": indexer["select_ms"],
                   "indexer_select_blocks_ms": indexer["select_blocks_ms"],
                   "lora_steps": [str(f.relative_to(ROOT)) for f in (FULL_FT, LORA_FT)],
                   "lora_time_scale": lora_time_scale(full_ft, lora_ft)}
    if SMALL.exists():
        calibration["small_mfu"] = json.loads(SMALL.read_text()).get("mfu_vs_measured_matmul")
    correction = (0.0, 0.0)
    if opts.slice and Path(opts.slice).exists():
        try:
            found = slice_correction(json.loads(Path(opts.slice).read_text()), step, moe_ffn)
            correction = (found["fwd_s"], found["bwd_s"])
            calibration["slice"] = {"file": opts.slice, **found}
        except (ValueError, KeyError, TypeError) as err:
            calibration["slice_note"] = f"--slice {opts.slice} not used ({err}): derived rates"
    else:
        calibration["slice_note"] = (f"--slice {opts.slice}: no such file" if opts.slice else "no --slice") + \
            ": the per-layer times are the derived ones (small_moe step + moe_ffn rates), not V4.1-width measurements"
    print(calibration.get("slice_note") or f"calibrated by the slice {opts.slice}", flush=True)
    lora = LoRA(opts.lora_rank, 16.0, LORA_TARGETS)
    calibration["memory_check"] = memory_check(full_ft, lora_ft)
    jobs = [Job("pretraining", opts.global_rows), Job("full fine-tuning", opts.finetune_rows),
            Job("LoRA", opts.finetune_rows, lora)]
    rows = projection(gpus, jobs, step, moe_ffn, indexer, correction, calibration["lora_time_scale"])
    chosen = best(rows)
    result = {**result_meta(), "model": f"model={NAME} layout=v41 parallel.recompute=layer parallel.head_chunk=4096 data.seq_len={T}",
              "jobs": [{"name": j.name, "rows": j.rows, "lora": dataclasses.asdict(j.lora) if j.lora else None}
                       for j in jobs],
              "global_rows": opts.global_rows, "calibration": calibration,
              "assumptions": {"alltoall_nvlink_gbps": ALLTOALL_NVLINK_GBPS, "ib_gbps_per_gpu": IB_GBPS,
                              "alltoall_ib_gbps": ALLTOALL_IB_FRACTION * IB_GBPS,
                              "allreduce_ib_gbps": ALLREDUCE_IB_FRACTION * IB_GBPS,
                              "p2p_nvlink_gbps": Cluster.p2p_gbps, "matmul_efficiency": MATMUL_EFFICIENCY,
                              "gate_tflops": gate_tflops(moe_ffn), "mhc_scale": MHC_SCALE,
                              "engram_scale": ENGRAM_SCALE,
                              "gpu_gib": GPU_BYTES / 2 ** 30, "routing": "uniform", "draft_head": "held, not trained"},
              "rows": rows, "best": chosen}
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(table(chosen))
    print(fit_table(rows))
    if opts.docs:
        Path(opts.docs).write_text(markdown(result))
    if opts.finetuning:
        replace_block(opts.finetuning, PLANS_BEGIN, PLANS_END, finetuning_block(result))
    return result


if __name__ == "__main__":
    main()
