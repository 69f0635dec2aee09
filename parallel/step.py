"""The optimizer step every job takes at the end of a batch, as one ordered call of its components.

By the time it runs, the pipeline schedule has reduced the gradients: shadow indexers' into their owners
(``parallel/shadows.py``), the dense ones by DeepSpeed over the data-parallel group, the table shards'
(``parallel/tables.py``) and the routed experts' (``parallel/experts.py``) over their own groups. Then, in order:

1. clip: every clipping group's norm over the whole pipeline, the gradients scaled (``parallel/clipping.py``);
2. guard: whether the loss and those norms are finite, agreed by all ranks (``parallel/step_guard.py``);
3. balance: the MoE routing biases, moved only when the step is applied (``parallel/bias_balance.py``);
4. on a skip: the gradients dropped and the step counted as skipped; nothing else changes;
5. the tables' sparse Adam, first: DeepSpeed's step below clears every module gradient;
6. the dense optimizer, through DeepSpeed (the LR schedule and step counters move with it), on this rank's rows
   under ZeRO-1, whose owners then broadcast them (``parallel/zero.py``);
7. the replicas (shadow indexers, the draft head's embedding) take their owners' new values.
The order fixes the numbers: the tables read the learning rate before the schedule moves it, and the replicas copy
only after every owner stepped.
"""
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parallel.bias_balance import BiasBalance
from parallel.clipping import GradientClipper
from parallel.shadows import Replicas
from parallel.step_guard import StepGuard
from parallel.tables import TableOptimizer
from parallel.zero import OptimizerShards


@dataclass
class StepParts:
    """A stage's step components. ``clip`` runs ``clipper`` (through a hook that tests and benchmarks wrap);
    ``dense_step(lr_kwargs)``: DeepSpeed's optimizer step; ``drop``: clear every gradient and count a skipped step;
    ``lr``: the dense optimizer's learning rate of this step."""
    clip: Callable[[], None]
    clipper: GradientClipper
    guard: StepGuard
    balance: BiasBalance
    tables: TableOptimizer | None
    shards: list[OptimizerShards]
    dense_step: Callable[[dict | None], None]
    drop: Callable[[], None]
    lr: Callable[[], float]
    replicas: Replicas
    device: torch.device


def optimizer_step(parts: StepParts, loss: torch.Tensor | None, lr_kwargs: dict | None = None) -> bool:
    """Take the step, or on a non-finite ``loss`` (the last stage's, None elsewhere) or gradient norm nothing on any
    rank: no parameter, optimizer, routing-bias or schedule change. Returns whether it was applied."""
    parts.clip()  # the norms (equal on every rank), then the scaling (dropped by a skip)
    skip = parts.guard.check(loss, parts.clipper.clip_norms.values(), parts.device)
    parts.balance(apply=not skip)
    if skip:
        parts.drop()
        if parts.tables is not None:
            parts.tables.clear()
        return False
    if parts.tables is not None:
        parts.tables.step(parts.lr())
    with contextlib.ExitStack() as views:
        for shards in parts.shards:
            views.enter_context(shards.gradients())
        parts.dense_step(lr_kwargs)
    for shards in parts.shards:
        shards.broadcast()
    parts.replicas.sync()
    return True
