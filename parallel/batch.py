"""Rows per optimizer step: the global batch, the microbatches each pipeline runs, and the 1F1B bubble.

One optimizer step consumes ``train.global_batch_size`` rows over all data-parallel replicas. Each replica
pushes ``microbatches`` microbatches of ``data.micro_batch_size`` rows through its pipeline (1F1B), so::

    global_batch_size = micro_batch_size x microbatches x data-parallel replicas
    data-parallel replicas = launched processes / (parallel.pipeline_stages x parallel.context_parallel)

(the ``parallel.context_parallel`` ranks of a replica share its rows, one chunk of each: ``parallel/context.py``).

1F1B needs at least one microbatch per stage, and a stage idles for a share (P-1)/(M+P-1) of the step (the
"bubble") with P stages and M microbatches. A user sets the global batch (``train.global_batch_size``) or the
microbatches (``train.grad_accum_steps``), or neither: then each pipeline runs one microbatch per stage, the
fewest that fill it. A number the user sets is never changed; one that cannot be met is an error that says
which values would work.
"""
from dataclasses import dataclass

from model.config import JobConfig
from parallel.context import check_context_world


class BatchConfigError(ValueError):
    """A batch setting that cannot run with this stage count and world size; the message names the fix."""


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int  # rows per microbatch (data.micro_batch_size)
    microbatches: int  # per pipeline and optimizer step
    data_parallel: int  # replicas of the pipeline
    stages: int  # pipeline stages
    source: str  # which setting fixed the microbatches, for the printout
    context: int = 1  # ranks that split each row (parallel.context_parallel)

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step over all replicas."""
        return self.micro_batch * self.microbatches * self.data_parallel

    @property
    def bubble(self) -> float:
        """Share of a step each stage idles under 1F1B: (P-1)/(M+P-1)."""
        return (self.stages - 1) / (self.microbatches + self.stages - 1)

    def describe(self) -> str:
        line = (f"batch: {self.global_batch} rows per step = {self.micro_batch} rows x {self.microbatches} "
                f"microbatch(es) x {self.data_parallel} data-parallel replica(s) ({self.source})")
        if self.context > 1:
            line += f"; each row split over {self.context} context-parallel ranks"
        if self.stages > 1:
            line += f"; 1F1B bubble {self.bubble:.0%} ((P-1)/(M+P-1): more microbatches shrink it)"
        return line


def batch_plan(config: JobConfig, world_size: int) -> BatchPlan:
    """The plan of a job's settings (its ``data``, ``parallel`` and ``train`` groups) on ``world_size`` processes."""
    return plan_batch(config.data.micro_batch_size, config.parallel.pipeline_stages, world_size,
                      config.train.global_batch_size, config.train.grad_accum_steps, config.parallel.context_parallel)


def data_parallel_size(stages: int, world_size: int) -> int:
    """Replicas of the pipeline, after checking that the stages fit the launched processes."""
    _check_positive("parallel.pipeline_stages", stages)
    if world_size % stages:
        raise BatchConfigError(f"parallel.pipeline_stages={stages} does not divide the {world_size} launched "
                               "process(es) — launch a multiple of the stage count, or set parallel.pipeline_stages "
                               f"to a divisor of {world_size}")
    return world_size // stages


def plan_batch(micro_batch: int, stages: int, world_size: int, global_batch: int | None = None,
               microbatches: int | None = None, context: int = 1) -> BatchPlan:
    """The step's geometry from ``train.global_batch_size`` and/or ``train.grad_accum_steps`` (None: unset)."""
    replicas = check_context_world(context, stages, data_parallel_size(stages, world_size) * stages)
    _check_positive("data.micro_batch_size", micro_batch)
    for name, value in (("train.global_batch_size", global_batch), ("train.grad_accum_steps", microbatches)):
        if value is not None:
            _check_positive(name, value)
    rows_per_microbatch = micro_batch * replicas  # over all replicas
    if global_batch is not None:
        if global_batch % rows_per_microbatch:
            raise BatchConfigError(
                f"train.global_batch_size={global_batch} is not a multiple of data.micro_batch_size={micro_batch} "
                f"x {replicas} data-parallel replica(s) = {rows_per_microbatch} — use "
                f"{_multiples(rows_per_microbatch, stages)}, or change data.micro_batch_size")
        derived = global_batch // rows_per_microbatch
        if microbatches is not None and microbatches != derived:
            raise BatchConfigError(
                f"train.global_batch_size={global_batch} means {derived} microbatch(es) per step here, but "
                f"train.grad_accum_steps={microbatches} — set only one of them")
        plan = BatchPlan(micro_batch, derived, replicas, stages, f"train.global_batch_size={global_batch}", context)
    elif microbatches is not None:
        plan = BatchPlan(micro_batch, microbatches, replicas, stages, f"train.grad_accum_steps={microbatches}",
                         context)
    else:
        plan = BatchPlan(micro_batch, stages, replicas, stages,
                         "by default one per stage; train.global_batch_size sets it", context)
    if plan.microbatches < stages:
        raise BatchConfigError(
            f"{plan.microbatches} microbatch(es) per step ({plan.source}) is fewer than parallel.pipeline_stages="
            f"{stages}: 1F1B needs at least one per stage — set train.global_batch_size to "
            f"{_multiples(rows_per_microbatch, stages)} ({micro_batch} rows x {replicas} replica(s) x at least "
            f"{stages} microbatches)")
    return plan


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BatchConfigError(f"{name}={value!r} is not a positive integer — set it to an integer >= 1")


def _multiples(rows_per_microbatch: int, stages: int) -> str:
    first = rows_per_microbatch * stages
    return f"{first}, {first + rows_per_microbatch}, {first + 2 * rows_per_microbatch}, ..."
