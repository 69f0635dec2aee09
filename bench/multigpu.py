"""Pipeline parallelism on the lent GPUs (issue 16): equivalence, throughput, bubble, transfers and memory.

    torchrun --standalone --nproc-per-node 2 bench/multigpu.py --out-dir DIR   # GPU (bench/gpu_multigpu.sh)
    python bench/multigpu.py --smoke --out-dir DIR                             # CPU: 2 gloo processes, tiny model

One process per GPU runs the sections in turn, most important first, so kernels compile and autotune once, at 64K
first (Triton's autotune keys leave out the sequence length: whatever length runs first picks the configs). After
every step rank 0 rewrites ``multigpu.json`` (atomically), so a run cut short keeps what it finished; parts marked
optional run only while the budget (``--budget``, rank 0's clock) keeps the reserve of the later sections.
Sections (``--smoke``: the same code on the tiny model, small shapes, fp32):

1. ``single``: 1 stage, data parallel over the GPUs, ``model=small layout=v41`` at 65,536 tokens (micro-batch 1,
   ``parallel.recompute=layer``, bf16): a warm-up step (compilation, autotuning), then steps of M = 2 and 4 microbatches
   per replica: tokens/s, peak memory, and the per-microbatch and fixed time (the slope and
   intercept of the two) that the 1F1B ideal is built from. During the first, per-layer forward/backward time and
   memory (``bench/layer_probe.py``) become ``layer_times_<model>_<T>.json``, the file ``parallel.layer_times`` reads.
2. ``transfer``: the payload of the boundary the pipeline uses, with index K by shadow and by payload, and its
   gradient, sent alone between the two GPUs the way the engine sends it (``parallel/p2p.py``): ms and GB/s.
3. ``pipeline``: 2 stages split on the measured times (memory-aware, ``parallel/balance.py``), ``parallel.p2p=
   overlap``: a warm-up step at M = 2, then M = 8; optional: M = 4 with the overlapped transfers and with
   DeepSpeed's blocking ones (``p2p=deepspeed``, before vs after), then M = 2 and 16. Per stage: the time in its
   passes (marks around each ForwardPass and BackwardPass), bubble = 1 - busy / pipeline time next to the 1F1B
   ideal (P-1)/(M+P-1), the time held up in receives, the shadow index-key recompute, peak memory.
   ``--keep-attention 0,2``: the stages keep that many attention outputs each (``parallel.keep_attention_layers``).
4. ``equivalence_tiny``: ``tiny``, fp32, 2 steps of 4 microbatches: 1 stage vs 2 stages with cuts that separate
   every edge kind (Full|Reuse, Full|Reindex with candidates, Reindex|Reuse), index K by shadow and by payload.
   First step's loss, every reduced gradient and the weights after the last step, compared tensor by tensor.
   Why the GPU need not be bitwise: each process autotunes the Triton kernels on its own, so a stage's layers
   may run another block size (another summation order) than the same layers of the 1-stage run; the section runs
   the 1-stage job with each rank's own choices, then adopts rank 0's choices everywhere (``share_autotuning``)
   and runs it twice more (run-to-run) and the 2-stage jobs, and records the choices.
5. ``equivalence_4k`` (optional): ``small``, bf16, T = 4,096, 20 steps, 2 microbatches per step, from the same
   weights on the same batches: 1 stage vs 2 stages. Loss and gradient norms per step, within bf16 noise
   (``BF16_NOISE``).

"1 stage" in the equivalence sections is the single-process computation: both ranks run the whole model on the
same microbatches as data-parallel replicas, whose all-reduced mean of two equal gradients is each of them exactly.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from layer_probe import Clock, LayerProbe, use_device_init  # noqa: E402
from result_meta import result_meta  # noqa: E402

BF16_NOISE = 2 ** -7  # relative: two bf16 roundings; a wrong shared tensor or gradient moves a loss far more
GPU = {
    "model": ["model=small", "layout=v41"], "seq_len": 65536, "micro_batch": 1, "precision": "bf16",
    "dp_microbatches": [2, 4], "microbatches": [8], "before_microbatches": 4, "optional_microbatches": [2, 16],
    "eq_model": ["model=small", "layout=v41"], "eq_seq_len": 4096, "eq_steps": 20, "eq_precision": "bf16",
    "tiny_seq_len": 256, "tiny_micro_batch": 2, "tiny_microbatches": 4, "tiny_steps": 2,
    "tiny_cases": [[8, "shadow"], [8, "payload"], [3, "payload"], [9, "shadow"]],
    "reserve_s": {"equivalence_tiny": 90}, "need_s": {"equivalence_4k": 70},
}
SMOKE = {
    "model": ["model=tiny", "layout=v41_scaled"], "seq_len": 128, "micro_batch": 1, "precision": "fp32",
    "dp_microbatches": [1, 2], "microbatches": [2], "before_microbatches": 2, "optional_microbatches": [],
    "eq_model": ["model=tiny", "layout=v41_scaled"], "eq_seq_len": 64, "eq_steps": 2, "eq_precision": "fp32",
    "tiny_seq_len": 64, "tiny_micro_batch": 2, "tiny_microbatches": 2, "tiny_steps": 2,
    "tiny_cases": [[8, "shadow"], [3, "payload"]],
    "reserve_s": {}, "need_s": {},
}
SECTIONS = ("single", "transfer", "pipeline", "equivalence_tiny", "equivalence_4k")  # most important first


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU: spawn 2 gloo processes, tiny shapes")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "bench/results/multigpu"))
    p.add_argument("--budget", type=float, default=390.0, help="seconds for all sections (optional parts skip)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--keep-attention", metavar="K0,K1",
                   help="the pipeline section's parallel.keep_attention_layers, one count per stage (e.g. 0,2)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------- plumbing

class Run:
    """What every section shares: settings, device, clock, budget, and the results rank 0 writes."""

    def __init__(self, opts, settings: dict, device: torch.device):
        self.opts, self.settings, self.device = opts, settings, device
        self.cuda = device.type == "cuda"
        self.clock = Clock(self.cuda)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.deadline = time.perf_counter() + opts.budget
        self.out = Path(opts.out_dir)
        self.results = {**result_meta(), "smoke": opts.smoke, "world_size": self.world, "budget_s": opts.budget,
                        "settings": settings, "sections": {}, "skipped": [], "errors": {}}

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def affordable(self, seconds: float, after: str, keep_reserve: bool = True) -> bool:
        """Room for a part of ``seconds`` that keeps the reserves of the sections after ``after`` (optional parts);
        rank 0's clock decides for every rank (a part that one rank skips and another runs would hang both)."""
        later = SECTIONS[SECTIONS.index(after) + 1:] if keep_reserve else ()
        reserve = sum(self.settings["reserve_s"].get(s, 0) for s in later if s in self.opts.sections.split(","))
        decision = [self.left() - reserve >= seconds]
        dist.broadcast_object_list(decision, src=0)
        return decision[0]

    def gather(self, value):
        values = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def save(self) -> None:
        """Rank 0 rewrites ``multigpu.json`` (atomically: a run killed mid-write keeps the previous one)."""
        if self.rank == 0:
            self.results["summary"] = summary(self.results)
            self.out.mkdir(parents=True, exist_ok=True)
            part = self.out / "multigpu.json.part"
            part.write_text(json.dumps(self.results, indent=1, default=str))
            os.replace(part, self.out / "multigpu.json")

    def keep(self, section: str, result: dict) -> None:
        """Record a section's results so far (a run cut short keeps every finished step)."""
        self.results["sections"][section] = result
        self.save()

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(f"[{time.strftime('%H:%M:%S')} {self.left():5.0f}s left] {text}", flush=True)


