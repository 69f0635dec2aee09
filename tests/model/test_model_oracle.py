"""The real model (``model/``) against the slow dense oracle (``tests/support/oracle.py``), and the oracle against a
second, vectorised reference written another way (masks, complex RoPE, reshaped compression).

Shapes are tiny; selections are checked to be unambiguous (a gap at every top-k / candidate-block boundary)
so the discrete choices of both sides must agree.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.model_oracle import DIMS, LAYOUTS, _one_thread, _pick_params, build_model, packed_doc_ids
from tests.support.oracle import layer_plan, oracle_forward, random_params


# ----------------------------------------------------------------------------------------------------------
# a second reference, vectorised with masks (single document per row)
# ----------------------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _freqs_cis(dims, yarn, T):
    rd = dims["rope_head_dim"]
    base = dims["compress_rope_theta"] if yarn else dims["rope_theta"]
    freqs = base ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    if yarn:
        def cd(r):
            return rd * math.log(dims["original_seq_len"] / (r * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = max(math.floor(cd(dims["beta_fast"])), 0), min(math.ceil(cd(dims["beta_slow"])), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        freqs = torch.where(ramp > 0, freqs * (1 - ramp) + freqs / dims["rope_factor"] * ramp, freqs)
    return torch.polar(torch.ones(T, rd // 2, dtype=torch.float64), torch.outer(torch.arange(T).double(), freqs))


def _rope_c(x, cis):
    """x [B,N,...,d], cis [N, rd/2] complex; complex multiplication on the last rd dims."""
    rd = cis.shape[-1] * 2
    tail = torch.view_as_complex(x[..., -rd:].reshape(*x.shape[:-1], rd // 2, 2).contiguous())
    c = cis.view(1, cis.shape[0], *([1] * (x.dim() - 3)), rd // 2)
    return torch.cat([x[..., :-rd], torch.view_as_real(tail * c).flatten(-2)], -1)


def vectorised_reference(P, dims, layout, ids):
    B, T = ids.shape
    eps, H, hd = dims["norm_eps"], dims["n_heads"], dims["head_dim"]
    Hi, Di, G, W, K = dims["index_n_heads"], dims["index_head_dim"], dims["o_groups"], dims["window_size"], dims["index_topk"]
    bs, keep = layout["candidate_block_size"], layout["candidate_topk_blocks"]
    plan = layer_plan(layout)
    tpos = torch.arange(T)
    win_mask = (tpos[None, :] <= tpos[:, None]) & (tpos[None, :] > tpos[:, None] - W)  # [T,T]
    latents, index_k, sel_mask, scores, blocks, targets = {}, {}, {}, {}, {}, {}
    h = P["embed.weight"][ids]
    for i, info in enumerate(plan):
        a = f"layers.{i}.attn."
        m = info["m"]
        cis = _freqs_cis(dims, m > 0, T)
        x = _rms(h, P[f"layers.{i}.attn_norm.weight"], eps)
        qr = _rms(x @ P[a + "wq_a.weight"].t(), P[a + "q_norm.weight"], eps)
        q = _rope_c((qr @ P[a + "wq_b.weight"].t()).view(B, T, H, hd), cis)
        kvw = _rope_c(_rms(x @ P[a + "wkv.weight"].t(), P[a + "kv_norm.weight"], eps), cis)
        keys, mask = kvw, win_mask[None].expand(B, T, T)
        if m > 0:
            n = T // m
            ecis = cis[torch.arange(n) * m]
            if info["mode"] == "full":
                C = (x[:, :n * m] @ P[a + "compressor.wkv.weight"].t()).unflatten(1, (n, m))
                if m > 1:
                    Z = (x[:, :n * m] @ P[a + "compressor.wgate.weight"].t()).unflatten(1, (n, m))
                    C = (C * Z.softmax(dim=2)).sum(2)
                else:
                    C = C.squeeze(2)
                latents[i] = _rms(C, P[a + "compressor.norm.weight"], eps)
                index_k[i] = _rope_c(_rms(latents[i].detach() @ P[a + "indexer.wk.weight"].t(),
                                          P[a + "indexer.k_norm.weight"], eps), ecis)
            kvc = _rope_c(latents[info["kv_src"]], ecis)
            nvis = (tpos + 1) // m  # [T]
            vis = torch.arange(n)[None, :] < nvis[:, None]  # [T,n]
            if info["mode"] in ("full", "reindex"):
                qi = _rope_c((qr.detach() @ P[a + "indexer.wq_b.weight"].t()).view(B, T, Hi, Di), cis)
                w = (x.detach() @ P[a + "indexer.weights_proj.weight"].t()) * (Di * Hi) ** -0.5
                I = torch.einsum("bth,bthn->btn", w, torch.relu(torch.einsum("bthd,bnd->bthn", qi, index_k[info["kv_src"]])))
                allowed = vis[None].expand(B, T, n)
                if info["restricted_by"] is not None:
                    allowed = allowed & blocks[info["restricted_by"]]
                masked = I.detach().masked_fill(~allowed, -math.inf)
                kk = min(K, n)
                if kk > 0:
                    vals, idx = masked.topk(kk, dim=-1)
                    sm = torch.zeros(B, T, n, dtype=torch.bool).scatter(-1, idx, vals > -math.inf)
                else:
                    sm = torch.zeros(B, T, n, dtype=torch.bool)
                sel_mask[i], scores[i] = sm, I
                if i == layout["candidate_source_layer_id"]:
                    nb = -(-n // bs)
                    pad = masked.new_full((B, T, nb * bs), -math.inf)
                    pad[..., :n] = masked
                    bmax = pad.view(B, T, nb, bs).amax(-1)
                    newest = ((nvis - 1).clamp(min=0) // bs)[None, :, None].expand(B, T, 1)
                    bmax = bmax.scatter(-1, newest, math.inf)
                    bmax = torch.where(nvis[None, :, None] > 0, bmax, torch.full_like(bmax, -math.inf))
                    kb = min(keep, nb)
                    bv, bi = bmax.topk(kb, dim=-1) if kb else (bmax[..., :0], bmax[..., :0].long())
                    bsel = torch.zeros(B, T, nb, dtype=torch.bool).scatter(-1, bi, bv > -math.inf)
                    blocks[i] = bsel.repeat_interleave(bs, dim=-1)[..., :n]
            smask = sel_mask[info["idx_src"]]
            keys = torch.cat([kvw, kvc], 1)
            mask = torch.cat([mask, smask], -1)
        logits = torch.einsum("bthd,bjd->bhtj", q, keys) * hd ** -0.5
        logits = logits.masked_fill(~mask[:, None], -math.inf)
        sink = P[a + "attn_sink"].view(1, H, 1, 1).expand(B, H, T, 1)
        prob = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
        o = torch.einsum("bhtj,bjd->bthd", prob, keys)
        if m > 0:
            mass = prob[..., T:].detach().sum(1)  # [B,T,n]
            norm = mass.sum(-1, keepdim=True)
            targets.setdefault(info["idx_src"], []).append(torch.where(norm > 0, mass / norm.clamp(min=1e-300), 0))
        o = _rope_c(o, cis.conj())
        og = o.reshape(B, T, G, H // G * hd)
        woa = P[a + "wo_a.weight"].view(G, -1, H // G * hd)
        h = h + torch.einsum("btgk,gok->btgo", og, woa).flatten(2) @ P[a + "wo_b.weight"].t()
        y = _rms(h, P[f"layers.{i}.ffn_norm.weight"], eps)
        f = f"layers.{i}.ffn."
        h = h + (F.silu(y @ P[f + "w1.weight"].t()) * (y @ P[f + "w3.weight"].t())) @ P[f + "w2.weight"].t()
    out = _rms(h, P["norm.weight"], eps) @ P["head.weight"].t()
    losses = {}
    for s in layout["index_source_layer_ids"]:
        sm = sel_mask[s]
        p = torch.stack(targets[s]).mean(0)
        logq = scores[s].masked_fill(~sm, -math.inf).log_softmax(-1)
        kl = torch.where(sm, p * (p.clamp(min=1e-300).log() - logq), 0).sum(-1)
        has = sm.any(-1)
        losses[s] = kl[has].sum() / has.sum() if has.any() else torch.zeros((), dtype=torch.float64)
    return out, losses


def _grads(loss, params):
    names = [n for n, p in params.items()]
    gs = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    return {n: (torch.zeros_like(params[n]) if g is None else g) for n, g in zip(names, gs)}


def _objective(logits, losses, ids):
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)) if ids.shape[1] > 1 \
        else logits.sum() * 1e-3
    return ce + sum(losses.values())


# ----------------------------------------------------------------------------------------------------------
# oracle self-checks (no model needed)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,T,topk,window", [
    ("m1", 9, 64, 64), ("m2", 9, 64, 64), ("m3", 11, 64, 64),  # dense: everything visible is read
    ("m2", 23, 4, 8), ("m3", 23, 3, 5), ("mixed_cand", 23, 4, 8), ("cand_m2", 29, 3, 8),  # sparse
    ("cand_full", 23, 4, 8),
])
def test_oracle_matches_vectorised_reference(name, T, topk, window):
    dims = dict(DIMS, index_topk=topk, window_size=window)
    layout = LAYOUTS[name]
    ids = torch.randint(0, dims["vocab_size"], (2, T), generator=torch.Generator().manual_seed(T))
    P, _ = _pick_params(dims, layout, ids)
    lo, so = oracle_forward(P, dims, layout, ids)
    lv, sv = vectorised_reference(P, dims, layout, ids)
    torch.testing.assert_close(lo, lv, rtol=1e-10, atol=1e-10)
    assert so.keys() == sv.keys()
    for s in so:
        torch.testing.assert_close(so[s], sv[s], rtol=1e-10, atol=1e-12)
        assert so[s].item() >= 0
    go, gv = _grads(_objective(lo, so, ids), P), _grads(_objective(lv, sv, ids), P)
    for n in P:
        torch.testing.assert_close(go[n], gv[n], rtol=1e-8, atol=1e-10, msg=lambda m: f"{n}: {m}")


def test_oracle_sparsity_is_real():
    """In the sparse configs the top-k and the candidate blocks really restrict (otherwise the checks above
    would not test them)."""
    dims = dict(DIMS, index_topk=4, window_size=8)
    layout = LAYOUTS["mixed_cand"]
    T = 23
    ids = torch.randint(0, 50, (1, T), generator=torch.Generator().manual_seed(1))
    P, diag = _pick_params(dims, layout, ids)
    sel = diag["selections"]
    # layer 3 (m=1 Full, candidate source), layer 4 (Reindex restricted to 2 blocks of 2 entries)
    assert any(len(sel[(3, 0, t)]) == 4 and t + 1 > 4 for t in range(T))
    blocks = diag["blocks"]
    for t in range(T):
        allowed = {j for b in blocks[(3, 0, t)] for j in range(2 * b, 2 * b + 2) if j <= t}
        assert set(sel[(4, 0, t)]) <= allowed
        assert len(sel[(4, 0, t)]) == min(4, len(allowed))
        assert t // 2 in blocks[(3, 0, t)]  # the newest visible entry's block is always kept
    assert any(set(sel[(4, 0, t)]) != set(sel[(3, 0, t)]) for t in range(T))
    assert any(not set(sel[(3, 0, t)]) <= {j for b in blocks[(3, 0, t)] for j in range(2 * b, 2 * b + 2)}
               for t in range(T))


def test_oracle_packing_is_doc_relative():
    dims = dict(DIMS)
    layout = LAYOUTS["mixed_cand"]
    lens = [7, 1, 12, 5]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (1, sum(lens)), generator=g)
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)])[None]
    P = random_params(dims, layout, seed=5)
    with torch.no_grad():
        packed, _ = oracle_forward(P, dims, layout, ids, doc)
        s = 0
        for n in lens:
            alone, _ = oracle_forward(P, dims, layout, ids[:, s:s + n])
            torch.testing.assert_close(packed[:, s:s + n], alone, rtol=1e-12, atol=1e-12)
            s += n


def run_model(model, ids, doc_ids=None):
    """(full-precision logits captured at the head, the returned logits, indexer losses)."""
    captured = {}
    hook = model.head.register_forward_hook(lambda mod, inp, out: captured.setdefault("logits", out))
    try:
        out = model(ids, doc_ids)
    finally:
        hook.remove()
    return captured["logits"], out.logits, out.indexer_losses


# Agreement of the fp64 model with the fp64 oracle, as a fraction of each tensor's largest magnitude: the model
# computes in at least fp32 (fp64 stays fp64), so only fp64 rounding separates the two.
TOL64_REL = 1e-10
TOL32_REL = 2e-4


def assert_close_rel(actual, expected, tol, what=""):
    """max |actual - expected| <= tol * max |expected| (+ a tiny floor for all-zero tensors)."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    ref = expected.abs().max().item() if expected.numel() else 0.0
    assert err <= tol * ref + 1e-12, f"{what}: max abs error {err:.3e} vs max magnitude {ref:.3e} (tol {tol:g})"


