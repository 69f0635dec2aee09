"""The LoRA stage of one GPU of the one-node plan over the quantised base against the bf16 base (issue 56, Measure
on one GPU): a V4.1-width slice with rank-16 adapters, forward + backward at the tokens a GPU trains, the two bases
one after the other in one process.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CSA2_CODE=<commit> python bench/lora_slice.py \
        --out $OUT/lora_slice.json
    python bench/lora_slice.py --smoke --out /tmp/lora_slice.json    # the same code on the CPU: v41_slice's smoke
                                                                     # widths, 64 tokens, fp32, PyTorch kernels

What runs, and why so:
- The plan (docs/FINETUNING.md, "LoRA over the released weights, kept quantised"): V4.1-Flash LoRA on 8 H200s,
  P x E x C = 1 x 8 x 8, one stage of all 40 layers, each 64K row in 8 context chunks, the 384 routed experts over
  8 expert ranks, rank 16 on ``[wq_a,wq_b,wkv,wo_a,wo_b,shared_experts,experts]``, ``parallel.recompute=layer``.
- What a GPU of it computes, measured on 4 of its layers: ``bench/v41_slice.py``'s slices (``--slices``; 20-23:
  Full 20 with its indexer, Reuse 21-23; 24-27: Reindex 24 reading 20's latent and candidates, Reuse 25-27) with its
  machinery (``Slice``, ``StandInDispatch``, ``measure``: per-layer times, parts, MFU against this process's bf16
  matmul rate), the MoE that of rank 0 of E = 8 (experts 0-47 of 384, all FP4 in the quantised base) receiving
  uniformly from 8 senders: 8 x 8,192 x 6 x 48 / 384 = 49,152 rows a layer, as many as its own tokens send out.
- Tokens: 8,192 of one row (``--tokens``), a GPU's context chunk of the 64K row. The context exchange is not run:
  the slice's attention sees its own 8,192 tokens as a whole row, not a chunk reading the gathered compressed
  entries of 64K (a Full layer's latent of the whole row, its all-gather buffers and the window halo; their bytes
  are in the plan's estimate below, their time is not measured here). Nor are the expert all-to-alls (the stand-in
  fills the received buffer locally, as in v41_slice).
- The two bases, each built as a run builds its stage (``parallel/stage.py``), then ``model.lora.attach`` (rank 16,
  the frozen matrices only autocast reads kept in bf16 under bf16):
  ``quantized``: ``train.lora.quantized_base=true``: ``model.quantized_build.quantized_transformer`` (the FP8
  attention, shared-expert and indexer ``wq_b`` matrices and the FP4 routed experts born as empty buffers of codes
  and scales, never in full precision) filled by ``train.formats.init_from.fill_stored``, the import's own code,
  from ``DrawnRelease``: a release whose stored tensors are drawn instead of read (each
  ``import_slice.written_value``, Normal(0, init_std) from its (seed, name) generator rounded onto its stored grid,
  quantised as the release stores it; one matrix in fp32 at a time). The GEMMs run on the stored bytes
  (``kernels/triton_quant_gemm.py`` on CUDA).
  ``bf16``: the ordinary LoRA stage (``Transformer``, the base matrices bf16) holding the same values: every base
  matrix the dequantised ``written_value``, every other tensor drawn by name as the quantised build draws it. So the
  two compute the same function (a code times a power of two is exact in bf16) and their adapters' gradients agree
  to the GEMMs' summation order: ``adapter_grad_norm`` per run.
  One base's stage is freed before the other's is built; a later slice reads what the first run of the earlier slice
  produced.
- FLOPs (both bases, the same work): ``v41_slice.slice_flops`` of the bf16-base LoRA slice built on the meta device,
  ``model.flops.passes``: a frozen matrix 4 per value and row (forward, gradient of its input), an adapter 6, the
  frozen indexer 2; the routed experts at the rows received.
- Memory model (``parallel.memory.estimate``, the plan's settings, each base): ``estimate_as_run``, the slice's
  layers as run here (a row of ``--tokens``; 8 ranks a stage, as the plan's C x D, so the state is the plan's:
  ``data_parallel=8, context_parallel=1``), ``stage_peak`` of those layers (their state, retained activations,
  max(casts, transient), the boundary payloads in and out); ``estimate_plan``: the same layers in the plan (64K rows
  in 8 chunks: the whole row's compressed entries and the gather's buffers on top). ``measured_over_estimate``: the
  peak allocated against ``estimate_as_run`` (the goal: within 10%). So that the peak holds what the estimate counts,
  each run keeps AdamW's two moments of the adapters as a training rank does (``hold_optimizer_state``: a step at
  learning rate 0 over zero gradients, which leaves the weights bit for bit; ``optimizer_state_gib``). The
  dense adapters' moments are held whole, where the plan's ZeRO-1 gives a rank 1/8 of them (0.04 GiB more than the
  plan at V4.1 width); the routed experts' adapters, nearly all of them, are held by their expert rank alone in both.

Per run: the ``v41_slice.measure`` keys (``--warmup`` steps, ``--steps`` timed, one probed; 3 warm-up steps,
because the first quantised run's first steps do one-time work, not explained: on 2026-12-07 its first timed step
took 13.2 s against 0.58 for the next after one warm-up step, and at bedd9d1 its three timed steps took 4.0, 9.5 and
0.37 s; step / fwd / bwd ms, per layer and per part, peak allocated and reserved, model TFLOP/s and MFU),
``base_held`` (quantised matrices by format, frozen GiB, adapter parameters, ``base_in_floating_point``: the
matrices the release stores quantised that the stage holds in bf16 / fp32, none for the quantised base) and
``adapter_grad_norm``; per slice ``quantized_over_bf16`` (step, forward, backward, peak). A run that fails (out of memory: ``out_of_memory``) is
recorded and the next one runs; the exit status is 1 when none was measured. The JSON is rewritten after each run,
so a cut call keeps what ran; a short table is printed at the end.
"""
import argparse
import json
import math
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from import_slice import written_value  # noqa: E402
from layer_probe import Clock  # noqa: E402
from model import ModelArgs, layout_from_config  # noqa: E402
from model.cli import compose  # noqa: E402
from model.config import LoRA  # noqa: E402
from model.lora import attach  # noqa: E402
from model.quant import quantize  # noqa: E402
from model.quantized_base import QuantizedMatrix, quantized_form, stored_slots  # noqa: E402
from model.quantized_build import quantized_transformer  # noqa: E402
from model.transformer import Transformer, init_parameters  # noqa: E402
from moe_ffn import Timer, matmul_rate  # noqa: E402
from parallel.memory import GIB, estimate  # noqa: E402
from result_meta import result_meta, write_result  # noqa: E402
from train.formats.init_from import fill_stored  # noqa: E402
from v41_slice import (SMOKE, V41, Slice, StandInDispatch, expert_split, free_memory, is_oom, measure,  # noqa: E402
                       parse_slices, rank_rows, slice_flops)

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
RANKS = 8  # E = C of the plan: a GPU holds 384 / 8 = 48 experts and 65,536 / 8 = 8,192 tokens of each row
TARGETS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts", "experts")
BASES = ("quantized", "bf16")
MODE, SPLIT = "layer", "uniform"  # parallel.recompute=layer; the rows of 8 senders, equal per expert


