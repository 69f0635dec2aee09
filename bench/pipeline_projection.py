"""Projection of pipeline parallelism to 4 and 8 stages and to two nodes (issue 16), from the 1F1B simulator
(``parallel/simulate.py``) and the per-stage memory model (``parallel/memory.py``).

    python bench/pipeline_projection.py [--results bench/results/multigpu] [--docs docs/PERFORMANCE.md]
                                        [--p2p-gbps 300] [--internode-gbps 50]

It reads the two-GPU run's files in ``--results`` when they are there (``multigpu.json`` and the layer-times file
``layer_times_small_65536.json`` that ``bench/gpu_multigpu.sh`` writes), writes ``projection.json`` beside them
and, with ``--docs``, the calibration and projection tables into the marked block of that Markdown file.

Calibrated (the run's files present): ``small``'s measured per-layer-mode times at 65,536 tokens (micro-batch 1,
recompute=layer, bf16), the LM head's charged to the last layer, all scaled by one factor so that a simulated
1-stage microbatch takes the measured one (the slope of the run's 1-stage steps; the probes' own marks and the
gaps between layers are what the factor absorbs), the optimizer's time per parameter from the steps' intercept,
and the point-to-point bandwidth measured between the two GPUs. The 2-stage steps are not fitted: their simulated
time, bubble and memory against the measured ones are the calibration error.

Until the run's files exist, the per-layer times are derived from the committed measurements:
- the per-mode times of the v5 kernels (``bench/results/multigpu/layer_times_small_65536_v5.json``, from
  ``bench/results/train/train_step_csa2_65536.json`` at commit 2b4e380: step 14.16 s);
- the attention kernels' change to v6 (docs/PERFORMANCE.md: forward 26.4 -> 29.4 ms, backward 119.4 -> 64.5 ms, per
  sparse layer; with recompute a layer's backward runs the forward kernel again; a window-only layer's attention is
  taken as W / (W + K) = 20% of that);
- one factor on all layer times, fitted so that the 1-stage step equals the measured v6 step (9.87 s,
  ``bench/results/train/train_step_csa2_65536_v7.json``): it stands for what else changed (RoPE, launches).
The step's remainder (step - layers, 0.18 s at v5) is the optimizer, norm and head: charged per parameter.

V4.1 width (``model=v41_flash``: dim 5,120, its dense FFN standing in for the MoE, vocab 129,280, 14.0 B parameters):
each layer's time is ``small``'s plus its extra matmul work (2 x extra parameters x tokens forward, 6 x with
recompute's backward) at ``MATMUL_EFFICIENCY`` of the measured bf16 matmul rate; the attention and indexer kernels
are the same (their shape does not depend on the width). The LM head's 6 x T x dim x vocab FLOPs beyond ``small``'s
at that rate, plus its fp32 logits' traffic, go to the last stage.

Each row: the stage split the engine would choose (``parallel/balance.py``: on these times, memory-aware, within
the GPU's memory), the simulated step (``Cluster``: NVLink within a node, ``--internode-gbps`` between nodes),
tokens/s per GPU, the bubble per stage and the estimated peak memory per stage (the run's measured bytes per layer
mode for ``small`` when calibrated). Assumptions of the simulator: ``parallel/simulate.py``.
"""
import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from model import ModelArgs, layout_from_config  # noqa: E402
from model.cli import compose  # noqa: E402
from parallel.balance import TIME_SLACK, LayerTimes, ModeTimes, mode_key  # noqa: E402
from parallel.memory import estimate, layer_parameters  # noqa: E402
from parallel.partition import balanced_cuts  # noqa: E402
from parallel.payload import Payload, boundary_fields  # noqa: E402
from parallel.simulate import Cluster, Layers, ideal_bubble, simulate, stage_work  # noqa: E402
from result_meta import result_meta  # noqa: E402

