"""The pipeline plan a job prints before training: the batch (microbatches per step and the 1F1B bubble),
stages, their layers and modes, and for every boundary the payload fields with their bytes per microbatch, plus
what shadow indexers cost against sending index K; and the memory verdict: every stage's estimated peak
(``parallel/memory.py``, in the precision the job computes in) against the memory of the device it runs on.

``python -m parallel.plan [--world-size N] [--memory SIZE] [--plot PNG] [overrides]`` prints it for any config
without starting a job (``--help``; ``--plot`` also draws it: ``parallel/plan_figure.py``), and fails as the job
would on a batch that does not fit, e.g.
``python -m parallel.plan model=v41_flash layout=v41 parallel.pipeline_stages=4 data.seq_len=65536``.
The world size is ``--world-size``, else ``WORLD_SIZE``, else the stage count (one data-parallel replica).
The device is the job's (``train.device``: ``auto`` is the GPU when this machine has one), and so is the
precision (``train.precision=auto``: bf16 on a GPU, fp32 on CPU); ``train.init_from=<DeepSeek's released
directory>`` sets the model from its config.json, as the job does. Under context parallelism
(``parallel.context_parallel``) it prints the chunk and what the context groups exchange, under LoRA
(``train.lora.rank``) what trains; every estimate is per rank.
"""
import argparse
import os
import sys
from dataclasses import dataclass

import torch

from model.config import ModelArgs, apply
from model.layout import Layout
from parallel.batch import BatchPlan
from parallel.checks import check_experts
from parallel.context import chunk_length
from parallel.experts import leaving, received_bytes, routed_bytes
from parallel.job import Job, plan, planned_device
from parallel.memory import context_bytes, layer_parameters, lora_counts
from parallel.partition import StagePlan, layer_costs
from parallel.payload import boundary_fields
from parallel.stage import shadow_sources


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f} MiB"


def describe(args: ModelArgs, layout: Layout, plan: StagePlan, micro_batch: int, seq_len: int,
             dtype: torch.dtype, index_k: str, batch: BatchPlan | None = None, costs: list[float] | None = None,
             unit: str = "FLOPs", peaks: list[float] | None = None, context: int = 1) -> str:
    """The printout; ``dtype`` is the compute dtype (payload fields show their own wire dtype). ``costs``
    (default: ``layer_costs``) in ``unit`` give each stage's share, ``peaks`` its estimated peak memory in bytes (per
    rank). With ``context`` ranks a row the boundaries are a rank's: its chunk's tokens, the row's entries."""
    costs = layer_costs(args, layout, seq_len) if costs is None else costs
    total = sum(costs)
    compute = "bfloat16 autocast over float32 weights" if dtype == torch.bfloat16 else str(dtype).replace("torch.", "")
    lines = [f"pipeline: {len(plan.stages)} stage(s), microbatch {micro_batch} x {seq_len} tokens, "
             f"compute {compute}, index K by {index_k}"]
    if batch is not None:
        lines.append(batch.describe())
    for s, layers in enumerate(plan.stages):
        modes = " ".join(f"{i}:{layout.plan[i].mode.value}" for i in layers)
        share = sum(costs[i] for i in layers) / total
        memory = f", est. peak {peaks[s] / 2 ** 30:,.1f} GiB" if peaks else ""
        lines.append(f"  stage {s}: layers {layers.start}-{layers.stop - 1} ({share:.0%} of {unit}{memory})  {modes}")
        shadows = shadow_sources(layout, layers)
        if shadows and index_k == "shadow":
            lines.append(f"    shadow indexers for Full layer(s) {shadows}")
        if layers.stop == layout.n_layers:
            continue
        fields = boundary_fields(args, layout, layers.stop - 1, micro_batch, seq_len, dtype, index_k, context=context)
        lines.append(f"    boundary {s}->{s + 1}: {_mib(sum(f.nbytes for f in fields))} per microbatch")
        for f in fields:
            source = "" if f.source is None else f"[{f.source}]"
            kind = "grad" if f.differentiable else "bits"
            lines.append(f"      {f.name + source:<22} {str(tuple(f.shape)):<20} "
                         f"{str(f.wire_dtype).replace('torch.', ''):<8} {kind}  {_mib(f.nbytes)}")
        other = boundary_fields(args, layout, layers.stop - 1, micro_batch, seq_len, dtype,
                                "payload" if index_k == "shadow" else "shadow", context=context)
        extra = sum(f.nbytes for f in fields) - sum(f.nbytes for f in other)
        if extra:
            lines.append(f"      index K by {'payload' if index_k == 'shadow' else 'shadow'} instead: "
                         f"{'+' if extra < 0 else '-'}{_mib(abs(extra))} here")
    for source in sorted({src for layers in plan.stages for src in shadow_sources(layout, layers)}):
        entries = micro_batch * seq_len // layout.compress_ratios[source]
        flops = 2 * entries * args.head_dim * args.index_head_dim
        index_bytes = entries * args.index_head_dim * dtype.itemsize
        lines.append(f"  index K of layer {source}: shadow recompute {flops / 1e9:,.2f} GFLOP per stage and "
                     f"microbatch vs {_mib(index_bytes)} per boundary sent (and its gradient back)")
    return "\n".join(lines)


