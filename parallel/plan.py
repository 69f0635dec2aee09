"""The pipeline plan a job prints before training: the batch (microbatches per step and the 1F1B bubble),
stages, their layers and modes, and for every boundary the payload fields with their bytes per microbatch, plus
what shadow indexers cost against sending index K.

``python -m parallel.plan [--world-size N] [overrides]`` prints it for any config without starting a job, and
fails as the job would on a batch that does not fit, e.g.
``python -m parallel.plan model=v41_flash layout=v41 parallel.pipeline_stages=4 data.seq_len=65536``.
The world size is ``--world-size``, else ``WORLD_SIZE``, else the stage count (one data-parallel replica).
"""
import os
import sys

import torch

from model.config import ModelArgs
from model.layout import Layout
from parallel.balance import split_stages
from parallel.batch import BatchPlan, batch_plan
from parallel.partition import StagePlan, layer_costs
from parallel.payload import boundary_fields
from parallel.stage import shadow_sources


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f} MiB"


def describe(args: ModelArgs, layout: Layout, plan: StagePlan, micro_batch: int, seq_len: int,
             dtype: torch.dtype, index_k: str, batch: BatchPlan | None = None, costs: list[float] | None = None,
             unit: str = "FLOPs", peaks: list[float] | None = None) -> str:
    """The printout; ``dtype`` is the compute dtype (payload fields show their own wire dtype). ``costs``
    (default: ``layer_costs``) in ``unit`` give each stage's share, ``peaks`` its estimated peak memory in bytes."""
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
        fields = boundary_fields(args, layout, layers.stop - 1, micro_batch, seq_len, dtype, index_k)
        lines.append(f"    boundary {s}->{s + 1}: {_mib(sum(f.nbytes for f in fields))} per microbatch")
        for f in fields:
            source = "" if f.source is None else f"[{f.source}]"
            kind = "grad" if f.differentiable else "bits"
            lines.append(f"      {f.name + source:<22} {str(tuple(f.shape)):<20} "
                         f"{str(f.wire_dtype).replace('torch.', ''):<8} {kind}  {_mib(f.nbytes)}")
        other = boundary_fields(args, layout, layers.stop - 1, micro_batch, seq_len, dtype,
                                "payload" if index_k == "shadow" else "shadow")
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


def compute_dtype(precision: str, cuda: bool) -> torch.dtype:
    """``train.precision`` as a dtype (``auto``: bf16 on GPU, fp32 on CPU)."""
    return torch.bfloat16 if precision == "bf16" or (precision == "auto" and cuda) else torch.float32


def _world_size(argv: list[str]) -> tuple[int | None, list[str]]:
    """``--world-size N`` (or ``--world-size=N``) out of ``argv``; else ``WORLD_SIZE`` (None: unset)."""
    rest, world = [], os.environ.get("WORLD_SIZE")
    args = iter(argv)
    for arg in args:
        if arg == "--world-size":
            world = next(args, "")
        elif arg.startswith("--world-size="):
            world = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if world is not None and not world.isdigit():
        raise SystemExit(f"error: --world-size {world!r} is not a process count — give a positive integer")
    return (int(world) if world else None), rest


def main(argv: list[str]) -> None:
    from model.cli import compose_checked, run_cli
    from model.layout import layout_from_config

    world, overrides = _world_size(argv)

    def report():
        cfg = compose_checked(overrides)
        args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
        par = cfg.parallel
        batch = batch_plan(cfg, world or par.pipeline_stages)
        dtype = compute_dtype(cfg.train.get("precision", "auto"), torch.cuda.is_available())
        cuda = torch.cuda.is_available() or dtype == torch.bfloat16  # bf16 jobs are GPU jobs: count kernel workspace
        split = split_stages(cfg, dtype, batch.microbatches, batch.data_parallel, cuda=cuda)
        print(describe(args, layout, split.plan, cfg.data.micro_batch_size, cfg.data.seq_len, dtype,
                       par.get("index_k", "shadow"), batch, split.costs, split.unit, split.peaks))

    run_cli(report)


if __name__ == "__main__":
    main(sys.argv[1:])
