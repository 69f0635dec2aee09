"""Pure-PyTorch reference of the CSA2 hot ops.

Each op is written as the formula, materialising the gathered rows and the score matrices. This is the path
used on CPU and the ground truth the Triton kernels are checked against; it is not meant for long contexts.
Argument conventions are in docs/DESIGN.md ("Kernel ops").
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulate in fp32 at least (fp64 stays fp64, so the reference can be checked against an fp64 oracle)."""
    return torch.promote_types(x.dtype, torch.float32)


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B,N,D], idx [B,T,K] (any value, clamped) -> [B,T,K,D]."""
    B, T, K = idx.shape
    if x.shape[1] == 0:  # no entries yet (sequence shorter than one group): every slot is empty
        return x.new_zeros(B, T, K, x.shape[-1])
    flat = idx.clamp(0, x.shape[1] - 1).reshape(B, T * K, 1).expand(-1, -1, x.shape[-1])
    return x.gather(1, flat).view(B, T, K, x.shape[-1])


def rope(x: torch.Tensor, rotation: torch.Tensor, dim: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [B,N,(H,)D] with its last ``dim`` features rotated: each adjacent pair, as a complex number, times
    ``rotation`` [B,N,dim/2] (complex; its real type is the compute dtype), in ``out_dtype`` (default x's). Linear
    in x: the backward is the same product by the conjugate, which autograd derives."""
    out_dtype = out_dtype or x.dtype
    if x.dim() == 4:
        rotation = rotation.unsqueeze(2)
    pairs = torch.view_as_complex(x[..., -dim:].to(rotation.dtype.to_real()).unflatten(-1, (-1, 2)))
    rotated = torch.view_as_real(pairs * rotation).flatten(-2).to(out_dtype)
    return torch.cat([x[..., :-dim].to(out_dtype), rotated], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rotation: torch.Tensor | None = None,
             rope_dim: int = 0) -> torch.Tensor:
    """RMSNorm over the last dim computed in (at least) fp32, then, with a ``rotation``, RoPE on its last
    ``rope_dim`` features, rounded to x's dtype once."""
    dtype = _compute_dtype(x)
    out = F.rms_norm(x.to(dtype), weight.shape, weight.to(dtype), eps)
    if rotation is not None:
        out = rope(out, rotation, rope_dim)
    return out.to(x.dtype)