T = 65536
V5_TIMES = ROOT / "bench/results/multigpu/layer_times_small_65536_v5.json"
V6_STEP = ROOT / "bench/results/train/train_step_csa2_65536_v7.json"  # the step the two-GPU runs had (kernels v7)
KERNEL_V5_MS, KERNEL_V6_MS = (26.4, 119.4), (29.37, 64.48)  # attention fwd, bwd at 64K (docs/PERFORMANCE.md)
MATMUL_EFFICIENCY = 0.8
GPU_BYTES = 139.8 * 2 ** 30
# The LM head and loss run 4,096 tokens at a time (parallel.head_chunk=4096): whole logits of V4.1's 129,280-token
# vocabulary would be 16 B x 65,536 x 129,280 = 135 GB of work on the last stage at 64K (parallel/memory.py).
HEAD_CHUNK = 4096
ISSUE_16 = {  # seen on two H200s, 2026-11-30, in issue 16's text: not in a committed result file
    "dp2_M4_tokens_per_s": 11600, "p2_M8_tokens_per_s": 10200, "p2_rank0_peak_gb": 78.7, "dp2_rank0_peak_gb": 85.4}


@functools.cache
def model(name: str):
    cfg = compose([f"model={name}", "layout=v41"])
    return ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)


def derived_v6_times(step_s: float) -> tuple[LayerTimes, dict]:
    """The v5 per-mode times moved to the v6 kernels and scaled to the measured v6 step (see the docstring)."""
    v5 = LayerTimes.load(str(V5_TIMES))
    df, db = KERNEL_V6_MS[0] - KERNEL_V5_MS[0], KERNEL_V6_MS[1] - KERNEL_V5_MS[1]
    window = 128 / (128 + 512)
    moved = {k: ModeTimes(m.fwd_ms + df * (window if k == "window" else 1),
                          m.bwd_ms + (df + db) * (window if k == "window" else 1)) for k, m in v5.modes.items()}
    args, layout = model("small")
    remainder_s = v5.meta["step_s"] - sum(v5.layer_costs(layout)) / 1e3
    kernel_only = sum(LayerTimes(**{**vars(v5), "modes": moved}).layer_costs(layout)) / 1e3
    scale = (step_s - remainder_s) / kernel_only
    times = LayerTimes(**{**vars(v5), "modes": {k: ModeTimes(m.fwd_ms * scale, m.bwd_ms * scale)
                                                 for k, m in moved.items()},
                          "meta": {"derived": "v5 per-mode times + v6 kernel deltas, scaled to the v6 step"}})
    return times, {"v5_step_s": v5.meta["step_s"], "remainder_s": remainder_s,
                   "kernel_deltas_only_step_s": kernel_only + remainder_s, "measured_v6_step_s": step_s,
                   "kernel_deltas_only_error": (kernel_only + remainder_s) / step_s - 1, "scale": scale}


def layer_inputs(name: str, times: LayerTimes, remainder_s: float, matmul_tflops: float, scale: float = 1.0) -> Layers:
    """Per-layer seconds, payload bytes and parameters of model ``name`` from ``small``'s measured times (times
    ``scale``; the head's, if measured, on the last layer); ``remainder_s``: optimizer time of ``small``'s step."""
    small_args, layout = model("small")
    args, _ = model(name)
    small_params, params = layer_parameters(small_args, layout), layer_parameters(args, layout)
    rate = MATMUL_EFFICIENCY * matmul_tflops * 1e12
    fwd, bwd = [], []
    for i, p in enumerate(layout.plan):
        mode = times.modes[mode_key(p)]
        extra = params[i] - small_params[i]
        if i in (0, layout.n_layers - 1):  # embedding and head are not in the layer times
            extra -= args.vocab_size * args.dim - small_args.vocab_size * small_args.dim
        fwd.append(scale * mode.fwd_ms / 1e3 + 2 * extra * T / rate)
        bwd.append(scale * mode.bwd_ms / 1e3 + 6 * extra * T / rate)
    bwd[-1] += scale * times.head_ms / 1e3 + head_s(args, small_args, rate)
    boundary, gradient = boundary_bytes(name)
    return Layers(fwd, bwd, boundary, gradient, params, remainder_s / sum(small_params))