def describe_experts(args: ModelArgs, layout: Layout, plan: StagePlan, micro_batch: int, seq_len: int,
                     dtype: torch.dtype, expert_parallel: int, data_parallel: int, recomputed: bool,
                     dspark: bool = False, context: int = 1) -> str:
    """The expert-parallel lines of the plan (none for E = 1): E, the experts a rank holds of every MoE, and per
    stage the all-to-all bytes a rank sends per microbatch (``parallel.experts.routed_bytes`` x (E - 1) / E, four
    exchanges a MoE forward and backward, six when recomputed; it receives as many). ``data_parallel``: the ranks of
    a stage the groups are cut from (C x D under context parallelism, whose ranks route their chunk's tokens)."""
    E = expert_parallel
    if E <= 1:
        return ""
    seq_len //= context
    moes = [f"{args.moe.n_routed_experts // E} of the {args.moe.n_routed_experts} routed experts of each MoE"]
    if args.dspark.blocks:
        moes.append(f"{args.dspark.n_routed_experts // E} of the draft head's {args.dspark.n_routed_experts}")
    replicas = "data-parallel replicas" if context == 1 else f"ranks ({context} context-parallel x "\
        f"{data_parallel // context} data-parallel)"
    lines = [f"experts: parallel.expert_parallel={E} over each stage's {data_parallel} {replicas} "
             f"({data_parallel // E} group(s) of {E}); a rank holds {' and '.join(moes)}; their gradients and ZeRO-1 "
             f"state over the {data_parallel // E} replica(s) holding the same experts",
             f"  all-to-all per microbatch and rank: tokens x top-k x dim x {dtype.itemsize} B per exchange, "
             f"(E-1)/E = {leaving(E):.0%} of it leaving the rank (uniform routing assumed: a rank holding busier "
             f"experts receives more); dispatch + combine forward, their gradients backward"
             + (", and the forward's again in the recomputation" if recomputed else "")]
    rows = micro_batch * seq_len * args.moe.n_activated_experts
    loads = ", ".join(f"{load}x {_mib(received_bytes(args.dim, args.moe.inter_dim, load * rows, dtype.itemsize))}"
                      for load in sorted({1, 2, E}))
    lines.append(f"  received rows per MoE and microbatch: {rows:,} a rank under uniform routing (tokens x top-k), "
                 f"up to {E}x when every token goes to one rank's experts; the experts' working set at 1x, 2x, ... "
                 f"that: {loads} (a rank that would run out of memory stops, naming the layer and its load)")
    exchanges = [b * leaving(E) for b in routed_bytes(args, layout, micro_batch, seq_len, dtype.itemsize, dspark)]
    for s, layers in enumerate(plan.stages):
        fwd = 2 * sum(exchanges[i] for i in layers)
        bwd = fwd * (2 if recomputed else 1)
        moe_layers = sum(1 for i in layers if exchanges[i])
        draft = " + draft head" if dspark and args.dspark.blocks and layers.stop == layout.n_layers else ""
        lines.append(f"  stage {s}: {moe_layers} MoE layer(s){draft}, {_mib(fwd + bwd)} sent per microbatch "
                     f"(forward {_mib(fwd)}, backward {_mib(bwd)})")
    return "\n".join(lines)


