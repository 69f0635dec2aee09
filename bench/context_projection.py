"""Projection of rows of 256K, 512K and 1M tokens split over C = 2..16 context-parallel ranks (issue 37), for
``model=small`` and ``model=v41_flash`` (``layout=v41``, ``parallel.recompute=layer``, bf16, one row a microbatch):
per row, the compute on the context group's slowest rank, what its collectives move and cost, and the memory per
rank, from the memory model (``parallel/memory.py``) and the simulator's passes (``parallel/simulate.py``).

    python bench/context_projection.py [--steps FILE ...] [--lengths 262144,524288,1048576] [--contexts 2,4,8,16]
                                       [--out bench/results/context/projection.json] [--docs docs/PERFORMANCE.md]

Time model. A layer's time on a row of T tokens is linear + growing: linear, the layer's time at the calibration
length T0 x T / T0 (projections, the window and the top-k entries, the candidate-restricted scoring, the FFN or MoE,
the stream: all per token); growing, the selection of an index source without candidate blocks (it scores every
visible entry: the Full layers 2, 8, 14 and the candidate source 20), x (T / T0)^2, taken from the indexer kernel at
64K (``INDEXER``: 74.6 ms for layer 20's selection with its blocks, 44.7 / m ms for another Full layer's). Under C the
slowest rank computes linear / C and (2C - 1) / C^2 of growing (its queries see the most entries), plus every layer's
all-gathers (a Full layer's latent, every layer's window halo) once forward and twice backward (reduce-scatter, the
recomputation's all-gathers), over NVLink in a node of 8, between nodes for C = 16 (``Cluster``'s links).

Calibration: the named files, read on every run (add a file and rerun to update the tables):
- ``small``: ``--steps``, ``bench/train_step.py``'s JSONs of model=small, one GPU or C GPUs (a
  ``parallel.context_parallel=C`` among the file's overrides). The first is the reference: its per-layer times
  (``per_mode``, scaled to the step less the step's ``rest``, the optimizer's fixed time) give linear and growing at
  its length. With two or more files one factor on linear and one on growing are fitted to all their steps by least
  squares. Each file's simulated step and estimated peak stand beside its measurement in the output (``check``).
- ``v41_flash``: ``bench/v41_projection.py``'s per-layer times at 64K (``small_moe``'s step, ``moe_ffn.json``'s grouped
  GEMM rates at the chunk's tokens per expert, the V4.1-width slice ``--slice``), the routed experts over the C ranks
  of a stage (E = C, one data-parallel replica) and their all-to-alls in the passes.

Memory per rank and throughput: ``small`` as one stage on C GPUs, ``ROWS_PER_STEP`` rows a step; ``v41_flash`` on
the fewest GPUs (P x C x D, up to ``--max-gpus``; P of 4-32, E of 8-128 over a stage's C x D ranks, the split the
engine would choose, ``MICROBATCHES_PER_STAGE`` x P rows a replica: 1F1B holds P - s on stage s, more add no memory)
on which every stage fits the GPU's 139.8 GiB, the fastest of them (else the one needing the least). Not modelled:
the LM head's fp32 logits beyond what the 64K step measured (a chunk of 64K tokens is the measured case), imbalance
between documents of a packed row (one document assumed: the worst case for the growing part).
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import v41_projection as v41  # noqa: E402
from pipeline_projection import GPU_BYTES, boundary_bytes, model, project, replace_block  # noqa: E402
from parallel.context import chunk_length  # noqa: E402
from parallel.memory import context_bytes, estimate, layer_parameters  # noqa: E402
from parallel.simulate import Cluster, Layers, simulate, stage_work  # noqa: E402
from result_meta import result_meta  # noqa: E402

STEPS = [ROOT / "bench/results/train/train_step_small_65536.json"]
INDEXER = v41.INDEXER
SLICE = ROOT / "bench/results/v41_slice/v41_slice.json"
LENGTHS, CONTEXTS = (262144, 524288, 1048576), (2, 4, 8, 16)
STAGES, REPLICAS, EXPERTS = (4, 8, 16, 32), (1, 2, 4, 8, 16, 32, 64), (8, 16, 32, 64, 128)  # v41_flash's search
MICROBATCHES_PER_STAGE = 4  # v41_flash: 4 P microbatches a replica (memory holds P - s in flight whatever M)
ROWS_PER_STEP = 8  # small: rows a step for its tokens/s (the gradients' reduction over the C ranks once a step)


def relative(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def context_of(step: dict) -> int:
    """A step file's C: its ``parallel.context_parallel`` override, else 1."""
    found = [o.split("=", 1)[1] for o in step.get("overrides", []) if o.startswith("parallel.context_parallel=")]
    return int(found[-1]) if found else 1


