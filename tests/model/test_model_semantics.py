"""Semantic properties of the real model, checked through its public outputs (and a hook on ``model.embed`` /
``model.layers[i].attn`` to get gradients with respect to a layer's input or output):
causality, prefix consistency (no entry of an incomplete group is read), the exact token-dependency pattern of
compressed attention, document isolation in packed rows, gradient paths of shared KV, and the separation of
the indexer loss from the trunk.
"""

import pytest
import torch
import torch.nn.functional as F

from parallel.recompute import recompute  # noqa: E402
from tests.support.model_oracle import (DIMS, LAYOUTS, _one_thread, build_model, mk_layout,
                                        packed_doc_ids)  # noqa: E402,F401
from tests.support.oracle import random_params


def make(layout, seed=0, **dims_over):
    dims = dict(DIMS, **dims_over)
    P = random_params(dims, layout, seed=seed)
    return build_model(dims, layout, P), dims


def rand_ids(shape, seed, vocab=50):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def ce(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), ids[:, 1:].reshape(-1))


EXACT = dict(rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["m1", "m2", "m3", "mixed_cand", "cand_m2"])
def test_causality(name):
    model, dims = make(LAYOUTS[name])
    T = 19
    ids = rand_ids((2, T), 1)
    with torch.no_grad():
        ref = model(ids).logits
        for k in (1, 2, 4, 7, 12, 18):
            other = ids.clone()
            other[:, k:] = rand_ids((2, T - k), 100 + k)
            got = model(other).logits
            torch.testing.assert_close(got[:, :k], ref[:, :k], **EXACT, msg=lambda m: f"future tokens >= {k} leak: {m}")
            assert not torch.allclose(got[:, k:], ref[:, k:])


@pytest.mark.parametrize("name", ["m2", "m3", "mixed_cand", "cand_m2"])
def test_prefix_consistency(name):
    """The logits of a sequence of length T are those of the first T tokens of any longer sequence: in
    particular no entry is built from an incomplete group at the end of a sequence (T not a multiple of m)."""
    model, _ = make(LAYOUTS[name])
    ids = rand_ids((2, 20), 2)
    with torch.no_grad():
        full = model(ids).logits
        for T in (1, 2, 3, 5, 7, 10, 11, 13, 17):
            torch.testing.assert_close(model(ids[:, :T]).logits, full[:, :T], rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"prefix {T}: {m}")


def test_prefix_consistency_with_tied_indexer_scores():
    """The tiny preset's 4 index heads give many exactly tied (zero) indexer scores; the selection among them must
    not depend on how many tokens follow (it did with ``topk``'s length-dependent order: 0.75% on the logits)."""
    from model import ModelArgs, layout_from_config
    from model.cli import compose
    from model.transformer import Transformer

    cfg = compose(["model=tiny", "layout=v41_scaled", "model.kernel_backend=torch"])
    model = Transformer(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout), seed=0)
    ids = rand_ids((2, 192), 3, vocab=256)
    with torch.no_grad():
        full = model(ids).logits
        for T in (160, 191):
            prefix = model(ids[:, :T]).logits
            assert ((prefix - full[:, :T]).norm() / full[:, :T].norm()).item() < 1e-6, T