def assert_losses_and_grads_close(model, P, ids, got, want, tol):
    """The model's indexer losses and the gradients of the objective (``_objective`` of its logits and losses, ``got``)
    against the oracle's (``want``), each within ``tol`` relative."""
    (logits, losses), (oracle_logits, oracle_losses) = got, want
    for s in oracle_losses:
        assert_close_rel(losses[s], oracle_losses[s], tol, f"indexer loss of layer {s}")
    gm = _grads(_objective(logits, losses, ids), dict(model.named_parameters()))
    go = _grads(_objective(oracle_logits, oracle_losses, ids), P)
    for n in P:
        assert_close_rel(gm[n], go[n], tol, f"grad of {n}")


CASES = [
    # (layout, T, doc lengths per row or None, topk, window)
    ("m1", 1, None, 4, 8), ("m2", 1, None, 4, 8), ("m3", 1, None, 4, 8),
    ("m1", 5, None, 4, 8), ("m2", 5, None, 4, 8), ("m3", 5, None, 4, 8),
    ("m1", 23, None, 4, 8), ("m2", 23, None, 4, 8), ("m3", 23, None, 3, 8),
    ("m2", 23, [[7, 1, 12, 3], [23]], 4, 8), ("m3", 23, [[2, 14, 7], [11, 12]], 3, 5),
    ("m1", 23, [[9, 14], [1, 22]], 4, 8),
    ("mixed_cand", 23, None, 4, 8), ("mixed_cand", 40, [[17, 23], [40]], 4, 8),
    ("cand_m2", 40, None, 3, 8), ("cand_m2", 40, [[25, 15], [3, 37]], 3, 6),
    ("cand_full", 31, None, 4, 8), ("cand_full", 40, [[17, 23], [40]], 4, 8),
]