def head_s(args: ModelArgs, base: ModelArgs, rate: float) -> float:
    """The LM head's time beyond ``base``'s (whose is measured, or in the step's remainder): its FLOPs at ``rate``
    plus its fp32 logits' traffic at ~4 TB/s."""
    flops = 6 * T * (args.dim * args.vocab_size - base.dim * base.vocab_size)
    return flops / rate + 4 * 4 * T * (args.vocab_size - base.vocab_size) / 4e12


def boundary_bytes(name: str, context: int = 1, seq_len: int = T) -> tuple[list[float], list[float]]:
    """Per layer of model ``name``: the payload bytes a rank sends after it per microbatch (bf16, one row of
    ``seq_len``, or its chunk of ``context``; index keys by shadow; 0 after the last) and those of their gradient
    back."""
    args, layout = model(name)
    boundary, gradient = [], []
    for i in range(layout.n_layers - 1):
        payload = Payload(boundary_fields(args, layout, i, 1, seq_len, torch.bfloat16, "shadow", context=context))
        floats, raw = payload.wire_sizes()
        gradient.append(floats * payload.float_dtype.itemsize)
        boundary.append(gradient[-1] + raw)
    return boundary + [0.0], gradient + [0.0]


def project(name: str, layers: Layers, stages: int, data_parallel: int, microbatches: int, cluster: Cluster,
            p2p: str = "overlap", cuts: list[int] | None = None, measured: LayerTimes | None = None,
            expert_parallel: int = 1, overlap: bool = False, context_parallel: int = 1, lora=None,
            seq_len: int = T) -> dict:
    """One simulated configuration: at ``cuts``, or the split the engine would choose on these times;
    ``measured``: a layer-times file of this model whose per-mode bytes replace the analytic memory figures;
    ``expert_parallel``, ``overlap``, ``context_parallel``: ``parallel.simulate.stage_work``'s (the all-to-alls' and
    the context collectives' shares of the step are the largest stage's exposed time of them over the step);
    ``lora``: a ``model.lora.LoRA`` (the memory of a frozen base and its adapters). ``data_parallel`` is D: the
    configuration runs on P x C x D GPUs, rows of ``seq_len`` tokens (``layers`` are given at that length)."""
    args, layout = model(name)
    C = context_parallel
    memory = estimate(args, layout, 1, seq_len, torch.bfloat16, layout.n_layers, data_parallel, 1, True,
                      measured=measured, expert_parallel=expert_parallel, context_parallel=C, lora=lora,
                      head_chunk=HEAD_CHUNK)
    costs = [layers.chunk_fwd_s(i, C) + b / C for i, b in enumerate(layers.bwd_s)]

    def peak(stage, span):
        return memory.stage_peak(stage, span, stages, microbatches)
    cuts = list(cuts) if cuts is not None else balanced_cuts(costs, stages, peak, GPU_BYTES, TIME_SLACK)
    bounds = [0, *cuts, layout.n_layers]
    split = tuple(range(a, b) for a, b in zip(bounds, bounds[1:]))
    work = stage_work(layers, split, data_parallel, cluster, expert_parallel, overlap, C)
    timeline = simulate(work, microbatches, p2p)
    peaks = memory.peaks(split, microbatches)
    gpus = stages * C * data_parallel
    return {"model": name, "nodes": cluster.nodes, "gpus": gpus, "stages": stages, "data_parallel": data_parallel,
            "context_parallel": C, "context_share": microbatches * max(w.context_s for w in work) / timeline.step_s,
            "microbatches": microbatches, "cuts": cuts, "pipeline_across_nodes": cluster.pipeline_across_nodes,
            "step_s": timeline.step_s, "tokens_per_s": microbatches * seq_len * data_parallel / timeline.step_s,
            "tokens_per_s_per_gpu": microbatches * seq_len * data_parallel / timeline.step_s / gpus,
            "bubble": list(timeline.bubble), "bubble_ideal": ideal_bubble(stages, microbatches),
            "of_balanced_1f1b": (microbatches + stages - 1) / stages * sum(costs) / timeline.pipeline_s,
            "transfer_share": microbatches * sum(w.send_s + w.grad_s for w in work) / timeline.step_s,
            "all_to_all_share": microbatches * max(w.all_to_all_s for w in work) / timeline.step_s,
            "peak_gib": [p / 2 ** 30 for p in peaks], "fits": max(peaks) <= GPU_BYTES,
            "state_gib": [sum(memory.state[i] for i in span) / 2 ** 30 for span in split]}


