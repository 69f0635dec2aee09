"""The training objective (SPEC §2, §5.4), in one place for the training step and for evaluation.

total = CE(logits, labels) + indexer_loss_coef * sum of the per-source indexer KLs + dspark_loss_coef * the draft
head's loss (when the job trains it). The model detaches the indexer's and the draft head's inputs and the KL
target, so each coefficient scales its part's own learning signal and nothing else.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


@dataclass
class Loss:
    total: torch.Tensor  # what backward sees
    lm: torch.Tensor
    indexer: dict[int, torch.Tensor]  # index source layer -> KL
    tokens: int  # label tokens that entered the LM loss
    draft: dict[str, torch.Tensor] = field(default_factory=dict)  # the draft head's loss parts (when it trains)

    @property
    def indexer_total(self) -> torch.Tensor:
        return sum(self.indexer.values(), torch.zeros((), device=self.lm.device))

    @property
    def draft_total(self) -> torch.Tensor:
        return sum(self.draft.values(), torch.zeros((), device=self.lm.device))

    def metrics(self) -> dict[str, float]:
        """Scalars for logs: ``loss``, ``lm_loss``, ``indexer_loss`` and ``indexer_loss/layer{N}`` per source;
        with the draft head trained, ``dspark_loss`` and ``dspark_loss/<part>``."""
        row = {"loss": self.total.item(), "lm_loss": self.lm.item(), "indexer_loss": self.indexer_total.item()}
        row.update({f"indexer_loss/layer{layer}": kl.item() for layer, kl in sorted(self.indexer.items())})
        if self.draft:
            row["dspark_loss"] = self.draft_total.item()
            row.update({f"dspark_loss/{name}": value.item() for name, value in self.draft.items()})
        return row


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, count: int | None = None) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over labelled tokens, and their count.

    A batch with no labelled token (all padding) gives 0 with a graph, not the 0/0 = NaN of a plain mean, so
    it cannot be mistaken for a diverged step. ``count``: the labelled tokens of the whole rows when ``logits`` and
    ``labels`` are one chunk's (context parallelism): the chunk's share of the rows' mean.
    """
    summed = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum")
    count = int((labels != IGNORE_INDEX).sum()) if count is None else count
    return summed / max(count, 1), count


def chunked_lm_loss(features: torch.Tensor, head, labels: torch.Tensor, chunk: int,
                    count: int | None = None) -> tuple[torch.Tensor, int]:
    """``lm_loss`` of ``head(features)`` without the whole logits: ``chunk`` tokens at a time go through the head and
    the cross-entropy inside a non-reentrant checkpoint, so one chunk's logits exist at a time, in the forward and
    again in its backward. At 64K tokens V4.1's 129,280-entry vocabulary makes 34 GB of fp32 logits, and as much
    again for their softmax and gradient; a chunk of 4,096 tokens makes 2 GB."""
    features, labels = features.flatten(0, -2), labels.flatten()
    count = int((labels != IGNORE_INDEX).sum()) if count is None else count
    summed = sum(checkpoint(_summed_cross_entropy, head, features[i:i + chunk], labels[i:i + chunk],
                            use_reentrant=False) for i in range(0, labels.numel(), chunk))
    return summed / max(count, 1), count


def _summed_cross_entropy(head, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(features)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels,
                           ignore_index=IGNORE_INDEX, reduction="sum")


def compute_loss(output, labels: torch.Tensor, indexer_loss_coef: float, dspark_loss_coef: float = 0.0,
                 label_count: int | None = None, lm: tuple[torch.Tensor, int] | None = None) -> Loss:
    """The objective of one forward (``model.ModelOutput``) against its ``labels`` (-100 = ignored);
    ``label_count``: ``lm_loss``'s ``count``; ``lm``: the LM loss and its count when made already (a chunked head:
    ``chunked_lm_loss``), the output's logits then unused."""
    lm, count = lm or lm_loss(output.logits, labels, label_count)
    loss = Loss(lm, lm, dict(output.indexer_losses), count, dict(output.draft_losses))
    loss.total = lm + indexer_loss_coef * loss.indexer_total + dspark_loss_coef * loss.draft_total
    return loss


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise mean of ``Loss.metrics()`` rows (micro-batches of a step, batches of an evaluation)."""
    return {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}