def fixed_s(step: dict) -> float:
    """The step's time outside the layers' probes that does not grow with the row: its ``rest`` (optimizer,
    gradient norm), 0 when the file has no parts."""
    return step.get("parts", {}).get("parts", {}).get("rest", {}).get("other_ms", 0.0) / 1e3


@dataclasses.dataclass(frozen=True)
class Base:
    """Per-layer seconds of one row at ``length`` tokens: the linear parts (forward, backward with recompute) and the
    growing forward part; ``fixed``: the optimizer's seconds a step; the inputs of ``Layers``."""
    name: str
    length: int
    linear_fwd: list[float]
    linear_bwd: list[float]
    growing: list[float]
    fixed: float
    layers: Layers  # the rest of the inputs (parameters, routed bytes, shared-expert times) at ``length``

    def at(self, seq_len: int, context: int, linear: float = 1.0, growing: float = 1.0) -> Layers:
        """The layers at ``seq_len`` tokens for C ranks: linear x seq_len / length, growing x its square, times the
        fitted factors; a rank's payloads and the context exchanges at that length."""
        r = seq_len / self.length
        grow = [g * r * r * growing for g in self.growing]
        boundary, gradient = boundary_bytes(self.name, context, seq_len)
        args, layout = model(self.name)
        gathered, halo = context_bytes(args, layout, 1, seq_len, torch.bfloat16)
        routed = [b * r for b in self.layers.routed_bytes] if self.layers.routed_bytes else None
        return dataclasses.replace(
            self.layers, fwd_s=[f * r * linear + g for f, g in zip(self.linear_fwd, grow)],
            bwd_s=[b * r * linear for b in self.linear_bwd], growing_fwd_s=grow, boundary_bytes=boundary,
            gradient_bytes=gradient, gathered_bytes=gathered, halo_bytes=halo, routed_bytes=routed,
            shared_fwd_s=[s * r for s in self.layers.shared_fwd_s] if self.layers.shared_fwd_s else None,
            shared_bwd_s=[s * r for s in self.layers.shared_bwd_s] if self.layers.shared_bwd_s else None)


def small_base(step: dict, indexer: dict) -> Base:
    """``small``'s layers from a step file: its probed per-layer times scaled to the step less ``fixed_s``, the
    growing part the indexer kernel's at 64K moved to the file's length."""
    args, layout = model("small")
    fwd, bwd = [0.0] * layout.n_layers, [0.0] * layout.n_layers
    for mode in step["per_mode"].values():
        for i, f, b in zip(mode["layers"], mode["fwd_ms"], mode["bwd_ms"]):
            fwd[i], bwd[i] = f / 1e3, b / 1e3
    length, fixed = step["T"], fixed_s(step)
    scale = (step["step_s"] - fixed) / (sum(fwd) + sum(bwd))
    grow = [g * (length / 65536) ** 2 for g in v41.growing_seconds(indexer, layout)]
    params = layer_parameters(args, layout)
    layers = Layers(fwd, bwd, [0.0] * layout.n_layers, [0.0] * layout.n_layers, params, fixed / sum(params),
                    recomputed=True)
    return Base("small", length, [f * scale - g for f, g in zip(fwd, grow)], [b * scale for b in bwd], grow, fixed,
                layers)


