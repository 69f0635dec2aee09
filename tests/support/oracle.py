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

The V4.1 parts around the attention (SPEC §5), each off unless ``dims`` turns it on:
- MoE FFN: every routed expert runs on every token, with routing weight 0 where the biased top-k did not pick it
  (a dense sum, unlike the model's sorted dispatch), plus the shared expert;
- staggered mHC (``hc_mult`` > 1): the stream is [B,T,hc,D], copies mixed with explicit sums over copies;
- Engram before its layers, the table rows found by plain-int n-gram hashes of each document (``engram_hash_ids``),
  every token its own normalised id;
- the DSpark draft head's loss parts (``draft=True``), per anchor, on detached features of the streams entering
  its target layers.
"""
from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["oracle_forward", "layer_plan", "rope_freqs", "doc_segments", "param_shapes", "random_params",
           "engram_primes", "engram_hash_ids"]


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
# the V4.1 parts around the attention (SPEC §5)
# ----------------------------------------------------------------------------------------------------------
def one_hot_pre(X):
    """The first block's pre-mix [..., hc]: all on copy 0."""
    pre = torch.zeros(X.shape[:-1], dtype=X.dtype)
    pre[..., 0] = 1
    return pre


def collapse(X, pre):
    """sum_c pre_c X_c: X [..., hc, D], pre [..., hc] -> [..., D]."""
    return sum(pre[..., c, None] * X[..., c, :] for c in range(X.shape[-2]))


def expand(y, X, post, comb):
    """Copy k after a sublayer with output y [..., D]: post_k y + sum_j comb[j, k] X_j."""
    hc = X.shape[-2]
    return torch.stack([post[..., k, None] * y + sum(comb[..., j, k, None] * X[..., j, :] for j in range(hc))
                        for k in range(hc)], dim=-2)


def hc_mixes(X, fn, scale, base, iters, norm_eps, hc_eps):
    """(pre, post, comb [j, k]) of the stream X [..., hc, D]: one projection of the flattened copies over one RMS
    statistic of all hc*D values; sigmoids; a row softmax, then Sinkhorn starting with the columns."""
    hc = X.shape[-2]
    flat = X.flatten(-2)
    m = linear(flat, fn) / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logit = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.softmax(logit, dim=-1) + hc_eps

    def columns(c):  # divide every column k by its sum over j
        return c / (c.sum(-2, keepdim=True) + hc_eps)

    def rows(c):
        return c / (c.sum(-1, keepdim=True) + hc_eps)

    comb = columns(comb)
    for _ in range(iters - 1):
        comb = columns(rows(comb))
    return pre, post, comb


def block(P, p, X, pre, attn_branch, ffn_branch, dims):
    """One pre-norm block on the stream X [..., hc, D] (params under prefix p; the branches take the normed input).
    hc 1 (``pre`` None): x + attn, then + ffn. Otherwise staggered mHC: the attention collapses with ``pre`` (the
    previous block's FFN pre-mix), the FFN with this block's attention pre-mix; returns the FFN's pre-mix too."""
    eps = dims["norm_eps"]
    if pre is None:
        h = X[..., 0, :]
        h = h + attn_branch(rms_norm(h, P[p + "attn_norm.weight"], eps))
        h = h + ffn_branch(rms_norm(h, P[p + "ffn_norm.weight"], eps))
        return h.unsqueeze(-2), None
    mix = dims["hc_sinkhorn_iters"], eps, dims["hc_eps"]
    a_pre, a_post, a_comb = hc_mixes(X, P[p + "hc_attn_fn"], P[p + "hc_attn_scale"], P[p + "hc_attn_base"], *mix)
    X = expand(attn_branch(rms_norm(collapse(X, pre), P[p + "attn_norm.weight"], eps)), X, a_post, a_comb)
    f_pre, f_post, f_comb = hc_mixes(X, P[p + "hc_ffn_fn"], P[p + "hc_ffn_scale"], P[p + "hc_ffn_base"], *mix)
    X = expand(ffn_branch(rms_norm(collapse(X, a_pre), P[p + "ffn_norm.weight"], eps)), X, f_post, f_comb)
    return X, f_pre


def swiglu_expert(x, P, e, limit, weight, counts=None):
    """W2 (silu(min(W1 x, limit)) * clamp(W3 x, +-limit) * weight) (no clamp for limit 0); ``counts`` (4 ints) adds
    the hidden values past the limit where weight != 0: up above, up below, gate above, gate below."""
    g, u = linear(x, P[e + "w1.weight"]), linear(x, P[e + "w3.weight"])
    if limit > 0:
        if counts is not None:
            live = (weight != 0).expand_as(g)
            for n, v in enumerate((u > limit, u < -limit, g > limit, g < -limit)):
                counts[n] += int((v & live).sum())
        u = torch.clamp(u, -limit, limit)
        g = torch.clamp(g, max=limit)
    return linear(g * torch.sigmoid(g) * u * weight, P[e + "w2.weight"])


def ffn(P, f, y, dims, n_experts, k, diag=None):
    """The FFN under prefix f on y [..., D]: dense SwiGLU, or the MoE (``n_experts`` routed, top ``k``) computed
    densely: every routed expert on every token with weight 0 where not chosen, plus the shared expert."""
    if dims.get("ffn", "dense") == "dense":
        return swiglu_expert(y, P, f, 0, 1)
    args = dims["moe"]
    assert args["score_func"] == "sqrtsoftplus", "the oracle knows V4.1's score function only"
    x = y.reshape(-1, y.shape[-1])
    scores = torch.sqrt(torch.nn.functional.softplus(linear(x, P[f + "gate.weight"]) / args["gate_temp"]))
    biased = (scores + P[f + "gate.bias"]).detach()  # the bias picks experts, never weights them
    order = torch.sort(biased, dim=-1, descending=True).indices
    chosen = order[:, :k]
    picked = torch.zeros_like(scores).scatter(1, chosen, 1.0)
    w = scores * picked
    if args["norm_topk_prob"] and k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * args["route_scale"]
    if diag is not None:
        if k < n_experts:
            gap = biased.gather(1, order[:, k - 1:k]) - biased.gather(1, order[:, k:k + 1])
            diag["route_margin"] = min(diag["route_margin"], float(gap.min()))
        unbiased = torch.sort(scores.detach(), dim=-1, descending=True).indices[:, :k]
        changed = sum(set(a) != set(b) for a, b in zip(chosen.tolist(), unbiased.tolist()))
        diag["routes"][f[:-1]] = (chosen, changed)
    counts = diag["clamped"].setdefault(f[:-1], [0, 0, 0, 0]) if diag is not None else None
    out = sum(swiglu_expert(x, P, f"{f}experts.{e}.", args["swiglu_limit"], w[:, e:e + 1], counts)
              for e in range(n_experts))
    if args["n_shared_experts"]:
        out = out + swiglu_expert(x, P, f + "shared_experts.", args["swiglu_limit"], 1)
    return out.view(y.shape)


def engram_update(P, g, X, ids, eps, diag=None, layer=None):
    """X [B,T,hc,D] + gate_c * value, per copy c: the looked-up rows ids [B,T,cols] of the table, flattened, through
    wkv give one key per copy and one value; the gate is the signed square root of the scaled dot product of
    the copy and its key (each normalised over D on its own), through a sigmoid."""
    hc, D = X.shape[-2:]
    kv = linear(P[g + "embed.weight"][ids].flatten(-2), P[g + "wkv.weight"])
    value = kv[..., hc * D:]
    out, gates = [], []
    for c in range(hc):
        x, key = X[:, :, c], kv[..., c * D:(c + 1) * D]
        dot = (x * P[g + "q_weight"][c] * P[g + "k_weight"][c] * key).sum(-1)
        dot = dot / torch.sqrt(x.pow(2).mean(-1) + eps) / torch.sqrt(key.pow(2).mean(-1) + eps) / math.sqrt(D)
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(torch.clamp(dot.abs(), min=1e-6)))
        gates.append(gate.detach())
        out.append(x + gate[..., None] * value)
    if diag is not None:
        diag["engram_gates"][layer] = torch.stack(gates, -1)
    return torch.stack(out, dim=2)


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def engram_primes(vocab_size: int, n_layers: int, max_ngram: int, heads: int) -> list[list[list[int]]]:
    """[layer][n-gram size][head]: per n-gram size a search from vocab_size - 1, per head the next prime not drawn."""
    drawn, primes = set(), []
    for _ in range(n_layers):
        primes.append([])
        for _ in range(max_ngram - 1):
            prime, row = vocab_size - 1, []
            for _ in range(heads):
                prime += 1
                while not _is_prime(prime) or prime in drawn:
                    prime += 1
                drawn.add(prime)
                row.append(prime)
            primes[-1].append(row)
    return primes