LAYOUTS = [  # (nodes, stages, data parallel, pipeline across nodes): 8 GPUs per node
    (1, 1, 8, False), (1, 2, 4, False), (1, 4, 2, False), (1, 8, 1, False), (2, 8, 2, False), (2, 16, 1, True)]


def two_gpus(cluster: Cluster) -> Cluster:
    return Cluster(nodes=1, gpus_per_node=2, p2p_gbps=cluster.p2p_gbps, allreduce_gbps=cluster.allreduce_gbps)


def calibrate(measured: dict, times: LayerTimes, matmul_tflops: float) -> tuple[Layers, dict]:
    """``small``'s layers from the run's layer times, fitted to its 1-stage steps (see the docstring)."""
    single = measured["sections"]["single"]
    raw = layer_inputs("small", times, 0.0, matmul_tflops)
    scale = single["per_microbatch_s"] / (sum(raw.fwd_s) + sum(raw.bwd_s))
    scaled = layer_inputs("small", times, 0.0, matmul_tflops, scale)
    D = single["data_parallel"]
    reduce_s = stage_work(scaled, (range(len(scaled.params)),), D, two_gpus(Cluster()))[0].reduce_s
    optimizer_s = max(0.0, single["fixed_s"] - reduce_s)
    layers = Layers(scaled.fwd_s, scaled.bwd_s, scaled.boundary_bytes, scaled.gradient_bytes,
                    scaled.params, optimizer_s * D / sum(scaled.params))
    return layers, {"layer_times_scale": scale, "measured_per_microbatch_s": single["per_microbatch_s"],
                    "probed_layers_s": sum(raw.fwd_s) + sum(raw.bwd_s), "measured_fixed_s": single["fixed_s"],
                    "simulated_allreduce_s": reduce_s, "optimizer_s": optimizer_s}


def measured_p2p_gbps(measured: dict) -> float | None:
    """The bandwidth of the boundary's activations between the two GPUs (bytes over median time)."""
    shadow = measured["sections"].get("transfer", {}).get("index_k", {}).get("shadow")
    return shadow["activations"]["gbps"] if shadow else None


def check_against(measured: dict, layers: Layers, cluster: Cluster, times: LayerTimes | None = None) -> list[dict]:
    """The simulation of each step ``bench/multigpu.py`` measured on two GPUs (the 2-stage ones at the run's cuts),
    next to the measurement; ``fitted`` marks the 1-stage steps the calibration matched by construction."""
    rows = []
    sections = measured["sections"]
    for step in sections.get("single", {}).get("steps", []):
        row = project("small", layers, 1, 2, step["microbatches"], two_gpus(cluster), measured=times)
        rows.append({"what": f"1 stage x 2 data-parallel, M={step['microbatches']}", "fitted": True,
                     "predicted_s": row["step_s"], "measured_s": step["step_s"],
                     "predicted_peak_gib": row["peak_gib"],
                     "measured_peak_gib": [r.get("peak_allocated_gib") for r in step["per_rank"]]})
    pipeline = sections.get("pipeline", {})
    for step in pipeline.get("steps", []) + ([pipeline["before"]] if "before" in pipeline else []):
        row = project("small", layers, 2, 1, step["microbatches"], two_gpus(cluster), step.get("p2p", "overlap"),
                      pipeline["cuts"], times)
        rows.append({"what": f"2 stages, M={step['microbatches']}, p2p={step.get('p2p', 'overlap')}",
                     "fitted": False, "predicted_s": row["step_s"], "measured_s": step["step_s"],
                     "predicted_bubble": row["bubble"], "measured_bubble": [r["bubble"] for r in step["per_rank"]],
                     "predicted_peak_gib": row["peak_gib"],
                     "measured_peak_gib": [r.get("peak_allocated_gib") for r in step["per_rank"]]})
    for row in rows:
        row["error"] = row["predicted_s"] / row["measured_s"] - 1
        peaks = list(zip(row["predicted_peak_gib"], row["measured_peak_gib"]))
        if all(m for _, m in peaks):
            row["peak_error"] = [p / m - 1 for p, m in peaks]
    return rows