def cast(groups: list[list[torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each group's tensors in ``dtype``, their rows stacked (``stack_rows``; differentiable)."""
    return [stack_rows([t.to(dtype) for t in group]) for group in groups]


class StreamMix(NamedTuple):
    """The coefficients one sublayer's ``hc_pre`` makes of the stream [..., hc, D]: ``pre`` [..., hc] (the next
    sublayer's collapse), ``post`` [..., hc] and ``comb`` [..., hc, hc] (this sublayer's expand), fp32 (fp64 for an
    fp64 stream). ``stream_grad``: where a fused implementation's ``hc_post`` backward leaves the stream's gradient
    for its ``hc_pre`` backward to add in the same pass (None here: autograd adds the two)."""
    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    stream_grad: object = None


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
             norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb) of the stream x [..., hc, D] in (at least) fp32: ``m = flatten(x) fn^T *
    rsqrt(mean(flatten(x)^2) + norm_eps)``, one statistic over all hc*D values of a token (not one per copy), the
    division after the projection (the mHC paper's reordering; the same function), then ``hc_split_sinkhorn``."""
    dtype = torch.promote_types(_compute_dtype(x), fn.dtype)
    flat = x.flatten(-2).to(dtype)
    m = F.linear(flat, fn.to(dtype)) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return hc_split_sinkhorn(m, scale.to(dtype), base.to(dtype), x.shape[-2], iters, hc_eps)


def hc_split_sinkhorn(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The coefficients from their logits m [..., (2+hc)hc] (the reference's ``hc_split_sinkhorn``, SPEC §5.2):
    ``pre = sigmoid(.) + hc_eps``, ``post = 2 sigmoid(.)``, ``comb = softmax_k(.) + hc_eps`` as [j, k], divided by
    its column sums (over j) + hc_eps, then ``iters - 1`` rounds of row then column normalisation, each dividing by
    (sum + hc_eps). The last step is a column normalisation, so columns sum to 1 (up to hc_eps) and rows to within
    Sinkhorn's convergence. The details were checked against public ports of the reference's kernel (comb is
    [j, k] with the softmax over k; hc_eps after the softmax and in every denominator; columns first)."""
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc)).softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_pre(x: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           iters: int, norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, StreamMix]:
    """What a sublayer takes of the stream x [..., hc, D]: its input ``hc_collapse(x, pre_in)`` in x's dtype, and
    the stream's mixes (``StreamMix``: this sublayer's post and comb, the next one's pre). Both read x: the fused
    implementation reads it once."""
    return hc_collapse(x, pre_in).to(x.dtype), StreamMix(*hc_mixes(x, fn, scale, base, iters, norm_eps, hc_eps))


def hc_post(y: torch.Tensor, x: torch.Tensor, mix: StreamMix) -> torch.Tensor:
    """The stream after a sublayer with output y [..., D]: ``hc_expand(y, x, mix.post, mix.comb)`` computed in (at
    least) fp32 and rounded to the stream's dtype (bf16 under bf16 autocast, as the reference's ``hc_post``)."""
    return hc_expand(y, x, mix.post, mix.comb).to(x.dtype)


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_c pre_c X_c`` [..., D] of the hyper-connected stream x [..., hc, D], in (at least) fp32: one matmul per
    token."""
    dtype = torch.promote_types(_compute_dtype(x), pre.dtype)
    return torch.matmul(pre.to(dtype).unsqueeze(-2), x.to(dtype)).squeeze(-2)


def hc_expand(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``out_k = post_k y + sum_j comb[j,k] X_j`` [..., hc, D] of a sublayer's output y [..., D] and the stream x,
    in (at least) fp32. The copy mix is one matmul per token, ``comb^T X``, so no [..., hc, hc, D] product is formed;
    the output add goes into the matmul's result in place (its backward needs only comb and X)."""
    dtype = torch.promote_types(torch.promote_types(_compute_dtype(x), y.dtype), comb.dtype)
    out = torch.matmul(comb.to(dtype).transpose(-1, -2), x.to(dtype))
    return out.addcmul_(post.to(dtype).unsqueeze(-1), y.to(dtype).unsqueeze(-2))


def stack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Matrices ``[..., rows_i, cols]`` (the same leading dims and columns) stacked by rows: ``[..., Σ rows_i,
    cols]``, so each leading index (a stack's expert) holds its matrices one above the other (one tensor: itself,
    no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-2)


# ------------------------------------------------------------------------------------------------------- the FFNs

def swiglu(h: torch.Tensor, limit: float = 0.0, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(min(gate, limit)) · clamp(up, ±limit) · weights`` of the stacked projection h = [gate | up] (last dim
    2I: w1 and w3 as one GEMM); no clamp for ``limit`` 0 (the dense FFN), ``weights`` one per row of h (shape
    ``h.shape[:-1]``, or with a trailing 1: a routed expert's routing weights), or None. Computed in (at least)
    fp32 and rounded to h's dtype once."""
    dtype = _compute_dtype(h) if weights is None else torch.promote_types(_compute_dtype(h), weights.dtype)
    gate, up = h.to(dtype).chunk(2, dim=-1)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    out = F.silu(gate) * up
    if weights is not None:
        out = out * weights.to(dtype).reshape(*h.shape[:-1], 1)
    return out.to(h.dtype)


def permute_rows(x: torch.Tensor, slot: torch.Tensor, dtype: torch.dtype,
                 copy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The MoE's dispatch: token rows x ``[N, D]`` put in slot order, ``rows[slot[t, j]] = x[t]`` for each of a
    token's k choices (``slot`` ``[N, k]``, a permutation of ``0..N·k-1``), in ``dtype``; with ``copy`` also x itself
    in ``dtype`` (the shared expert's input), else None. The gradient of x is the sum of its k rows' gradients (and
    its copy's), computed in (at least) fp32."""
    N, k = slot.shape
    acc = _compute_dtype(x)
    spread = x.to(acc).repeat_interleave(k, dim=0)  # token-major: row t·k + j is choice j of token t
    rows = spread.new_empty(N * k, x.shape[-1]).index_copy(0, slot.flatten(), spread)
    return rows.to(dtype), (x.to(acc).to(dtype) if copy else None)


def unpermute_rows(rows: torch.Tensor, slot: torch.Tensor, add: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """The MoE's combine: ``y[t] = add[t] + Σ_j rows[slot[t, j]]`` ``[N, D]`` (``add``, the shared expert's
    output, optional), summed in (at least) fp32 and rounded to ``dtype`` (default rows') once."""
    acc = _compute_dtype(rows) if add is None else torch.promote_types(_compute_dtype(rows), add.dtype)
    y = rows.to(acc)[slot].sum(dim=1)
    if add is not None:
        y = y + add.to(acc)
    return y.to(dtype or rows.dtype)


def window_slots(win_lo: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions t, t-1, ..., t-window+1 of each query and whether each is inside [win_lo, t]."""
    B, T = win_lo.shape
    t = torch.arange(T, device=win_lo.device).view(1, T, 1)
    positions = (t - torch.arange(window, device=win_lo.device).view(1, 1, window)).expand(B, T, window)
    return positions, positions >= win_lo.unsqueeze(-1)


def sparse_attention(q, kv_window, win_lo, kv_comp, topk_idx, sink, scale: float, window: int, rotation=None,
                     with_mass: bool = True):
    """Attention of each query over its sliding window and its selected compressed entries, with a sink.

    Returns (out [B,T,H,D] in q's dtype, selected_mass [B,T,K] fp32 without grad; None without selection or
    ``with_mass``). ``selected_mass`` is the head-summed probability on each selected slot: the indexer-loss target
    before normalisation. With a
    ``rotation`` ([B,T,rope_dim/2] complex, as ``rope`` takes it) q's last rope_dim features are rotated first and
    the output's rotated back (by the conjugate) last: the layer's RoPE, which the Triton kernels do on the fly.

    Two formulations of one function; the one that holds fewer values runs. Long rows gather each query's
    ``window + K`` key rows (``T (window + K) D`` values); short rows, as in the CPU runs, score every query against
    all ``T + S`` rows (``T (T + S) H`` scores) in a few large matmuls instead of ``B T`` small ones.
    """
    if rotation is not None:
        rope_dim = 2 * rotation.shape[-1]
        out, selected_mass = sparse_attention(rope(q, rotation, rope_dim), kv_window, win_lo, kv_comp, topk_idx,
                                              sink, scale, window, with_mass=with_mass)
        return rope(out, rotation.conj(), rope_dim), selected_mass
    _, T, H, D = q.shape
    slots, valid = window_slots(win_lo, window)  # [B,T,n]: the rows each query reads, token positions then entries
    if topk_idx is not None:
        slots = torch.cat([slots, T + topk_idx], dim=2)
        valid = torch.cat([valid, topk_idx >= 0], dim=2)
    rows = kv_window if topk_idx is None else torch.cat([kv_window, kv_comp], dim=1)
    attend = _attend_all_rows if _all_rows_hold_fewer(rows.shape[1], slots.shape[-1], H, D) else _attend_gathered_rows
    out, probs = attend(q, rows, slots, valid, sink, scale)
    return out, (probs[..., window:] if topk_idx is not None and with_mass else None)


def _all_rows_hold_fewer(n_rows: int, n_slots: int, heads: int, dim: int) -> bool:
    """Whether scoring all rows (``n_rows x heads`` scores a query) holds no more than gathering its slots' rows
    (``n_slots x dim``)."""
    return n_rows * heads <= n_slots * dim


def _attend_gathered_rows(q, rows, slots, valid, sink, scale: float):
    """``sparse_attention`` on each query's gathered rows ``rows[slots]``; returns (out, head-summed probability
    per slot)."""
    dtype = _compute_dtype(q)
    keys = _gather_rows(rows, slots).to(dtype)
    scores = torch.einsum("bthd,btnd->bthn", q.to(dtype), keys) * scale
    probs = _softmax_with_sink(scores.masked_fill(~valid.unsqueeze(2), NEG_INF), sink)
    return torch.einsum("bthn,btnd->bthd", probs, keys).to(q.dtype), probs.sum(2).detach()


def _attend_all_rows(q, rows, slots, valid, sink, scale: float):
    """``sparse_attention`` against every row, each weighted by how many of the query's slots read it: adding
    log(count) to a score gives the row count x exp(score) in the softmax (0 for a row not read, twice for an
    entry picked twice), what the gathered form sums slot by slot. Returns (out, head-summed probability per slot)."""
    dtype = _compute_dtype(q)
    count = torch.zeros(*slots.shape[:2], rows.shape[1], dtype=dtype, device=q.device)
    count.scatter_add_(2, slots.clamp(min=0), valid.to(dtype))  # invalid slots add 0 wherever they point
    log_count = count.clamp(min=1).log().masked_fill(count == 0, NEG_INF)  # log(0) itself is 9x slower on CPU
    rows = rows.to(dtype)
    scores = torch.einsum("bthd,bsd->bths", q.to(dtype), rows) * scale + log_count.unsqueeze(2)
    probs = _softmax_with_sink(scores, sink)
    per_read = probs.detach().sum(2) / count.clamp(min=1)  # a row's probability split over the slots that read it
    slot_probs = per_read.gather(2, slots.clamp(min=0)).masked_fill(~valid, 0.0)
    return torch.einsum("bths,bsd->bthd", probs, rows).to(q.dtype), slot_probs


def _softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with each head's sink logit [H] as one more slot, which is then dropped."""
    sink_logit = sink.to(scores.dtype).view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat([scores, sink_logit], dim=-1), dim=-1)[..., :-1]


def index_scores(q, w, k):
    """I[b,t,s] = sum_h w[b,t,h] * relu(q[b,t,h] . k[b,s]) for every entry s."""
    dtype = _compute_dtype(q)
    dots = torch.einsum("bthd,bsd->btsh", q.to(dtype), k.to(dtype))
    return (dots.relu() * w.to(dtype).unsqueeze(2)).sum(-1)


def _visible(vis_lo, vis_hi, n_entries):
    s = torch.arange(n_entries, device=vis_lo.device).view(1, 1, -1)
    return (s >= vis_lo.unsqueeze(-1)) & (s < vis_hi.unsqueeze(-1))


def _doc_block(vis_lo, n_entries, block_size):
    """Doc-relative block number of every entry, seen from each query (negative before its document)."""
    s = torch.arange(n_entries, device=vis_lo.device).view(1, 1, -1)
    return torch.div(s - vis_lo.unsqueeze(-1), block_size, rounding_mode="floor")


def _top(scores: torch.Tensor, k: int, ties_by_index: bool = True) -> torch.Tensor:
    """Indices of the k best finite scores along the last dim, -1 where fewer exist.

    Ties are common (a ReLU-weighted score is exactly 0 wherever every head's ReLU is off) and ``topk`` breaks
    them by an order that depends on the row's length, which makes a token's selection, and so its output,
    depend on how many tokens follow it. ``ties_by_index`` keeps the lower index first (a stable sort); the
    Triton path passes False and keeps ``topk``, whose speed at 64K was measured (a full sort's was not)."""
    n = min(k, scores.shape[-1])
    if ties_by_index:
        values, idx = scores.sort(dim=-1, descending=True, stable=True)
        values, idx = values[..., :n], idx[..., :n]
    else:
        values, idx = scores.topk(n, dim=-1)
    idx = idx.masked_fill(values == NEG_INF, -1)
    return F.pad(idx, (0, k - n), value=-1)


def indexer_select(q, w, k, vis_lo, vis_hi, topk: int, cand_blocks=None, block_size: int = 8,
                   keep_blocks: int = 0):
    """Top-k entries of the lightning indexer, optionally restricted to / producing candidate blocks."""
    with torch.no_grad():
        S = k.shape[1]
        if S == 0:  # sequence shorter than one group: nothing to select
            empty = torch.full((*q.shape[:2], topk), -1, dtype=torch.long, device=q.device)
            return empty, (torch.full((*q.shape[:2], keep_blocks), -1, dtype=torch.long, device=q.device)
                           if keep_blocks else None)
        scores = index_scores(q, w, k)
        allowed = _visible(vis_lo, vis_hi, S)
        block = _doc_block(vis_lo, S, block_size)
        if cand_blocks is not None:
            in_cand = (block.unsqueeze(-1) == cand_blocks.long().unsqueeze(-2)).any(-1)
            allowed &= in_cand
        scores = scores.masked_fill(~allowed, NEG_INF)
        topk_idx = _top(scores, topk)
        if not keep_blocks:
            return topk_idx, None
        n_blocks = -(-S // block_size)
        block_scores = scores.new_full((*scores.shape[:2], n_blocks), NEG_INF)
        block_scores.scatter_reduce_(2, block.clamp(0, n_blocks - 1), scores, "amax")
        newest = torch.div(vis_hi - 1 - vis_lo, block_size, rounding_mode="floor")
        has_entry = (vis_hi > vis_lo).unsqueeze(-1)
        forced = torch.where(has_entry, float("inf"), NEG_INF).to(block_scores.dtype)
        block_scores.scatter_(2, newest.clamp(min=0).unsqueeze(-1), forced)
        return topk_idx, _top(block_scores, keep_blocks)


def index_logits(q, w, k, topk_idx):
    """Differentiable indexer scores of the selected entries (the student logits), -inf on empty slots."""
    dtype = _compute_dtype(q)
    k_sel = _gather_rows(k, topk_idx).to(dtype)
    dots = torch.einsum("bthd,btkd->btkh", q.to(dtype), k_sel)
    logits = (dots.relu() * w.to(dtype).unsqueeze(2)).sum(-1)
    return logits.masked_fill(topk_idx < 0, NEG_INF)