def v41_base(experts: int, context: int, seq_len: int, step: dict, moe_ffn: dict, indexer: dict, correction) -> Base:
    """``v41_flash``'s layers at 64K with the routed experts over E ranks, the grouped GEMMs at the rate of a rank's
    chunk of ``seq_len`` (``v41_projection.layer_inputs``)."""
    layers, _ = v41.layer_inputs(step, moe_ffn, experts, correction, context, indexer, chunk=seq_len // context)
    grow = layers.growing_fwd_s
    fixed = layers.optimizer_s_per_param * sum(layers.params)
    return Base(v41.NAME, v41.T, [f - g for f, g in zip(layers.fwd_s, grow)], list(layers.bwd_s), grow, fixed, layers)


def cluster(ranks: int) -> Cluster:
    """C ranks, consecutive: one node of 8 up to C = 8, two for 16 (the context ring crosses nodes)."""
    return Cluster(nodes=max(1, ranks // 8))


def row_costs(layers: Layers, context: int, experts: int = 1, rows: int = 1) -> dict:
    """A row on a context group as one stage: the slowest rank's compute, its collectives and all-to-alls
    (``stage_work``'s passes), and the step of ``rows`` rows with the gradients' reduction over the C ranks and the
    optimizer (``simulate``)."""
    n = len(layers.params)
    work = stage_work(layers, (range(n),), 1, cluster(context), expert_parallel=experts, context_parallel=context)[0]
    step = simulate([work], rows).step_s
    compute = sum(layers.chunk_fwd_s(i, context) + layers.bwd_s[i] / context for i in range(n))
    received = sum(layers.context_received(i, context) for i in range(n))
    return {"step_s": step, "compute_s": compute, "context_s": work.context_s, "all_to_all_s": work.all_to_all_s,
            "growing_s": sum(g * (2 * context - 1) / context ** 2 for g in layers.growing_fwd_s or []),
            "gathered_gib_forward": received / 2 ** 30, "gathered_gib_step": 3 * received / 2 ** 30}


def small_peak(seq_len: int, context: int) -> float:
    """``small``'s estimated peak per rank (GiB): one stage, one replica, C ranks a row."""
    args, layout = model("small")
    memory = estimate(args, layout, 1, seq_len, torch.bfloat16, layout.n_layers, 1, 1, True, context_parallel=context)
    return memory.peaks((range(layout.n_layers),), 1)[0] / 2 ** 30


def fit(bases: list[tuple[dict, Base]]) -> tuple[float, float]:
    """Factors on linear and growing fitted to the steps by least squares (1, 1 with one file: the reference)."""
    if len(bases) < 2:
        return 1.0, 1.0
    rows, targets = [], []
    for step, base in bases:
        C, layers = context_of(step), base.at(step["T"], context_of(step), 1.0, 1.0)
        n = len(layers.params)
        grow = sum(g * (2 * C - 1) / C ** 2 for g in layers.growing_fwd_s)
        linear = sum(layers.chunk_fwd_s(i, C) + layers.bwd_s[i] / C for i in range(n)) - grow
        other = row_costs(layers, C)["step_s"] - linear - grow  # collectives and optimizer: not fitted
        rows.append((linear, grow))
        targets.append(step["step_s"] - other)
    solution = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                                  torch.tensor(targets, dtype=torch.float64).unsqueeze(1)).solution
    return solution[0, 0].item(), solution[1, 0].item()


def check(steps: list[tuple[Path, dict]], reference: Base, factors: tuple[float, float]) -> list[dict]:
    """Each calibration file's measured step and peak beside the model's."""
    rows = []
    for path, step in steps:
        C = context_of(step)
        predicted = row_costs(reference.at(step["T"], C, *factors), C)["step_s"]
        peak = small_peak(step["T"], C)
        rows.append({"file": relative(path), "seq_len": step["T"], "context_parallel": C,
                     "measured_step_s": step["step_s"], "predicted_step_s": predicted,
                     "step_error": predicted / step["step_s"] - 1, "measured_peak_gib": step.get("peak_alloc_gib"),
                     "predicted_peak_gib": peak})
    return rows


def small_rows(reference: Base, factors, lengths, contexts) -> list[dict]:
    args, layout = model("small")
    rows = []
    for T in lengths:
        for C in contexts:
            length = chunk_length(C, T, args.window_size, layout.compress_ratios, layout.candidate_block_size)
            costs = row_costs(reference.at(T, C, *factors), C, rows=ROWS_PER_STEP)
            peak = small_peak(T, C)
            rows.append({"model": "small", "seq_len": T, "context_parallel": C, "chunk": length, **costs,
                         "gpus": C, "tokens_per_s_per_gpu": ROWS_PER_STEP * T / costs["step_s"] / C, "peak_gib": peak,
                         "fits": peak * 2 ** 30 <= GPU_BYTES, "configuration": f"1 stage x C = {C}"})
    return rows


def v41_shapes(context: int, max_gpus: int) -> list[tuple[int, int, int]]:
    """(P, E, D) for C ranks a row on at most ``max_gpus``: P x C x D GPUs, E dividing the C x D ranks of a stage
    and both expert counts, fewest GPUs first."""
    shapes = [(P, E, D) for P in STAGES for D in REPLICAS for E in EXPERTS
              if P * context * D <= max_gpus and (context * D) % E == 0 and 384 % E == 0 and 128 % E == 0]
    return sorted(shapes, key=lambda s: s[0] * s[2])


def v41_rows(lengths, contexts, step: dict, moe_ffn: dict, indexer: dict, correction, max_gpus: int) -> list[dict]:
    """Per length and C: the fewest GPUs on which every stage fits (the fastest of them, ``MICROBATCHES_PER_STAGE``
    x P microbatches per replica), its per-row costs and memory; or the least memory found up to ``max_gpus``."""
    args, layout = model(v41.NAME)
    rows = []
    for T in lengths:
        for C in contexts:
            length = chunk_length(C, T, args.window_size, layout.compress_ratios, layout.candidate_block_size)
            bases, tried = {}, []
            for P, E, D in v41_shapes(C, max_gpus):
                if tried and any(r["fits"] for r in tried) and P * C * D > min(r["gpus"] for r in tried if r["fits"]):
                    break
                if E not in bases:
                    bases[E] = v41_base(E, C, T, step, moe_ffn, indexer, correction).at(T, C)
                M = MICROBATCHES_PER_STAGE * P
                tried.append({**project(v41.NAME, bases[E], P, D, M, v41.cluster(P * C * D, C * D),
                                        expert_parallel=E, context_parallel=C, seq_len=T), "expert_parallel": E})
            fitting = [r for r in tried if r["fits"]]
            found = max(fitting, key=lambda r: r["tokens_per_s_per_gpu"]) if fitting else \
                min(tried, key=lambda r: max(r["peak_gib"]))
            E = found["expert_parallel"]
            rows.append({"model": v41.NAME, "seq_len": T, "context_parallel": C, "chunk": length,
                         **row_costs(bases[E], C, E), "gpus": found["gpus"], "stages": found["stages"],
                         "expert_parallel": E, "data_parallel": found["data_parallel"], "cuts": found["cuts"],
                         "microbatches": found["microbatches"], "peak_gib": max(found["peak_gib"]),
                         "fits": found["fits"], "tokens_per_s_per_gpu": found["tokens_per_s_per_gpu"],
                         "configuration": f"P x E x D = {found['stages']} x {E} x {found['data_parallel']}"})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | tokens a row | C | chunk | compute s a row, slowest rank (of it: indexer's growing part) | "
             "context collectives s | all-to-all s | gathered GiB received a rank, forward (with backward and "
             "recompute) | est. peak GiB a rank | tokens/s per GPU | as |", "|---" * 11 + "|"]
    for r in rows:
        fit = "" if r["fits"] else " **does not fit**"
        lines.append(f"| {r['model']} | {r['seq_len']:,} | {r['context_parallel']} | {r['chunk']:,} | "
                     f"{r['compute_s']:,.1f} ({r['growing_s']:,.1f}) | {r['context_s']:.2f} | "
                     f"{r['all_to_all_s']:.2f} | "
                     f"{r['gathered_gib_forward']:.2f} ({r['gathered_gib_step']:.2f}) | {r['peak_gib']:.0f}{fit} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {r['configuration']} ({r['gpus']} GPUs) |")
    return "\n".join(lines)


def check_table(rows: list[dict]) -> str:
    lines = ["| calibration file | tokens a row | C | step s, measured / model | peak GiB, measured / model |",
             "|---|---|---|---|---|"]
    for r in rows:
        peak = f"{r['measured_peak_gib']:.1f}" if r["measured_peak_gib"] is not None else "-"
        lines.append(f"| `{r['file']}` | {r['seq_len']:,} | {r['context_parallel']} | {r['measured_step_s']:.2f} / "
                     f"{r['predicted_step_s']:.2f} ({r['step_error']:+.1%}) | {peak} / {r['predicted_peak_gib']:.1f} |")
    return "\n".join(lines)


DOCS_BEGIN = "<!-- context projection: written by bench/context_projection.py --docs -->"
DOCS_END = "<!-- context projection: end -->"


def tokens(n: int) -> str:
    return f"{n // 2 ** 20}M" if n % 2 ** 20 == 0 else f"{n // 1024}K"


def reading(result: dict) -> list[str]:
    """What the table says, per model: the least C that fits each length, and at the longest row what the indexer's
    growing part and the collectives cost."""
    lines = []
    for name in dict.fromkeys(r["model"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["model"] == name]
        fits = []
        for T in sorted({r["seq_len"] for r in rows}):
            least = min((r for r in rows if r["seq_len"] == T and r["fits"]), key=lambda r: r["context_parallel"],
                        default=None)
            fits.append(f"{tokens(T)} from C = {least['context_parallel']} ({least['gpus']:,} GPUs)" if least else
                        f"{tokens(T)} at no C up to {max(r['context_parallel'] for r in rows)}"
                        + (f" on up to {result['max_gpus']:,} GPUs" if name == v41.NAME else ""))
        longest = max(rows, key=lambda r: (r["seq_len"], r["context_parallel"]))
        lines.append(f"- `{name}` fits {', '.join(fits)}. At {tokens(longest['seq_len'])} over "
                     f"{longest['context_parallel']} ranks the indexer's scoring over every visible entry is "
                     f"{longest['growing_s'] / longest['compute_s']:.0%} of the slowest rank's compute, the context "
                     f"collectives {longest['context_s'] / longest['compute_s']:.1%} of it.")
    return lines


def markdown(result: dict) -> str:
    """The marked block of docs/PERFORMANCE.md."""
    c = result["calibration"]
    fitted = ("one factor on the linear part and one on the growing part fitted to the files: "
              f"{c['linear_factor']:.3f}, {c['growing_factor']:.3f}" if len(c["steps"]) > 1 else
              "the reference step alone, whose layers give both parts; measured steps at other lengths or C added to "
              "--steps fit a factor on each")
    out = relative(Path(result["out"]))
    return "\n".join([
        DOCS_BEGIN,
        f"Written from [{out}](../{out}) (`{result['command']}`, {result['date']}, code {result['code']}). A "
        "projection, not a measurement: per row, the slowest rank's compute (its chunk's share of every layer's "
        "per-token work, and (2C - 1) / C^2 of the indexer's scoring over every visible entry, the part that grows "
        "with T^2), the context group's all-gathers and reduce-scatters over NVLink (between nodes at C = 16), and "
        "the memory model's peak per rank. `small` is one stage on C GPUs, its tokens/s per GPU of steps of "
        f"{ROWS_PER_STEP} rows (the gradients reduced over the C ranks once a step); `v41_flash` the fewest GPUs (P x "
        f"C x D, up to {result['max_gpus']:,}) on which every stage fits, the fastest of those, its experts over E of "
        f"a stage's C x D ranks, {MICROBATCHES_PER_STAGE} P rows a replica and step; where none fits, the "
        "configuration needing the least memory.", "",
        f"Calibration: {', '.join(f'`{s}`' for s in c['steps'])} for `small`: {fitted}; the indexer's selection at "
        f"64K from `{c['indexer']}` ({c['indexer_select_ms']:.1f} ms a Full layer at m = 1, "
        f"{c['indexer_select_blocks_ms']:.1f} ms with the candidate blocks); `v41_flash`'s layers from "
        "`bench/v41_projection.py`'s inputs ([projection_v41.md](projection_v41.md)). The calibration files against "
        "the model:", "", check_table(result["check"]), "",
        table(result["rows"]), "", *reading(result), DOCS_END])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", nargs="+", type=Path, default=STEPS,
                   help="bench/train_step.py JSONs of model=small (the first is the reference)")
    p.add_argument("--slice", type=Path, default=SLICE, help="bench/v41_slice.py's JSON for v41_flash's layer times")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--max-gpus", type=int, default=2048, help="v41_flash: the largest world searched for a fit")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/context/projection.json")
    p.add_argument("--docs", type=Path, help="Markdown file whose marked block gets the tables (docs/PERFORMANCE.md)")
    opts = p.parse_args(argv)
    lengths, contexts = [int(x) for x in opts.lengths.split(",")], [int(x) for x in opts.contexts.split(",")]
    indexer = json.loads(INDEXER.read_text())["indexer_64k"]
    steps = [(path, json.loads(path.read_text())) for path in opts.steps]
    wrong = [relative(path) for path, step in steps if step.get("model") != "small"]
    if wrong:
        raise SystemExit(f"error: --steps {' '.join(wrong)}: not a step of model=small — give bench/train_step.py "
                         "JSONs of model=small")
    reference = small_base(steps[0][1], indexer)
    factors = fit([(step, reference) for _, step in steps])
    moe_step, moe_ffn = json.loads(v41.SMALL_MOE.read_text()), json.loads(v41.MOE_FFN.read_text())
    correction = (0.0, 0.0)
    if opts.slice.exists():
        found = v41.slice_correction(json.loads(opts.slice.read_text()), moe_step, moe_ffn)
        correction = (found["fwd_s"], found["bwd_s"])
    rows = small_rows(reference, factors, lengths, contexts) + v41_rows(lengths, contexts, moe_step, moe_ffn,
                                                                        indexer, correction, opts.max_gpus)
    result = {**result_meta(), "out": relative(opts.out), "max_gpus": opts.max_gpus,
              "calibration": {"steps": [relative(path) for path, _ in steps], "indexer": relative(INDEXER),
                              "indexer_select_ms": indexer["select_ms"],
                              "indexer_select_blocks_ms": indexer["select_blocks_ms"],
                              "linear_factor": factors[0], "growing_factor": factors[1],
                              "v41_slice": relative(opts.slice) if opts.slice.exists() else None,
                              "v41_correction_s": list(correction)},
              "assumptions": {"gpu_gib": GPU_BYTES / 2 ** 30, "nvlink_gbps": Cluster.p2p_gbps,
                              "internode_gbps": Cluster.internode_gbps, "gpus_per_node": 8,
                              "documents": "one a row (the growing part's worst case)"},
              "check": check(steps, reference, factors), "rows": rows}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=1))
    print(check_table(result["check"]))
    print(table(rows))
    if opts.docs:
        replace_block(opts.docs, DOCS_BEGIN, DOCS_END, markdown(result))
    return result


if __name__ == "__main__":
    main()
