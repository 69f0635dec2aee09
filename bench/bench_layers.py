"""One CSA2 layer of each mode, forward + backward, at V4.1-Flash width on one GPU
(``python3 bench/bench_layers.py --out FILE``).

The layers are model/'s ``Attention`` with the dims of conf/model/v41_flash.yaml (dim 5,120, 64 heads x 512,
window 128, top-512, index 32 x 128; bf16 parameters) and the plans of conf/layout/v41.yaml: window-only (layer 0),
Full m=2 (layer 2), Full m=1 and candidate source (layer 20: 2,048 blocks of 8), Reindex restricted to those
candidates (layer 24), Reuse of layer 20 (layer 21). The shared inputs of Reindex and Reuse come from running the
Full m=1 layer first and handing its outputs over through ``SharedState`` (``write``, then ``reads``), as the model
does; they enter as leaves, so the backward also computes the KV and index-key gradients that flow back to the Full
layer in the model.

One step = forward + backward of <out, g>, plus the indexer KL of a selecting layer (target: its own selected mass,
as for a selection with a single reader). Per mode: Triton at T = 65,536 (median of 3 steps after a warm-up; peak
memory of a step at T/2 and T, which must be linear in T); the PyTorch reference at the largest T of 16,384 /
8,192 / 4,096 that fits, and Triton at that same T. Baseline, same step at T = 65,536: a dense multi-head attention
layer of the same width (64 heads x 128, cuDNN causal SDPA). ``--profile MODE``: only the device time of one
step of that mode per operator. ``--smoke``: tiny dims on the CPU interpreter.
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402
from torch import nn  # noqa: E402

from bench.bench_kernels import BF16, DEV, RESULTS, n, peak_mib, rel_err, run_steps, section  # noqa: E402
from model.attention import Attention, linear  # noqa: E402
from model.config import ModelArgs  # noqa: E402
from model.layout import layout_from_config  # noqa: E402
from model.state import SharedState, indexer_kl  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "conf"
MODES = {"window": 0, "full_m2": 2, "full_m1": 20, "reindex": 24, "reuse": 21}  # layer ids in the V4.1 layout
T_MAIN = n(65536, 64)
T_REFERENCE = n((16384, 8192, 4096), (32, 16))
REPS = 3


def config(name: str) -> dict:
    """A conf/ node as a dict with its ``defaults`` merged in order (plain YAML: the GPU machine has no Hydra)."""
    node = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    defaults = node.pop("defaults", [])
    merged = {}
    for parent in defaults if "_self_" in defaults else [*defaults, "_self_"]:
        merged.update(node if parent == "_self_" else config(f"{Path(name).parent}/{parent}"))
    return merged


ARGS = ModelArgs.from_config({**config("model/tiny" if SMOKE else "model/v41_flash"), "kernel_backend": "triton"})
# Under --smoke, 4 candidate blocks instead of 2,048 (the interpreter would score 16,384 columns per query).
LAYOUT = layout_from_config({**config("layout/v41"), "candidate_topk_blocks": n(2048, 4)})


def build_layers(modes=tuple(MODES)) -> dict[str, Attention]:
    return {mode: Attention(ARGS, LAYOUT.plan[MODES[mode]], LAYOUT.candidate_topk_blocks, LAYOUT.candidate_block_size)
            .to(device=DEV, dtype=BF16) for mode in modes}


def use_backend(layer: Attention, backend: str) -> None:
    layer.args = dataclasses.replace(layer.args, kernel_backend=backend)


def inputs(T: int, full_m1: Attention):
    """x, geometry and each mode's shared reads at length T; Reindex and Reuse read what the Full m=1 layer wrote."""
    state = SharedState(LAYOUT, torch.zeros(1, T, dtype=torch.long, device=DEV), ARGS.window_size)
    x = torch.randn(1, T, ARGS.dim, device=DEV, dtype=BF16)
    with torch.no_grad():
        _, produced = full_m1(x, state.geometry, state.reads(full_m1.plan))
    state.write(full_m1.plan, produced)
    reads = {mode: {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in
                    state.reads(LAYOUT.plan[layer]).items()} for mode, layer in MODES.items()}
    return x.requires_grad_(), state.geometry, reads


def clear_grads(layer: nn.Module, *leaves: torch.Tensor) -> None:
    """Drop the gradients of the last step, so each step allocates its own (and peak memory counts them)."""
    layer.zero_grad(set_to_none=True)
    for t in leaves:
        t.grad = None


def step(layer: Attention, x, geometry, reads, grad) -> torch.Tensor:
    """Forward + backward of one layer: <out, grad> plus, for a selecting layer, its indexer KL."""
    clear_grads(layer, x, *reads.values())
    out, produced = layer(x, geometry, reads)
    outputs, grads = [out], [grad]
    if "index_logits" in produced:
        mass = produced["selected_mass"]
        target = mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)
        outputs.append(indexer_kl(target, produced["index_logits"]))
        grads.append(None)
    torch.autograd.backward(outputs, grads)
    return out.detach()


def median_ms(fn, reps: int = REPS, warmup: bool = True) -> float:
    """Median of ``reps`` timed calls (after a warm-up call unless the caller just made one). Steps take 0.1-2 s,
    so do_bench's estimation rounds would only spend device time; CUDA events around each call (wall clock under
    --smoke)."""
    if warmup:
        fn()
    times = []
    for _ in range(reps):
        if SMOKE:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


LAYERS: dict[str, Attention] = {}


