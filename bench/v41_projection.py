"""Projection of V4.1-Flash training at 64K tokens a row on 64 to 512 H200s (issue 35): pipeline stages P x
data-parallel replicas D, the routed experts split over expert groups of E of a stage's replicas, from the 1F1B
simulator (``parallel/simulate.py``, the all-to-alls in the passes) and the memory model (``parallel/memory.py``).

    python bench/v41_projection.py [--gpus 64,128,256,512] [--global-rows 1024] [--slice v41_slice.json]
                                   [--out bench/results/projection_v41/projection.json] [--docs docs/projection_v41.md]

Model: ``model=v41_flash layout=v41`` (40 layers, 384 experts top-6 + 1 shared, dim 5,120, hc 4, Engram before
layers 1 and 14 with its tables trained and row-sharded over each stage's D replicas), ``parallel.recompute=layer``,
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
  held above it), the shared expert at the dense rate, the gate's extra experts (384 instead of the benchmark's 24,
  fp32) at ``FP32_TFLOPS``, and the rest (gate, sort, gathers, combine) per token from ``moe_ffn.json``'s whole
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
import functools
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from pipeline_projection import GPU_BYTES, MATMUL_EFFICIENCY, T, boundary_bytes, head_s, model, project  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from parallel.experts import routed_bytes  # noqa: E402
from parallel.memory import parameter_counts  # noqa: E402
from parallel.simulate import Cluster, Layers  # noqa: E402
from result_meta import result_meta  # noqa: E402

SMALL_MOE = ROOT / "bench/results/train/train_step_small_moe_65536.json"
SMALL = ROOT / "bench/results/train/train_step_small_65536.json"
MOE_FFN = ROOT / "bench/results/kernels/moe_ffn.json"
NAME = "v41_flash"
FP32_TFLOPS = 50.0  # the gate's fp32 GEMM (no TF32), ~75% of the H200's 67 TFLOP/s fp32 peak: assumed
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


def moe_seconds(moe_ffn: dict, expert_parallel: int, dense_tflops: float) -> dict:
    """V4.1's MoE layer on one rank at E, forward + backward without recompute (seconds), by part."""
    args, _ = model(NAME)
    moe, dim = args.moe, args.dim
    rows = T * moe.n_activated_experts
    per_expert = rows / (moe.n_routed_experts // expert_parallel)
    routed = 18 * rows * dim * moe.inter_dim / (routed_tflops(moe_ffn, per_expert) * 1e12)
    shared = 18 * T * dim * moe.inter_dim * moe.n_shared_experts / (dense_tflops * 1e12)
    layer = max(moe_ffn["moe_layer"], key=lambda c: c["tokens"])  # the whole layer, 24 experts, largest count
    bench_rows = layer["tokens"] * moe_ffn["shape"]["topk"]
    bench_routed = 18 * bench_rows * dim * moe.inter_dim / (
        routed_tflops(moe_ffn, layer["tokens_per_expert"]) * 1e12)
    bench_shared = 18 * layer["tokens"] * dim * moe.inter_dim / (dense_tflops * 1e12)
    rest = max(0.0, layer["ms"] / 1e3 - bench_routed - bench_shared) * T / layer["tokens"]
    gate = 6 * T * dim * (moe.n_routed_experts - moe_ffn["shape"]["local_experts"]) / (FP32_TFLOPS * 1e12)
    return {"routed": routed, "shared": shared, "rest": rest, "gate": gate, "tokens_per_expert": per_expert,
            "routed_tflops": routed_tflops(moe_ffn, per_expert)}


def layer_inputs(step: dict, moe_ffn: dict, expert_parallel: int, correction=(0.0, 0.0)) -> tuple[Layers, dict]:
    """V4.1's per-layer seconds, bytes and parameters at E (see the docstring); ``correction``: seconds added to
    every layer's forward and backward (the slice's residual)."""
    args, layout = model(NAME)
    base_args, _ = model("small_moe")
    dense = MATMUL_EFFICIENCY * step["matmul_tflops"]
    fwd, bwd = small_moe_layers(step)
    parts, n = step["parts"]["parts"], layout.n_layers
    extra = [a - b for a, b in zip(attention_params(NAME), attention_params("small_moe"))]
    moe = moe_seconds(moe_ffn, expert_parallel, dense)
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
    boundary, gradient = boundary_bytes(NAME)
    layers = Layers(fwd, bwd, boundary, gradient, params, rest_per_param,
                    routed_bytes=routed_bytes(args, layout, 1, T, 2), shared_fwd_s=[moe["shared"] / 3] * n,
                    shared_bwd_s=[moe["shared"]] * n, expert_params=list(counts["experts"]), recomputed=True)
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


def configurations(gpus: int, stages=(4, 8, 16, 32), experts=(8, 16, 32, 64, 128)) -> list[tuple[int, int, int]]:
    """(P, E, D) with P x D = ``gpus`` and E dividing D and both expert counts (384, 128)."""
    return [(P, E, gpus // P) for P in stages if gpus % P == 0 for E in experts
            if (gpus // P) % E == 0 and 384 % E == 0 and 128 % E == 0]


def cluster(gpus: int, data_parallel: int) -> Cluster:
    """8 GPUs a node, DeepSpeed's rank order (stage x D + replica): a stage's replicas fill whole nodes once D >= 8
    (its boundaries then cross nodes, its all-reduce too when D > 8)."""
    spans = data_parallel > 8
    return Cluster(nodes=max(1, gpus // 8), internode_gbps=IB_GBPS, pipeline_across_nodes=data_parallel >= 8,
                   allreduce_gbps=ALLREDUCE_IB_FRACTION * IB_GBPS if spans else Cluster.allreduce_gbps,
                   alltoall_gbps=ALLTOALL_NVLINK_GBPS, alltoall_internode_gbps=ALLTOALL_IB_FRACTION * IB_GBPS)


def projection(gpus: list[int], global_rows: int, step: dict, moe_ffn: dict, correction=(0.0, 0.0)) -> list[dict]:
    """Every configuration of every GPU count, simulated without and with the all-to-alls overlapped."""
    rows, inputs = [], {}
    for n in gpus:
        for P, E, D in configurations(n):
            if global_rows % D:
                continue
            layers, moe = inputs.get(E) or inputs.setdefault(E, layer_inputs(step, moe_ffn, E, correction))
            row = project(NAME, layers, P, D, global_rows // D, cluster(n, D), expert_parallel=E)
            hidden = project(NAME, layers, P, D, global_rows // D, cluster(n, D), cuts=row["cuts"],
                             expert_parallel=E, overlap=True)
            row.update(expert_parallel=E, overlap_tokens_per_s_per_gpu=hidden["tokens_per_s_per_gpu"],
                       overlap_all_to_all_share=hidden["all_to_all_share"], tokens_per_expert=moe["tokens_per_expert"],
                       routed_tflops=moe["routed_tflops"], peak_gib_max=max(row["peak_gib"]),
                       bubble_max=max(row["bubble"]))
            rows.append(row)
    return rows


def best(rows: list[dict]) -> list[dict]:
    """Per GPU count: the fastest configuration that fits; when none does, the fastest and the one needing the
    least memory."""
    chosen = []
    for n in sorted({r["gpus"] for r in rows}):
        mine = [r for r in rows if r["gpus"] == n]
        fitting = [r for r in mine if r["fits"]]
        fastest = max(fitting or mine, key=lambda r: r["tokens_per_s_per_gpu"])
        smallest = min(mine, key=lambda r: r["peak_gib_max"])
        chosen += [fastest] if fitting or smallest is fastest else [fastest, smallest]
    return chosen


def table(rows: list[dict]) -> str:
    lines = ["| GPUs | P x E x D | M | cuts | tokens/s per GPU (overlapped) | est. peak GiB per GPU, max stage (of it "
             "weights, gradients, AdamW, tables) | "
             "bubble (max stage) | all-to-all share (overlapped) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fit = "" if r["fits"] else " **does not fit**"
        worst = r["peak_gib"].index(max(r["peak_gib"]))
        lines.append(f"| {r['gpus']} | {r['stages']} x {r['expert_parallel']} x {r['data_parallel']} | "
                     f"{r['microbatches']} | {r['cuts']} | {r['tokens_per_s_per_gpu']:,.0f} "
                     f"({r['overlap_tokens_per_s_per_gpu']:,.0f}) | {r['peak_gib_max']:.0f} "
                     f"(state {r['state_gib'][worst]:.0f}){fit} | "
                     f"{r['bubble_max']:.1%} | {r['all_to_all_share']:.1%} ({r['overlap_all_to_all_share']:.1%}) |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """docs/projection_v41.md: what is projected, the assumptions, the tables, the calibration and its error."""
    a, c = result["assumptions"], result["calibration"]
    source = (f"the V4.1-width slice `{c['slice']['file']}` (mean residual per layer forward "
              f"{c['slice']['fwd_s'] * 1e3:+.1f} ms, backward {c['slice']['bwd_s'] * 1e3:+.1f} ms over the derived "
              f"times, {', '.join(c['slice']['slices'])})" if c.get("slice") else
              f"**derived rates only** ({c['slice_note']})")
    return "\n".join([
        "# Projection: V4.1-Flash training at 64K on 64-512 H200s (issue 35)", "",
        f"Written by `{result['command']}` ({result['date']}, code {result['code']}; "
        "`bench/results/projection_v41/projection.json`). A projection, not a measurement: the 1F1B simulator "
        "(`parallel/simulate.py`, the expert all-to-alls inside the passes) and the memory model "
        "(`parallel/memory.py`, 1/E of the routed experts per rank) on per-layer times calibrated on one H200.", "",
        f"**Job.** {result['model']}, one 64K row a microbatch, {result['global_rows']} rows (67 M tokens) a step, "
        "bf16 autocast over fp32 masters, ZeRO-1, the Engram tables trained and row-sharded over each stage's D "
        "replicas, the draft head held (its experts split by E) but not trained (at 64K its activations do not fit: "
        "docs/V41.md). P x E x D: P stages, D data-parallel replicas a stage, expert groups of E of them; the split "
        "is the engine's (`balanced_cuts` on these times, memory-aware, under the GPU's 139.8 GiB).", "",
        "**Assumptions.** 8 H200s a node. Expert all-to-all within a node over NVLink 4 (900 GB/s bidirectional per "
        f"GPU) at {a['alltoall_nvlink_gbps']:.0f} GB/s effective per direction; between nodes InfiniBand "
        f"8 x 400 Gb/s a node = {a['ib_gbps_per_gpu']:.0f} GB/s per GPU and direction, all-to-all at "
        f"{a['alltoall_ib_gbps']:.0f} GB/s (70%), gradient all-reduce at {a['allreduce_ib_gbps']:.0f} GB/s (80%) "
        f"when a stage's replicas span nodes, pipeline boundaries at {a['ib_gbps_per_gpu']:.0f} GB/s across nodes, "
        f"{a['p2p_nvlink_gbps']:.0f} within. No NCCL bandwidth measured (no two GPUs were lent): published link "
        "figures. An expert group of E > 8 spans nodes: (E-8)/E of a rank's rows go between nodes. Routing uniform: "
        "each exchange moves tokens x 6 x 5120 x 2 B x (E-1)/E (4.0 GB x (E-1)/E a layer), six exchanges a layer and "
        "microbatch under recompute (dispatch + combine, again in the recomputation, and both gradients). "
        "\"Overlapped\" hides the all-to-alls behind the shared expert of the same pass, up to its time (an "
        "optimistic bound for that switch). Dense matmuls at "
        f"{a['matmul_efficiency']:.0%} of the measured bf16 rate, the gate in fp32 at {a['fp32_tflops']:.0f} "
        "TFLOP/s (assumed), the hyper-connections' time x 5 and Engram's x 10 of small_moe's (their work grows with "
        "the width).", "",
        "## Best configuration per GPU count", "",
        "The fastest that fits; where none fits, the fastest and the one needing the least memory.", "",
        table(result["best"]), "",
        "## Every configuration", "", table(result["rows"]), "",
        "## Calibration", "",
        f"- Per-layer times: {source}.",
        f"- `{c['small_moe_step']}`: small_moe at 64K on one H200, step {c['small_moe_step_s']:.2f} s, MFU "
        f"{c['small_moe_mfu']:.1%} of the measured {c['matmul_tflops']:.0f} TFLOP/s: its probed layer times scaled "
        "to its parts (attention, mhc, engram, moe), its MoE part replaced, its `rest` as the optimizer's time per "
        "parameter.",
        f"- `{c['moe_ffn']}`: the grouped GEMMs of 24 V4.1 experts at 256-4,096 tokens per expert (fwd + bwd, "
        "autocast) give the routed rate at E's tokens per expert (1,024 E; 4,096's rate held above it), the whole "
        "MoE layer there the gate/sort/gather/combine cost per token.",
        f"- `bench/results/train/train_step_small_65536.json`: small (dense FFN, no hc) at MFU "
        f"{c.get('small_mfu') or 0:.1%}, the attention kernels' share without MoE or hc: context, not fitted.", "",
        "## Reading it, and its likely error", "",
        "- **Nothing fits at 64K** under this memory model: every stage keeps, per microbatch in flight, each "
        "layer's 4 fp32 copies of the stream (65,536 x 4 x 5,120 x 4 B = 5.4 GB a layer) and its boundary payloads "
        "(the stream again, ~5.4 GB, received and copied); stage s holds P - s microbatches, so activations alone "
        "exceed 141 GB on the early stages whatever E, and the weights and fp32 gradients (8 B a parameter, never "
        "partitioned by ZeRO-1: 552 B x 8 B / 64 GPUs = 69 GB) fill 64 GPUs before AdamW. Making it fit needs a "
        "lever the engine lacks: context parallelism (SPEC §7, splitting the 5.4 GB tensors), a bf16 stream "
        "checkpoint, or ZeRO-2/3 for the expert weights; the times above are what those configurations would run "
        "at if their memory were found.",
        "- The all-to-all share is small while the group stays in a node (E = 8: ~5%) and 20-35% once it spans nodes "
        "(E >= 16) at the assumed 35 GB/s; more stages raise the bubble at a fixed batch (fewer microbatches per "
        "replica).",
        "- Error: the per-layer times are derived, not measured at V4.1's width (unless the slice line above says "
        "otherwise): the hyper-connections' x 5 scaling and the fp32 gate are the largest unknowns (+-30% on the "
        "layer time is plausible); the all-to-all bandwidths are published figures with assumed efficiencies "
        "(+-30%), and uniform routing understates the busiest rank (small_moe's deep layers ran at 6-8x the mean "
        "load early in training: the slowest rank sets every all-to-all's end). The memory model was within the "
        "two-GPU run's errors for `small` (docs/PERFORMANCE.md); its expert terms are checked against hand numbers "
        "(`tests/test_expert_plan.py`), not against a multi-GPU run.", ""])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="64,128,256,512", help="GPU counts, comma-separated (multiples of 8)")
    p.add_argument("--global-rows", type=int, default=1024, help="rows of 64K tokens per optimizer step")
    p.add_argument("--slice", help="bench/v41_slice.py's JSON (default: the derived rates, said in the output)")
    p.add_argument("--out", default=str(ROOT / "bench/results/projection_v41/projection.json"))
    p.add_argument("--docs", help="Markdown file to write (docs/projection_v41.md)")
    opts = p.parse_args(argv)
    gpus = [int(g) for g in opts.gpus.split(",")]
    step, moe_ffn = json.loads(SMALL_MOE.read_text()), json.loads(MOE_FFN.read_text())
    calibration = {"small_moe_step": str(SMALL_MOE.relative_to(ROOT)), "moe_ffn": str(MOE_FFN.relative_to(ROOT)),
                   "small_moe_step_s": step["step_s"], "small_moe_mfu": step["mfu_vs_measured_matmul"],
                   "matmul_tflops": step["matmul_tflops"], "slice": None}
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
    rows = projection(gpus, opts.global_rows, step, moe_ffn, correction)
    chosen = best(rows)
    result = {**result_meta(), "model": f"model={NAME} layout=v41 parallel.recompute=layer data.seq_len={T}",
              "global_rows": opts.global_rows, "calibration": calibration,
              "assumptions": {"alltoall_nvlink_gbps": ALLTOALL_NVLINK_GBPS, "ib_gbps_per_gpu": IB_GBPS,
                              "alltoall_ib_gbps": ALLTOALL_IB_FRACTION * IB_GBPS,
                              "allreduce_ib_gbps": ALLREDUCE_IB_FRACTION * IB_GBPS,
                              "p2p_nvlink_gbps": Cluster.p2p_gbps, "matmul_efficiency": MATMUL_EFFICIENCY,
                              "fp32_tflops": FP32_TFLOPS, "mhc_scale": MHC_SCALE, "engram_scale": ENGRAM_SCALE,
                              "gpu_gib": GPU_BYTES / 2 ** 30, "routing": "uniform", "draft_head": "held, not trained"},
              "rows": rows, "best": chosen}
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(table(chosen))
    print(table(rows))
    if opts.docs:
        Path(opts.docs).write_text(markdown(result))
    return result


if __name__ == "__main__":
    main()
