"""Replicas of parameters held on other pipeline stages, kept bitwise equal to their owner's.

Two kinds: the shadow indexers (``parallel.index_k=shadow``: a stage reading a Full layer's index keys that another
stage owns holds a copy of its key projection, ``parallel/stage.py``), and the draft head's embedding on the last
stage when the first stage holds the embedding. Only the owner's copy is in the optimizer. Shadow replicas'
gradients are summed into the owner (and the replicas) before the data-parallel reduction (``reduce_gradients``);
after every step, and after weights are loaded, the owner's values are broadcast to its replicas (``sync``).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.layout import Layout
from parallel.partition import StagePlan
from parallel.stage import PipelineStage, owner_name, shadow_sources


@dataclass(frozen=True)
class Link:
    """The ranks holding one parameter set (owner first) as a process group, and this rank's tensors of it."""
    group: object
    owner: int
    tensors: list[torch.Tensor]


class Replicas:
    """This rank's links: ``shadows`` (the shadow indexers' key projections) and ``draft_embedding``. The groups are
    created in the same order on every rank, as ``torch.distributed.new_group`` requires. ``topo``: DeepSpeed's
    pipeline topology (``PipelineModule.topology()``)."""

    def __init__(self, topo, layout: Layout, plan: StagePlan, stage: PipelineStage, stage_id: int, index_k: str,
                 run_dspark: bool, device: torch.device):
        self.device = device
        me = dist.get_rank()
        self.shadows = self._shadow_links(topo, layout, plan, stage, stage_id, me) if index_k == "shadow" else []
        self.draft_embedding = self._draft_links(topo, stage, stage_id, me) if run_dspark else []

    @staticmethod
    def _shadow_links(topo, layout: Layout, plan: StagePlan, stage: PipelineStage, stage_id: int,
                      me: int) -> list[Link]:
        """One link per shadowed Full layer that my stage owns or mirrors."""
        holders: dict[int, list[int]] = {}
        for s, layers in enumerate(plan.stages):
            for source in shadow_sources(layout, layers):
                holders.setdefault(source, [plan.stage_of(source)]).append(s)
        links = []
        for source in sorted(holders):
            for data in range(topo.get_dim("data")):
                ranks = [topo.get_rank(pipe=s, data=data) for s in holders[source]]
                group = dist.new_group(ranks)
                if me not in ranks:
                    continue
                if stage_id == holders[source][0]:
                    named = dict(stage.model.named_parameters())
                    tensors = [named[owner_name(source, n)] for n in ("wk.weight", "k_norm.weight")]
                else:
                    tensors = list(stage.shadows[str(source)].parameters())
                links.append(Link(group, ranks[0], tensors))
        return links

    @staticmethod
    def _draft_links(topo, stage: PipelineStage, stage_id: int, me: int) -> list[Link]:
        """The draft head's embedding replica on the last stage and the first stage's embedding (none on one
        stage, where they are one tensor)."""
        last = topo.get_dim("pipe") - 1
        links = []
        for data in range(topo.get_dim("data")) if last > 0 else ():
            ranks = [topo.get_rank(pipe=0, data=data), topo.get_rank(pipe=last, data=data)]
            group = dist.new_group(ranks)
            if me in ranks:
                links.append(Link(group, ranks[0], [stage.model.embed.weight if stage_id == 0 else stage.draft_embed]))
        return links

    def reduce_gradients(self) -> None:
        """Sum every shadow indexer's gradients over its owner and replicas (none anywhere: left as they are)."""
        for link in self.shadows:
            tensors = link.tensors
            has = torch.tensor([float(any(t.grad is not None for t in tensors))], device=self.device)
            flat = torch.cat([has] + [(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1).float()
                                      for t in tensors])
            dist.all_reduce(flat, group=link.group)
            if flat[0] == 0:
                continue
            offset = 1
            for t in tensors:
                t.grad = flat[offset: offset + t.numel()].view_as(t).to(t.dtype)
                offset += t.numel()

    def sync(self) -> None:
        """Copy every owner's values to its replicas."""
        for link in self.shadows + self.draft_embedding:
            for t in link.tensors:
                dist.broadcast(t.data, src=link.owner, group=link.group)
