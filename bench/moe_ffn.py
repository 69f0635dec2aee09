"""The MoE FFN's routed experts (model/moe.py, grouped_mm) against one dense bf16 GEMM chain of the same FLOPs.

    python bench/moe_ffn.py --out $OUT/moe_ffn.json [--tokens-per-expert 256,1024,2048,4096] [--reps 10]
    python bench/moe_ffn.py --smoke --out /tmp/moe_ffn.json   # the same code at tiny shapes on the CPU

Shapes are V4.1's: dim 5120, expert width 2304, top-6, and the 24 experts an expert-parallel rank of 16 holds of
the 384. For each tokens-per-expert count ``t`` the rank's experts get ``24 t`` rows, sorted by expert, either
``uniform`` (t each) or ``skewed`` (counts falling as ``(e + 1)^-0.5`` over the experts, the same total: 2.85x the
mean on the busiest expert, 0.58x on the idlest). Timed, forward + backward (gradients of the rows, the routing
weights and the three stacked matrices), CUDA events, median of ``--reps`` after ``--warmup`` runs:
- ``routed``: ``RoutedExperts.forward`` as training runs it, bf16 autocast over fp32 master weights (so the time
  includes the weights' casts to bf16 and their gradients' casts back: 849 M values, about 5 GB of traffic each
  way);
- ``routed_bf16``: the same on bf16 weights (no autocast: the grouped GEMMs, the SwiGLU and nothing else);
- ``dense``: one expert's nine GEMMs (3 forward, 6 backward: x·W1ᵀ, x·W3ᵀ, h·W2ᵀ, and each one's input and weight
  gradients) at ``24 t`` rows, plain ``torch.mm`` in bf16: the same FLOPs with no grouping and no elementwise work.
FLOPs counted: ``18 · rows · dim · inter`` (the GEMMs only). ``efficiency`` = dense ms / routed ms. The bf16 matmul
rate of this process (8192³, the fastest of three medians) is reported beside them, and the whole ``MoE`` layer
(gate, sort, gather, routed + shared experts, combine) on ``4 t`` tokens of a 24-expert top-6 MoE under autocast,
for what the dispatch costs around the GEMMs.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model.config import MoEArgs  # noqa: E402
from model.moe import MoE, RoutedExperts  # noqa: E402
from result_meta import result_meta  # noqa: E402

V41 = dict(dim=5120, inter=2304, topk=6, local_experts=24)
SMOKE = dict(dim=64, inter=32, topk=6, local_experts=24)


class Timer:
    """Median milliseconds of ``fn`` over ``reps`` runs after ``warmup``: CUDA events on the GPU, the wall clock on
    the CPU (--smoke, where the numbers only show that the script runs)."""

    def __init__(self, cuda: bool, warmup: int, reps: int):
        self.cuda, self.warmup, self.reps = cuda, warmup, reps

    def ms(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(self.reps):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


def matmul_rate(timer: Timer, device, size: int) -> dict:
    """TFLOP/s of a bf16 size³ matmul: the fastest of three medians (one slow timing must not flatter a ratio)."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    times = [timer.ms(lambda: a @ b) for _ in range(3)]
    return {"size": size, "ms": min(times), "tflops": 2 * size ** 3 / min(times) / 1e9, "ms_each": times}


def routing_counts(routing: str, experts: int, per_expert: int) -> list[int]:
    """Rows per expert summing to ``experts · per_expert``: equal, or falling as (e + 1)^-0.5."""
    if routing == "uniform":
        return [per_expert] * experts
    share = torch.arange(1, experts + 1, dtype=torch.float64) ** -0.5
    counts = (share / share.sum() * experts * per_expert).floor().long()
    counts[0] += experts * per_expert - counts.sum()
    return counts.tolist()