@section
def bench_layers_triton():
    """Each mode with the Triton kernels: time at T_MAIN, peak memory at T_MAIN/2 and T_MAIN."""
    LAYERS.update(build_layers())
    for T in (T_MAIN // 2, T_MAIN):
        x, geometry, reads = inputs(T, LAYERS["full_m1"])
        grad = torch.randn_like(x)
        for mode, layer in LAYERS.items():
            run = lambda: step(layer, x, geometry, reads[mode], grad)  # noqa: E731
            res = RESULTS.setdefault(f"layer_{mode}", {"T": T_MAIN, "peak_mib": {}})
            if T == T_MAIN:
                res["ms"] = median_ms(run)
            else:
                run()  # compile and autotune before the peak is measured
            clear_grads(layer, x, *reads[mode].values())
            res["peak_mib"][T] = peak_mib(run)
        del x, geometry, reads, grad


def reference_vs_triton(layer: Attention, x, geometry, reads, grad) -> dict:
    """Reference step (output, peak memory, time) then the Triton step at the same T; a RuntimeError (out of
    memory above all) propagates. The first step of each backend is its warm-up."""
    run = lambda: step(layer, x, geometry, reads, grad)  # noqa: E731
    use_backend(layer, "torch")
    try:
        ref_out = run()
        clear_grads(layer, x, *reads.values())
        ref_peak = peak_mib(run)
        ref_ms = median_ms(run, reps=2, warmup=False)
    finally:
        use_backend(layer, "triton")
    out = run()
    triton_ms = median_ms(run, warmup=False)
    return {"T": x.shape[1], "reference_ms": ref_ms, "reference_peak_mib": ref_peak, "triton_ms": triton_ms,
            "speedup": ref_ms / triton_ms, "out_rel_diff": rel_err(out, ref_out)}


@section
def bench_layers_reference():
    """Each mode with the reference ops at the largest T of T_REFERENCE that runs (a failure, out of memory above
    all, is recorded and the next T tried), against Triton at that T."""
    pending = list(LAYERS)
    for T in T_REFERENCE:
        if not pending:
            break
        x, geometry, reads = inputs(T, LAYERS["full_m1"])
        grad = torch.randn_like(x)
        for mode in list(pending):
            try:
                RESULTS[f"layer_{mode}"]["vs_reference"] = reference_vs_triton(LAYERS[mode], x, geometry,
                                                                               reads[mode], grad)
                pending.remove(mode)
            except RuntimeError as e:  # torch.OutOfMemoryError is one
                RESULTS[f"layer_{mode}"].setdefault("reference_failed", {})[T] = f"{type(e).__name__}: {e}"[:160]
            torch.cuda.empty_cache()
        del x, geometry, reads, grad


class DenseAttention(nn.Module):
    """The baseline a user would otherwise train: multi-head attention of the same width, 64 heads x 128 (QKV and
    output projections, no RoPE), dense causal through cuDNN SDPA."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wqkv = linear(dim, 3 * heads * head_dim)
        self.wo = linear(heads * head_dim, dim)

    def forward(self, x):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        B, T, _ = x.shape
        # [B, heads, T, head_dim] contiguous: the layout the kernel benchmark's cuDNN SDPA ran with.
        q, k, v = self.wqkv(x).view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).contiguous()
        with sdpa_kernel(SDPBackend.MATH if SMOKE else SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


@section
def bench_dense_layer():
    layer = DenseAttention(ARGS.dim, n(64, 4), n(128, 16)).to(device=DEV, dtype=BF16)
    x = torch.randn(1, T_MAIN, ARGS.dim, device=DEV, dtype=BF16, requires_grad=True)
    grad = torch.randn_like(x)

    def run():
        clear_grads(layer, x)
        torch.autograd.backward(layer(x), grad)
    res = {"T": T_MAIN, "ms": median_ms(run)}
    clear_grads(layer, x)
    res["peak_mib"] = peak_mib(run)
    res["speedup_of_each_mode"] = {mode: res["ms"] / RESULTS[f"layer_{mode}"]["ms"] for mode in MODES
                                   if "ms" in RESULTS.get(f"layer_{mode}", {})}
    RESULTS["dense_mha_layer"] = res


def profile_mode(mode: str) -> None:
    """Device time of one Triton step of ``mode`` at T_MAIN by operator (torch.profiler, self time): where a layer's
    time goes outside the attention and indexer kernels."""
    from torch.profiler import ProfilerActivity, profile
    layers = build_layers(("full_m1", mode))
    x, geometry, reads = inputs(T_MAIN, layers["full_m1"])
    grad = torch.randn_like(x)
    step(layers[mode], x, geometry, reads[mode], grad)  # compile and autotune outside the profile
    with profile(activities=[ProfilerActivity.CPU if SMOKE else ProfilerActivity.CUDA]) as prof:
        step(layers[mode], x, geometry, reads[mode], grad)
        if not SMOKE:
            torch.cuda.synchronize()
    attr = "self_cpu_time_total" if SMOKE else "self_device_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, attr))
    RESULTS[f"profile_{mode}_self_ms"] = {e.key[:90]: getattr(e, attr) / 1e3 for e in events[:25]}
    RESULTS[f"profile_{mode}_self_ms"]["total"] = sum(getattr(e, attr) for e in events) / 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny dims on the CPU interpreter")
    parser.add_argument("--profile", choices=list(MODES), help="only the per-operator profile of one mode's step")
    args = parser.parse_args()
    os.environ["CSA2_KERNEL_POISON"] = "0"
    steps = ([section(lambda: profile_mode(args.profile))] if args.profile else
             [bench_layers_triton, bench_dense_layer, bench_layers_reference])
    run_steps(steps, args.out, "layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
