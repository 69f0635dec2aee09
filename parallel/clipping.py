"""Gradient clipping by the global norm over all pipeline stages, one norm per clipping group.

DeepSpeed's fp32 clipping, given a pipeline grid, counts only the first stage's gradients. Here the per-tensor
squared norms of all stages are gathered and summed in the full model's parameter order, so each norm (and every
clipped gradient) is bitwise the single-stage one. The trunk, the indexer and the draft head (``model.groups
.CLIP_GROUPS``) are each clipped by their own norm, so that the indexer's and the draft head's losses never change
how far the trunk moves (SPEC §2: the indexer learns only from its KL; §5.4: the draft head only from its own loss).

Runs after the data-parallel, expert and stage reductions, so every replica of a stage sees the same norms. The
norms stay on the device and the gradients are scaled by group (foreach): no host sync on one stage; several stages
gather their squares on the host once.
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from model.groups import CLIP_GROUPS, GROUPS, clip_group, param_group


def squares(grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The squared norms of gradients, dense or sparse, as an fp32 vector on the device (0 for none): the dense ones
    in one pass (torch's foreach norm), no host sync. A tensor's value depends on it alone, not on the others."""
    dense = iter(torch._foreach_norm([g for g in grads if g is not None and not g.is_sparse]) if grads else ())
    zero = torch.zeros((), device=device)
    return torch.stack([zero if g is None else
                        g.coalesce().values().float().pow(2).sum() if g.is_sparse else next(dense).float().square()
                        for g in grads]) if grads else torch.zeros(0, device=device)


@dataclass
class GradientClipper:
    """Clips a stage's gradients to ``max_norm`` per clipping group (0: only measures the norms).

    ``sharded``: (parameter names, process group) pairs of parameters that hold other rows on every member of the
    group (the Engram tables' shards over the data-parallel replicas, an expert range over its expert-parallel
    group): their squares are the sums of the group's. ``pipe_group``: the stage's pipeline group, of ``stages``.
    After a call: ``clip_norms`` (each clipping group's norm) and ``group_norms`` (the same squares split by
    parameter role, ``model.groups.GROUPS``: training-health diagnostics)."""
    max_norm: float
    device: torch.device
    sharded: list[tuple[set[str], object]]
    pipe_group: object
    stages: int
    clip_norms: dict[str, torch.Tensor] = field(default_factory=dict)
    group_norms: dict[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, named: list[tuple[str, torch.Tensor | None]]) -> None:
        """Measure and clip ``named`` (name, gradient) in the stage's parameter order; a table without a gradient
        is listed too (every replica lists the same names)."""
        group_ids = [GROUPS.index(param_group(n)) for n, _ in named]
        local = squares([g for _, g in named], self.device)
        for names, group in self.sharded:
            if names and dist.get_world_size(group) > 1:
                at = torch.tensor([i for i, (n, _) in enumerate(named) if n in names])
                at = at.to(self.device, non_blocking=True)
                summed = local[at]
                dist.all_reduce(summed, group=group)
                local[at] = summed
        if self.stages > 1:
            per_stage = [None] * self.stages
            dist.all_gather_object(per_stage, (local.cpu(), group_ids), group=self.pipe_group)
            all_squares = torch.cat([part for part, _ in per_stage]).to(self.device)
            all_group_ids = [i for _, ids in per_stage for i in ids]
        else:
            all_squares, all_group_ids = local, group_ids
        ids = torch.tensor(all_group_ids, dtype=torch.long).to(self.device, non_blocking=True)
        clip_of = torch.tensor([CLIP_GROUPS.index(clip_group(group)) for group in GROUPS]).to(
            self.device, non_blocking=True)[ids]

        def norm_where(mask):  # a fixed-length sum in parameter order: bitwise the same on every split
            return torch.where(mask, all_squares, 0.0).sum().sqrt()

        self.group_norms = {group: norm_where(ids == i) for i, group in enumerate(GROUPS) if i in all_group_ids}
        self.clip_norms = {group: norm_where(clip_of == i) for i, group in enumerate(CLIP_GROUPS)}
        if self.max_norm > 0:
            self._scale(named, group_ids)

    def _scale(self, named: list[tuple[str, torch.Tensor | None]], group_ids: list[int]) -> None:
        for clip in CLIP_GROUPS:
            grads = [g for (_, g), i in zip(named, group_ids) if g is not None and clip_group(GROUPS[i]) == clip]
            scale = torch.clamp(self.max_norm / (self.clip_norms[clip] + 1e-6), max=1.0)
            dense = [g for g in grads if not g.is_sparse]
            if dense:
                torch._foreach_mul_(dense, scale)
            for g in grads:
                if g.is_sparse:
                    g.mul_(scale)