def routed_step(experts: RoutedExperts, rows, counts, weights, grad, autocast: bool):
    """One forward + backward of the routed experts; the gradients come back (none accumulate)."""
    with torch.autocast(rows.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = experts(rows, counts, weights, grouped=True)
    return torch.autograd.grad(out, [rows, weights, experts.w1, experts.w2, experts.w3], grad)


def dense_chain(x, w1, w2, w3, h, grad_h, grad_out):
    """The nine GEMMs of one expert's forward and backward over all rows (inputs fixed: GEMMs only)."""
    g, u, out = x @ w1.T, x @ w3.T, h @ w2.T
    grad_h2 = grad_out @ w2
    grad_w2 = grad_out.T @ h
    grad_x = grad_h @ w1 + grad_h2 @ w3
    grad_w1, grad_w3 = grad_h.T @ x, grad_h2.T @ x
    return g, u, out, grad_x, grad_w1, grad_w2, grad_w3


def case(timer: Timer, shape: dict, per_expert: int, routing: str, device, seed: int) -> dict:
    E, dim, inter = shape["local_experts"], shape["dim"], shape["inter"]
    counts = routing_counts(routing, E, per_expert)
    M = sum(counts)
    flops = 18 * M * dim * inter
    gen = torch.Generator(device).manual_seed(seed)
    args = MoEArgs(n_routed_experts=E, n_activated_experts=shape["topk"], inter_dim=inter)
    experts = RoutedExperts(dim, args).to(device)
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.normal_(std=0.006, generator=gen)
    rows = torch.randn(M, dim, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    weights = torch.rand(M, device=device, generator=gen).requires_grad_()
    grad = torch.randn(M, dim, device=device, dtype=torch.bfloat16, generator=gen)
    counts_t = torch.tensor(counts, device=device)
    res = {"tokens_per_expert": per_expert, "routing": routing, "rows": M, "max_over_mean": max(counts) * E / M,
           "gemm_flops": flops}
    routed_ms = timer.ms(lambda: routed_step(experts, rows, counts_t, weights, grad, autocast=True))
    experts.to(torch.bfloat16)
    routed_bf16_ms = timer.ms(lambda: routed_step(experts, rows, counts_t, weights, grad, autocast=False))
    del experts
    if routing == "uniform":  # the dense chain does not depend on the routing
        w1, w3 = (torch.randn(inter, dim, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        w2 = torch.randn(dim, inter, device=device, dtype=torch.bfloat16, generator=gen)
        h, grad_h = (torch.randn(M, inter, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        res["dense_ms"] = timer.ms(lambda: dense_chain(rows.detach(), w1, w2, w3, h, grad_h, grad))
    for name, ms in (("routed", routed_ms), ("routed_bf16", routed_bf16_ms)):
        res[f"{name}_ms"], res[f"{name}_tflops"] = ms, flops / ms / 1e9
    return res


def moe_layer(timer: Timer, shape: dict, per_expert: int, device, seed: int) -> dict:
    """The whole MoE (24 experts, top-6, one shared expert) on ``4 t`` tokens, forward + backward under autocast."""
    torch.manual_seed(seed)
    dim, E = shape["dim"], shape["local_experts"]
    args = MoEArgs(n_routed_experts=E, n_activated_experts=shape["topk"], inter_dim=shape["inter"])
    moe = MoE(dim, args).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.006)
    N = E * per_expert // shape["topk"]
    x = torch.randn(N, dim, device=device, requires_grad=True)
    grad = torch.randn(N, dim, device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = moe(x)
        return torch.autograd.grad(y, [x, *moe.parameters()], grad)

    ms = timer.ms(step)
    load = moe.take_load()
    return {"tokens_per_expert": per_expert, "tokens": N, "ms": ms,
            "load_max_over_mean": (load.max() / load.mean()).item(),
            "gemm_flops": 18 * N * (shape["topk"] + 1) * dim * shape["inter"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to test this script")
    p.add_argument("--tokens-per-expert", default=None, help="comma-separated (default 256,1024,2048,4096; smoke 8,16)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()
    cuda = not a.smoke
    if cuda and not torch.cuda.is_available():
        p.error("no CUDA device: run on the GPU, or --smoke on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    shape = SMOKE if a.smoke else V41
    per_expert = [int(t) for t in (a.tokens_per_expert or ("8,16" if a.smoke else "256,1024,2048,4096")).split(",")]
    timer = Timer(cuda, 1 if a.smoke else a.warmup, 2 if a.smoke else a.reps)
    res = {**result_meta(), "shape": shape, "timing": {"warmup": timer.warmup, "reps": timer.reps, "stat": "median"}}
    res["matmul_bf16"] = matmul_rate(timer, device, 64 if a.smoke else 8192)
    rate = res["matmul_bf16"]["tflops"]
    res["cases"], res["moe_layer"] = [], []
    for t in per_expert:
        for routing in ("uniform", "skewed"):
            r = case(timer, shape, t, routing, device, seed=t)
            if routing == "uniform":
                dense_ms = r["dense_ms"]
                r["dense_tflops"] = r["gemm_flops"] / dense_ms / 1e9
            for name in ("routed", "routed_bf16"):
                r[f"{name}_efficiency_vs_dense"] = dense_ms / r[f"{name}_ms"]
                r[f"{name}_fraction_of_matmul_rate"] = r[f"{name}_tflops"] / rate
            res["cases"].append(r)
            print(json.dumps(r), flush=True)
        layer = moe_layer(timer, shape, t, device, seed=t)
        layer["tflops"] = layer["gemm_flops"] / layer["ms"] / 1e9
        res["moe_layer"].append(layer)
        print(json.dumps(layer), flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))  # rewritten after each size: a cut run keeps its numbers
        if cuda:
            torch.cuda.empty_cache()
    print(f"\nmatmul {res['matmul_bf16']['size']}^3 bf16: {rate:.0f} TFLOP/s")
    print(f"{'t/expert':>8} {'routing':>8} {'routed ms':>10} {'TFLOP/s':>8} {'eff':>5} {'bf16 ms':>8} {'TFLOP/s':>8} "
          f"{'eff':>5} {'dense ms':>9}")
    for r in res["cases"]:
        print(f"{r['tokens_per_expert']:>8} {r['routing']:>8} {r['routed_ms']:>10.3f} {r['routed_tflops']:>8.0f} "
              f"{r['routed_efficiency_vs_dense']:>5.2f} {r['routed_bf16_ms']:>8.3f} {r['routed_bf16_tflops']:>8.0f} "
              f"{r['routed_bf16_efficiency_vs_dense']:>5.2f} {r.get('dense_ms', float('nan')):>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