def describe_context(args: ModelArgs, layout: Layout, plan: StagePlan, micro_batch: int, seq_len: int,
                     dtype: torch.dtype, context: int, data_parallel: int, recomputed: bool) -> str:
    """The context-parallel lines of the plan (none for C = 1): C, the chunk (``parallel.context.chunk_length``), and
    what a rank receives per microbatch (``parallel.memory.context_bytes``): of every Full layer's latent all-gather
    (C - 1) / C of the row's entries, of every layer's halo C - 1 tails of window KV (and m - 1 input rows for m > 1);
    the backward sends as much back (reduce-scatter, the halos' gradients), and recomputation gathers again."""
    if context <= 1:
        return ""
    length = chunk_length(context, seq_len, args.window_size, layout.compress_ratios, layout.candidate_block_size)
    gathered, halo = context_bytes(args, layout, micro_batch, seq_len, dtype)
    received = [g * (context - 1) / context + h * (context - 1) for g, h in zip(gathered, halo)]
    lines = [f"context: parallel.context_parallel={context}: each row of {seq_len:,} tokens in {context} chunks of "
             f"{length:,} tokens, one per rank of a context group ({data_parallel} group(s) of {context} consecutive "
             f"ranks a stage); a rank computes its chunk's queries, per-token activations at 1/{context} of a row, "
             "the row's compressed entries (gathered) whole",
             f"  received per microbatch and rank, forward: a Full layer's latent, (C-1)/C = "
             f"{(context - 1) / context:.0%} of the row's entries (index keys computed from it, not sent); every "
             f"layer's halo, {context - 1} x {args.window_size - 1} rows of window KV; the backward returns as much "
             "(reduce-scatter, halo gradients)" + (", the recomputation gathers again" if recomputed else "")]
    for i, p in enumerate(layout.plan):
        if gathered[i]:
            share = gathered[i] * (context - 1) / context
            lines.append(f"  layer {i} ({p.mode.value}, m={p.ratio}): all-gather {_mib(share)}"
                         f" of its {micro_batch * seq_len // p.ratio:,} entries, halo {_mib(halo[i] * (context - 1))}")
    passes = 3 if recomputed else 2
    for s, layers in enumerate(plan.stages):
        fwd = sum(received[i] for i in layers)
        lines.append(f"  stage {s}: {_mib(fwd)} received per microbatch in the forward, {_mib(passes * fwd)} with "
                     "the backward" + (" and the recomputation" if recomputed else ""))
    return "\n".join(lines)


def describe_lora(args: ModelArgs, layout: Layout, lora, dtype: torch.dtype) -> str:
    """The LoRA line of the plan (none without): what trains and what the frozen base keeps
    (``parallel.memory.lora_counts``)."""
    if lora is None:
        return ""
    counts, total = lora_counts(args, layout, lora), sum(layer_parameters(args, layout))
    adapters = sum(counts["adapters"]) + sum(counts["adapter_experts"])
    low = "its attention, expert and head matrices in bf16, the rest fp32" if dtype == torch.bfloat16 else "fp32"
    if lora.quantized_base:
        low = (f"{sum(counts['fp8']):,} attention and shared-expert values in FP8 and {sum(counts['fp4']):,} routed-"
               f"expert values in FP4 as released, {'the head bf16, ' * (dtype == torch.bfloat16)}the rest fp32")
    return (f"lora: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}: {adapters:,} adapter "
            f"parameters train ({adapters / total:.2%} of the {total:,} outside the Engram tables); the base is frozen "
            f"(no gradients or AdamW state; {low})")


@dataclass(frozen=True)
class Memory:
    """What a job's processes can hold: one GPU each, or the host's RAM, shared by the processes on it."""

    on_gpu: bool
    capacity: float  # bytes: one GPU's memory, or the host's available RAM
    processes: int = 1  # on the host: how many of the job's processes share its RAM
    given: bool = False  # from ``--memory``, not measured on this machine

    def describe(self) -> str:
        source = "given by --memory" if self.given else "on this machine"
        if self.on_gpu:
            return f"{_size(self.capacity)} per GPU ({source})"
        shared = f", shared by {self.processes} processes" if self.processes > 1 else ""
        return f"{_size(self.capacity)} of host RAM available ({source}{shared})"