# ------------------------------------------------------------------------------------------------ the bases

class DrawnRelease:
    """A release whose stored tensors are drawn, not read: ``load_stored`` as ``ReleasedWeights``' (what
    ``fill_stored`` asks of a source), each tensor ``written_value`` quantised in its stored form."""

    directory = "(drawn, bench/lora_slice.py)"

    def __init__(self, args: ModelArgs, n_layers: int, seed: int, shapes: dict[str, tuple[int, int]]):
        self.args, self.n_layers, self.seed, self.shapes = args, n_layers, seed, shapes

    def load_stored(self, names, rows=None, device=None) -> dict[str, tuple]:
        stored = {}
        for name in names:
            fmt, block = quantized_form(name)
            value = written_value(name, self.shapes[name], self.args, self.n_layers, self.seed, device)
            stored[name] = (*quantize(value, fmt, block), fmt, block)
        return stored


def weight_shape(codes: torch.Size, fmt: str) -> tuple[int, int]:
    """A stored matrix's shape from its codes' (FP4: two a byte)."""
    return codes[0], codes[1] * (2 if fmt == "fp4" else 1)


def quantized_layers(lora: LoRA, low_precision, args: ModelArgs, layout, layers: range, dispatch, seed: int):
    """The LoRA stage of ``train.lora.quantized_base=true``, its base filled by ``fill_stored`` from a
    ``DrawnRelease``."""
    model = quantized_transformer(quantized_form, args, layout, layers, seed, experts=dispatch)
    slots = stored_slots(model)
    shapes = {name: weight_shape(slot.codes.shape, slot.fmt) for name, slot in slots.items()}
    fill_stored(model, DrawnRelease(args, layout.n_layers, seed, shapes), set(slots))
    attach(model, lora, seed, low_precision)
    return model