def _dependency(model, ids, doc_ids=None):
    """dep[t, u] = True when logits at t depend on the embedding at u (exact zero gradient otherwise)."""
    B, T = ids.shape
    assert B == 1
    delta = torch.zeros(1, T, model.args.dim, dtype=torch.float64, requires_grad=True)
    hook = model.embed.register_forward_hook(lambda mod, inp, out: out + delta)
    try:
        logits = model(ids, doc_ids).logits
    finally:
        hook.remove()
    r = torch.randn(logits.shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    dep = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        (g,) = torch.autograd.grad((logits[0, t].double() * r).sum(), delta, retain_graph=True)
        mag = g[0].abs().amax(-1)
        assert bool(((mag == 0) | (mag > 1e-9)).all()), f"query {t}: ambiguous tiny gradients {mag}"
        dep[t] = mag > 0
    return dep


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("lens", [None, [5, 1, 11]])
def test_token_dependencies_follow_complete_groups(m, lens):
    """With a window of 1 and top-k >= every entry, query t (doc-relative position p) sees another token u of
    its document only through compressed entries, i.e. exactly when u's group is complete: u//m < (p+1)//m.
    The last m-1 tokens of an incomplete group are never read by anyone but themselves; nothing crosses a
    document boundary. Layout: window-only, Full, Reindex, Reuse."""
    layout = mk_layout([0, m, m, m], [1], [1, 2])
    model, _ = make(layout, seed=3, window_size=1, index_topk=64)
    T = 17
    ids = rand_ids((1, T), 4)
    doc = packed_doc_ids(1, T, [lens]) if lens else None
    dep = _dependency(model, ids, doc)
    starts = [0] + list(torch.tensor(lens).cumsum(0)[:-1].tolist()) if lens else [0]
    start_of = [max(s for s in starts if s <= t) for t in range(T)]
    expected = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        for u in range(T):
            if start_of[u] != start_of[t]:
                continue
            p, q = t - start_of[t], u - start_of[u]
            expected[t, u] = (u == t) or (q // m < (p + 1) // m)
    assert torch.equal(dep, expected), f"dependency mismatch at {(dep != expected).nonzero().tolist()}"


@pytest.mark.parametrize("name,lens", [("m3", [6, 1, 10]), ("mixed_cand", [9, 2, 12]), ("cand_m2", [4, 13, 6])])
def test_packed_documents_are_isolated(name, lens):
    model, _ = make(LAYOUTS[name], seed=4)
    T = sum(lens)
    ids = rand_ids((1, T), 5)
    doc = packed_doc_ids(1, T, [lens])
    bounds = [0] + torch.tensor(lens).cumsum(0).tolist()
    with torch.no_grad():
        ref = model(ids, doc).logits
        for d in range(len(lens)):
            s, e = bounds[d], bounds[d + 1]
            other = ids.clone()
            other[:, s:e] = rand_ids((1, e - s), 50 + d)
            got = model(other, doc).logits
            keep = torch.ones(T, dtype=torch.bool)
            keep[s:e] = False
            torch.testing.assert_close(got[:, keep], ref[:, keep], **EXACT,
                                       msg=lambda m: f"changing document {d} changed another document: {m}")
            # doc-relative: a document computes the same thing alone
            alone = model(ids[:, s:e]).logits
            torch.testing.assert_close(ref[:, s:e], alone, rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"document {d} packed vs alone: {m}")


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("reader", ["reuse", "reindex"])
def test_reader_loss_reaches_full_compressor(m, reader):
    """Layer 0 is Full, layer 1 reads its KV. With layer 0's own attention output switched off (wo_b = 0),
    the compressor of layer 0 influences the loss only through layer 1's attention: its gradient is nonzero,
    and it vanishes when layer 1's output is switched off too."""
    layout = mk_layout([m, m], [0], [0, 1] if reader == "reindex" else [0])
    model, _ = make(layout, seed=6)
    ids = rand_ids((2, 13), 7)
    comp = {n: p for n, p in model.named_parameters() if n.startswith("layers.0.attn.compressor.")}
    assert ("layers.0.attn.compressor.wgate.weight" in comp) == (m > 1)
    with torch.no_grad():
        model.get_submodule("layers.0.attn.wo_b").weight.zero_()
    loss = ce(model(ids).logits, ids)
    grads = torch.autograd.grad(loss, list(comp.values()))
    for n, g in zip(comp, grads):
        assert g.abs().max() > 1e-8, f"{n} gets no gradient from the {reader} layer reading its KV"
    # a loss on layer 1's attention output (after its output projection) alone also reaches it
    captured = {}
    attn = model.get_submodule("layers.1.attn")
    hook = attn.register_forward_hook(lambda mod, inp, out: captured.update(o=out[0]))  # out: (output, produced)
    model(ids)
    hook.remove()
    grads = torch.autograd.grad(captured["o"].pow(2).sum(), list(comp.values()))
    for n, g in zip(comp, grads):
        assert g.abs().max() > 1e-8, n
    with torch.no_grad():
        model.get_submodule("layers.1.attn.wo_b").weight.zero_()
    grads = torch.autograd.grad(ce(model(ids).logits, ids), list(comp.values()), allow_unused=True)
    for n, g in zip(comp, grads):
        assert g is None or g.abs().max() == 0, n


@pytest.mark.parametrize("name,lens", [("mixed_cand", [[9, 14], [23]]), ("m2", None), ("cand_m2", [[5, 18], [23]])])
def test_indexer_loss_changes_no_trunk_gradient(name, lens):
    layout = LAYOUTS[name]
    model, _ = make(layout, seed=8)
    T = 23
    ids = rand_ids((2, T), 9)
    doc = packed_doc_ids(2, T, lens) if lens else None
    params = dict(model.named_parameters())
    names = list(params)
    is_indexer = {n: ".attn.indexer." in n for n in names}
    assert any(is_indexer.values())

    def grads(loss):
        gs = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True, retain_graph=True)
        return {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, gs)}

    out = model(ids, doc)
    assert sorted(out.indexer_losses) == sorted(layout["index_source_layer_ids"])
    for s, v in out.indexer_losses.items():
        assert v.dim() == 0 and torch.isfinite(v) and v.item() >= 0, (s, v)
    lm = ce(out.logits, ids)
    kl = sum(out.indexer_losses.values())
    g_lm, g_all, g_kl = grads(lm), grads(lm + kl), grads(kl)
    for n in names:
        if is_indexer[n]:
            assert g_lm[n].abs().max() == 0, f"LM loss reaches indexer parameter {n}"
            assert g_kl[n].abs().max() > 0, f"indexer loss does not reach {n}"
        else:
            assert g_kl[n].abs().max() == 0, f"indexer loss reaches trunk parameter {n}"
            torch.testing.assert_close(g_all[n], g_lm[n], rtol=0, atol=0, msg=lambda m: n)
    # the index keys are owned by the Full layer: a Reindex layer's KL reaches the owner's wk / k_norm
    reindex = [s for s in layout["index_source_layer_ids"] if s not in layout["kv_source_layer_ids"]]
    for s in reindex:
        kv = max(j for j in layout["kv_source_layer_ids"] if j <= s
                 and layout["compress_ratios"][j] == layout["compress_ratios"][s])
        g = grads(out.indexer_losses[s])
        for part in ("wk.weight", "k_norm.weight"):
            assert g[f"layers.{kv}.attn.indexer.{part}"].abs().max() > 0, (s, part)
        for n in names:
            if is_indexer[n] and n.startswith(f"layers.{s}."):
                assert g[n].abs().max() > 0, n
            elif not is_indexer[n] or not (n.startswith(f"layers.{s}.") or n.startswith(f"layers.{kv}.")):
                assert g[n].abs().max() == 0, f"KL of layer {s} reaches {n}"


# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep_attention", [False, True])
def test_recompute_changes_no_gradient(keep_attention):
    """Recomputing every layer in the backward (``parallel.recompute``), plain or as a selective checkpoint that
    keeps the sparse-attention outputs (``parallel.keep_attention_layers``; the PyTorch reference has no attention
    op to keep, so it recomputes everything), gives bitwise the loss and every gradient of no recomputation."""
    model, _ = make(LAYOUTS["mixed_cand"])
    ids = rand_ids((2, 19), 5)

    def loss_and_grads():
        model.zero_grad()
        out = model(ids, packed_doc_ids(2, 19, [[11, 8], [19]]))
        loss = ce(out.logits, ids) + sum(out.indexer_losses.values())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = loss_and_grads()
    for block in model.layers.values():
        recompute(block, keep_attention)
    loss, got = loss_and_grads()
    assert torch.equal(loss, want_loss)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_grouped_output_projection_has_its_own_layout_backward():
    """The grouped output projection (``GroupedLowRank``) against a plain einsum's autograd in fp64, values and both
    gradients, with the input's gradient in the input's own layout (tokens slowest): autograd's backward of the
    transposed batched matmul gives it tokens fastest, a transposing copy of the attention output's gradient per
    layer. Catches a group's slice or weight mixed up, and a gradient left transposed."""
    from model.attention import GroupedLowRank
    N, G, K, R = 13, 4, 6, 3
    x = torch.randn(N, G, K, dtype=torch.float64, requires_grad=True)
    w = torch.randn(G * R, K, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(N, G * R, dtype=torch.float64)
    # the projection's consumer reads low^T [G, R, N] as [N, G*R] (a transposed view), as F.linear(low.t(), wo_b) does
    got = GroupedLowRank.apply(x, w, R)
    dx, dw = torch.autograd.grad(got.reshape(G * R, N).t(), (x, w), grad)
    want = torch.einsum("ngk,grk->grn", x, w.view(G, R, K))
    want_dx, want_dw = torch.autograd.grad(want.reshape(G * R, N).t(), (x, w), grad)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    assert torch.allclose(dx, want_dx, rtol=1e-12, atol=1e-12) and torch.allclose(dw, want_dw, rtol=1e-12, atol=1e-12)
    assert dx.is_contiguous() and dx.stride() == x.stride()
