"""Per-forward shared state of a CSA2 stack: the tensors that one layer produces and later layers read.

One ``SharedState`` is made per forward (per microbatch) and passed layer to layer; nothing of it lives on a
module or in ``state_dict``. Each field is a dict keyed by the producing layer and is dropped right after its
last consumer (``Layout.last_use``), so what is alive between two layers is exactly what a pipeline boundary
there must carry. The multi-layer indexer loss (SPEC §2) is assembled here: every reader of a selection adds its
normalised attention mass on the selected entries, and the last reader turns the average into the KL.
"""
import torch
import torch.nn.functional as F

from model.geometry import EntryGeometry, TokenGeometry
from model.layout import Layout

FIELDS = ("kv", "index_k", "topk", "candidates", "index_logits", "index_target")


class SharedState:
    def __init__(self, layout: Layout, doc_ids: torch.Tensor, window: int, collect_recall: bool = False):
        self.layout = layout
        self.collect_recall = collect_recall
        self.tokens = TokenGeometry.from_doc_ids(doc_ids)
        self.window_lo = self.tokens.window_lo(window)
        self._entries: dict[int, EntryGeometry] = {}
        self.kv: dict[int, torch.Tensor] = {}  # Full layer -> pre-RoPE latent [B,S,head_dim]
        self.index_k: dict[int, torch.Tensor] = {}  # Full layer -> post-RoPE index keys [B,S,index_head_dim]
        self.topk: dict[int, torch.Tensor] = {}  # index source -> selected entries [B,T,K], -1 empty
        self.candidates: dict[int, torch.Tensor] = {}  # candidate source -> doc-relative blocks [B,T,NB]
        self.index_logits: dict[int, torch.Tensor] = {}  # index source -> student logits [B,T,K]
        self.index_target: dict[int, torch.Tensor] = {}  # index source -> sum of readers' normalised mass
        self.indexer_losses: dict[int, torch.Tensor] = {}  # index source -> KL, once its last reader ran
        self.index_recall: dict[int, torch.Tensor] = {}  # reading layer -> recall (evaluation diagnostic)

    def entries(self, ratio: int) -> EntryGeometry:
        if ratio not in self._entries:
            self._entries[ratio] = EntryGeometry.from_tokens(self.tokens, ratio)
        return self._entries[ratio]

    def live(self) -> dict[str, list[int]]:
        """Producing layers of the shared tensors alive now, per field (what a boundary here would carry)."""
        return {f: sorted(getattr(self, f)) for f in FIELDS if getattr(self, f)}

    def add_reader_mass(self, index_source: int, mass: torch.Tensor) -> None:
        """A layer read the selection of ``index_source``: add its attention distribution on the selected set."""
        total = mass.sum(-1, keepdim=True)
        share = torch.where(total > 0, mass / total.clamp_min(torch.finfo(mass.dtype).tiny), 0.0)
        previous = self.index_target.get(index_source)
        self.index_target[index_source] = share if previous is None else previous + share

    def release_after(self, layer_id: int) -> None:
        """Drop every field whose last consumer is ``layer_id``; a finished selection becomes its KL first."""
        ending = [(f, src) for (f, src), last in self.layout.last_use.items()
                  if last == layer_id and src in getattr(self, f)]
        for field, source in ending:
            if field == "index_target":
                self.indexer_losses[source] = self._indexer_kl(source)
        for field, source in ending:
            getattr(self, field).pop(source)

    def _indexer_kl(self, source: int) -> torch.Tensor:
        target = (self.index_target[source] / len(self.layout.readers(source))).detach()
        return indexer_kl(target, self.index_logits[source])


def indexer_kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over queries with a selection of KL(target || softmax(logits)) on the selected slots (-inf = empty)."""
    valid = logits > float("-inf")
    log_q = F.log_softmax(logits.float().masked_fill(~valid, -1e30), dim=-1)
    terms = torch.where(valid & (target > 0), torch.xlogy(target, target) - target * log_q, 0.0)
    has_selection = valid.any(-1)
    return terms.sum(-1)[has_selection].sum() / has_selection.sum().clamp_min(1)