def bf16_layers(lora: LoRA, low_precision, args: ModelArgs, layout, layers: range, dispatch, seed: int):
    """The ordinary LoRA stage holding the quantised one's values: the base matrices the release's (dequantised),
    the rest drawn as ``quantized_transformer`` draws it."""
    model = Transformer(args, layout, layers, seed, init=False, experts=dispatch)
    state = model.state_dict(keep_vars=True)
    base = {name for name in state if quantized_form(name) is not None}
    init_parameters([(n, t) for n, t in state.items() if n not in base], args, layout.n_layers, seed,
                    model.row_shards())
    with torch.no_grad():
        for name in base:
            state[name].copy_(written_value(name, state[name].shape, args, layout.n_layers, seed, state[name].device))
    attach(model, lora, seed, low_precision)
    return model


BUILDS = {"quantized": quantized_layers, "bf16": bf16_layers}


def describe_base(model) -> dict:
    """The frozen base as held: quantised matrices by format, frozen bytes, and the matrices the release stores
    quantised that the stage holds in bf16 / fp32 instead (state-dict names: a routed expert's each; the quantised
    base holds none)."""
    quantized = [m for m in model.modules() if isinstance(m, QuantizedMatrix)]
    tensors = dict(model.named_buffers()) | dict(model.named_parameters())
    return {"quantized_matrices": {fmt: sum(m.fmt == fmt for m in quantized) for fmt in ("fp8", "fp4")},
            "fp4_expert_matrices": sum(m.experts for m in quantized if m.fmt == "fp4"),
            "frozen_gib": sum(t.numel() * t.element_size() for t in tensors.values() if not t.requires_grad) / GIB,
            "adapter_params": sum(t.numel() for t in tensors.values() if t.requires_grad),
            "base_in_floating_point": sum(quantized_form(n) is not None and t.dtype in FLOATS
                                          for n, t in model.state_dict().items())}


def hold_optimizer_state(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the trained parameters with its moments allocated (AdamW allocates them at its first step: one at
    learning rate 0 over zero gradients, which leaves the weights bit for bit), kept by the caller through the
    measured steps."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.0)
    for p in trained:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def state_gib(optimizer: torch.optim.Optimizer) -> float:
    """GiB of the optimizer's state tensors (AdamW's moments; its step counters are scalars, left out)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0) / GIB


def adapter_grad_norm(model) -> float:
    """The 2-norm of every adapter's gradient after a step: the two bases' agree to the GEMMs' summation order."""
    return math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters() if p.grad is not None))


# ------------------------------------------------------------------------------------------- the memory model

def memory_estimates(args: ModelArgs, layout, layers: range, T: int, lora: LoRA, dtype, cuda: bool) -> dict:
    """``parallel.memory.estimate`` of the slice's layers under the plan's settings: ``as_run`` (rows of ``T``
    tokens, 8 ranks a stage) and ``plan`` (rows of RANKS x T in RANKS context chunks), GiB by term."""
    out = {}
    for key, seq_len, data, context in (("as_run", T, RANKS, 1), ("plan", RANKS * T, 1, RANKS)):
        m = estimate(args, layout, 1, seq_len, dtype, layout.n_layers, data, 1, cuda, expert_parallel=RANKS,
                     context_parallel=context, lora=lora)
        terms = {"state": sum(m.state[i] for i in layers), "retained": sum(m.retained[i] for i in layers),
                 "casts": sum(m.casts[i] for i in layers), "transient": max(m.transient[i] for i in layers),
                 "payloads": 2 * m.boundary[layers.start - 1] + m.boundary[layers.stop - 1],
                 "peak": m.stage_peak(0, layers, 1, 1)}
        out[key] = {"seq_len": seq_len, "data_parallel": data, "context_parallel": context,
                    **{f"{k}_gib": v / GIB for k, v in terms.items()}}
    return out


# -------------------------------------------------------------------------------------------------- the runs

def flops_model(lora: LoRA, args: ModelArgs, layout, layers: range, dispatch):
    """The bf16-base LoRA slice on the meta device: its parameters are what both bases compute with."""
    with torch.device("meta"):
        model = Transformer(args, layout, layers, init=False, experts=dispatch)
        attach(model, lora, 0)
    return model