def calibration_error(rows: list[dict]) -> dict:
    """The largest step-time, bubble and memory errors of the steps the calibration did not fit."""
    free = [r for r in rows if not r["fitted"]]
    if not free:
        return {}
    return {"steps": len(free), "max_abs_step_error": max(abs(r["error"]) for r in free),
            "max_abs_bubble_error": max(abs(p - m) for r in free
                                        for p, m in zip(r["predicted_bubble"], r["measured_bubble"])),
            "max_abs_peak_error": max((abs(e) for r in rows for e in r.get("peak_error", [])), default=None)}


def bench_prediction(layers: Layers, cluster: Cluster) -> dict:
    """What ``bench/multigpu.py`` should measure on two GPUs, with its own yardsticks: the 1F1B ideal from the
    1-stage per-microbatch time (slope of the M=2 and M=4 data-parallel steps) and fixed time (optimizer, halved
    on two stages), the transfers' share of the step, and the spread of peak memory over the stages."""
    two = two_gpus(cluster)
    dp = {M: project("small", layers, 1, 2, M, two)["step_s"] for M in (2, 4)}
    per_microbatch = (dp[4] - dp[2]) / 2
    fixed = dp[2] - 2 * per_microbatch
    rows = []
    for p2p in ("overlap", "deepspeed"):
        for M in (2, 4, 8, 16):
            row = project("small", layers, 2, 1, M, two, p2p)
            peaks = row["peak_gib"]
            rows.append({"p2p": p2p, "microbatches": M, "cuts": row["cuts"], "step_s": row["step_s"],
                         "tokens_per_s": row["tokens_per_s"], "bubble": row["bubble"],
                         "bubble_ideal": row["bubble_ideal"],
                         "of_ideal": ((M + 1) * per_microbatch / 2 + fixed / 2) / row["step_s"],
                         "transfer_share": row["transfer_share"], "peak_gib": peaks,
                         "memory_spread": (max(peaks) - min(peaks)) / max(peaks)})
    return {"one_stage_per_microbatch_s": per_microbatch, "one_stage_fixed_s": fixed,
            "one_stage_steps_s": dp, "two_stages": rows}


KEEP_STEPS = ROOT / "bench/results/train/train_step_csa2_65536_v7.json", \
    ROOT / "bench/results/train/train_step_csa2_keep4_65536.json"


