"""Where the sparse-attention and indexer kernels lose time: Nsight Compute metrics of their launches (issue 12).

    python bench/ncu_attention.py --out DIR [--tokens 16384]   # on the GPU: runs itself under ncu, writes DIR/ncu_attention.json
    python bench/ncu_attention.py --out DIR --target indexer   # the indexer's scoring and selection: ncu_indexer.json
    python bench/ncu_attention.py --out DIR --smoke            # CPU: the same driver through the interpreter, no ncu

The timing benchmark (``bench_kernels.py bench``) says how long each kernel takes; this says why: for each kernel,
the tensor-pipe and memory-pipe utilisation (% of peak), DRAM and L2 throughput, registers and occupancy, spilled
bytes, and the warps' stall reasons. Attention: the forward, dKV-partials and dq kernels from one forward and
backward at the V4.1 shape (H = 64, D = 512, W = 128, K = 512); their work per token is the same at any length, so a
shorter sequence than 64K (16K by default) profiles the same loop in less replay time. Indexer: the scoring and
selection of the last chunk of queries of a causal 64K sequence (32 x 128 index heads, top-512), the widest rows.
Autotuning runs first, outside the profiled range (``cudaProfilerStart``), so the profiled launches use the configs a
training step would.
"""
import argparse
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

KERNELS = {"attention": ("_fwd_kernel", "_bwd_dkv_kernel", "_bwd_dq_kernel"),
           "indexer": ("_score_kernel", "_select_kernel")}
SHAPES = {"attention": "H 64, D 512, W 128, K 512", "indexer": "T 65536, 32 x 128 index heads, top-512, last chunk"}
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats",
            "WarpStateStats")
# Why warps wait: cycles per issued instruction spent in each stall reason (the section alone prints only the sum).
STALLS = r"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
# The metrics kept in the JSON, by the names ncu's details page prints (section, metric name).
KEPT = {"Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput", "L2 Cache Throughput",
        "L1/TEX Cache Throughput", "Registers Per Thread", "Achieved Occupancy", "Theoretical Occupancy",
        "Dynamic Shared Memory Per Block", "Static Shared Memory Per Block", "Block Size", "Grid Size",
        "Executed Ipc Active", "Issue Slots Busy", "Warp Cycles Per Issued Instruction", "Local Memory Spilling Requests",
        "Max Bandwidth", "Mem Busy", "L1/TEX Hit Rate", "L2 Hit Rate", "Mem Pipes Busy", "SM Busy"}


def profiled(once, smoke: bool) -> None:
    """once() twice: the first compiles and autotunes, the second runs inside the profiled range."""
    import torch
    once()
    if not smoke:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    once()
    if not smoke:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def drive_attention(tokens: int, smoke: bool) -> None:
    """One forward and one backward of the sparse attention."""
    import torch

    from bench_kernels import attention_problem  # its device and dtype follow --smoke as this script's do
    from kernels import triton_ops

    T, H, D, W, K = (64, 4, 32, 8, 16) if smoke else (tokens, 64, 512, 128, 512)
    args = attention_problem(T, H, D, W, K)
    q, kv_window, kv_comp, sink = args[0], args[1], args[3], args[5]

    def once():
        out, _ = triton_ops.sparse_attention(*args)
        torch.autograd.grad(out, [q, kv_window, kv_comp, sink], torch.ones_like(out))
    profiled(once, smoke)


def drive_indexer(tokens: int, smoke: bool) -> None:
    """The scoring and selection of the last chunk of a causal sequence of 65,536 tokens (``tokens`` is ignored:
    a chunk's rows are as wide as its queries' positions)."""
    import torch

    from bench_kernels import indexer_problem
    from kernels import triton_indexer, triton_select

    T, NH, DI, topk = (128, 2, 16, 8) if smoke else (65536, 32, 128, 512)
    q, w, k, vis_lo, vis_hi = indexer_problem(T, NH, DI)
    lo, hi = vis_lo[0].contiguous(), vis_hi[0].contiguous()
    t0, t1, pyramid = triton_indexer.chunk_plan((hi - lo).cpu().numpy(), topk, 8, False)[-1]
    levels = torch.empty(t1 - t0, pyramid.row, device=q.device)

    def once():
        triton_indexer.score_chunk(levels, pyramid, q[0, t0:t1], w[0, t0:t1], k[0], lo[t0:t1], hi[t0:t1], None)
        triton_select.build_upper_levels(levels, pyramid, lo[t0:t1], hi[t0:t1])
        triton_select.select_entries(levels, pyramid, lo[t0:t1], hi[t0:t1], topk)
    profiled(once, smoke)


DRIVERS = {"attention": drive_attention, "indexer": drive_indexer}


def parse_details(text: str, kernels: tuple) -> dict:
    """ncu's ``--page details --csv`` rows -> {kernel: {metric: (value, unit)}} for the KEPT metrics and every
    stall reason ("stall <reason>", in cycles per issued instruction)."""
    rows = csv.DictReader(io.StringIO(text[text.index('"ID"'):]))
    found = {}
    for row in rows:
        kernel = next((k for k in kernels if k in row["Kernel Name"]), None)
        name = row["Metric Name"]
        if name.startswith("smsp__average_warps_issue_stalled_"):
            name = "stall " + name.removeprefix("smsp__average_warps_issue_stalled_").split("_per_issue")[0]
        if kernel and (name in KEPT or name.startswith("stall ") or "Spill" in name):
            value = row["Metric Value"].replace(",", "")
            try:
                value = float(value)
            except ValueError:
                pass
            found.setdefault(kernel, {})[name] = [value, row["Metric Unit"]]
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--target", choices=sorted(KERNELS), default="attention")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--drive", action="store_true", help="(internal) the profiled process")
    opts = p.parse_args()
    if opts.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    if opts.drive or opts.smoke:
        DRIVERS[opts.target](opts.tokens, opts.smoke)
        if not opts.smoke:
            return 0
    from result_meta import result_meta

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    kernels, name = KERNELS[opts.target], f"ncu_{opts.target}"
    result = {**result_meta(), "tokens": opts.tokens, "shape": SHAPES[opts.target], "sections": SECTIONS}
    if not opts.smoke:
        report = out / name
        # The first launch of each kernel (the backward runs dKV and dq once per chunk of tokens); clocks as the
        # GPU runs them (ncu's default locks them to base clock).
        ncu = ["ncu", "--profile-from-start", "off", "--kernel-name", "regex:" + "|".join(kernels),
               "--launch-count", str(len(kernels)), "--clock-control", "none", "--force-overwrite", "--export",
               str(report), *[a for s in SECTIONS for a in ("--section", s)], "--metrics", "regex:" + STALLS]
        driver = [sys.executable, __file__, "--drive", "--out", str(out), "--tokens", str(opts.tokens), "--target",
                  opts.target]
        run = subprocess.run(ncu + driver, capture_output=True, text=True)
        (out / f"{name}.log").write_text(run.stdout + run.stderr)
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-3000:])
            return run.returncode
        details = subprocess.run(["ncu", "--import", str(report) + ".ncu-rep", "--page", "details", "--csv"],
                                 capture_output=True, text=True, check=True).stdout
        (out / f"{name}_details.csv").write_text(details)
        result["ncu_command"] = " ".join(ncu)
        try:
            result["kernels"] = parse_details(details, kernels)
        except (ValueError, KeyError) as err:  # the CSV is kept either way: parse it again offline
            result["parse_error"] = repr(err)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    for kernel, metrics in result.get("kernels", {}).items():
        print(kernel)
        for name, (value, unit) in metrics.items():
            print(f"  {name:48s} {value} {unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