def device_memory(on_gpu: bool, processes: int, given: float | None = None) -> Memory | None:
    """The memory of the device a job runs on: the GPU's total (``LOCAL_RANK``'s), else the host's available RAM
    (psutil) shared by its ``processes``; ``given`` bytes instead when set; None for a GPU job planned on a machine
    without a GPU."""
    if given is not None:
        return Memory(on_gpu, given, 1 if on_gpu else processes, given=True)
    if on_gpu:
        if not torch.cuda.is_available():
            return None
        return Memory(True, torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory)
    import psutil

    return Memory(False, psutil.virtual_memory().available, processes)


def _size(n: float) -> str:
    return f"{n / 2 ** 30:,.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:,.1f} MiB"


@dataclass(frozen=True)
class Verdict:
    """Whether a split's estimated peaks fit the memory: each GPU holds one stage; on a host, its processes hold
    their share of every stage's data-parallel replicas together."""

    need: float  # bytes: the largest stage's peak (GPU), or what the host's processes hold together
    stage: int  # the stage that needs the most
    memory: Memory
    state: float  # of ``need``: weights, gradients and optimizer state

    @property
    def fits(self) -> bool:
        return self.need <= self.memory.capacity

    def describe(self) -> str:
        where = f"stage {self.stage} needs" if self.memory.on_gpu else (
            "the processes on this host need" if self.memory.processes > 1 else "the process needs")
        return (f"{where} an estimated {_size(self.need)} (weights, gradients and optimizer state "
                f"{_size(self.state)}), against {self.memory.describe()}")


def verdict(split, batch: BatchPlan, memory: Memory) -> Verdict:
    """``split``'s peaks (``parallel.balance.split_stages``) against ``memory``."""
    state = [sum(split.memory.state[i] for i in layers) for layers in split.plan.stages]
    if memory.on_gpu:
        stage = max(range(len(split.peaks)), key=lambda s: split.peaks[s])
        return Verdict(split.peaks[stage], stage, memory, state[stage])
    world = batch.stages * batch.context * batch.data_parallel
    # this host's share of every stage's C x D ranks
    replicas = batch.context * batch.data_parallel * min(memory.processes, world) / world
    return Verdict(replicas * sum(split.peaks), 0, memory, replicas * sum(state))


class DoesNotFit(ValueError):
    """A job whose estimated peak memory exceeds its device's; the message names the estimate, the memory and
    settings that would fit."""


def precision_note(setting: str, dtype: torch.dtype, on_gpu: bool) -> str:
    """Which precision the estimates are in and why: ``bf16 on GPU (train.precision=auto)``."""
    return f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} on {'GPU' if on_gpu else 'CPU'}, train.precision={setting}"


def split_capacity(device: torch.device, memory: Memory | None) -> float | None:
    """The bound a split keeps every stage under (``parallel.job.plan``): one GPU's memory; None on a host (its
    processes share its RAM: ``verdict``) or without a memory to compare with."""
    return memory.capacity if memory is not None and device.type == "cuda" else None


