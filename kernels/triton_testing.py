"""Inputs for checking and benchmarking the kernels: packed-document geometry and random selections.

Shared by tests/kernels/test_kernels.py (CPU interpreter) and bench/bench_kernels.py (GPU), so both exercise the same
doc-relative conventions of docs/DESIGN.md ("Packed sequences").
"""
import torch


def packed_geometry(doc_lens: list[list[int]], m: int, window: int, device="cpu"):
    """(win_lo, vis_lo, vis_hi) [B,T] int64 for rows of packed documents (each row's lengths sum to T).

    Entry ranges are doc-relative: a document's ``len // m`` entries follow the previous documents' entries, and
    query t of a document at position p sees entries [first, first + (p+1)//m).
    """
    rows = []
    for lens in doc_lens:
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        firsts = torch.tensor([0] + [n // m for n in lens[:-1]]).cumsum(0)
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        t = torch.arange(sum(lens))
        pos = t - starts[doc]
        win_lo = torch.maximum(t - window + 1, starts[doc])
        vis_lo = firsts[doc]
        rows.append(torch.stack([win_lo, vis_lo, vis_lo + (pos + 1) // m]))
    geometry = torch.stack(rows, 1).to(device)
    return geometry[0], geometry[1], geometry[2]


def random_topk(vis_lo, vis_hi, k: int, empty_frac: float = 0.0, duplicate: bool = False):
    """Random visible entries per query (drawn with replacement), -1 where nothing is visible.

    ``empty_frac`` of the slots are emptied (-1) at random; ``duplicate`` copies slot 0 into slot 1.
    """
    n = (vis_hi - vis_lo).clamp(min=0).unsqueeze(-1)
    idx = vis_lo.unsqueeze(-1) + (torch.rand(*vis_lo.shape, k, device=vis_lo.device) * n).long()
    idx = torch.where(n > 0, idx, -1)
    if empty_frac:
        idx[torch.rand(idx.shape, device=idx.device) < empty_frac] = -1
    if duplicate:
        idx[..., 1] = idx[..., 0]
    return idx
