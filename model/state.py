"""Per-forward shared state of a CSA2 stack: the tensors that one layer produces and later layers read.

One ``SharedState`` is made per forward (per microbatch) and passed layer to layer; nothing of it lives on a
module or in ``state_dict``. Each field is a dict keyed by the producing layer and is dropped right after its
last consumer (``Layout.last_use``), so what is alive between two layers is exactly what a pipeline boundary
there must carry. The multi-layer indexer loss (SPEC §2) is assembled here: every reader of a selection adds its
normalised attention mass on the selected entries, and the last reader turns the average into the KL.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.geometry import Geometry
from model.layout import LayerPlan, Layout, Mode
from model.offload import HostStash

FIELDS = ("kv", "index_k", "topk", "candidates", "index_logits", "index_target")


@dataclass(frozen=True)
class LayerInputs:
    """What one layer reads of the forward beside its stream, as explicit values: a recomputed layer
    (``parallel/recompute.py``) runs again in the backward on these, after the state has dropped them."""
    geometry: Geometry
    reads: dict[str, torch.Tensor]  # the shared tensors it consumes (``SharedState.reads``)
    engram_ids: torch.Tensor | None  # its Engram's hash ids (None: no Engram before this layer)
    host_stash: HostStash  # where an offloading wrapper parks the layer's input until the backward


class SharedState:
    def __init__(self, layout: Layout, doc_ids: torch.Tensor, window: int, context=None):
        """``context``: this forward computes one chunk of the rows ``doc_ids`` (``model/context.py``)."""
        self.layout = layout
        self.geometry = Geometry(doc_ids, window, context)
        self.kv: dict[int, torch.Tensor] = {}  # Full layer -> pre-RoPE latent [B,S,head_dim]
        self.index_k: dict[int, torch.Tensor] = {}  # Full layer -> post-RoPE index keys [B,S,index_head_dim]
        self.topk: dict[int, torch.Tensor] = {}  # index source -> selected entries [B,T,K], -1 empty
        self.candidates: dict[int, torch.Tensor] = {}  # candidate source -> doc-relative blocks [B,T,NB]
        self.index_logits: dict[int, torch.Tensor] = {}  # index source -> student logits [B,T,K]
        self.index_target: dict[int, torch.Tensor] = {}  # index source -> sum of readers' normalised mass
        self.indexer_losses: dict[int, torch.Tensor] = {}  # index source -> KL, once its last reader ran
        self.on_store = None  # optional callback(field, layer, tensor) for every tensor stored (a ledger)
        self.host_stash = HostStash()  # recomputed layers' inputs waiting on the host (``parallel/recompute.py``)
        # Around the attention (SPEC §5): the row's token ids (Engram hashes, the draft head's inputs and targets),
        # the hash ids per Engram layer, and the draft head's features (detached) per target layer.
        self.input_ids: torch.Tensor | None = None
        self.engram_ids: dict[int, torch.Tensor] = {}
        self.dspark_features: dict[int, torch.Tensor] = {}

    def inputs(self, plan: LayerPlan) -> LayerInputs:
        """Everything layer ``plan`` reads of this forward beside its stream."""
        return LayerInputs(self.geometry, self.reads(plan), self.engram_ids.get(plan.layer_id), self.host_stash)

    def reads(self, plan: LayerPlan) -> dict[str, torch.Tensor]:
        """The shared tensors layer ``plan`` consumes."""
        reads = {}
        if plan.mode in (Mode.REINDEX, Mode.REUSE):
            reads["kv"] = self.kv[plan.kv_source]
        if plan.mode is Mode.REINDEX:
            reads["index_k"] = self.index_k[plan.kv_source]
        if plan.mode is Mode.REUSE:
            reads["topk"] = self.topk[plan.index_source]
        if plan.candidate_source is not None:
            reads["candidates"] = self.candidates[plan.candidate_source]
        return reads

    def write(self, plan: LayerPlan, produced: dict[str, torch.Tensor]) -> None:
        """Store what layer ``plan`` produced, add its reading of a selection, then drop what it used last."""
        for field in FIELDS:
            if field in produced:
                self._store(field, plan.layer_id, produced[field])
        if "selected_mass" in produced:
            self._add_reader_mass(plan.index_source, produced["selected_mass"])
        if "dspark_feature" in produced:
            self.dspark_features[plan.layer_id] = produced["dspark_feature"]
        self._release_after(plan.layer_id)

    def live(self) -> dict[str, list[int]]:
        """Producing layers of the shared tensors alive now, per field (what a boundary here would carry)."""
        return {f: sorted(getattr(self, f)) for f in FIELDS if getattr(self, f)}

    def _add_reader_mass(self, index_source: int, mass: torch.Tensor) -> None:
        """A layer read the selection of ``index_source``: add its attention distribution on the selected set."""
        total = mass.sum(-1, keepdim=True)
        share = torch.where(total > 0, mass / total.clamp_min(torch.finfo(mass.dtype).tiny), 0.0)
        previous = self.index_target.get(index_source)
        self._store("index_target", index_source, share if previous is None else previous + share)

    def _store(self, field: str, layer: int, tensor: torch.Tensor) -> None:
        getattr(self, field)[layer] = tensor
        if self.on_store is not None:
            self.on_store(field, layer, tensor)

    def _release_after(self, layer_id: int) -> None:
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
        return indexer_kl(target, self.index_logits[source], self.geometry.context)


def indexer_kl(target: torch.Tensor, logits: torch.Tensor, context=None) -> torch.Tensor:
    """Mean over queries with a selection of KL(target || softmax(logits)) on the selected slots (-inf = empty).
    With a ``context`` the queries are one chunk's and the mean is over the whole rows' queries: the chunk's share,
    which the chunks' shares add up to."""
    valid = logits > float("-inf")
    log_q = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)).masked_fill(~valid, -1e30),
                          dim=-1)
    terms = torch.where(valid & (target > 0), torch.xlogy(target, target) - target * log_q, 0.0)
    has_selection = valid.any(-1)
    count = has_selection.sum() if context is None else context.total(has_selection.sum())
    return terms.sum(-1)[has_selection].sum() / count.clamp_min(1)
