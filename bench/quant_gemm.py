"""The quantised base's GEMMs (issue 56, ``kernels/triton_quant_gemm.py``) against the bf16 base's on one GPU, at
one expert rank's share of a V4.1-Flash MoE layer and one attention projection, forward and backward to the input
(the frozen base's two products under LoRA), in the same process:

    python bench/quant_gemm.py --out $OUT/quant_gemm.json [--tokens 8192] [--expert-parallel 8] [--reps 20]
    python bench/quant_gemm.py --smoke --out /tmp/quant_gemm.json   # tiny shapes on the CPU, under the interpreter
    python bench/quant_gemm.py --sweep --out $OUT/quant_gemm_sweep.json  # and every launch shape of SWEEP

- routed experts: the rank's ``384 / E`` experts of ``[2·2304, 5120]`` (w1 | w3) and ``[5120, 2304]`` (w2) in FP4
  with e8m0 per 32 (``QuantizedMatrix``) against the same values in bf16 through ``F.grouped_mm``, at each of
  ``--rows-per-expert`` (rows spread evenly over the experts): 128 is one sender's share of the one-node plan
  (8,192 tokens x 6 slots / 8 ranks / 48 experts), 1,024 what the rank receives from all 8 (``bench/lora_slice.py``);
- attention: ``wq_b [64·512, 1280]`` in FP8 (32 x 32 blocks) against bf16 ``F.linear``, at the same rows a matrix
  and at ``--tokens``.
Per case and rows: milliseconds (forward, backward to x; CUDA events, the median of ``--reps``) of the bf16 GEMM,
the fused kernel (``quant_gemm``) and the transient dequantised stack (``dequantize_stack`` + torch's GEMM), the
one ``dequantizes`` picks, and each product's largest relative difference from bf16's (the same values, another
summation order); the bytes the weights hold. ``--sweep`` also times the fused kernel itself at each launch shape
of ``SWEEP`` at the first rows (``quant_gemm(..., tiles=)``), each with its outputs' largest relative difference from
the default launch's: the data to choose ``PLAIN`` and ``GROUPED`` from. Every shape in it compiles for sm_90a
without spilling (2026-12-07: 137-255 registers a thread; (64, 256, 64) over 4 warps spilled in the FP8 forward and
is left out).
"""
import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.triton_quant_gemm import GROUPED, PLAIN, Tiles, quant_gemm, quant_matmul  # noqa: E402
from model.quant import BLOCK_FP8, BLOCK_ROW  # noqa: E402
from model.quantized_base import QuantizedMatrix, dequantizes  # noqa: E402
from result_meta import result_meta  # noqa: E402


# The launch shapes --sweep times: today's two, wider column tiles (one program an SM: 219-255 registers a thread over
# 8 warps), 4 warps on 128 x 128, a 128-wide reduced step, and a narrow tile that fits three programs an SM.
SWEEP = (PLAIN, GROUPED, Tiles(128, 256, 64, 8, 2, None), Tiles(256, 128, 64, 8, 2, None),
         Tiles(128, 128, 64, 4, 3, None), Tiles(128, 128, 128, 8, 2, None), Tiles(128, 64, 64, 4, 3, None))
SMOKE_SWEEP = (Tiles(16, 32, 32, 4, 1, None), Tiles(32, 32, 32, 4, 1, None))  # the interpreter's


def timed(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, wall clock elsewhere)."""
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[1:])  # the first compiles


def rel_diff(y: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference of ``y`` from ``want`` over ``want``'s largest magnitude."""
    return ((y.float() - want.float()).abs().max() / want.float().abs().max()).item()


def sweep(quantized, x, grad, counts, shapes, reps, device) -> list[dict]:
    """The kernel at each launch shape: ms forward and backward to x, and the largest relative difference of each
    output from the default launch's."""
    args = (quantized.codes, quantized.scale, counts, quantized.fmt == "fp4", quantized.block, quantized.shape[-2:])
    inputs = {"forward": (x.detach(), False), "backward": (grad, True)}
    default = {way: quant_gemm(rows, *args, transpose=t) for way, (rows, t) in inputs.items()}
    out = []
    for tiles in shapes:
        entry = {"tiles": tiles._asdict()}
        for way, (rows, transpose) in inputs.items():
            run = partial(quant_gemm, rows, *args, transpose=transpose, tiles=tiles)
            y = run()
            entry[f"{way}_ms"] = timed(run, reps, device)
            entry[f"{way}_rel_diff"] = rel_diff(y, default[way])
        out.append(entry)
    return out


