"""The reference sparse attention (``kernels/reference.py``) in both of its formulations, gathered rows and all rows
weighted by their read counts, against a loop over queries and heads written from SPEC §1: a query reads the
tokens of its window from ``win_lo`` on, the entries its non-empty slots pick (a pick made twice read twice) and one
sink logit per head; ``selected_mass`` is each slot's probability summed over heads."""
import pytest
import torch

from kernels import reference


def attention_query_by_query(q, kv_window, win_lo, kv_comp, topk_idx, sink, scale, window):
    B, T, H, _ = q.shape
    n_slots = topk_idx.shape[-1] if topk_idx is not None else 0
    out, mass = torch.zeros_like(q), torch.zeros(B, T, n_slots, dtype=q.dtype)
    for b in range(B):
        for t in range(T):
            tokens = [s for s in range(t - window + 1, t + 1) if s >= max(0, int(win_lo[b, t]))]
            picks = [k for k in range(n_slots) if topk_idx[b, t, k] >= 0]
            keys = torch.stack([kv_window[b, s] for s in tokens] + [kv_comp[b, topk_idx[b, t, k]] for k in picks])
            for h in range(H):
                p = torch.softmax(torch.cat([keys @ q[b, t, h] * scale, sink[h].view(1)]), dim=0)[:-1]
                out[b, t, h] = p @ keys
                for j, k in enumerate(picks):
                    mass[b, t, k] += p[len(tokens) + j].detach()
    return out, (mass if topk_idx is not None else None)


def random_case(entries, seed):
    """fp64 inputs with documents starting anywhere (win_lo in [0, t]), empty slots and a slot repeating another's pick;
    ``entries`` None: a window-only layer, 0: no entry complete yet."""
    g = torch.Generator().manual_seed(seed)
    B, T, H, D, window, K = 2, 11, 3, 8, 4, 4
    leaf = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, kv_window, sink = leaf(B, T, H, D), leaf(B, T, D), leaf(H)
    win_lo = (torch.rand(B, T, generator=g) * (torch.arange(T) + 1)).long()
    kv_comp = topk_idx = None
    if entries is not None:
        kv_comp = leaf(B, entries, D)
        topk_idx = torch.randint(0, max(entries, 1), (B, T, K), generator=g)
        topk_idx[..., 2] = topk_idx[..., 0]
        topk_idx[(torch.rand(B, T, K, generator=g) < 0.3) | (entries == 0)] = -1
    return q, kv_window, win_lo, kv_comp, topk_idx, sink, D ** -0.5, window


@pytest.mark.parametrize("form", ["all_rows", "gathered"])
@pytest.mark.parametrize("entries", [6, 0, None])
def test_both_formulations_match_a_query_by_query_loop(form, entries, monkeypatch):
    monkeypatch.setattr(reference, "_all_rows_hold_fewer", lambda *sizes: form == "all_rows")
    args = random_case(entries, seed=3)
    out, mass = reference.sparse_attention(*args)
    want_out, want_mass = attention_query_by_query(*args)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    if entries is None:
        assert mass is None
    else:
        assert not mass.requires_grad
        torch.testing.assert_close(mass, want_mass, rtol=1e-12, atol=1e-12)
    leaves = [x for x in args if isinstance(x, torch.Tensor) and x.requires_grad and x.numel()]
    d_out = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    for got, want in zip(torch.autograd.grad(out, leaves, d_out), torch.autograd.grad(want_out, leaves, d_out)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_short_rows_score_all_rows_and_long_rows_gather():
    """The CPU runs' rows (64 tokens + 32 entries, 4 heads; window 32 + 16 picks of 64 features) take the all-rows
    form; a 4K row with 2K entries the gathered one."""
    assert reference._all_rows_hold_fewer(n_rows=64 + 32, n_slots=32 + 16, heads=4, dim=64)
    assert not reference._all_rows_hold_fewer(n_rows=4096 + 2048, n_slots=32 + 16, heads=4, dim=64)