def fitting_settings(job: Job, memory: Memory) -> list[str]:
    """Overrides that bring the job under ``memory``, with the need they leave: every layer recomputed, one row
    per microbatch, on GPUs the fewest more context-parallel ranks and the fewest more expert-parallel ranks on the
    same GPUs (each a doubling the world and the model admit), the longest shorter row (``data.seq_len`` halved up to
    3 times), the fewest more pipeline stages (on GPUs, each stage on GPUs of its own; on a host the processes share
    its RAM, so stages do not help). When no single one fits, every layer recomputed together with each of the
    others."""
    config, world, on_gpu = job.config, job.world_size, job.on_gpu
    stages, seq_len = config.parallel.pipeline_stages, config.data.seq_len
    replicas = world // stages
    levers = []  # each: its alternatives, least drastic first, as (changes, processes, where)
    if config.parallel.recompute != "layer":
        levers.append([({"parallel.recompute": "layer"}, world, "")])
    if config.data.micro_batch_size > 1:
        levers.append([({"data.micro_batch_size": 1}, world, "")])
    if on_gpu:
        levers += [lever for lever in (_wider(job, "context_parallel"), _wider(job, "expert_parallel")) if lever]
    levers.append([({"data.seq_len": seq_len >> k}, world, "") for k in (1, 2, 3) if seq_len >> k >= 64])
    if on_gpu and not isinstance(config.parallel.keep_attention_layers, list):  # a list is per stage
        cuts = {"parallel.cuts": None} if config.parallel.cuts is not None else {}
        counts = [stages * 2 ** k for k in range(1, 8) if stages * 2 ** k <= job.layout.n_layers]
        levers.append([({"parallel.pipeline_stages": p, **cuts}, p * replicas, f" on {p * replicas} GPUs")
                       for p in counts])

    def need(changes: dict, processes: int) -> float | None:
        try:
            variant = plan(apply(config, changes), processes, job.device, split_capacity(job.device, memory))
        except ValueError:  # a batch, split or parallel setting the variant cannot run
            return None
        found = verdict(variant.split, variant.batch, memory)
        return found.need if found.fits else None

    def fitting(extra: dict) -> list[str]:
        settings = []
        for alternatives in levers:
            for changes, processes, where in alternatives:
                if set(changes) & set(extra):
                    break
                found = need({**extra, **changes}, processes)
                if found is not None:
                    overrides = " ".join(f"{k}={'null' if v is None else v}" for k, v in {**extra, **changes}.items())
                    settings.append(f"{overrides}{where} ({_size(found)})")
                    break
        return settings

    return fitting({}) or (fitting({"parallel.recompute": "layer"}) if config.parallel.recompute != "layer" else [])


def _wider(job: Job, setting: str) -> list[tuple[dict, int, str]]:
    """The doublings of ``parallel.context_parallel`` or ``parallel.expert_parallel`` that the job's ranks and model
    admit (``chunk_length``, ``check_experts``), as ``fitting_settings`` alternatives."""
    par, args, layout = job.config.parallel, job.args, job.layout
    if setting == "expert_parallel" and args.ffn != "moe":
        return []
    ranks, found = job.world_size // par.pipeline_stages, []
    for k in range(1, 8):
        value = getattr(par, setting) * 2 ** k
        try:
            if setting == "context_parallel":
                if ranks % value:
                    break
                chunk_length(value, job.config.data.seq_len, args.window_size, layout.compress_ratios,
                             layout.candidate_block_size)
            check_experts(value if setting == "expert_parallel" else par.expert_parallel, args, ranks)
        except ValueError:
            break
        found.append(({f"parallel.{setting}": value}, job.world_size, ""))
    return found


def check_memory(job: Job, memory: Memory | None) -> str:
    """The verdict line for a job that fits (or has no memory to compare with, or ``parallel.check_memory=false``);
    ``DoesNotFit`` otherwise."""
    note = precision_note(job.config.train.precision, job.dtype, job.on_gpu)
    if memory is None:
        return (f"memory: no verdict ({note}) — no GPU on this machine; --memory SIZE (e.g. --memory 80GiB) "
                "compares the estimates with a GPU of that size")
    found = verdict(job.split, job.batch, memory)
    if found.fits:
        return f"memory: fits ({note}) — {found.describe()}"
    if not job.config.parallel.check_memory:
        return f"memory: does not fit ({note}) — {found.describe()}; running anyway (parallel.check_memory=false)"
    settings = fitting_settings(job, memory)
    if settings:
        fix = "settings that would fit (estimated need): " + "; ".join(settings)
    else:
        fix = ("no setting of parallel.recompute, data.micro_batch_size, data.seq_len" +
               (" or parallel.pipeline_stages" if job.on_gpu else "") + " fits it" +
               ("" if job.on_gpu else ": more processes on this host share its RAM; plan it for GPUs "
                "(python -m parallel.plan train.device=cuda --memory 80GiB --world-size N <overrides>)") +
               ", or choose a smaller model")
    raise DoesNotFit(f"the job does not fit in memory ({note}): {found.describe()} — {fix}; or "
                     "parallel.check_memory=false to run it anyway")


