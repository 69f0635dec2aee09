"""The MoE FFN (model/moe.py) against one dense bf16 GEMM chain of the same FLOPs: the routed experts alone, the
whole layer as training runs it, and the gate's precision.

    python bench/moe_ffn.py --out $OUT/moe_ffn.json [--tokens-per-expert 256,1024,2048,4096] [--reps 10]
                            [--shape v41|small_moe] [--kernel-table]
    python bench/moe_ffn.py --smoke --out /tmp/moe_ffn.json   # the same code at tiny shapes on the CPU

Shapes: ``v41`` (default) is V4.1's: dim 5120, expert width 2304, top-6, the 24 experts an expert-parallel rank of
16 holds of the 384 (the gate scores all 384); ``small_moe`` the small MoE model's: dim 1024, width 448, top-4, 32
experts. For each tokens-per-expert count ``t``, timed forward + backward, CUDA events, median of ``--reps`` after
``--warmup`` runs:
- ``cases``: the routed experts alone on ``E t`` rows sorted by expert, either ``uniform`` (t each) or ``skewed``
  (counts falling as ``(e + 1)^-0.5`` over the experts, the same total: 2.85x the mean on the busiest expert,
  0.58x on the idlest); gradients of the rows, the routing weights and the three stacked matrices.
  ``routed``: ``RoutedExperts.forward`` as training runs it, bf16 autocast over fp32 master weights (so the time
  includes the weights' cast and stacking to bf16 and their gradients' cast back: 849 M values at V4.1, about 5 GB
  of traffic each way); ``routed_bf16``: the same on bf16 weights (no autocast: the grouped GEMMs, the SwiGLU
  kernel and the stacking copy of w1 and w3); ``dense``: one expert's nine GEMMs (3 forward, 6 backward: x·W1ᵀ,
  x·W3ᵀ, h·W2ᵀ, and each one's input and weight gradients) at ``E t`` rows, plain ``torch.mm`` in bf16: the same
  FLOPs with no grouping and no elementwise work. FLOPs counted: ``18 · rows · dim · inter`` (the GEMMs only).
  ``efficiency`` = dense ms / routed ms.
- ``moe_layer``: the whole ``MoE`` as a training step runs it: x fp32 (the stream's dtype) [N, dim] with ``N = E t
  / k`` tokens, bf16 autocast over fp32 master weights, the gate (split bf16 GEMMs), the sort by expert, the spread
  of the tokens to their slots, the routed experts and the shared expert, the combine; gradients of x and every
  parameter. Against ``dense_ms``: the dense chain at ``N (k + 1)`` rows, the layer's GEMM FLOPs (routed and
  shared); ``efficiency_vs_dense`` is the issue's goal (>= 0.9 at 1,024-4,096 tokens per expert). The dense chain
  has no weights to cast: ``weight_cast_ms`` times the layer's master-weight casts alone (forward and backward; at
  V4.1 5 GB of traffic each way, the same at any token count), and ``efficiency_vs_dense_without_weight_cast``
  takes them out. With ``--kernel-table``, one step's device time by kernel (``train_step.kernel_table``) and its
  GEMM share.
- ``gate``: the gate's scores over all the shape's experts on 16,384 tokens (normal rows, as the FFN norm gives
  them; the weight drawn at the init's scale), fp32 x: the split bf16 GEMMs (``model/split_gemm.py``) and a plain
  bf16 GEMM against the fp32 GEMM (TF32 off): relative error of the scores, the share of tokens whose top-k set is
  the same, forward + backward times.
The bf16 matmul rate of this process (8192³, the fastest of three medians) is reported beside them.
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
from model.split_gemm import split_linear  # noqa: E402
from model.weights import cast_stacked, matmul_weights  # noqa: E402
from result_meta import result_meta  # noqa: E402

SHAPES = {"v41": dict(dim=5120, inter=2304, topk=6, local_experts=24, experts=384),
          "small_moe": dict(dim=1024, inter=448, topk=4, local_experts=32, experts=32)}
SMOKE = dict(dim=64, inter=32, topk=6, local_experts=24, experts=48)
GEMM_KERNELS = ("gemm", "cutlass", "xmma", "nvjet", "wgmma")  # substrings of the GEMM kernels' names


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


def dense_ms(timer: Timer, shape: dict, rows: int, device, gen: torch.Generator) -> float:
    """The dense chain (``dense_chain``) of one expert's shape at ``rows`` rows, bf16."""
    dim, inter = shape["dim"], shape["inter"]
    x, grad = (torch.randn(rows, dim, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    w1, w3 = (torch.randn(inter, dim, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    w2 = torch.randn(dim, inter, device=device, dtype=torch.bfloat16, generator=gen)
    h, grad_h = (torch.randn(rows, inter, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return timer.ms(lambda: dense_chain(x, w1, w2, w3, h, grad_h, grad))


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
        res["dense_ms"] = dense_ms(timer, shape, M, device, gen)
    for name, ms in (("routed", routed_ms), ("routed_bf16", routed_bf16_ms)):
        res[f"{name}_ms"], res[f"{name}_tflops"] = ms, flops / ms / 1e9
    return res


def moe_layer(timer: Timer, shape: dict, per_expert: int, device, seed: int, table: bool) -> dict:
    """The whole MoE (the shape's experts, top-k, one shared expert) on ``E t / k`` tokens, forward + backward under
    autocast, against the dense chain of its GEMM FLOPs; with ``table`` one step's kernels."""
    torch.manual_seed(seed)
    dim, E, k = shape["dim"], shape["local_experts"], shape["topk"]
    args = MoEArgs(n_routed_experts=E, n_activated_experts=k, inter_dim=shape["inter"])
    moe = MoE(dim, args).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.006)
        moe.gate.weight.normal_(std=dim ** -0.5)  # scores of unit scale: a balanced, not a degenerate, routing
    N = E * per_expert // k
    x = torch.randn(N, dim, device=device, requires_grad=True)
    grad = torch.randn(N, dim, device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = moe(x)
        return torch.autograd.grad(y, [x, *moe.parameters()], grad)

    ms = timer.ms(step)
    load = moe.take_load()
    res = {"tokens_per_expert": per_expert, "tokens": N, "ms": ms,
           "load_max_over_mean": (load.max() / load.mean()).item(),
           "gemm_flops": 18 * N * (k + 1) * dim * shape["inter"]}
    res["dense_ms"] = dense_ms(timer, shape, N * (k + 1), device, torch.Generator(device).manual_seed(seed))
    res["efficiency_vs_dense"] = res["dense_ms"] / ms
    res["weight_cast_ms"] = timer.ms(lambda: weight_casts(moe, device))
    res["efficiency_vs_dense_without_weight_cast"] = res["dense_ms"] / (ms - res["weight_cast_ms"])
    if table and timer.cuda:
        from train_step import kernel_table
        kernels = kernel_table(step, torch.cuda.synchronize, top=25)
        gemm = sum(r["ms"] for r in kernels["kernels"] if any(g in r["name"].lower() for g in GEMM_KERNELS))
        res["kernel_table"] = kernels
        res["gemm_share_of_top_kernels"] = gemm / kernels["device_ms_total"]
    return res


def weight_casts(moe: MoE, device) -> tuple:
    """What the layer's step spends on its fp32 master weights under autocast, alone: the routed stacks cast and
    stacked (``cast_stacked``) and the shared expert's (``matmul_weights``), forward and backward (the gradients
    cast back to fp32)."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        experts, shared = moe.experts, moe.shared_experts
        casts = [*cast_stacked([[experts.w1, experts.w3], [experts.w2]], torch.bfloat16, experts.kernel_backend),
                 *matmul_weights([(shared.w1, shared.w3), shared.w2], shared.kernel_backend)]
    return torch.autograd.grad(casts, [experts.w1, experts.w3, experts.w2, *shared.parameters()],
                               [torch.ones_like(c) for c in casts])


def gate_precision(timer: Timer, shape: dict, device, tokens: int = 16384) -> dict:
    """The gate's scores (all the shape's experts, x fp32 normal, weight at the init's scale dim^-0.5) by the split
    bf16 GEMMs and by a plain bf16 GEMM against the fp32 GEMM (TF32 off): the scores' relative error (norm-wise),
    the share of tokens whose top-k set (of sqrt-softplus scores, V4.1's) equals the fp32 one, and forward +
    backward times of the three."""
    gen = torch.Generator(device).manual_seed(0)
    dim, E, k = shape["dim"], shape["experts"], shape["topk"]
    x = torch.randn(tokens, dim, device=device, generator=gen, requires_grad=True)
    w = (torch.randn(E, dim, device=device, generator=gen) * dim ** -0.5).requires_grad_()
    grad = torch.randn(tokens, E, device=device, generator=gen)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        gates = {"fp32": lambda: x @ w.t(), "split_bf16": lambda: split_linear(x, w),
                 "bf16": lambda: (x.bfloat16() @ w.bfloat16().t()).float()}
        with torch.no_grad():
            scores = {name: gate() for name, gate in gates.items()}
        picks = {name: torch.nn.functional.softplus(s).sqrt().topk(k, dim=-1).indices.sort(-1).values
                 for name, s in scores.items()}
        res = {"tokens": tokens, "experts": E, "topk": k}
        for name in ("split_bf16", "bf16"):
            err = (scores[name].double() - scores["fp32"].double()).norm() / scores["fp32"].double().norm()
            res[name] = {"rel_err": err.item(), "same_topk_share": (picks[name] == picks["fp32"]).all(-1).float().mean().item()}
        for name, gate in gates.items():
            res.setdefault(name, {})["fwd_bwd_ms"] = timer.ms(lambda: torch.autograd.grad(gate(), [x, w], grad))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to test this script")
    p.add_argument("--tokens-per-expert", default=None, help="comma-separated (default 256,1024,2048,4096; smoke 8,16)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--shape", choices=sorted(SHAPES), default="v41")
    p.add_argument("--kernel-table", action="store_true", help="one layer step's device time by kernel (GPU)")
    a = p.parse_args()
    cuda = not a.smoke
    if cuda and not torch.cuda.is_available():
        p.error("no CUDA device: run on the GPU, or --smoke on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    shape = SMOKE if a.smoke else SHAPES[a.shape]
    per_expert = [int(t) for t in (a.tokens_per_expert or ("8,16" if a.smoke else "256,1024,2048,4096")).split(",")]
    timer = Timer(cuda, 1 if a.smoke else a.warmup, 2 if a.smoke else a.reps)
    res = {**result_meta(), "shape": shape, "timing": {"warmup": timer.warmup, "reps": timer.reps, "stat": "median"}}
    res["matmul_bf16"] = matmul_rate(timer, device, 64 if a.smoke else 8192)
    rate = res["matmul_bf16"]["tflops"]
    res["gate"] = gate_precision(timer, shape, device, 256 if a.smoke else 16384)
    print(json.dumps(res["gate"]), flush=True)
    res["cases"], res["moe_layer"] = [], []
    for t in per_expert:
        for routing in ("uniform", "skewed"):
            r = case(timer, shape, t, routing, device, seed=t)
            if routing == "uniform":
                dense = r["dense_ms"]
                r["dense_tflops"] = r["gemm_flops"] / dense / 1e9
            for name in ("routed", "routed_bf16"):
                r[f"{name}_efficiency_vs_dense"] = dense / r[f"{name}_ms"]
                r[f"{name}_fraction_of_matmul_rate"] = r[f"{name}_tflops"] / rate
            res["cases"].append(r)
            print(json.dumps(r), flush=True)
        layer = moe_layer(timer, shape, t, device, seed=t, table=a.kernel_table)
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
    print(f"\n{'t/expert':>8} {'tokens':>7} {'layer ms':>9} {'dense ms':>9} {'eff':>5} {'cast ms':>8} "
          f"{'eff w/o cast':>12}   (the whole MoE layer)")
    for r in res["moe_layer"]:
        print(f"{r['tokens_per_expert']:>8} {r['tokens']:>7} {r['ms']:>9.3f} {r['dense_ms']:>9.3f} "
              f"{r['efficiency_vs_dense']:>5.2f} {r['weight_cast_ms']:>8.3f} "
              f"{r['efficiency_vs_dense_without_weight_cast']:>12.2f}")
    gate = res["gate"]
    print(f"\ngate, {gate['tokens']} tokens x {gate['experts']} experts, top-{gate['topk']}: " + "; ".join(
        f"{name} {gate[name]['fwd_bwd_ms']:.3f} ms" + (f", rel err {gate[name]['rel_err']:.1e}, same top-k "
                                                       f"{gate[name]['same_topk_share']:.4%}" if name != "fp32" else "")
        for name in ("fp32", "split_bf16", "bf16")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