def keep_prediction(measured: dict, layers: Layers, cluster: Cluster, max_keep: int = 4) -> dict:
    """A prediction, not a measurement: the run's 2-stage step at M = 8 with its last stage keeping the attention
    outputs of its first k layers (``parallel.keep_attention_layers=[0,k]``), k = 0 .. ``max_keep``. The last stage
    holds one microbatch, the first two: the spare memory of the last buys its attention forwards. Per kept layer,
    from the committed one-GPU steps with and without ``keep_attention_layers=4`` (``KEEP_STEPS``): the backward
    saves (step - step_keep4) / 4 and the peak grows by (peak_keep4 - peak) / 4. Peaks are the run's measured ones
    plus that growth (the memory model's absolute level is not calibrated, its per-layer increments are); times
    are simulated at the run's cut with the kept layers' backward shortened."""
    base, keep4 = (json.loads(path.read_text()) for path in KEEP_STEPS)
    saving_s, growth_gib = (base["step_s"] - keep4["step_s"]) / 4, (keep4["peak_alloc_gib"] - base["peak_alloc_gib"]) / 4
    run = next(s for s in measured["sections"]["pipeline"]["steps"] if s["stages"] == 2 and s["microbatches"] == 8)
    cut, peaks = measured["sections"]["pipeline"]["cuts"][0], [r["peak_allocated_gib"] for r in run["per_rank"]]
    rows = []
    for k in range(max_keep + 1):
        bwd = [b - saving_s if cut <= i < cut + k else b for i, b in enumerate(layers.bwd_s)]
        row = project("small", dataclasses.replace(layers, bwd_s=bwd), 2, 1, 8, two_gpus(cluster), cuts=[cut])
        keep_peaks = [peaks[0], peaks[1] + k * growth_gib]
        rows.append({"keep_attention_layers": [0, k], "step_s": row["step_s"], "tokens_per_s": row["tokens_per_s"],
                     "peak_gib": keep_peaks, "memory_spread": (max(keep_peaks) - min(keep_peaks)) / max(keep_peaks)})
    return {"prediction": True, "cuts": [cut], "microbatches": 8, "saving_s_per_kept_layer": saving_s,
            "peak_gib_per_kept_layer": growth_gib, "from": [str(p.relative_to(ROOT)) for p in KEEP_STEPS],
            "measured_step_s": run["step_s"], "rows": rows}


def keep_outcome(prediction: dict, results: Path) -> list[dict]:
    """The prediction against the runs that tried it: each ``multigpu_keep_<k0>_<k1>.json`` in ``results``
    (``bench/multigpu.py --keep-attention k0,k1``) beside the predicted row of the same setting. The run repeats the
    1-stage section, so its step is compared as measured; the predicted step is the simulator's at the old run's
    calibration."""
    outcomes = []
    for path in sorted(results.glob("multigpu_keep_*.json")):
        run = json.loads(path.read_text())
        section = run["sections"]["pipeline"]
        step = next(s for s in section["steps"] if s["stages"] == 2 and s["microbatches"] == prediction["microbatches"])
        row = next((r for r in prediction["rows"] if r["keep_attention_layers"] == section["keep_attention_layers"]),
                   None)
        peaks = [r["peak_allocated_gib"] for r in step["per_rank"]]
        outcomes.append({"file": path.name, "keep_attention_layers": section["keep_attention_layers"],
                         "cuts": section["cuts"], "step_s": step["step_s"], "of_ideal": step["of_ideal"],
                         "peak_gib": peaks, "memory_spread": (max(peaks) - min(peaks)) / max(peaks),
                         "predicted": row and {k: row[k] for k in ("step_s", "peak_gib", "memory_spread")}})
    return outcomes


def issue_check(layers: Layers, cluster: Cluster) -> dict:
    """The simulation of the two-GPU runs quoted in issue 16 (not in a committed file)."""
    two = two_gpus(cluster)
    dp = project("small", layers, 1, 2, 4, two)
    pp = project("small", layers, 2, 1, 8, two)
    return {"quoted": ISSUE_16, "dp2_M4_tokens_per_s": dp["tokens_per_s"], "p2_M8_tokens_per_s": pp["tokens_per_s"],
            "dp2_M4_error": dp["tokens_per_s"] / ISSUE_16["dp2_M4_tokens_per_s"] - 1,
            "p2_M8_error": pp["tokens_per_s"] / ISSUE_16["p2_M8_tokens_per_s"] - 1,
            "p2_peak_gib": pp["peak_gib"], "dp2_peak_gib": dp["peak_gib"], "p2_cuts": pp["cuts"]}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | GPUs (nodes) | stages x data parallel | cuts | tokens/s per GPU, M=8 / 32 | 1F1B bubble "
             "(P-1)/(M+P-1), M=8 / 32 | pipeline time of balanced 1F1B's, M=8 / 32 | est. peak GiB, first .. last "
             "stage |", "|---|---|---|---|---|---|---|---|"]
    by_key = {}
    for r in rows:
        by_key.setdefault((r["model"], r["nodes"], r["stages"], r["data_parallel"]), {})[r["microbatches"]] = r
    for (name, nodes, stages, dp), pair in by_key.items():
        a, b = pair[8], pair[32]
        where = " (pipeline across nodes)" if a["pipeline_across_nodes"] else ""
        memory = " .. ".join(f"{p:.0f}" for p in (a["peak_gib"][0], a["peak_gib"][-1])) if stages > 1 else \
            f"{a['peak_gib'][0]:.0f}"
        if not a["fits"]:
            memory += " (does not fit)"
        lines.append(f"| {name} | {a['gpus']} ({nodes}){where} | {stages} x {dp} | {a['cuts'] or '-'} | "
                     f"{a['tokens_per_s_per_gpu']:,.0f} / {b['tokens_per_s_per_gpu']:,.0f} | "
                     f"{a['bubble_ideal']:.1%} / {b['bubble_ideal']:.1%} | {a['of_balanced_1f1b']:.1%} / "
                     f"{b['of_balanced_1f1b']:.1%} | {memory} |")
    return "\n".join(lines)