_UNITS = {"": 2 ** 30, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


def parse_memory(text: str) -> float:
    """``80GiB``, ``141GB``, ``24g``, ``512MiB`` -> bytes (binary units; a bare number is GiB)."""
    import re

    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not found or float(found.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size (e.g. 80GiB, 512MiB)")
    return float(found.group(1)) * _UNITS[found.group(2)]


def parser() -> argparse.ArgumentParser:
    command = argparse.ArgumentParser(
        prog="python -m parallel.plan",
        description="Print a job's pipeline plan (batch and 1F1B bubble, stages and their layers, the tensors each "
                    "boundary carries) and its memory verdict: every stage's estimated peak in the precision the job "
                    "computes in, against the memory of the device it runs on. Fails (status 2, one line) where the "
                    "job would: a batch or split that cannot run, or a job that does not fit.",
        epilog="The overrides are those of python -m train, e.g. model=v41_flash layout=v41 data.seq_len=65536 "
               "parallel.pipeline_stages=8 train.device=cuda. The device is train.device (auto: this machine's GPU "
               "if any, else its CPU); the precision train.precision (auto: bf16 on a GPU, fp32 on CPU).")
    command.add_argument("--world-size", type=int, default=None, metavar="N",
                         help="processes of the job (default: WORLD_SIZE, else one per pipeline stage)")
    command.add_argument("--memory", type=parse_memory, default=None, metavar="SIZE",
                         help="memory per GPU (or of the host, for a CPU job) to judge the plan against, e.g. 80GiB "
                              "(default: this machine's GPU, or its available RAM)")
    command.add_argument("--plot", metavar="PNG", default=None,
                         help="also draw the plan into this PNG: the stages, the 1F1B schedule, each boundary's bytes")
    command.add_argument("overrides", nargs="*", help="config overrides, as for python -m train")
    return command


def main(argv: list[str]) -> None:
    from model.cli import job_config, run_cli
    from model.deepseek_config import adopt_released_config

    options = parser().parse_intermixed_args(argv)
    world = options.world_size or (int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE") else None)
    if world is not None and world < 1:
        raise SystemExit(f"error: --world-size {world} is not a process count — give a positive integer")

    def report():
        # train.init_from=<DeepSeek's released directory> sets the model, as in a job
        config = adopt_released_config(job_config(options.overrides))
        processes = world or config.parallel.pipeline_stages
        device = planned_device(config.train.device)
        memory = device_memory(device.type == "cuda", processes, options.memory)
        job = plan(config, processes, device, split_capacity(device, memory))
        args, layout, split, batch, dtype = job.args, job.layout, job.split, job.batch, job.dtype
        micro_batch, seq_len, index_k = config.data.micro_batch_size, config.data.seq_len, config.parallel.index_k
        print(describe(args, layout, split.plan, micro_batch, seq_len, dtype, index_k, batch, split.costs, split.unit,
                       split.peaks, batch.context), flush=True)
        recomputed = config.parallel.recompute == "layer"
        for lines in (describe_lora(args, layout, job.lora, dtype),
                      describe_context(args, layout, split.plan, micro_batch, seq_len, dtype, batch.context,
                                       batch.data_parallel, recomputed),
                      describe_experts(args, layout, split.plan, micro_batch, seq_len, dtype,
                                       config.parallel.expert_parallel, batch.data_parallel * batch.context,
                                       recomputed, job.trains_dspark, batch.context)):
            if lines:
                print(lines, flush=True)
        print(check_memory(job, memory))
        if options.plot:
            from parallel.plan_figure import draw

            draw(options.plot, args, layout, split, batch, micro_batch, seq_len, dtype, index_k,
                 title=f"model={config.model.name} layout={config.layout.name}, {batch.stages} stage(s) x "
                 f"{batch.data_parallel} data-parallel, {seq_len:,} tokens a row")
            print(f"drew {options.plot}")

    run_cli(report)


if __name__ == "__main__":
    main(sys.argv[1:])