@pytest.mark.parametrize("name,T,lens,topk,window", CASES)
def test_model_matches_oracle_fp64(name, T, lens, topk, window):
    dims = dict(DIMS, index_topk=topk, window_size=window)
    layout = LAYOUTS[name]
    B = 2
    ids = torch.randint(0, dims["vocab_size"], (B, T), generator=torch.Generator().manual_seed(7 * T + topk))
    doc = packed_doc_ids(B, T, lens) if lens else None
    P, _ = _pick_params(dims, layout, ids, doc, min_gap=1e-4)
    model = build_model(dims, layout, P)
    lm_full, lm, sm = run_model(model, ids, doc)
    lo, so = oracle_forward(P, dims, layout, ids, doc)
    assert lm.dtype == torch.float64 and lm.shape == (B, T, dims["vocab_size"])
    assert_close_rel(lm_full, lo, TOL64_REL, "logits")
    assert_close_rel(lm, lo, TOL64_REL, "returned logits")
    assert sorted(sm) == sorted(so), (sorted(sm), sorted(so))
    assert_losses_and_grads_close(model, P, ids, (lm_full, sm), (lo, so), TOL64_REL)


@pytest.mark.parametrize("name,T,lens", [("mixed_cand", 23, [[9, 14], [23]]), ("m3", 17, None)])
def test_model_matches_oracle_fp32(name, T, lens):
    dims = dict(DIMS)
    layout = LAYOUTS[name]
    B = 2
    ids = torch.randint(0, dims["vocab_size"], (B, T), generator=torch.Generator().manual_seed(11))
    doc = packed_doc_ids(B, T, lens) if lens else None
    P, _ = _pick_params(dims, layout, ids, doc, min_gap=1e-3)
    P = {n: p.detach().float().double().requires_grad_(True) for n, p in P.items()}  # fp32-representable
    model = build_model(dims, layout, P, dtype=torch.float32)
    _, lm, sm = run_model(model, ids, doc)
    lo, so = oracle_forward(P, dims, layout, ids, doc)
    assert_close_rel(lm, lo, TOL32_REL, "logits")
    assert_losses_and_grads_close(model, P, ids, (lm, sm), (lo, so), TOL32_REL)
