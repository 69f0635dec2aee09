"""bench/query_blocks.py (context_check.py's yardstick) against the whole-row PyTorch reference, in fp64.

Blocks of 6-20 queries over rows of 25-37 tokens: blocks start inside documents, mid-window (so a block's window
reaches rows of the previous block) and inside compression groups. Planted bugs this catches: a block's window
positions left block-relative (the ``+ a``), a block's output gradient slice off by one.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from query_blocks import by_query_blocks  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.triton_testing import packed_geometry, random_topk  # noqa: E402

BUDGET = 20_000  # bytes: blocks of 6 (attention with selection) to 20 (indexer logits) queries here


def both(op, *args):
    """``op`` of ``kernels.reference`` on the whole row, then with the blocked ops swapped in."""
    original = getattr(reference, op)
    with by_query_blocks(BUDGET):
        blocked = getattr(reference, op)(*args)
    assert getattr(reference, op) is original  # swapped back
    return original(*args), blocked


@pytest.mark.parametrize("selected, rope_dim", [(True, 4), (False, 0), (True, 0)])
def test_sparse_attention_by_blocks(selected, rope_dim):
    torch.manual_seed(0)
    H, D, W, K, m = 3, 16, 8, 12, 2
    win_lo, vis_lo, vis_hi = packed_geometry([[5, 10, 10], [25]], m, W)
    B, T = win_lo.shape
    leaves = [torch.randn(B, T, H, D, dtype=torch.float64), torch.randn(B, T, D, dtype=torch.float64),
              torch.randn(B, T // m, D, dtype=torch.float64), torch.randn(H, dtype=torch.float64)]
    for t in leaves:
        t.requires_grad_()
    q, kv_window, kv_comp, sink = leaves
    topk = random_topk(vis_lo, vis_hi, K, empty_frac=0.2, duplicate=True) if selected else None
    rotation = torch.polar(torch.ones(B, T, rope_dim // 2, dtype=torch.float64),
                           torch.randn(B, T, rope_dim // 2, dtype=torch.float64)) if rope_dim else None
    grad = torch.randn(B, T, H, D, dtype=torch.float64)
    runs = []
    for (out, mass) in both("sparse_attention", q, kv_window, win_lo, kv_comp if selected else None, topk, sink,
                            D ** -0.5, W, rotation):
        runs.append((out, mass, torch.autograd.grad(out, [q, kv_window, sink] + ([kv_comp] if selected else []),
                                                    grad)))
    (out, mass, grads), (b_out, b_mass, b_grads) = runs
    torch.testing.assert_close(b_out, out, rtol=1e-12, atol=1e-12)
    assert (b_mass is None) == (mass is None) == (not selected)
    if selected:
        torch.testing.assert_close(b_mass, mass, rtol=1e-12, atol=1e-12)
    for got, want in zip(b_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_indexer_by_blocks():
    torch.manual_seed(0)
    NH, DI, K, bs, keep = 3, 16, 6, 4, 3
    _, vis_lo, vis_hi = packed_geometry([[5, 14, 18], [37]], 2, 1)
    B, T = vis_lo.shape
    q, w = torch.randn(B, T, NH, DI, dtype=torch.float64), torch.randn(B, T, NH, dtype=torch.float64)
    k = torch.randn(B, T // 2, DI, dtype=torch.float64, requires_grad=True)
    (picks, blocks), (b_picks, b_blocks) = both("indexer_select", q, w, k, vis_lo, vis_hi, K, None, bs, keep)
    assert torch.equal(b_picks, picks) and torch.equal(b_blocks, blocks)
    cand = blocks.clone()
    cand[..., 1] = -1
    (picks, _), (b_picks, _) = both("indexer_select", q, w, k, vis_lo, vis_hi, K, cand, bs)
    assert torch.equal(b_picks, picks)
    logits, b_logits = both("index_logits", q, w, k, picks)
    torch.testing.assert_close(b_logits, logits, rtol=1e-12, atol=0)
    finite = torch.isfinite(logits)
    grad = torch.where(finite, torch.randn_like(logits), 0)
    (g,), (b_g,) = (torch.autograd.grad(x.masked_fill(~finite, 0), [k], grad) for x in (logits, b_logits))
    torch.testing.assert_close(b_g, g, rtol=1e-10, atol=1e-12)
