"""Doc-relative positions, compression groups and visibility ranges of a packed batch (docs/DESIGN.md).

Everything a layer needs to know about *where* tokens and compressed entries are is derived once per forward
from ``doc_ids``: integer tensors only, so a pipeline stage can rebuild it from ``doc_ids`` alone. Each set of
positions also keeps the RoPE rotations made from it (``rotations``, filled by ``model.rope.Rotary``), so the
40 layers of a forward compute each rotation once instead of once per call.
"""
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F


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
    # Under context parallelism (``model/context.py``) vis_lo/vis_hi are the chunk's queries' (slots stay the
    # row's), ``own`` the groups completing in the chunk and ``gathered_slot`` where each slot lies among the
    # gathered chunks' entries.
    own: "Groups | None" = None
    gathered_slot: torch.Tensor | None = None  # [B,S]

    @classmethod
    def from_tokens(cls, tokens: TokenGeometry, m: int) -> "EntryGeometry":
        B, T = tokens.pos.shape
        completes = (tokens.pos + 1) % m == 0  # token closing a group of its document
        done = completes.long().cumsum(dim=1)  # groups completed so far in the row
        vis_lo = (done - completes.long()).gather(1, tokens.doc_start)
        S = T // m
        # each completing token writes its group's slot; the others write a spare slot S, dropped (no host sync)
        slot = torch.where(completes, done - 1, S)
        t = torch.arange(T, device=slot.device).expand(B, T)
        first_token = slot.new_zeros(B, S + 1).scatter_(1, slot, t - m + 1)[:, :S]
        pos = slot.new_zeros(B, S + 1).scatter_(1, slot, tokens.pos - m + 1)[:, :S]
        valid = slot.new_zeros(B, S + 1, dtype=torch.bool).scatter_(1, slot, completes)[:, :S]
        return cls(m, vis_lo, done, first_token.contiguous(), pos.contiguous(), valid.contiguous())

    def chunk(self, start: int, stop: int, chunks: int) -> "EntryGeometry":
        """This row geometry seen from chunk ``[start, stop)`` of ``chunks`` equal ones. A chunk owns the groups
        that complete inside it, at most ``L / m`` of them (``own``: their first token counted from ``m - 1``
        rows before ``start``, the rows a halo puts in front); chunk c's slots start at the groups completed before
        it, so slot s of the row lies at ``c * L/m + s - first[c]`` of the gathered chunks (``gathered_slot``)."""
        m, L = self.ratio, stop - start
        n, S = L // m, self.first_token.shape[1]
        first = F.pad(self.vis_hi[:, L - 1::L][:, :chunks - 1], (1, 0))  # [B,C] slots before each chunk
        mine = first[:, start // L:start // L + 1] + torch.arange(n, device=first.device)  # [B,n] own slots
        own_valid = mine < self.vis_hi[:, stop - 1:stop]
        own_first = torch.where(own_valid, self.first_token.gather(1, mine.clamp(max=S - 1)) - start + m - 1, 0)
        s = torch.arange(S, device=first.device).expand_as(self.first_token)
        owner = torch.searchsorted(first, s.contiguous(), right=True) - 1
        gathered = (owner * n + s - first.gather(1, owner)).clamp(0, chunks * n - 1)
        return EntryGeometry(m, self.vis_lo[:, start:stop], self.vis_hi[:, start:stop], self.first_token, self.pos,
                             self.valid, own=Groups(own_first, own_valid), gathered_slot=gathered)


@dataclass(frozen=True)
class Groups:
    """Groups a compressor pools: each one's first token (an index into the compressor's input) and validity."""
    first_token: torch.Tensor  # [B,n]
    valid: torch.Tensor  # [B,n] bool


class Geometry:
    """All the geometry of one forward: token positions, window starts, and entries per compression ratio.

    With a ``context`` (``model/context.py``) ``doc_ids`` are the whole rows and the forward computes the chunk
    ``[context.start, context.stop)``: ``tokens`` and ``window_lo`` are its queries' (positions doc-relative and
    window starts as token indices of the row), entries are the row's (``EntryGeometry.chunk``)."""

    def __init__(self, doc_ids: torch.Tensor, window: int, context=None):
        self.doc_ids, self.context = doc_ids, context
        self.start, self.stop = (0, doc_ids.shape[1]) if context is None else (context.start, context.stop)
        self.row_tokens = TokenGeometry.from_doc_ids(doc_ids)
        self.tokens = self.row_tokens if context is None else TokenGeometry(
            *(t[:, self.start:self.stop] for t in (self.row_tokens.doc_start, self.row_tokens.pos)))
        self.window_lo = self.row_tokens.window_lo(window)[:, self.start:self.stop]
        self._entries: dict[int, EntryGeometry] = {}
        self.cache: dict = {}  # other per-forward objects made once for all layers (the dense baseline's mask)

    @cached_property
    def single_document(self) -> bool:
        """Every row holds one document (plain causal attention is then document-causal)."""
        return bool((self.doc_ids == self.doc_ids[:, :1]).all())

    def entries(self, ratio: int) -> EntryGeometry:
        if ratio not in self._entries:
            entries = EntryGeometry.from_tokens(self.row_tokens, ratio)
            if self.context is not None:
                entries = entries.chunk(self.start, self.stop, self.context.size)
            self._entries[ratio] = entries
        return self._entries[ratio]

    def chunk_of(self, row: torch.Tensor) -> torch.Tensor:
        """The columns of a row tensor [B,T,...] that belong to this forward's chunk."""
        return row if self.context is None else row[:, self.start:self.stop]
