"""The pipeline plan a job prints before training: stages, their layers and modes, and for every boundary
the payload fields with their bytes per microbatch, plus what shadow indexers cost against sending index K.

``python -m parallel.plan [overrides]`` prints it for any config without starting a job, e.g.
``python -m parallel.plan model=v41_flash layout=v41 parallel.pipeline_stages=4 data.seq_len=65536``.
"""
import sys

import torch

from model.config import ModelArgs
from model.layout import Layout
from parallel.partition import StagePlan, layer_costs, partition
from parallel.payload import boundary_fields
from parallel.stage import shadow_sources


class PipelineConfigError(ValueError):
    """A pipeline setting that cannot run; the message names the setting."""


def check_pipeline(n_stages: int, world_size: int, microbatches: int) -> int:
    """Data-parallel degree of a job, after checking that the stages fit the launched processes."""
    if world_size % n_stages:
        raise PipelineConfigError(f"parallel.pipeline_stages={n_stages} does not divide the {world_size} launched "
                                  "processes: the world size must be a multiple of the stage count")
    if microbatches < n_stages:
        raise PipelineConfigError(f"train.grad_accum_steps={microbatches} microbatches per step is fewer than "
                                  f"parallel.pipeline_stages={n_stages}: 1F1B needs at least one per stage")
    return world_size // n_stages


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f} MiB"


def describe(args: ModelArgs, layout: Layout, plan: StagePlan, micro_batch: int, seq_len: int,
             dtype: torch.dtype, index_k: str) -> str:
    costs = layer_costs(args, layout, seq_len)
    total = sum(costs)
    lines = [f"pipeline: {len(plan.stages)} stage(s), microbatch {micro_batch} x {seq_len} tokens, "
             f"{str(dtype).replace('torch.', '')}, index K by {index_k}"]
    for s, layers in enumerate(plan.stages):
        modes = " ".join(f"{i}:{layout.plan[i].mode.value}" for i in layers)
        share = sum(costs[i] for i in layers) / total
        lines.append(f"  stage {s}: layers {layers.start}-{layers.stop - 1} ({share:.0%} of FLOPs)  {modes}")
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


def main(argv: list[str]) -> None:
    from model.cli import compose, run_cli
    from model.layout import layout_from_config

    def report():
        cfg = compose(argv)
        args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
        par = cfg.parallel
        plan = partition(args, layout, cfg.data.seq_len, par.pipeline_stages, par.get("cuts"))
        dtype = torch.bfloat16 if cfg.train.get("precision") == "bf16" else torch.float32
        print(describe(args, layout, plan, cfg.data.micro_batch_size, cfg.data.seq_len, dtype,
                       par.get("index_k", "shadow")))

    run_cli(report)


if __name__ == "__main__":
    main(sys.argv[1:])