def run_base(base: str, layers: range, args, layout, device, carried: dict, clock: Clock, a, lora: LoRA,
             dispatch: StandInDispatch, counts: list[int], rate: float) -> tuple[dict, dict]:
    """Build the slice over ``base``, measure it with ``counts`` rows received a held expert: (the run's result,
    what it produced for later slices)."""
    rows = sum(counts)
    flops = slice_flops(flops_model(lora, args, layout, layers, dispatch), layout, args, layers, a.tokens, rows)
    run, produced = {"base": base, "rows_per_layer": rows}, {}
    build = partial(BUILDS[base], lora, torch.bfloat16 if a.autocast else None)
    start = time.monotonic()
    optimizer = None
    try:
        sl = Slice(args, layout, layers, a.tokens, device, carried, dispatch, a.autocast, a.seed, build=build)
        sl.shadows.requires_grad_(False)  # replicas of frozen owners, as parallel/stage.py freezes them
        run.update(build_s=time.monotonic() - start, base_held=describe_base(sl.model))
        optimizer = hold_optimizer_state(sl.model)
        run["optimizer_state_gib"] = state_gib(optimizer)
        measured, state = measure(sl, clock, a, MODE, SPLIT, RANKS, counts, flops, rate, None)
        run.update(measured, adapter_grad_norm=adapter_grad_norm(sl.model))
        produced = sl.produced(state)
        del state
    except Exception as err:  # noqa: BLE001 - recorded; the other base and later slices still run
        run["error"] = f"{type(err).__name__}: {err}"[:600]
        run["out_of_memory"] = is_oom(err)
        if not run["out_of_memory"]:
            traceback.print_exc()  # the log of a GPU call is all there is to debug it from
        if clock.cuda:
            run["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / GIB
    sl = optimizer = None  # noqa: F841 - the stage and its moments freed before the next is built
    free_memory(clock.cuda)
    run["run_s"] = time.monotonic() - start
    return run, produced


def compare(entry: dict) -> None:
    """``quantized_over_bf16`` and the measured peak against the memory model, where both ran."""
    runs = {r["base"]: r for r in entry["runs"] if "step_ms" in r}
    for base, run in runs.items():
        if "peak_alloc_gib" in run:
            run["measured_over_estimate"] = run["peak_alloc_gib"] / entry["estimate"][base]["as_run"]["peak_gib"]
            run["within_10_percent"] = abs(run["measured_over_estimate"] - 1) <= 0.1
    if len(runs) == 2:
        q, b = runs["quantized"], runs["bf16"]
        ratio = {k: q[k] / b[k] for k in ("step_ms", "fwd_ms", "bwd_ms", "peak_alloc_gib", "peak_reserved_gib")
                 if k in q and k in b}
        entry["quantized_over_bf16"] = {**ratio, "no_slower": q["step_ms"] <= b["step_ms"],
                                        "adapter_grad_norm": q["adapter_grad_norm"] / b["adapter_grad_norm"]}


def table(res: dict) -> None:
    print(f"\nmatmul 8192^3 bf16: {res['matmul_bf16']['tflops']:.0f} TFLOP/s; {res['T']} tokens, ms over the slice's "
          "layers, fwd+bwd; peak GiB against the memory model's estimate of the same layers")
    print(" ".join(f"{h:>{w}}" for h, w in zip(("slice", "base", "step", "fwd", "bwd", "TFLOP/s", "MFU", "peak",
                                                 "est.", "meas/est"), (7, 9, 7, 7, 7, 7, 6, 7, 7, 8))))
    for entry in res["slices"]:
        name = f"{entry['layers'][0]}-{entry['layers'][-1]}"
        for run in entry["runs"]:
            est = entry["estimate"][run["base"]]["as_run"]["peak_gib"]
            if "step_ms" not in run:
                print(f"{name:>7} {run['base']:>9} {run.get('error', '')[:100]}")
                continue
            print(f"{name:>7} {run['base']:>9} {run['step_ms']:7.0f} {run['fwd_ms']:7.0f} {run['bwd_ms']:7.0f} "
                  f"{run['model_tflops']:7.1f} {run['mfu_vs_measured_matmul']:6.1%} "
                  f"{run.get('peak_alloc_gib', float('nan')):7.1f} {est:7.1f} "
                  f"{run.get('measured_over_estimate', float('nan')):8.2f}")
        if "quantized_over_bf16" in entry:
            r = entry["quantized_over_bf16"]
            peak = r.get("peak_alloc_gib", float("nan"))
            print(f"{name:>7} quantised / bf16: step {r['step_ms']:.2f}, peak {peak:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to test this script")
    p.add_argument("--slices", default="20-23,24-27", help="first-last layers of each slice, in order")
    p.add_argument("--bases", default=",".join(BASES), help=f"in order, of {','.join(BASES)}")
    p.add_argument("--tokens", type=int, default=None, help="T: a GPU's chunk of the row (default 8192; smoke 64)")
    p.add_argument("--rank", type=int, default=16, help="train.lora.rank")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 3; smoke 1)")
    p.add_argument("--warmup", type=int, default=None, help="steps before them (default 3; smoke 0)")
    p.add_argument("--kernel-table", action="store_true",
                   help="each run: one more step's device time by kernel (CUDA; v41_slice.measure)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="config overrides after the preset's")
    a = p.parse_args(argv)
    started = time.monotonic()
    for name, gpu, smoke in (("steps", 3, 1), ("warmup", 3, 0), ("tokens", 8192, 64)):
        if getattr(a, name) is None:
            setattr(a, name, smoke if a.smoke else gpu)
    bases = a.bases.split(",")
    if not bases or any(b not in BASES for b in bases):
        p.error(f"--bases {a.bases}: use some of {','.join(BASES)}")
    cuda = not a.smoke
    if cuda and not torch.cuda.is_available():
        p.error("no CUDA device: run on the GPU, or --smoke on the CPU")
    if a.smoke:
        torch.set_num_threads(1)  # tiny ops on a shared CPU: threads only wait on each other
    device = torch.device("cuda" if cuda else "cpu")
    a.autocast = cuda  # bf16 autocast over fp32 adapters, as training; the smoke in fp32
    dtype = torch.bfloat16 if a.autocast else torch.float32
    overrides = (SMOKE if a.smoke else V41) + a.overrides
    cfg = compose(overrides)
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    lora = LoRA(rank=a.rank, targets=TARGETS, quantized_base=True)
    try:
        slices = parse_slices(a.slices, layout.n_layers)
        tables = sorted({i for layers in slices for i in layers} & set(args.engram.layers))
        if tables:
            raise ValueError(f"--slices {a.slices}: layers {tables} hold Engram tables, which are not drawn here "
                             "(DrawnRelease): choose layers without them (e.g. 20-23,24-27)")
        lora.check(args)
        dispatch = StandInDispatch(RANKS)
        held = dispatch.experts_of(args.moe.n_routed_experts)
        counts = expert_split(rank_rows(a.tokens, args.moe.n_activated_experts, args.moe.n_routed_experts,
                                        len(held), RANKS), len(held), "uniform")
    except ValueError as err:
        p.error(str(err))
    clock = Clock(cuda)
    res = {**result_meta(), "overrides": overrides, "T": a.tokens, "lora": {"rank": a.rank, "targets": list(TARGETS)},
           "plan": {"pipeline_stages": 1, "expert_parallel": RANKS, "context_parallel": RANKS,
                    "row": RANKS * a.tokens, "recompute": MODE},
           "expert_parallel": {"ranks": RANKS, "held": [held[0], held[-1]], "split": SPLIT, "senders": RANKS,
                               "all_to_all": "left out (AllToAllStandIn)"},
           "context_exchange": "not run: the slice's tokens are one whole row",
           "gpu_total_gib": torch.cuda.get_device_properties(0).total_memory / GIB if cuda else None,
           "timing": {"warmup": a.warmup, "steps": a.steps, "stat": "median"}, "slices": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        res["wall_s"] = time.monotonic() - started
        write_result(out, res)

    res["matmul_bf16"] = matmul_rate(Timer(cuda, 1 if a.smoke else 3, 2 if a.smoke else 10), device,
                                     64 if a.smoke else 8192)
    carried = {}
    for layers in slices:
        entry = {"layers": list(layers), "runs": [], "estimate": {
            base: memory_estimates(args, layout, layers, a.tokens, LoRA(rank=a.rank, targets=TARGETS,
                                                                        quantized_base=base == "quantized"),
                                   dtype, cuda) for base in BASES}}
        res["slices"].append(entry)
        produced = {}
        for base in bases:
            run, made = run_base(base, layers, args, layout, device, carried, clock, a, lora, dispatch, counts,
                                 res["matmul_bf16"]["tflops"])
            produced = produced or made
            entry["runs"].append(run)
            compare(entry)
            print(json.dumps({k: v for k, v in run.items() if k not in ("per_layer", "parts", "flops", "per_expert",
                                                                        "summary", "step_ms_each")}), flush=True)
            save()
        carried.update(produced)
    table(res)
    return 0 if any("step_ms" in run for entry in res["slices"] for run in entry["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