def job(model: list[str], seq_len: int, micro_batch: int, stages: int, microbatches: int, precision: str,
        extra: dict | None = None):
    """A job's settings (``model.config.JobConfig``); ``extra`` ({key: value}) overrides the defaults here."""
    from model.cli import compose, resolved

    settings = {"data.seq_len": seq_len, "data.micro_batch_size": micro_batch, "parallel.pipeline_stages": stages,
                "train.grad_accum_steps": microbatches, "train.precision": precision, "parallel.recompute": "layer",
                "train.warmup_steps": 5, "train.lr": 1e-4, "train.max_steps": 100, "logger.mode": "disabled",
                **(extra or {})}
    return resolved(compose([*model, *(f"{k}={v}" for k, v in settings.items())]))


def build(run: Run, config):
    """The engine of ``config`` on this run's ranks, split within its GPU's memory (as the job's preflight)."""
    from parallel.job import plan
    from train.run.engine import build_engine

    capacity = torch.cuda.get_device_properties(run.device).total_memory if run.cuda else None
    return build_engine(plan(config, run.world, run.device, capacity))


def release(engine) -> None:
    """Drop an engine and give its memory back before the next one is built."""
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def batches(vocab: int, seq_len: int, micro_batch: int, count: int, seed: int, device) -> list:
    """``count`` microbatches of rows that repeat a random 64-token segment (copying it is learnable through
    attention, so a loss falls within a few steps), one document per row, next-token labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        segment = torch.randint(0, min(vocab, 256), (micro_batch, 64), generator=g)
        ids = segment.repeat(1, -(-(seq_len + 1) // 64))[:, : seq_len + 1]
        out.append(((ids[:, :-1].to(device), torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)),
                    ids[:, 1:].to(device)))
    return out


def set_microbatches(engine, microbatches: int) -> None:
    engine.set_train_batch_size(microbatches * engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)


def instrument(engine, clock: Clock) -> list:
    """Mark the start and end of every instruction the engine runs; returns the list the marks go to."""
    from deepspeed.runtime.pipe import schedule

    from parallel.deepspeed_private import instructions, use_instructions

    log = []
    table = instructions(engine)
    for kind in (schedule.ForwardPass, schedule.BackwardPass, schedule.SendActivation, schedule.RecvActivation,
                 schedule.SendGrad, schedule.RecvGrad, schedule.OptimizerStep):
        def timed(self, *args, inner=table[kind], name=kind.__name__, **kwargs):
            start = clock.mark()
            inner(self, *args, **kwargs)
            log.append((name, start, clock.mark()))
        table[kind] = timed
    use_instructions(engine, table)
    stage = engine.module.stage
    if stage.shadows:  # the shadow index-key recompute inside the forward
        inner = stage._recompute_index_keys

        def recompute(state):
            start = clock.mark()
            inner(state)
            log.append(("ShadowIndexKeys", start, clock.mark()))
        stage._recompute_index_keys = recompute
    return log


def timed_step(run: Run, engine, data: list, log: list) -> dict:
    """One optimizer step; this rank's wall time, busy time, waits, marks and peak memory."""
    dist.barrier()
    run.clock.sync()
    if run.cuda:
        torch.cuda.reset_peak_memory_stats()
    log.clear()
    started = time.perf_counter()
    zero = run.clock.mark()
    loss = engine.train_batch(iter(data))
    run.clock.sync()
    wall = time.perf_counter() - started
    spans: dict[str, float] = {}
    pass_end = step_end = 0.0
    for name, start, end in log:
        spans[name] = spans.get(name, 0.0) + run.clock.ms(start, end)
        if name in ("ForwardPass", "BackwardPass"):
            pass_end = max(pass_end, run.clock.ms(zero, end))
        step_end = max(step_end, run.clock.ms(zero, end))
    step = {"stage": engine.stage_id, "wall_s": wall, "loss": float(loss), "pass_end_ms": pass_end,
            "after_passes_ms": step_end - pass_end,
            "busy_ms": spans.get("ForwardPass", 0.0) + spans.get("BackwardPass", 0.0), "spans_ms": spans,
            "grad_norm": float(engine.grad_norm), "indexer_grad_norm": float(engine.indexer_grad_norm)}
    if run.cuda:
        step["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        step["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2 ** 30
    return step


def pipeline_row(run: Run, ranks: list[dict], stages: int, microbatches: int, tokens: int) -> dict:
    """Per-stage figures of one step (one rank per stage and replica), the bubble against the 1F1B ideal."""
    wall = max(r["wall_s"] for r in ranks)
    pipeline_ms = max(r["pass_end_ms"] for r in ranks)
    per_stage = []
    for r in ranks:
        per_stage.append({
            "stage": r["stage"], "busy_ms": r["busy_ms"], "bubble": 1 - r["busy_ms"] / pipeline_ms,
            "recv_wait_ms": r["spans_ms"].get("RecvActivation", 0.0) + r["spans_ms"].get("RecvGrad", 0.0),
            "send_ms": r["spans_ms"].get("SendActivation", 0.0) + r["spans_ms"].get("SendGrad", 0.0),
            "shadow_index_keys_ms": r["spans_ms"].get("ShadowIndexKeys", 0.0),
            "after_passes_ms": r["after_passes_ms"],
            **{k: r[k] for k in ("peak_allocated_gib", "peak_reserved_gib") if k in r}})
    return {"stages": stages, "microbatches": microbatches, "step_s": wall, "tokens_per_s": tokens / wall,
            "pipeline_ms": pipeline_ms, "bubble_ideal": (stages - 1) / (microbatches + stages - 1),
            "loss": ranks[-1]["loss"], "per_rank": per_stage}


# ---------------------------------------------------------------------------------------------------- sections

def section_single(run: Run) -> dict:
    """1 stage, data parallel over the GPUs, 64K: per-microbatch time, layer times, peak memory."""
    from model import layout_from_config
    from parallel.balance import DIMS, LayerTimes

    s = run.settings
    cfg = job(s["model"], s["seq_len"], s["micro_batch"], 1, 1, s["precision"])
    engine = build(run, cfg)
    log = instrument(engine, run.clock)
    vocab, T, B = cfg.model.vocab_size, s["seq_len"], s["micro_batch"]
    rows, seed = [], 100 * run.rank
    set_microbatches(engine, 1)
    warm = timed_step(run, engine, batches(vocab, T, B, 1, seed, run.device), log)
    run.log(f"single: warm-up step {warm['wall_s']:.1f} s")
    result = {"warmup_s": warm["wall_s"], "steps": rows, "data_parallel": run.world}
    layer_times = None
    for i, M in enumerate(s["dp_microbatches"]):
        set_microbatches(engine, M)
        probe = LayerProbe(engine.module.stage.model, run.clock, memory=run.cuda) if i == 0 else None
        step = timed_step(run, engine, batches(vocab, T, B, M, seed + M, run.device), log)
        if probe is not None:
            probe.remove()
            layer_times = LayerTimes(T, B, "layer", s["precision"],
                                     {k: getattr(cfg.model, k) for k in DIMS},
                                     probe.per_mode(), probe.head_ms() or 0.0,
                                     {**result_meta(), "from": "bench/multigpu.py section single"})
            layer_rows = probe.per_layer()
            for key in ("peak_allocated_gib", "peak_reserved_gib"):  # the probe resets the peak counter
                step.pop(key, None)
        ranks = run.gather(step)
        row = pipeline_row(run, ranks, 1, M, M * B * T * run.world)
        rows.append(row)
        run.keep("single", result)
        run.log(f"single: M={M}: {row['step_s']:.2f} s, {row['tokens_per_s']:,.0f} tokens/s")
    if len(rows) >= 2:  # step(M) = M * per_microbatch + fixed (optimizer, all-reduce)
        (m0, t0), (m1, t1) = [(r["microbatches"], r["step_s"]) for r in rows[:2]]
        result["per_microbatch_s"] = (t1 - t0) / (m1 - m0)
        result["fixed_s"] = t0 - m0 * result["per_microbatch_s"]
    else:
        result["per_microbatch_s"] = rows[0]["step_s"] / rows[0]["microbatches"]
        result["fixed_s"] = 0.0
    path = run.out / f"layer_times_{cfg.model.name}_{T}.json"
    if run.rank == 0:
        run.out.mkdir(parents=True, exist_ok=True)
        layer_times.save(str(path))
    dist.barrier()  # the other ranks read it to split the pipeline
    result["layer_times"] = str(path)
    result["layer_modes"] = {k: vars(v) for k, v in layer_times.modes.items()}
    result["layers"] = layer_rows
    layout = layout_from_config(cfg.layout)
    result["layers_ms"] = sum(layer_times.layer_costs(layout))
    release(engine)
    return result


def section_transfer(run: Run, cut: int) -> dict:
    """The boundary before layer ``cut`` of the 64K model: its activations (shadow and payload index K) from rank 0
    to rank 1 and the gradient back, alone, 5 times each after one warm-up."""
    from model import layout_from_config
    from parallel.p2p import Link, StageLinks, Wire
    from parallel.payload import Payload, boundary_fields

    s = run.settings
    cfg = job(s["model"], s["seq_len"], s["micro_batch"], 2, 2, s["precision"])
    args, layout = cfg.model.args, layout_from_config(cfg.layout)
    dtype = torch.bfloat16 if s["precision"] == "bf16" else torch.float32
    groups = (dist.new_group([0, 1]), dist.new_group([0, 1]))
    result = {"cut": cut, "index_k": {}}
    for index_k in ("shadow", "payload"):
        wire = Wire.of(Payload(boundary_fields(args, layout, cut - 1, s["micro_batch"], s["seq_len"], dtype, index_k)))
        links = (StageLinks(None, Link(1, *groups), None, wire, run.device) if run.rank == 0
                 else StageLinks(Link(0, *groups), None, wire, None, run.device))
        tensors = [t.zero_() for t in wire.empty(run.device)] if run.rank == 0 else None
        grad = wire.gradient().empty(run.device)[0].zero_() if run.rank == 1 else None
        times = {"activations": [], "gradient": []}
        for repeat in range(6):
            for what in times:
                dist.barrier()
                run.clock.sync()
                start = run.clock.mark()
                if run.rank == 0:
                    links.send_activations(tensors) if what == "activations" else links.recv_gradient()
                else:
                    links.recv_activations() if what == "activations" else links.send_gradient(grad)
                links.drain()
                end = run.clock.mark()
                run.clock.sync()
                receiver = 1 if what == "activations" else 0
                if repeat and run.rank == receiver:
                    times[what].append(run.clock.ms(start, end))
        nbytes = {"activations": wire.nbytes, "gradient": wire.gradient().nbytes}
        measured = run.gather(times)
        result["index_k"][index_k] = {
            what: {"bytes": nbytes[what], "ms": statistics.median(measured[1 if what == "activations" else 0][what]),
                   "gbps": nbytes[what] / 1e6 / statistics.median(measured[1 if what == "activations" else 0][what])}
            for what in times}
        run.log(f"transfer ({index_k}): " + ", ".join(
            f"{w} {v['bytes'] / 2 ** 20:,.0f} MiB {v['ms']:.2f} ms" for w, v in result["index_k"][index_k].items()))
    return result


def layer_times(single: dict | None) -> dict:
    """The override that balances the pipeline on section 1's measured times (FLOPs without them)."""
    return {"parallel.layer_times": single["layer_times"]} if single else {}


def section_pipeline(run: Run, single: dict | None) -> dict:
    """2 stages at 64K on the measured split: per microbatch count, throughput, bubble, waits, memory."""
    s = run.settings
    keep = [int(k) for k in run.opts.keep_attention.split(",")] if run.opts.keep_attention else [0, 0]
    extra = {**layer_times(single), "parallel.keep_attention_layers": f"[{keep[0]},{keep[1]}]"}
    cfg = job(s["model"], s["seq_len"], s["micro_batch"], 2, 8, s["precision"], extra)
    engine = build(run, cfg)
    plan = engine.module.plan
    log = instrument(engine, run.clock)
    vocab, T, B = cfg.model.vocab_size, s["seq_len"], s["micro_batch"]
    result = {"cuts": plan.cuts, "balanced_on": "measured ms" if single else "FLOPs", "p2p": "overlap",
              "keep_attention_layers": keep, "steps": []}
    set_microbatches(engine, 2)
    warm = timed_step(run, engine, batches(vocab, T, B, 2, 7, run.device), log)
    result["warmup_s"] = warm["wall_s"]
    run.log(f"pipeline: cuts {plan.cuts}, warm-up step {warm['wall_s']:.1f} s")

    def one(M, p2p="overlap"):
        set_microbatches(engine, M)
        step = timed_step(run, engine, batches(vocab, T, B, M, M, run.device), log)
        row = {**pipeline_row(run, run.gather(step), 2, M, M * B * T), "p2p": p2p}
        if single:
            ideal = (M + 1) * single["per_microbatch_s"] / 2
            row["ideal_step_s"] = ideal
            row["of_ideal"] = (ideal + single["fixed_s"] / 2) / row["step_s"]
            row["pipeline_of_ideal"] = 1e3 * ideal / row["pipeline_ms"]
        run.log(f"pipeline ({p2p}): M={M}: {row['step_s']:.2f} s, {row['tokens_per_s']:,.0f} tokens/s, bubble "
                + ", ".join(f"{r['bubble']:.1%}" for r in row["per_rank"]) + f" (ideal {row['bubble_ideal']:.1%})")
        return row

    def affordable(M: int, runs: int = 1) -> bool:
        """Room for ``runs`` steps of M microbatches (from the last step's time per 1F1B slot) that keeps the
        reserve of the sections after this one."""
        return run.affordable(runs * per_slot * (M + 1) * 1.2, "pipeline")

    def add(row: dict) -> dict:
        nonlocal per_slot
        result["steps"].append(row)
        per_slot = row["step_s"] / (row["microbatches"] + 1)
        run.keep("pipeline", result)
        return row

    per_slot = warm["wall_s"] / 3
    for M in s["microbatches"]:
        add(one(M))
    M = s["before_microbatches"]  # DeepSpeed's blocking transfers ("before") next to the overlapped ("after")
    after = next((r for r in result["steps"] if r["microbatches"] == M), None)
    if affordable(M, 1 if after else 2):
        after = after or add(one(M))
        links, engine.links = engine.links, None
        result["before"], result["after"] = one(M, "deepspeed"), after
        engine.links = links
        run.keep("pipeline", result)
    else:
        run.results["skipped"].append(f"pipeline p2p before/after M={M}: budget")
    for M in s["optional_microbatches"]:
        if affordable(M):
            add(one(M))
        else:
            run.results["skipped"].append(f"pipeline M={M}: budget")
    release(engine)
    return result


def autotuners() -> dict:
    """Every autotuned Triton kernel of the ``kernels`` package, by module and name."""
    import triton.runtime.autotuner as autotuner

    return {f"{module}.{name}": value for module, mod in sorted(sys.modules.items())
            if module.startswith("kernels.") for name, value in vars(mod).items()
            if isinstance(value, autotuner.Autotuner)}


def autotune_choices(tuners: dict) -> dict:
    """Each kernel's chosen config per autotune key, as an index into its config list."""
    return {name: [(key, t.configs.index(config)) for key, config in t.cache.items() if config in t.configs]
            for name, t in tuners.items()}


def adopt_choices(tuners: dict, choices: dict) -> None:
    for name, entries in choices.items():
        for key, index in entries:
            tuners[name].cache[key] = tuners[name].configs[index]


def share_autotuning(run: Run) -> dict:
    """Rank 0's Triton autotuning choices, adopted by every rank; returns each rank's choices before."""
    tuners = autotuners()
    everyone = run.gather(autotune_choices(tuners))
    adopt_choices(tuners, everyone[0])
    return {f"rank{r}": {name: {repr(key): str(tuners[name].configs[i]) for key, i in entries}
                         for name, entries in choices.items() if entries} for r, choices in enumerate(everyone)}


def training_run(run: Run, cfg, data: list, steps: int, snapshot: bool) -> dict:
    """``steps`` steps on ``data`` (a list of microbatches per step): per-step loss and norms; with ``snapshot`` the
    first step's reduced gradients (before clipping) and the final weights, on the CPU."""
    engine = build(run, cfg)
    stage, grads = engine.module.stage, {}
    clip = engine._clip_gradients

    def snapshot_then_clip():
        if snapshot and not grads:
            grads.update({n: p.grad.detach().cpu().clone() for n, p in stage.model.named_parameters()
                          if p.grad is not None})
        clip()
    engine._clip_gradients = snapshot_then_clip
    history = []
    for microbatches in data[:steps]:
        loss = engine.train_batch(iter(microbatches))
        history.append({"loss": float(loss), "grad_norm": float(engine.grad_norm),
                        "indexer_grad_norm": float(engine.indexer_grad_norm),
                        **{f"grad_norm/{k}": float(v) for k, v in engine.group_grad_norms.items()}})
    out = {"history": history, "cuts": engine.module.plan.cuts}
    if snapshot:
        out["grads"] = grads
        out["params"] = {n: p.detach().cpu().clone() for n, p in stage.model.named_parameters()}
    release(engine)
    return out


def compare_tensors(got: dict, want: dict) -> dict:
    """Per tensor of ``got`` (this rank's stage): bitwise equal or the relative difference of the norm."""
    diffs = {}
    for name, tensor in got.items():
        ref = want[name]
        diffs[name] = 0.0 if torch.equal(tensor, ref) else float((tensor - ref).norm() / ref.norm().clamp_min(1e-30))
    return diffs


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def section_equivalence_4k(run: Run) -> dict:
    """small bf16 at 4K: 1 stage (single-process arithmetic) vs 2 stages, losses and norms per step."""
    s = run.settings
    steps, M = s["eq_steps"], 2
    share = share_autotuning(run) if run.cuda else {}
    cfg1 = job(s["eq_model"], s["eq_seq_len"], 1, 1, M, s["eq_precision"])
    data = [batches(cfg1.model.vocab_size, s["eq_seq_len"], 1, M, 1000 + i, run.device) for i in range(steps)]
    one = training_run(run, cfg1, data, steps, snapshot=False)["history"]
    cfg2 = job(s["eq_model"], s["eq_seq_len"], 1, 2, M, s["eq_precision"])
    two = training_run(run, cfg2, data, steps, snapshot=False)
    loss_diff = [relative(b["loss"], a["loss"]) for a, b in zip(one, two["history"])]
    norm_diff = [relative(b["grad_norm"], a["grad_norm"]) for a, b in zip(one, two["history"])]
    result = {"steps": steps, "microbatches": M, "cuts": two["cuts"], "noise": BF16_NOISE,
              "one_stage": one, "two_stages": two["history"], "loss_rel_diff": loss_diff,
              "grad_norm_rel_diff": norm_diff, "max_loss_rel_diff": max(loss_diff),
              "within_noise": max(loss_diff) <= BF16_NOISE, "loss_first_last": [one[0]["loss"], one[-1]["loss"]],
              "autotuning_before_sharing": share}
    run.log(f"equivalence 4k: max loss rel diff {max(loss_diff):.2e} over {steps} steps "
            f"(noise {BF16_NOISE:.1e}); loss {one[0]['loss']:.3f} -> {one[-1]['loss']:.3f}")
    return result


def section_equivalence_tiny(run: Run) -> dict:
    """tiny fp32: 1 stage vs 2 stages over cuts and index-K modes, tensor by tensor."""
    s = run.settings
    M, T, B, steps = s["tiny_microbatches"], s["tiny_seq_len"], s["tiny_micro_batch"], s["tiny_steps"]

    def cfg(stages, cut=None, index_k="shadow"):
        return job(["model=tiny", "layout=v41_scaled"], T, B, stages, M, "fp32",
                   {"parallel.cuts": f"[{cut}]" if cut else "null", "parallel.index_k": index_k,
                    "parallel.recompute": "none", "train.lr": 3e-3})

    data = [batches(259, T, B, M, 2000 + i, run.device) for i in range(steps)]
    result = {"microbatches": M, "seq_len": T, "steps": steps, "cases": {}}
    if run.cuda:  # the CPU neither autotunes nor varies run to run: nothing to separate there
        own = training_run(run, cfg(1), data, steps, snapshot=True)
        result["autotuning_before_sharing"] = share_autotuning(run)
    reference = training_run(run, cfg(1), data, steps, snapshot=True)

    def versus(got, want):
        grads, params = compare_tensors(got["grads"], want["grads"]), compare_tensors(got["params"], want["params"])
        everyone = run.gather({"grads": grads, "params": params})
        merged = {k: {} for k in ("grads", "params")}
        for rank in everyone:  # a tensor both ranks hold (1 stage) counts with its larger difference
            for k, diffs in rank.items():
                for n, d in diffs.items():
                    merged[k][n] = max(d, merged[k].get(n, 0.0))
        return {"first_loss_rel_diff": relative(got["history"][0]["loss"], want["history"][0]["loss"]),
                "loss_rel_diff": [relative(a["loss"], b["loss"]) for a, b in zip(got["history"], want["history"])],
                "grad_norm_rel_diff": relative(got["history"][0]["grad_norm"], want["history"][0]["grad_norm"]),
                **{f"{k}_bitwise": sum(d == 0.0 for d in v.values()) for k, v in merged.items()},
                **{f"{k}_count": len(v) for k, v in merged.items()},
                **{f"{k}_max_rel_diff": max(v.values()) for k, v in merged.items()},
                **{f"{k}_differing": sorted((n for n, d in v.items() if d), key=lambda n: -v[n])[:12]
                   for k, v in merged.items()}}

    if run.cuda:
        result["own_autotuning_vs_shared"] = versus(own, reference)
        result["run_to_run"] = versus(training_run(run, cfg(1), data, steps, snapshot=True), reference)
    for cut, index_k in s["tiny_cases"]:
        pipelined = training_run(run, cfg(2, cut, index_k), data, steps, snapshot=True)
        # the 2-stage run holds one stage's tensors per rank: compare each with the reference's same names
        result["cases"][f"cut {cut} {index_k}"] = versus(pipelined, reference)
        case = result["cases"][f"cut {cut} {index_k}"]
        run.log(f"equivalence tiny, cut {cut} {index_k}: first loss {case['first_loss_rel_diff']:.1e}, grads "
                f"{case['grads_bitwise']}/{case['grads_count']} bitwise (max {case['grads_max_rel_diff']:.1e}), "
                f"params max {case['params_max_rel_diff']:.1e}")
    return result


# ---------------------------------------------------------------------------------------------------- driver

def summary(results: dict) -> dict:
    """The issue's "done when" figures at the headline microbatch count (8 on the GPUs) from the sections that ran:
    2 stages against the 1F1B ideal from the 1-stage time, the transfers' share of the step, the spread of peak
    memory over the stages, and the data-parallel run of the same global batch beside it."""
    sections = results["sections"]
    M = results["settings"]["microbatches"][0]
    row = next((r for r in sections.get("pipeline", {}).get("steps", []) if r["microbatches"] == M), None)
    if row is None:
        return {}
    out = {"microbatches": M, "tokens_per_s": row["tokens_per_s"], "bubble": [r["bubble"] for r in row["per_rank"]],
           "bubble_ideal": row["bubble_ideal"],
           "recv_wait_share": max(r["recv_wait_ms"] for r in row["per_rank"]) / 1e3 / row["step_s"]}
    if "of_ideal" in row:
        out["of_ideal"], out["pipeline_of_ideal"] = row["of_ideal"], row["pipeline_of_ideal"]
    single = sections.get("single", {})
    same_batch = [r for r in single.get("steps", []) if r["microbatches"] * single["data_parallel"] == M]
    if same_batch:
        out["data_parallel_tokens_per_s"] = same_batch[0]["tokens_per_s"]
    peaks = [r["peak_allocated_gib"] for r in row["per_rank"] if "peak_allocated_gib" in r]
    if peaks:
        out["peak_allocated_gib"], out["memory_spread"] = peaks, (max(peaks) - min(peaks)) / max(peaks)
    transfer = sections.get("transfer", {}).get("index_k", {}).get("shadow")
    if transfer:
        per_microbatch_ms = transfer["activations"]["ms"] + transfer["gradient"]["ms"]
        out["transfer_share"] = M * per_microbatch_ms / 1e3 / row["step_s"]
    pipeline = sections.get("pipeline", {})
    if "before" in pipeline:
        out["overlap_speedup"] = pipeline["before"]["step_s"] / pipeline["after"]["step_s"]
    out["done"] = {"of_ideal >= 0.95": out.get("of_ideal", 0) >= 0.95,
                   "transfer_share < 0.01": out.get("transfer_share", 1) < 0.01,
                   "memory_spread <= 0.10": out.get("memory_spread", 1) <= 0.10}
    return out


def worker(rank: int, opts) -> None:
    """One process per GPU (``--smoke``: per CPU process, gloo); under ``spawn`` the process group exists already."""
    settings = SMOKE if opts.smoke else GPU
    if opts.smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # two processes share the cores
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if opts.smoke else "nccl", verbose=False,
                                   timeout=timedelta(minutes=5))
    use_device_init()
    run = Run(opts, settings, device)
    if run.world != 2:
        raise SystemExit(f"bench/multigpu.py needs 2 processes (one per GPU), got {run.world}")
    wanted = opts.sections.split(",")
    run.log(f"sections {wanted}, budget {opts.budget:.0f} s, device {device}")
    steps = {"single": lambda: section_single(run),
             "transfer": lambda: section_transfer(run, transfer_cut(run)),
             "pipeline": lambda: section_pipeline(run, run.results["sections"].get("single")),
             "equivalence_tiny": lambda: section_equivalence_tiny(run),
             "equivalence_4k": lambda: section_equivalence_4k(run)}
    for name in SECTIONS:
        if name not in wanted:
            continue
        optional = name in settings["need_s"]  # a section the budget may drop; the others run while time is left
        if not run.affordable(settings["need_s"].get(name, 10.0), name, keep_reserve=optional):
            run.results["skipped"].append(f"{name}: budget")
            run.save()
            continue
        started = time.perf_counter()
        try:
            run.results["sections"][name] = steps[name]()
            run.results["sections"][name]["section_s"] = time.perf_counter() - started
        except Exception as err:  # the other sections still run; the error is in the JSON
            run.results["errors"][name] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"
            run.log(f"{name} failed: {type(err).__name__}: {err}")
            gc.collect()
        run.save()
    run.log(json.dumps(run.results.get("summary", {})))  # rank 0 computes it


def transfer_cut(run: Run) -> int:
    """The boundary the pipeline section will use: the measured-time split if section 1 wrote times."""
    from parallel.job import plan

    s, single = run.settings, run.results["sections"].get("single")
    config = job(s["model"], s["seq_len"], s["micro_batch"], 2, 8, s["precision"], layer_times(single))
    capacity = torch.cuda.get_device_properties(run.device).total_memory if run.cuda else None
    return plan(config, 2, run.device, capacity).split.plan.cuts[0]


def main(argv=None) -> None:
    opts = parse(argv)
    if "RANK" in os.environ:  # torchrun (the GPU run, or --smoke through bench/gpu_multigpu.sh)
        worker(int(os.environ["RANK"]), opts)
    elif opts.smoke:
        from parallel.local import spawn

        spawn(worker, 2, opts)
    else:
        raise SystemExit("bench/multigpu.py runs under torchrun --nproc-per-node 2 (or with --smoke on CPU)")


if __name__ == "__main__":
    main()
