"""Doc-relative positions, compression groups and visibility ranges of a packed batch (docs/DESIGN.md).

Everything a layer needs to know about *where* tokens and compressed entries are is derived once per forward
from ``doc_ids``: integer tensors only, so a pipeline stage can rebuild it from ``doc_ids`` alone. Each set of
positions also keeps the RoPE rotations made from it (``rotations``, filled by ``model.rope.Rotary``), so the
40 layers of a forward compute each rotation once instead of once per call.
"""
from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class TokenGeometry:
    doc_start: torch.Tensor  # [B,T] index of the first token of each token's document
    pos: torch.Tensor  # [B,T] doc-relative position (RoPE position)
    rotations: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor) -> "TokenGeometry":
        B, T = doc_ids.shape
        t = torch.arange(T, device=doc_ids.device).expand(B, T)
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        doc_start = torch.where(starts, t, 0).cummax(dim=1).values
        return cls(doc_start, t - doc_start)

    def window_lo(self, window: int) -> torch.Tensor:
        """First token of query t's sliding window: ``max(t - window + 1, doc_start)``."""
        t = torch.arange(self.pos.shape[1], device=self.pos.device)
        return torch.maximum(t - window + 1, self.doc_start)


@dataclass(frozen=True)
class EntryGeometry:
    """Compressed entries at ratio m: complete groups of m tokens of each document, stored document after
    document in ``S = T // m`` slots; query t sees the contiguous range ``[vis_lo[t], vis_hi[t])``."""

    ratio: int
    vis_lo: torch.Tensor  # [B,T]
    vis_hi: torch.Tensor  # [B,T]
    first_token: torch.Tensor  # [B,S] token index of each entry's first token (0 for unused slots)
    pos: torch.Tensor  # [B,S] doc-relative position of the entry's first token (its RoPE position)
    valid: torch.Tensor  # [B,S] bool: slot holds an entry
    rotations: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_tokens(cls, tokens: TokenGeometry, m: int) -> "EntryGeometry":
        B, T = tokens.pos.shape
        completes = (tokens.pos + 1) % m == 0  # token closing a group of its document
        done = completes.long().cumsum(dim=1)  # groups completed so far in the row
        vis_lo = (done - completes.long()).gather(1, tokens.doc_start)
        S = T // m
        b, t = completes.nonzero(as_tuple=True)
        slot = done[b, t] - 1
        first_token = torch.zeros(B, S, dtype=torch.long, device=t.device)
        first_token[b, slot] = t - m + 1
        pos = torch.zeros_like(first_token)
        pos[b, slot] = tokens.pos[b, t] - m + 1
        valid = torch.zeros(B, S, dtype=torch.bool, device=t.device)
        valid[b, slot] = True
        return cls(m, vis_lo, done, first_token, pos, valid)


class Geometry:
    """All the geometry of one forward: token positions, window starts, and entries per compression ratio."""

    def __init__(self, doc_ids: torch.Tensor, window: int):
        self.doc_ids = doc_ids
        self.tokens = TokenGeometry.from_doc_ids(doc_ids)
        self.window_lo = self.tokens.window_lo(window)
        self._entries: dict[int, EntryGeometry] = {}
        self.cache: dict = {}  # other per-forward objects made once for all layers (the dense baseline's mask)

    @cached_property
    def single_document(self) -> bool:
        """Every row holds one document (plain causal attention is then document-causal)."""
        return bool((self.doc_ids == self.doc_ids[:, :1]).all())

    def entries(self, ratio: int) -> EntryGeometry:
        if ratio not in self._entries:
            self._entries[ratio] = EntryGeometry.from_tokens(self.tokens, ratio)
        return self._entries[ratio]
