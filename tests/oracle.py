"""A slow, obvious dense reference ("oracle") of the CSA2 model, written from SPEC.md and docs/DESIGN.md.

It shares nothing with ``model/`` or ``kernels/``: it takes a dict of parameters named like the model's
state_dict, a dict of dims (ModelArgs field names), a dict describing the layout (Layout field names) and
the inputs. Everything is computed per row, per document, per query with explicit index lists, in the
dtype of the parameters (use float64 for tight comparisons). Differentiable through ``params``.

Conventions (SPEC §1, DESIGN "Packed sequences"):
- every document is processed as if it were alone (doc-relative positions, compression groups, window,
  entry visibility, candidate blocks); nothing crosses a document boundary;
- the candidate source's own top-k is over all its visible entries; every index source after it (Full or
  Reindex, same ratio: the reference's rule) scores only the visible entries of its own KV inside the candidate
  blocks of the candidate source (same query);
- the indexer loss of an index source is averaged over all queries of the batch that select >= 1 entry;
  if no query selects anything, the loss is 0.
"""
from __future__ import annotations

import math

import torch

__all__ = ["oracle_forward", "layer_plan", "rope_freqs", "doc_segments", "param_shapes", "random_params"]


# ----------------------------------------------------------------------------------------------------------
# layout
# ----------------------------------------------------------------------------------------------------------
def layer_plan(layout: dict) -> list[dict]:
    """Per layer: m, mode ('window' | 'full' | 'reindex' | 'reuse'), kv_src, idx_src, restricted_by."""
    ratios = list(layout["compress_ratios"])
    kv_ids = set(layout["kv_source_layer_ids"])
    idx_ids = set(layout["index_source_layer_ids"])
    cand = layout.get("candidate_source_layer_id")
    plan = []
    for i, m in enumerate(ratios):
        if m == 0:
            plan.append(dict(m=0, mode="window", kv_src=None, idx_src=None, restricted_by=None))
            continue
        if i in kv_ids:
            mode = "full"
        elif i in idx_ids:
            mode = "reindex"
        else:
            mode = "reuse"
        kv_src = max(j for j in kv_ids if j <= i and ratios[j] == m)
        idx_src = max(j for j in idx_ids if j <= i)
        if idx_src < i:
            assert plan[idx_src]["kv_src"] == kv_src, f"layer {i}: its index source {idx_src} reads another KV"
        restricted_by = None
        if mode in ("full", "reindex") and cand is not None and i > cand:
            assert m == ratios[cand], f"layer {i}: candidate blocks of layer {cand} index entries of another ratio"
            restricted_by = cand
        plan.append(dict(m=m, mode=mode, kv_src=kv_src, idx_src=idx_src, restricted_by=restricted_by))
    return plan


def doc_segments(doc_row: torch.Tensor) -> list[tuple[int, int]]:
    """Runs of equal consecutive ids -> [(start, end)]."""
    ids = doc_row.tolist()
    segs, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or ids[t] != ids[t - 1]:
            segs.append((start, t))
            start = t
    return segs


# ----------------------------------------------------------------------------------------------------------
# elementary pieces
# ----------------------------------------------------------------------------------------------------------
def rms_norm(x, w, eps):
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(dt)).to(x.dtype)