def at_rows(quantized, dense, rows, counts, reps, device, dtype) -> dict:
    """The three products of ``rows`` rows (``counts`` a matrix, None for one linear): bf16, fused, transient."""
    x = torch.randn(rows, dense.shape[-1], device=device, dtype=dtype, requires_grad=True)
    args = (quantized.codes, quantized.scale, counts, quantized.fmt == "fp4", quantized.block, quantized.shape[-2:])
    if counts is None:
        def bf16():
            return F.linear(x, dense)
    else:
        offsets = counts.cumsum(0, dtype=torch.int32)

        def bf16():
            return F.grouped_mm(x, dense.transpose(-2, -1), offs=offsets)
    ways = {"bf16": bf16, "fused": partial(quant_matmul, x, *args, dequantize=False),
            "transient": partial(quant_matmul, x, *args, dequantize=True)}
    out = {"rows": rows, "rows_per_matrix": rows // quantized.experts,
           "chosen": "transient" if dequantizes(rows, quantized.experts, quantized.shape[-2:], dtype) else "fused"}
    want = bf16()
    grad = torch.randn_like(want)
    for way, fn in ways.items():
        y = fn()
        if way != "bf16":
            out[f"{way}_max_rel_diff"] = rel_diff(y, want)
        out[f"{way}_forward_ms"] = timed(fn, reps, device)
        out[f"{way}_backward_ms"] = timed(lambda: torch.autograd.grad(y, x, grad, retain_graph=True), reps, device)
    return out


def case(name, weight, fmt, block, row_counts, reps, device, dtype, shapes=()):
    """One matrix (or stack) at each of ``row_counts`` (``at_rows``); and the fused kernel at each of ``shapes``
    (``sweep``) at the first."""
    quantized = QuantizedMatrix.of(weight, fmt, block, "triton")
    dense = quantized.dequantized(dtype)
    experts = quantized.experts if weight.dim() == 3 else None

    def counts(rows):
        return None if experts is None else torch.full((experts,), rows // experts, dtype=torch.int64, device=device)
    out = {"case": name, "shape": list(weight.shape), "format": fmt,
           "weight_bytes": {"quantised": quantized.codes.nbytes + quantized.scale.nbytes, "bf16": dense.numel() * 2},
           "by_rows": [at_rows(quantized, dense, rows, counts(rows), reps, device, dtype) for rows in row_counts]}
    if shapes:
        rows = row_counts[0]
        x = torch.randn(rows, weight.shape[-1], device=device, dtype=dtype)
        grad = torch.randn(rows, weight.shape[-2], device=device, dtype=dtype)
        out["sweep"] = {"rows": rows, "shapes": sweep(quantized, x, grad, counts(rows), shapes, reps, device)}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON file")
    p.add_argument("--tokens", type=int, default=8192, help="tokens a rank computes (a 64K row over 8 ranks)")
    p.add_argument("--expert-parallel", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rows-per-expert", default="128,256,512,1024",
                   help="rows a matrix multiplies, comma-separated (the experts': each; wq_b: the same, then --tokens)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the Triton interpreter)")
    p.add_argument("--sweep", action="store_true", help="also time the kernel at each launch shape of SWEEP")
    a = p.parse_args()
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16  # the interpreter computes bf16 wrongly
    dim, inter, heads, head_dim, q_rank, experts = (
        (64, 32, 2, 32, 32, 4) if a.smoke else (5120, 2304, 64, 512, 1280, 384 // a.expert_parallel))
    tokens, reps, per_matrix = ((64, 1, [4, 16]) if a.smoke else
                                (a.tokens, a.reps, [int(r) for r in a.rows_per_expert.split(",")]))
    torch.manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, dim, device=device) * dim ** -0.5
    w2 = torch.randn(experts, dim, inter, device=device) * inter ** -0.5
    wq_b = torch.randn(heads * head_dim, q_rank, device=device) * q_rank ** -0.5
    shapes = (SMOKE_SWEEP if a.smoke else SWEEP) if a.sweep else ()
    expert_rows = [r * experts for r in per_matrix]
    results = [case("experts w1|w3", w13, "fp4", BLOCK_ROW, expert_rows, reps, device, dtype, shapes),
               case("experts w2", w2, "fp4", BLOCK_ROW, expert_rows, reps, device, dtype, shapes),
               case("attn wq_b", wq_b, "fp8", BLOCK_FP8, per_matrix + [tokens], reps, device, dtype, shapes)]
    Path(a.out).write_text(json.dumps({"meta": result_meta(), "results": results}, indent=1))
    for r in results:
        for e in r["by_rows"]:
            print(f"{r['case']:<14} {e['rows_per_matrix']:>5} rows a matrix, fwd / bwd ms: bf16 "
                  f"{e['bf16_forward_ms']:.2f} / {e['bf16_backward_ms']:.2f}, fused {e['fused_forward_ms']:.2f} / "
                  f"{e['fused_backward_ms']:.2f}, transient {e['transient_forward_ms']:.2f} / "
                  f"{e['transient_backward_ms']:.2f} (chosen: {e['chosen']})")
        for e in r.get("sweep", {}).get("shapes", ()):
            print(f"  {tuple(e['tiles'].values())}: fwd {e['forward_ms']:.2f} ms, bwd {e['backward_ms']:.2f} ms")


if __name__ == "__main__":
    main()
