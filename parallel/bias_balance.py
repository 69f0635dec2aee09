"""The MoE layers' auxiliary-loss-free balance at the step boundary (SPEC §5.1, ``Transformer.balance_experts``).

After every step each routing bias moves against its expert loads summed over the step's microbatches and the
stage's data-parallel replicas, so every replica keeps the same bias. A skipped step still sums the loads (they are
reported, and the next step must not count them again) but moves no bias.
"""
from functools import partial

import torch
import torch.distributed as dist


class BiasBalance:
    """The balance step of a stage's model over its data-parallel ``group``; ``loads``: the last step's summed
    expert loads by MoE module name (empty without MoE layers)."""

    def __init__(self, model, group):
        self.model, self.group = model, group
        self.loads: dict[str, torch.Tensor] = {}

    def __call__(self, apply: bool) -> None:
        self.loads = self.model.balance_experts(partial(dist.all_reduce, group=self.group), apply=apply)