def rope_freqs(rope_dim: int, theta: float, yarn: bool, dims: dict) -> torch.Tensor:
    """freq_i = theta^(-2i/rope_dim), i < rope_dim/2; with YaRN (DeepSeek-V3 style, always on)."""
    i = torch.arange(0, rope_dim, 2, dtype=torch.float64)
    freqs = 1.0 / theta ** (i / rope_dim)
    if yarn:
        orig, factor = dims["original_seq_len"], dims["rope_factor"]

        def corr_dim(n_rot):
            return rope_dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corr_dim(dims["beta_fast"])), 0)
        high = min(math.ceil(corr_dim(dims["beta_slow"])), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope(x, pos, freqs, inverse=False):
    """Rotate the last 2*len(freqs) dims of x[n, ..., d] in adjacent pairs by angle pos[n]*freq."""
    rd = 2 * freqs.numel()
    ang = pos.to(torch.float64)[:, None] * freqs[None, :]
    if inverse:
        ang = -ang
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [rd // 2]
    cos = ang.cos().to(x.dtype).view(shape)
    sin = ang.sin().to(x.dtype).view(shape)
    nope, r = x[..., : x.shape[-1] - rd], x[..., x.shape[-1] - rd:]
    a, b = r[..., 0::2], r[..., 1::2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([nope, rot], dim=-1)


def linear(x, w):
    return x @ w.t()


# ----------------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------------
def oracle_forward(params: dict, dims: dict, layout: dict, input_ids: torch.Tensor, doc_ids=None, diag=None):
    """Returns (logits [B,T,V], {index source layer id: scalar KL}).

    ``diag`` (optional dict) receives ``topk_margin`` and ``block_margin``: the smallest score gap at a
    selection boundary (k-th vs (k+1)-th best), so tests can check that the selection is unambiguous, and
    ``selections``: {(layer, b, t): sorted list of selected doc-relative entry indices}.
    """
    P = params
    B, T = input_ids.shape
    if doc_ids is None:
        doc_ids = torch.zeros_like(input_ids)
    eps = dims["norm_eps"]
    H, hd, rd = dims["n_heads"], dims["head_dim"], dims["rope_head_dim"]
    Hi, Di = dims["index_n_heads"], dims["index_head_dim"]
    G, ol = dims["o_groups"], dims["o_lora_rank"]
    W, topk = dims["window_size"], dims["index_topk"]
    bs = layout.get("candidate_block_size", 8)
    keep_blocks = layout.get("candidate_topk_blocks", 0)
    cand_src = layout.get("candidate_source_layer_id")
    scale = hd ** -0.5
    plan = layer_plan(layout)
    n_layers = len(plan)
    freqs_window = rope_freqs(rd, dims["rope_theta"], False, dims)
    freqs_comp = rope_freqs(rd, dims["compress_rope_theta"], True, dims)
    segs = [doc_segments(doc_ids[b]) for b in range(B)]
    if diag is not None:
        diag.setdefault("topk_margin", math.inf)
        diag.setdefault("block_margin", math.inf)
        diag.setdefault("selections", {})

    # shared[(layer, b, seg)] = {"latent", "index_k", "sel": [LongTensor per query], "student": [...],
    #                            "blocks": [set per query]}
    shared: dict = {}
    # target[(s, b, seg, t)] = list of reader distributions over s's selected slots (detached)
    target: dict = {}

    h = P["embed.weight"][input_ids]  # [B,T,D]
    for i in range(n_layers):
        pre = f"layers.{i}."
        a = pre + "attn."
        info = plan[i]
        m = info["m"]
        freqs = freqs_comp if m > 0 else freqs_window
        x = rms_norm(h, P[pre + "attn_norm.weight"], eps)
        rows = []
        for b in range(B):
            parts = []
            for si, (s0, s1) in enumerate(segs[b]):
                xd = x[b, s0:s1]
                L = s1 - s0
                pos = torch.arange(L)
                # --- every layer's own parts
                qr = rms_norm(linear(xd, P[a + "wq_a.weight"]), P[a + "q_norm.weight"], eps)
                q = rope(linear(qr, P[a + "wq_b.weight"]).view(L, H, hd), pos, freqs)
                kv_win = rope(rms_norm(linear(xd, P[a + "wkv.weight"]), P[a + "kv_norm.weight"], eps), pos, freqs)
                sel = None
                if m > 0:
                    n_ent = L // m
                    gpos = torch.arange(n_ent) * m
                    # --- main KV (+ index K) of a Full layer
                    if info["mode"] == "full":
                        C = linear(xd, P[a + "compressor.wkv.weight"])
                        if m > 1:
                            Z = linear(xd, P[a + "compressor.wgate.weight"])
                        entries = []
                        for g in range(n_ent):
                            if m == 1:
                                entries.append(C[g])
                            else:
                                wts = torch.softmax(Z[g * m:(g + 1) * m], dim=0)  # per channel over the group
                                entries.append((wts * C[g * m:(g + 1) * m]).sum(0))
                        raw = torch.stack(entries) if entries else C.new_zeros(0, hd)
                        latent = rms_norm(raw, P[a + "compressor.norm.weight"], eps)
                        k_idx = rms_norm(linear(latent.detach(), P[a + "indexer.wk.weight"]),
                                         P[a + "indexer.k_norm.weight"], eps)
                        k_idx = rope(k_idx, gpos, freqs)
                        shared[(i, b, si)] = {"latent": latent, "index_k": k_idx}
                    src = shared[(info["kv_src"], b, si)]
                    kv_comp = rope(src["latent"], gpos, freqs)
                    # --- selection (Full / Reindex)
                    if info["mode"] in ("full", "reindex"):
                        me = shared.setdefault((i, b, si), {})
                        k_idx = src["index_k"]
                        q_idx = rope(linear(qr.detach(), P[a + "indexer.wq_b.weight"]).view(L, Hi, Di), pos, freqs)
                        w_idx = linear(xd.detach(), P[a + "indexer.weights_proj.weight"]) * (Di ** -0.5 * Hi ** -0.5)
                        me["sel"], me["student"] = [], []
                        if i == cand_src:
                            me["blocks"] = []
                        for t in range(L):
                            n_vis = (t + 1) // m
                            allowed = list(range(n_vis))
                            if info["restricted_by"] is not None:
                                blocks = shared[(info["restricted_by"], b, si)]["blocks"][t]
                                allowed = [j for j in allowed if j // bs in blocks]
                            idx = torch.tensor(allowed, dtype=torch.long)
                            if len(allowed) == 0:
                                me["sel"].append(idx)
                                me["student"].append(None)
                                if i == cand_src:
                                    me["blocks"].append(set())
                                continue
                            dots = q_idx[t] @ k_idx[idx].t()  # [Hi, n_allowed]
                            score = (w_idx[t][:, None] * torch.relu(dots)).sum(0)  # [n_allowed]
                            k = min(topk, len(allowed))
                            order = torch.sort(score.detach(), descending=True).indices
                            top = order[:k]
                            if diag is not None and k < len(allowed):
                                sd = score.detach()
                                diag["topk_margin"] = min(diag["topk_margin"], float(sd[order[k - 1]] - sd[order[k]]))
                            me["sel"].append(idx[top])
                            me["student"].append(score[top])
                            if diag is not None:
                                diag["selections"][(i, b, s0 + t)] = sorted(idx[top].tolist())
                            if i == cand_src:
                                # doc-relative blocks of bs entries; block score = max of visible entries
                                assert len(allowed) == n_vis
                                n_blk = (n_vis + bs - 1) // bs
                                sd = score.detach()
                                bscore = torch.stack([sd[bb * bs:min((bb + 1) * bs, n_vis)].max() for bb in range(n_blk)])
                                newest = (n_vis - 1) // bs
                                bscore_forced = bscore.clone()
                                bscore_forced[newest] = math.inf
                                nkeep = min(keep_blocks, n_blk)
                                border = torch.sort(bscore_forced, descending=True).indices
                                me["blocks"].append(set(border[:nkeep].tolist()))
                                if diag is not None and nkeep < n_blk and nkeep >= 2:
                                    diag["block_margin"] = min(
                                        diag["block_margin"],
                                        float(bscore_forced[border[nkeep - 1]] - bscore_forced[border[nkeep]]))
                                if diag is not None and nkeep >= 1:
                                    diag.setdefault("blocks", {})[(i, b, s0 + t)] = sorted(border[:nkeep].tolist())
                    sel = shared[(info["idx_src"], b, si)]["sel"]
                # --- attention, per query (heads vectorised)
                sink = P[a + "attn_sink"]
                outs = []
                for t in range(L):
                    lo = max(0, t - W + 1)
                    keys = [kv_win[lo:t + 1]]
                    n_sel = 0
                    if sel is not None and sel[t].numel() > 0:
                        keys.append(kv_comp[sel[t]])
                        n_sel = sel[t].numel()
                    K = torch.cat(keys, 0)  # [n_keys, hd]; values = keys
                    s = (q[t] @ K.t()) * scale  # [H, n_keys]
                    lse = torch.logsumexp(torch.cat([s, sink.to(s.dtype)[:, None]], 1), dim=1)
                    prob = torch.exp(s - lse[:, None])  # sink only in the denominator
                    outs.append(prob @ K)  # [H, hd]
                    if n_sel > 0:
                        mass = prob[:, K.shape[0] - n_sel:].detach().sum(0)
                        target.setdefault((info["idx_src"], b, si, t), []).append(mass / mass.sum())
                o = rope(torch.stack(outs), pos, freqs, inverse=True)  # [L, H, hd]
                # --- grouped output projection
                hg = H // G
                wo_a = P[a + "wo_a.weight"]
                low = [linear(o[:, g * hg:(g + 1) * hg].reshape(L, hg * hd), wo_a[g * ol:(g + 1) * ol]) for g in range(G)]
                parts.append(linear(torch.cat(low, -1), P[a + "wo_b.weight"]))
            rows.append(torch.cat(parts, 0))
        h = h + torch.stack(rows)
        y = rms_norm(h, P[pre + "ffn_norm.weight"], eps)
        f = pre + "ffn."
        h = h + linear(torch.nn.functional.silu(linear(y, P[f + "w1.weight"])) * linear(y, P[f + "w3.weight"]),
                       P[f + "w2.weight"])
    logits = linear(rms_norm(h, P["norm.weight"], eps), P["head.weight"])

    # --- indexer losses
    losses = {}
    for s in sorted(set(layout["index_source_layer_ids"])):
        total, count = None, 0
        for b in range(B):
            for si, (s0, s1) in enumerate(segs[b]):
                me = shared[(s, b, si)]
                for t in range(s1 - s0):
                    if me["sel"][t].numel() == 0:
                        continue
                    p = torch.stack(target[(s, b, si, t)]).mean(0)
                    logq = torch.log_softmax(me["student"][t], dim=0)
                    kl = (p * (p.log() - logq)).sum()
                    total = kl if total is None else total + kl
                    count += 1
        losses[s] = total / count if count else torch.zeros((), dtype=logits.dtype)
    return logits, losses


# ----------------------------------------------------------------------------------------------------------
# parameters (for self-tests without the model)
# ----------------------------------------------------------------------------------------------------------
def param_shapes(dims: dict, layout: dict) -> dict:
    """Parameter names and shapes as the model's state_dict has them."""
    D, V, H, hd = dims["dim"], dims["vocab_size"], dims["n_heads"], dims["head_dim"]
    ql, G, ol, I = dims["q_lora_rank"], dims["o_groups"], dims["o_lora_rank"], dims["inter_dim"]
    Hi, Di = dims["index_n_heads"], dims["index_head_dim"]
    shapes = {"embed.weight": (V, D), "norm.weight": (D,), "head.weight": (V, D)}
    for i, info in enumerate(layer_plan(layout)):
        p = f"layers.{i}."
        a = p + "attn."
        shapes.update({
            p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,),
            p + "ffn.w1.weight": (I, D), p + "ffn.w2.weight": (D, I), p + "ffn.w3.weight": (I, D),
            a + "wq_a.weight": (ql, D), a + "q_norm.weight": (ql,), a + "wq_b.weight": (H * hd, ql),
            a + "wkv.weight": (hd, D), a + "kv_norm.weight": (hd,), a + "wo_a.weight": (G * ol, H * hd // G),
            a + "wo_b.weight": (D, G * ol), a + "attn_sink": (H,),
        })
        if info["mode"] == "full":
            shapes.update({a + "compressor.wkv.weight": (hd, D), a + "compressor.norm.weight": (hd,),
                           a + "indexer.wk.weight": (Di, hd), a + "indexer.k_norm.weight": (Di,)})
            if info["m"] > 1:
                shapes[a + "compressor.wgate.weight"] = (hd, D)
        if info["mode"] in ("full", "reindex"):
            shapes.update({a + "indexer.wq_b.weight": (Hi * Di, ql), a + "indexer.weights_proj.weight": (Hi, D)})
    return shapes


def random_params(dims: dict, layout: dict, seed: int = 0, dtype=torch.float64) -> dict:
    """Random leaf tensors (requires_grad) away from any init: norms ~ 1 +- 0.3, sinks ~ N(0,1)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in param_shapes(dims, layout).items():
        if name.endswith("attn_sink"):
            t = torch.randn(shape, generator=gen, dtype=torch.float64)
        elif len(shape) == 1:
            t = 1 + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif name == "embed.weight":
            t = torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float64) * shape[1] ** -0.5
        out[name] = t.to(dtype).requires_grad_(True)
    return out