def calibration_markdown(rows: list[dict]) -> str:
    """Simulated against measured, per step of the two-GPU run."""
    def cells(values, fmt):
        return " / ".join(format(v, fmt) if v is not None else "-" for v in values)

    lines = ["| step (two GPUs) | measured s | simulated s | error | bubble per stage, measured / simulated | "
             "peak GiB per stage, measured / simulated |", "|---|---|---|---|---|---|"]
    for r in rows:
        bubble = (f"{cells(r['measured_bubble'], '.1%')} / {cells(r['predicted_bubble'], '.1%')}"
                  if "measured_bubble" in r else "-")
        lines.append(f"| {r['what']}{' (fitted)' if r['fitted'] else ''} | {r['measured_s']:.2f} | "
                     f"{r['predicted_s']:.2f} | {r['error']:+.1%} | {bubble} | "
                     f"{cells(r['measured_peak_gib'], '.1f')} / {cells(r['predicted_peak_gib'], '.1f')} |")
    return "\n".join(lines)


DOCS_BEGIN = "<!-- projection: written by bench/pipeline_projection.py --docs -->"
DOCS_END = "<!-- projection: end -->"


def write_docs(path: Path, result: dict) -> None:
    """Replace the marked block of ``path`` with the calibration and projection tables of ``result``."""
    meta = f"`{result['command']}`, {result['date']}; inputs: {result['times']}"
    parts = [DOCS_BEGIN, f"Written from `bench/results/multigpu/projection.json` ({meta}).", ""]
    if result.get("measured_check"):
        error = result["calibration_error"]
        parts += [f"Calibration ({result['measured']}; the 1-stage steps are fitted, the 2-stage ones are the check: "
                  f"largest step-time error {error['max_abs_step_error']:.1%}, bubble "
                  f"{error['max_abs_bubble_error']:.1%} points"
                  + (f", peak memory {error['max_abs_peak_error']:.0%}" if error["max_abs_peak_error"] is not None
                     else "") + "):", "", calibration_markdown(result["measured_check"]),
                  ""]
    parts += ["Projection (8 GPUs per node, M microbatches per pipeline, the split the engine would choose):", "",
              markdown(result["rows"]), DOCS_END]
    replace_block(path, DOCS_BEGIN, DOCS_END, "\n".join(parts))


