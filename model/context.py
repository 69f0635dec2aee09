"""The model's seam for context parallelism (SPEC §7): one forward computes one contiguous chunk of each row.

A row of ``T`` tokens is split into ``C`` chunks of ``L = T / C`` tokens; a forward given a ``context`` takes the
whole rows' ``input_ids``/``doc_ids`` (so positions, documents and n-gram look-back stay global) and computes the
queries of its chunk ``[start, stop)`` only. What a chunk's tokens need from earlier chunks comes through three
exchanges of the context object (``parallel/context.py``'s ``ContextShard``; there are none without a context):

- ``halo(x, rows)``: the previous chunk's last ``rows`` rows of ``x`` along dim 1 (zeros on the first chunk), their
  gradient returned to it. The sliding window reads ``window - 1`` rows of window KV; a compressor of ratio m reads
  the ``m - 1`` input rows of a group that a document starting mid-group makes straddle the chunk border.
- ``gather(x)``: every chunk's ``x`` [B, n, ...] concatenated along dim 1; its backward gives each chunk the sum of
  every chunk's gradient of its part (all queries' uses of its compressed entries).
- ``total(x)``: the sum over chunks, without gradient (counts that normalise a loss over the whole row).

Everything else of a layer is per token (projections, norms, mHC, MoE, Engram given its hashed ids), so a chunk
computes exactly the rows the whole-row forward computes for its tokens. No distributed code lives here.
"""
import torch
import torch.nn.functional as F


def gather_entries(context, own: torch.Tensor, entries) -> torch.Tensor:
    """The compressed entries of the whole row [B, S, D], in the row's slot order (``EntryGeometry``), from each
    chunk's ``own`` entries [B, L/m, D] (the groups completing inside it, from its slot 0). Chunks hold different
    numbers of entries when documents do not start at multiples of m, so the gathered rows are put back into the
    row's order by ``entries.gathered_slot``; empty slots are zeros, as the whole-row compressor leaves them."""
    parts = context.gather(own)
    if entries.ratio == 1:  # one entry per token: every chunk holds L of them, in order already
        return parts
    rows = entries.gathered_slot.unsqueeze(-1).expand(-1, -1, parts.shape[-1])
    return torch.where(entries.valid.unsqueeze(-1), parts.gather(1, rows), 0).to(own.dtype)


def with_window_halo(context, window: int, q, kv_window, win_lo, topk, rotation, start: int):
    """The sparse-attention operands of a chunk with the previous chunk's ``window - 1`` window-KV rows in front.

    The kernels take as many window rows as queries, so the halo rows come with placeholder queries (zero, reading
    only their own row, no selection) whose outputs the caller drops: ``window - 1`` extra queries per chunk
    instead of a second kernel signature. ``win_lo`` is global (``Geometry.window_lo``); it becomes an index into
    the extended rows."""
    n = window - 1
    B = q.shape[0]
    kv_window = torch.cat([context.halo(kv_window, n), kv_window], dim=1)
    q = F.pad(q, (0, 0, 0, 0, n, 0))
    own_row = torch.arange(n, device=win_lo.device).expand(B, n)
    win_lo = torch.cat([own_row, win_lo - start + n], dim=1)
    if topk is not None:
        topk = F.pad(topk, (0, 0, n, 0), value=-1)
    rotation = torch.cat([rotation.new_ones(B, n, rotation.shape[-1]), rotation], dim=1)
    return q, kv_window, win_lo, topk, rotation
