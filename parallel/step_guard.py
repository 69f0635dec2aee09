"""Whether an optimizer step is applied: the same answer on every rank, before anything is written.

A step is skipped when its loss or any clipping group's gradient norm is not finite. The loss alone is not enough:
one inf gradient entry with a finite loss gives an inf norm, clipping scales the gradients by ``max_norm / inf = 0``
and turns that entry into ``0 * inf = NaN``, and AdamW writes the NaN into the weight and its moments; a checkpoint
saved then would be published as a good one. The clipping groups' norms are computed after the data-parallel, expert
and stage reductions (``parallel/clipping.py``), so they are equal on every rank; the loss is known on
the last stage only. One MAX all-reduce of the two flags over the world makes the verdict common: the one host sync
the guard costs, which the loss check already paid.
"""
from collections.abc import Iterable

import torch
import torch.distributed as dist

CAUSES = ("loss", "gradient norm")  # the flags' order


class StepGuard:
    """The verdict of the last step: ``skipped``, and ``cause`` (what was not finite; "" when applied)."""

    def __init__(self):
        self.skipped = False
        self.cause = ""

    def check(self, loss: torch.Tensor | None, norms: Iterable[torch.Tensor], device: torch.device) -> bool:
        """Whether this step must be skipped, agreed over all ranks (collective: every rank calls it once a step).
        ``loss``: the step's loss on the last stage, None elsewhere; ``norms``: the clipping groups' gradient norms
        (scalars on ``device``)."""
        flags = torch.zeros(len(CAUSES), device=device)
        if loss is not None:
            flags[0] = (~torch.isfinite(loss.detach())).any().float()
        norms = [n.reshape(1).float() for n in norms]
        if norms:
            flags[1] = (~torch.isfinite(torch.cat(norms))).any().float()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad = flags.tolist()
        self.cause = " and ".join(cause for cause, flag in zip(CAUSES, bad) if flag)
        self.skipped = bool(self.cause)
        return self.skipped