def replace_block(path: Path, begin: str, end: str, block: str) -> None:
    """Replace the lines from ``begin`` to ``end`` of ``path`` (both marks, once each) with ``block``."""
    text = path.read_text()
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"{path}: needs one '{begin}' line and one '{end}' line around the tables")
    start, stop = text.index(begin), text.index(end) + len(end)
    path.write_text(text[:start] + block + text[stop:])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "bench/results/multigpu"),
                   help="folder of the two-GPU run's multigpu.json and layer-times file (used when present)")
    p.add_argument("--docs", help="Markdown file whose marked block gets the tables (docs/PERFORMANCE.md)")
    p.add_argument("--p2p-gbps", type=float, help="within a node (default: measured by the run, else 300)")
    p.add_argument("--internode-gbps", type=float, default=Cluster.internode_gbps)
    p.add_argument("--out", help="default: projection.json in --results")
    opts = p.parse_args(argv)
    results = Path(opts.results)
    measured_path, times_path = results / "multigpu.json", results / f"layer_times_small_{T}.json"
    measured = json.loads(measured_path.read_text()) if measured_path.exists() else None
    v6 = json.loads(V6_STEP.read_text())
    if measured is not None and times_path.exists() and "per_microbatch_s" in measured["sections"].get("single", {}):
        times = LayerTimes.load(str(times_path))
        small, calibration = calibrate(measured, times, v6["matmul_tflops"])
        remainder_s, source = calibration["optimizer_s"], str(times_path.relative_to(ROOT)) \
            if times_path.is_relative_to(ROOT) else str(times_path)
        p2p_gbps = opts.p2p_gbps or measured_p2p_gbps(measured) or Cluster.p2p_gbps
    else:
        derived, calibration = derived_v6_times(v6["step_s"])
        times, small, remainder_s, source = None, None, calibration["remainder_s"], "derived (see calibration)"
        p2p_gbps = opts.p2p_gbps or Cluster.p2p_gbps
    base = times or derived
    layers = {"small": small or layer_inputs("small", base, remainder_s, v6["matmul_tflops"]),
              "v41_flash": layer_inputs("v41_flash", base, remainder_s, v6["matmul_tflops"],
                                        calibration.get("layer_times_scale", 1.0))}
    rows = []
    for name in layers:
        for nodes, stages, dp, across in LAYOUTS:
            cluster = Cluster(nodes=nodes, p2p_gbps=p2p_gbps, internode_gbps=opts.internode_gbps,
                              pipeline_across_nodes=across)
            for microbatches in (8, 32):
                rows.append(project(name, layers[name], stages, dp, microbatches, cluster,
                                    measured=times if name == "small" else None))
    cluster = Cluster(p2p_gbps=p2p_gbps, internode_gbps=opts.internode_gbps)
    result = {**result_meta(), "times": source, "calibration": calibration,
              "assumptions": {"p2p_gbps": p2p_gbps, "internode_gbps": opts.internode_gbps,
                              "allreduce_gbps": Cluster.allreduce_gbps, "latency_s": Cluster.latency_s,
                              "matmul_efficiency": MATMUL_EFFICIENCY, "matmul_tflops": v6["matmul_tflops"],
                              "gpu_gib": GPU_BYTES / 2 ** 30, "gpus_per_node": 8},
              "issue_16_check": issue_check(layers["small"], cluster),
              "bench_prediction": bench_prediction(layers["small"], cluster), "rows": rows}
    if measured is not None:
        result["measured"] = str(measured_path.relative_to(ROOT)) if measured_path.is_relative_to(ROOT) \
            else str(measured_path)
        result["measured_check"] = check_against(measured, layers["small"], cluster, times)
        result["calibration_error"] = calibration_error(result["measured_check"])
        if "pipeline" in measured["sections"]:
            result["keep_attention_prediction"] = prediction = keep_prediction(measured, layers["small"], cluster)
            prediction["outcomes"] = keep_outcome(prediction, results)
    out = Path(opts.out) if opts.out else results / "projection.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if opts.docs:
        write_docs(Path(opts.docs), result)
    print(markdown(rows))
    print(json.dumps({k: result[k] for k in ("calibration", "issue_16_check")}, indent=1))
    if result.get("measured_check"):
        print(calibration_markdown(result["measured_check"]))
        print(json.dumps(result["calibration_error"], indent=1))
    if result.get("keep_attention_prediction"):
        print(json.dumps(result["keep_attention_prediction"], indent=1))


if __name__ == "__main__":
    main()