def engram_hash_ids(tokens, doc_start, token_map, map_size, engram) -> list:
    """ids[b][t][layer][col] with plain ints (``engram``: a mapping or object with EngramArgs' fields): n-gram of
    size n at t = tokens t-n+1..t of its document, slots before the document's start the pad's normalised id; XOR
    of id * multiplier (odd, from numpy's default_rng(10007 * layer id)); mod the (n, head) prime; + its offset."""
    get = engram.get if isinstance(engram, dict) else lambda name: getattr(engram, name)
    layers, size, pad = list(get("layers")), get("max_ngram_size"), get("pad_id")
    primes = engram_primes(get("vocab_size"), len(layers), size, get("n_heads"))
    bound = ((2 ** 63 - 1) // map_size) // 2
    mult = [[int(v) * 2 + 1 for v in np.random.default_rng(10007 * layer).integers(0, bound, size=size, dtype=np.int64)]
            for layer in layers]
    out = []
    for row, starts in zip(tokens, doc_start):
        out.append([])
        for t in range(len(row)):
            back = [token_map[row[t - s]] if t - s >= starts[t] else token_map[pad] for s in range(size)]
            per_layer = []
            for layer in range(len(layers)):
                cols, offset = [], 0
                for n in range(2, size + 1):
                    h = 0
                    for s in range(n):
                        h ^= back[s] * mult[layer][s]
                    for p in primes[layer][n - 2]:
                        cols.append(h % p + offset)
                        offset += p
                per_layer.append(cols)
            out[-1].append(per_layer)
    return out


def dspark_attention(P, a, xn, main_x, segs, dims):
    """A draft block's attention: xn [B,T,bs,D] the normed draft stream (anchor i's slots), main_x [B,T,D].

    Slot j of anchor i (doc-relative position pos_i) sits at pos_i + 1 + j; its query reads the main KV of its
    document's last ``window_size`` positions up to i and the KV of all bs slots of its block, with the sink;
    window-only RoPE (rope_theta, no YaRN); the output rotated back per slot, then the grouped projection."""
    B, T, bs, D = xn.shape
    eps, H, hd, G, ol, W = (dims[k] for k in ("norm_eps", "n_heads", "head_dim", "o_groups", "o_lora_rank",
                                              "window_size"))
    freqs = rope_freqs(dims["rope_head_dim"], dims["rope_theta"], False, dims)

    def kv(v, pos):
        return rope(rms_norm(linear(v, P[a + "wkv.weight"]), P[a + "kv_norm.weight"], eps), pos, freqs)

    out = torch.zeros(B, T, bs, D, dtype=xn.dtype)
    for b in range(B):
        for s0, s1 in segs[b]:
            kv_main = kv(main_x[b, s0:s1], torch.arange(s1 - s0))
            for i in range(s0, s1):
                pos = torch.arange(bs) + (i - s0) + 1
                q = linear(rms_norm(linear(xn[b, i], P[a + "wq_a.weight"]), P[a + "q_norm.weight"], eps),
                           P[a + "wq_b.weight"])
                q = rope(q.view(bs, H, hd), pos, freqs)
                keys = torch.cat([kv_main[max(0, i - s0 - W + 1):i - s0 + 1], kv(xn[b, i], pos)])
                s = torch.einsum("jhd,nd->jhn", q, keys) * hd ** -0.5
                sink = P[a + "attn_sink"].view(1, H, 1).expand(bs, H, 1)
                prob = torch.exp(s - torch.logsumexp(torch.cat([s, sink], -1), -1, keepdim=True))
                o = rope(torch.einsum("jhn,nd->jhd", prob, keys), pos, freqs, inverse=True)
                hg = H // G
                low = [linear(o[:, g * hg:(g + 1) * hg].flatten(1), P[a + "wo_a.weight"][g * ol:(g + 1) * ol])
                       for g in range(G)]
                out[b, i] = linear(torch.cat(low, -1), P[a + "wo_b.weight"])
    return out


def draft_losses(P, dims, features, input_ids, segs, main_logits, diag=None) -> dict:
    """The draft head's loss parts (SPEC §5.4), every position i an anchor: slot 0 holds t_{i+1}, the others the
    noise token; slot j predicts t_{i+2+j} (when that token is in i's document), its Markov bias from t_{i+1+j}
    (noise past the row), its L1 teacher the main model's distribution at i+1+j. Means over the predicted slots of:
    cross-entropy, L1 between the draft and teacher distributions, BCE of the confidence logit against "argmax is
    the target". The main embedding, head, features and teacher are detached."""
    d = dims["dspark"]
    bs, noise, n_blocks, eps = d["block_size"], d["noise_token_id"], d["blocks"], dims["norm_eps"]
    B, T = input_ids.shape
    ids = input_ids.tolist()
    doc = [[si for si, (s0, s1) in enumerate(segs[b]) for _ in range(s0, s1)] for b in range(B)]

    def token(b, p):
        return ids[b][p] if p < T else noise

    main_x = rms_norm(linear(torch.cat([f.detach() for f in features], -1), P["mtp.0.main_proj.weight"]),
                      P["mtp.0.main_norm.weight"], eps)
    draft_in = torch.tensor([[[token(b, i + 1)] + [noise] * (bs - 1) for i in range(T)] for b in range(B)])
    hc = dims.get("hc_mult", 1)
    X = P["embed.weight"].detach()[draft_in].unsqueeze(-2).repeat(1, 1, 1, hc, 1)  # [B,T,bs,hc,D]
    pre = one_hot_pre(X) if hc > 1 else None
    counts = d["n_routed_experts"], d["n_activated_experts"]
    for k in range(n_blocks):
        p = f"mtp.{k}."
        X, pre = block(P, p, X, pre, lambda h, p=p: dspark_attention(P, p + "attn.", h, main_x, segs, dims),
                       lambda y, p=p: ffn(P, p + "ffn.", y, dims, *counts, diag), dims)
    last = f"mtp.{n_blocks - 1}."
    hidden = X[..., 0, :] if pre is None else collapse(X, pre)
    prev = torch.tensor([[[token(b, i + 1 + j) for j in range(bs)] for i in range(T)] for b in range(B)])
    markov = P[last + "markov_head.embed.weight"][prev]
    logits = linear(rms_norm(hidden, P[last + "norm.weight"], eps), P["head.weight"].detach()) \
        + linear(markov, P[last + "markov_head.head.weight"])
    confidence = linear(torch.cat([hidden, markov], -1), P[last + "confidence_head.proj.weight"])[..., 0]
    teacher = main_logits.detach()
    ce, l1, bce, n, hits = 0, 0, 0, 0, 0
    for b in range(B):
        for i in range(T):
            for j in range(bs):
                p = i + 2 + j
                if p >= T or doc[b][p] != doc[b][i]:
                    continue
                n += 1
                y, z, c = ids[b][p], logits[b, i, j], confidence[b, i, j]
                ce = ce - torch.log_softmax(z, -1)[y]
                l1 = l1 + (torch.softmax(z, -1) - torch.softmax(teacher[b, p - 1], -1)).abs().sum()
                top2 = torch.topk(z.detach(), 2).values
                hit = float(int(z.argmax()) == y)
                bce = bce - hit * torch.log(torch.sigmoid(c)) - (1 - hit) * torch.log(torch.sigmoid(-c))
                hits += int(hit)
                if diag is not None:
                    diag["argmax_margin"] = min(diag["argmax_margin"], float(top2[0] - top2[1]))
    if diag is not None:
        diag["draft_hits"] = (hits, n)
    n = max(n, 1)
    return {"ce": ce / n, "l1": l1 / n, "confidence": bce / n}


# ----------------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------------
def oracle_forward(params: dict, dims: dict, layout: dict, input_ids: torch.Tensor, doc_ids=None, diag=None,
                   draft: bool = False):
    """Returns (logits [B,T,V], {index source layer id: scalar KL}); with ``draft`` also the draft head's loss parts
    ``{"ce", "l1", "confidence"}`` (empty without a draft head).

    ``dims`` holds ModelArgs' fields, the V4.1 parts as nested dicts (``moe``, ``engram``, ``dspark``); a missing
    part is off (dense FFN, ``hc_mult`` 1, no Engram, no draft head), so the dims of the plain trunk still work.

    ``diag`` (optional dict) receives ``topk_margin`` and ``block_margin``: the smallest score gap at a
    selection boundary (k-th vs (k+1)-th best), so tests can check that the selection is unambiguous, and
    ``selections``: {(layer, b, t): sorted list of selected doc-relative entry indices}; with the V4.1 parts also
    ``route_margin`` (the same gap of every MoE's biased expert scores), ``routes`` {MoE name: (chosen experts
    [N,k], tokens whose choice the bias changed)}, ``clamped`` {MoE name: counts of routed hidden values past the
    limit: up above, up below, gate above, gate below}, ``engram_gates`` {layer: [B,T,hc]}, ``copies`` {layer: the
    stream entering its block [B,T,hc,D]}, ``pre_mixes`` {layer: the pre-mix its block hands on [B,T,hc]},
    ``argmax_margin`` (the smallest top-1 vs top-2 gap of the draft logits at a predicted slot: the confidence
    target is discrete), ``draft_hits`` (predicted slots whose argmax is the target, predicted slots) and ``recall``
    {layer: per query that reads a selection, the share of its selected entries among the ``index_topk`` visible
    compressed entries its own dense attention (summed over heads) weighs most}.
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
        for key in ("route_margin", "argmax_margin"):
            diag.setdefault(key, math.inf)
        for key in ("routes", "clamped", "engram_gates", "copies", "pre_mixes", "recall"):
            diag.setdefault(key, {})

    # shared[(layer, b, seg)] = {"latent", "index_k", "sel": [LongTensor per query], "student": [...],
    #                            "blocks": [set per query]}
    shared: dict = {}
    # target[(s, b, seg, t)] = list of reader distributions over s's selected slots (detached)
    target: dict = {}

    def attention(i, x):
        """Layer i's attention on its normed input x [B,T,D] -> [B,T,D]; fills ``shared`` and ``target``."""
        a = f"layers.{i}.attn."
        info = plan[i]
        m = info["m"]
        freqs = freqs_comp if m > 0 else freqs_window
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
                        if diag is not None:  # the selection's share of the dense attention's top-k
                            visible = kv_comp[:(t + 1) // m]
                            dense = torch.softmax((q[t] @ visible.t()) * scale, dim=-1).sum(0)
                            best = set(torch.sort(dense, descending=True).indices[:topk].tolist())
                            diag["recall"].setdefault(i, []).append(len(best & set(sel[t].tolist())) / n_sel)
                o = rope(torch.stack(outs), pos, freqs, inverse=True)  # [L, H, hd]
                # --- grouped output projection
                hg = H // G
                wo_a = P[a + "wo_a.weight"]
                low = [linear(o[:, g * hg:(g + 1) * hg].reshape(L, hg * hd), wo_a[g * ol:(g + 1) * ol]) for g in range(G)]
                parts.append(linear(torch.cat(low, -1), P[a + "wo_b.weight"]))
            rows.append(torch.cat(parts, 0))
        return torch.stack(rows)

    hc = dims.get("hc_mult", 1)
    engram = dims.get("engram") or {}
    engram_layers = list(engram.get("layers", ()))
    dspark = dims.get("dspark") or {}
    feature_layers = list(dspark.get("target_layers", ())) if dspark.get("blocks", 0) else []
    if engram_layers:  # every token its own normalised id (the model without a tokenizer's map)
        doc_start = [[s0 for s0, s1 in segs[b] for _ in range(s0, s1)] for b in range(B)]
        vocab = list(range(dims["vocab_size"]))
        hash_ids = torch.tensor(engram_hash_ids(input_ids.tolist(), doc_start, vocab, len(vocab), engram))
    moe = (dims.get("moe", {}).get("n_routed_experts"), dims.get("moe", {}).get("n_activated_experts"))
    X = P["embed.weight"][input_ids].unsqueeze(2).repeat(1, 1, hc, 1)  # [B,T,hc,D]: the embedding in every copy
    pre = one_hot_pre(X) if hc > 1 else None
    features = {}
    for i in range(n_layers):
        p = f"layers.{i}."
        if i in engram_layers:
            X = engram_update(P, p + "engram.", X, hash_ids[:, :, engram_layers.index(i)], eps, diag, i)
        if i in feature_layers:
            features[i] = X.mean(2).detach()
        if diag is not None:
            diag["copies"][i] = X.detach()
        X, pre = block(P, p, X, pre, lambda x, i=i: attention(i, x),
                       lambda y, p=p: ffn(P, p + "ffn.", y, dims, *moe, diag), dims)
        if diag is not None and pre is not None:
            diag["pre_mixes"][i] = pre.detach()
    hidden = X[:, :, 0] if pre is None else collapse(X, pre)
    logits = linear(rms_norm(hidden, P["norm.weight"], eps), P["head.weight"])

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
    if not draft:
        return logits, losses
    if not feature_layers:
        return logits, losses, {}
    return logits, losses, draft_losses(P, dims, [features[i] for i in feature_layers], input_ids, segs, logits, diag)


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


# ------------------------------------------------------------------------------------------------------------------
# mHC stream (SPEC §5.2), one token at a time (tests/model/test_hyper.py, tests/model/test_dspark.py)
# ------------------------------------------------------------------------------------------------------------------
def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def ref_split(m: list[float], scale: list[float], base: list[float], hc: int, iters: int, eps: float):
    """pre, post (lists) and comb (list of rows comb[j][k]) of one token's logits m."""
    pre = [sigmoid(m[c] * scale[0] + base[c]) + eps for c in range(hc)]
    post = [2 * sigmoid(m[hc + c] * scale[1] + base[hc + c]) for c in range(hc)]
    logit = [[m[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k] for k in range(hc)] for j in range(hc)]
    comb = []
    for j in range(hc):  # softmax along a row j (over k), then + eps
        top = max(logit[j])
        e = [math.exp(v - top) for v in logit[j]]
        comb.append([v / sum(e) + eps for v in e])

    def normalise_columns():
        for k in range(hc):
            s = sum(comb[j][k] for j in range(hc)) + eps
            for j in range(hc):
                comb[j][k] /= s

    def normalise_rows():
        for j in range(hc):
            s = sum(comb[j]) + eps
            comb[j] = [v / s for v in comb[j]]

    normalise_columns()
    for _ in range(iters - 1):
        normalise_rows()
        normalise_columns()
    return pre, post, comb


def ref_mixes(x, fn, scale, base, iters, norm_eps, hc_eps):
    """Per token: flat = the hc copies one after the other; m_r = sum_i fn[r,i] flat_i / rms(flat)."""
    B, T, hc, D = x.shape
    pre, post, comb = (torch.zeros(B, T, hc, dtype=torch.float64), torch.zeros(B, T, hc, dtype=torch.float64),
                       torch.zeros(B, T, hc, hc, dtype=torch.float64))
    for b in range(B):
        for t in range(T):
            flat = [float(x[b, t, c, d]) for c in range(hc) for d in range(D)]  # copy after copy
            inv_rms = 1.0 / math.sqrt(sum(v * v for v in flat) / len(flat) + norm_eps)
            rows = fn.detach().tolist()
            m = [sum(w * v for w, v in zip(row, flat)) * inv_rms for row in rows]
            p, q, c = ref_split(m, scale.tolist(), base.tolist(), hc, iters, hc_eps)
            pre[b, t], post[b, t], comb[b, t] = (torch.tensor(v, dtype=torch.float64) for v in (p, q, c))
    return pre, post, comb


def ref_collapse(x, pre):
    B, T, hc, D = x.shape
    return torch.tensor([[[sum(float(pre[b, t, c]) * float(x[b, t, c, d]) for c in range(hc)) for d in range(D)]
                          for t in range(T)] for b in range(B)], dtype=torch.float64)


def ref_expand(y, x, post, comb):
    """out_k = post_k y + sum_j comb[j][k] X_j."""
    B, T, hc, D = x.shape
    out = torch.zeros(B, T, hc, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for k in range(hc):
                for d in range(D):
                    out[b, t, k, d] = float(post[b, t, k]) * float(y[b, t, d]) + sum(
                        float(comb[b, t, j, k]) * float(x[b, t, j, d]) for j in range(hc))
    return out


def ref_block(params, x, pre_in, attn, ffn, iters, norm_eps, hc_eps):
    """Block(X, pre_in) of SPEC §5.2: the attention collapses with pre_in, the FFN with the attention's pre."""
    a_pre, a_post, a_comb = ref_mixes(x, params["hc_attn_fn"], params["hc_attn_scale"], params["hc_attn_base"],
                                      iters, norm_eps, hc_eps)
    x1 = ref_expand(attn(ref_collapse(x, pre_in)), x, a_post, a_comb)
    f_pre, f_post, f_comb = ref_mixes(x1, params["hc_ffn_fn"], params["hc_ffn_scale"], params["hc_ffn_base"],
                                      iters, norm_eps, hc_eps)
    return ref_expand(ffn(ref_collapse(x1, a_pre)), x1, f_post, f_comb), f_pre
