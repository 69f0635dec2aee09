"""Lightning-indexer scoring in Triton: chunked full scoring, candidate-restricted scoring, and index_logits.

Score of query t and entry j: ``sum_h w[t,h] * relu(q[t,h] . k[j])``. The heads of a few queries form the M
dimension of one matmul against a tile of entries (M = BLOCK_T * 32 heads, contraction over 128), and the
weighted ReLU head-sum is reduced in registers, so per-head dots never reach memory.

Selection (``indexer_select``) never holds the T x S score matrix: queries are processed in chunks of rows
whose fp32 scores fit ``SCORE_CHUNK_BYTES``; each chunk is scored by a Triton kernel into a doc-relative row
(column c = entry vis_lo[t] + c, so candidate blocks of 8 are plain column groups), then reduced by
``torch.topk`` (entries) and a column-group max + ``torch.topk`` (blocks). Memory is O(chunk x S), linear in T.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.reference import _top
from kernels.triton_common import INTERPRET, add_rows, configs, load_rows, new_output

NEG_INF = float("-inf")
KERNEL_NEG_INF = tl.constexpr(NEG_INF)  # kernels may only read constexpr globals
SCORE_CHUNK_BYTES = 256 << 20  # fp32 scores of one chunk of queries

# M = BLOCK_T * 32 heads = 128 rows of wgmma on Hopper; the key tile (BLOCK_S x 128 bf16) is L2-resident.
_SCORE_CONFIGS = configs(
    hopper=[dict(BLOCK_T=4, BLOCK_S=64, num_warps=4, num_stages=3), dict(BLOCK_T=4, BLOCK_S=128, num_warps=4, num_stages=3),
            dict(BLOCK_T=8, BLOCK_S=64, num_warps=8, num_stages=3), dict(BLOCK_T=2, BLOCK_S=128, num_warps=4, num_stages=3)],
    interpret=dict(BLOCK_T=4, BLOCK_S=16, num_warps=4, num_stages=1))
# Candidate and index_logits kernels gather rows per query: one query's 32 heads against BLOCK_E entries.
_GATHER_CONFIGS = configs(
    hopper=[dict(BLOCK_E=64, num_warps=4, num_stages=3), dict(BLOCK_E=128, num_warps=4, num_stages=3),
            dict(BLOCK_E=128, num_warps=8, num_stages=3)],
    interpret=dict(BLOCK_E=16, num_warps=4, num_stages=1))


@triton.jit
def _head_rows(Q, WGT, first_query, n_queries, NH, DI: tl.constexpr, QUERIES: tl.constexpr, NH_P: tl.constexpr):
    """q rows [QUERIES*NH_P, DI] and head weights [QUERIES*NH_P] (fp32) of consecutive queries; row = query*NH_P + h.

    Heads are padded to the power of two NH_P (padding rows are 0), queries past n_queries are 0 too.
    """
    m = tl.arange(0, QUERIES * NH_P)
    query = first_query + m // NH_P
    head = m % NH_P
    ok = (query < n_queries) & (head < NH)
    row = query.to(tl.int64) * NH + head
    q = load_rows(Q, row, ok, DI)
    w = tl.load(WGT + row, mask=ok, other=0.0).to(tl.float32)
    return q, w


@triton.jit
def _relu_head_sum(q, w, keys, QUERIES: tl.constexpr, NH_P: tl.constexpr, N: tl.constexpr):
    """sum_h w * relu(q_h . k) for each (query, key): [QUERIES, N] fp32 from the [QUERIES*NH_P, N] dots."""
    dots = tl.dot(q, tl.trans(keys))
    weighted = tl.maximum(dots, 0.0) * w[:, None]
    return tl.sum(tl.reshape(weighted, [QUERIES, NH_P, N]), 1)


@triton.jit
def _score_tile(q, w, KEY, lo, hi, r, OUT, s0, s_end, C, DI: tl.constexpr, NH_P: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """Scores of BLOCK_T queries against entries s0..s0+BLOCK_S, stored at doc-relative columns where visible."""
    j = s0 + tl.arange(0, BLOCK_S)
    score = _relu_head_sum(q, w, load_rows(KEY, j, j < s_end, DI), BLOCK_T, NH_P, BLOCK_S)
    visible = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
    tl.store(OUT + r[:, None].to(tl.int64) * C + (j[None, :] - lo[:, None]), score, mask=visible)


@triton.autotune(configs=_SCORE_CONFIGS, key=["NH", "DI"])
@triton.jit
def _score_kernel(Q, WGT, KEY, VIS_LO, VIS_HI, OUT, n_queries, s_begin, s_end, C, NH,
                  DI: tl.constexpr, NH_P: tl.constexpr, WHILE_LOOP: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """Scores of BLOCK_T queries against entries [s_begin, s_end) (the chunk's hull), stored doc-relative.

    The loop bounds are the chunk's, not the program's: a program wastes at most a chunk's width of entries.
    Invisible entries are skipped by the store mask; the caller pre-fills OUT with -inf. WHILE_LOOP (set under
    the interpreter only): Triton 3.6's interpreter cannot take a ``range`` bound from a runtime argument under
    NumPy 2 (it calls int() on a 1-element array), while a ``for`` loop is what the GPU compiler pipelines.
    """
    first = tl.program_id(0) * BLOCK_T
    q, w = _head_rows(Q, WGT, first, n_queries, NH, DI, BLOCK_T, NH_P)
    r = first + tl.arange(0, BLOCK_T)
    rmask = r < n_queries
    lo = tl.load(VIS_LO + r, mask=rmask, other=0)
    hi = tl.load(VIS_HI + r, mask=rmask, other=0)
    if WHILE_LOOP:
        s0 = s_begin
        while s0 < s_end:
            _score_tile(q, w, KEY, lo, hi, r, OUT, s0, s_end, C, DI, NH_P, BLOCK_T, BLOCK_S)
            s0 += BLOCK_S
    else:
        for s0 in range(s_begin, s_end, BLOCK_S):
            _score_tile(q, w, KEY, lo, hi, r, OUT, s0, s_end, C, DI, NH_P, BLOCK_T, BLOCK_S)


@triton.autotune(configs=_GATHER_CONFIGS, key=["NH", "DI", "BS", "NC"])
@triton.jit
def _cand_score_kernel(Q, WGT, KEY, VIS_LO, VIS_HI, CAND, OUT, NH, DI: tl.constexpr, NH_P: tl.constexpr,
                       BS: tl.constexpr, NC: tl.constexpr, BLOCK_E: tl.constexpr):
    """Scores of one query's candidate entries: column slot*BS + i is entry vis_lo + cand[slot]*BS + i.

    Empty slots (-1) and entries at or past vis_hi get -inf, so every column of OUT is written.
    """
    r = tl.program_id(0).to(tl.int64)
    q, w = _head_rows(Q, WGT, r, r + 1, NH, DI, 1, NH_P)
    lo = tl.load(VIS_LO + r)
    hi = tl.load(VIS_HI + r)
    for c0 in range(0, NC * BS, BLOCK_E):
        col = c0 + tl.arange(0, BLOCK_E)
        slot = col // BS
        blk = tl.load(CAND + r * NC + slot, mask=slot < NC, other=-1)
        j = lo + blk * BS + col % BS
        valid = (blk >= 0) & (j < hi)
        score = tl.reshape(_relu_head_sum(q, w, load_rows(KEY, j, valid, DI), 1, NH_P, BLOCK_E), [BLOCK_E])
        tl.store(OUT + r * NC * BS + col, tl.where(valid, score, KERNEL_NEG_INF), mask=slot < NC)


@triton.autotune(configs=_GATHER_CONFIGS, key=["NH", "DI", "K"])
@triton.jit
def _logits_fwd_kernel(Q, WGT, KEY, IDX, OUT, T, S, NH, DI: tl.constexpr, NH_P: tl.constexpr, K: tl.constexpr,
                       BLOCK_E: tl.constexpr):
    """Per token: logits of its K selected entries (-inf on empty slots), gathered BLOCK_E rows at a time."""
    tok = tl.program_id(0).to(tl.int64)
    q, w = _head_rows(Q, WGT, tok, tok + 1, NH, DI, 1, NH_P)
    key = KEY + (tok // T) * S * DI
    for k0 in range(0, K, BLOCK_E):
        offs = k0 + tl.arange(0, BLOCK_E)
        idx = tl.load(IDX + tok * K + offs, mask=offs < K, other=-1)
        valid = idx >= 0
        logit = tl.reshape(_relu_head_sum(q, w, load_rows(key, idx, valid, DI), 1, NH_P, BLOCK_E), [BLOCK_E])
        tl.store(OUT + tok * K + offs, tl.where(valid, logit, KERNEL_NEG_INF), mask=offs < K)


@triton.autotune(configs=_GATHER_CONFIGS, key=["NH", "DI", "K"], reset_to_zero=["DKEY"])
@triton.jit
def _logits_bwd_kernel(Q, WGT, KEY, IDX, DOUT, DQ, DW, DKEY, T, S, NH, DI: tl.constexpr, NH_P: tl.constexpr,
                       K: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per token: dq = sum_j g_hj k_j, dw_h = sum_j dl_j relu(d_hj), dk_j += sum_h g_hj q_h (fp32 atomics),
    with g_hj = dl_j * w_h * [d_hj > 0] and d_hj = q_h . k_j."""
    tok = tl.program_id(0).to(tl.int64)
    q, w = _head_rows(Q, WGT, tok, tok + 1, NH, DI, 1, NH_P)
    key = KEY + (tok // T) * S * DI
    dkey = DKEY + (tok // T) * S * DI
    dq = tl.zeros([NH_P, DI], tl.float32)
    dw = tl.zeros([NH_P], tl.float32)
    for k0 in range(0, K, BLOCK_E):
        offs = k0 + tl.arange(0, BLOCK_E)
        idx = tl.load(IDX + tok * K + offs, mask=offs < K, other=-1)
        valid = idx >= 0
        dl = tl.load(DOUT + tok * K + offs, mask=valid, other=0.0)
        keys = load_rows(key, idx, valid, DI)
        dots = tl.dot(q, tl.trans(keys))
        active = (dots > 0) & valid[None, :]
        dw += tl.sum(tl.where(active, dots, 0.0) * dl[None, :], 1)
        g = tl.where(active, w[:, None] * dl[None, :], 0.0)
        dq = tl.dot(g.to(keys.dtype), keys, dq)
        add_rows(dkey, idx, valid, tl.dot(tl.trans(g.to(q.dtype)), q), DI)
    heads = tl.arange(0, NH_P)
    hmask = heads < NH
    dims = tl.arange(0, DI)
    tl.store(DQ + tok * NH * DI + heads[:, None] * DI + dims[None, :], dq.to(DQ.dtype.element_ty), mask=hmask[:, None])
    tl.store(DW + tok * NH + heads, dw.to(DW.dtype.element_ty), mask=hmask)


def _heads_p(n_heads: int) -> int:
    """Heads padded to a power of two (tl.reshape and tl.arange need one) of at least 16: one query's heads are
    the M dimension of a ``tl.dot``, which needs 16 rows on the GPU (padding rows are 0 and weigh 0)."""
    return max(16, triton.next_power_of_2(n_heads))


def _chunks(lo: torch.Tensor, hi: torch.Tensor, chunk: int):
    """(start, end, s_begin, s_end, width) per chunk of query rows, from one host sync.

    [s_begin, s_end) is the hull of the chunk's visible ranges and width the longest range (the chunk's columns).
    """
    T = lo.shape[0]
    n_chunks = -(-T // chunk)
    which = torch.arange(T, device=lo.device) // chunk

    def per_chunk(values, reduce):
        out = torch.zeros(n_chunks, dtype=torch.long, device=lo.device)
        return out.scatter_reduce(0, which, values.long(), reduce, include_self=False)

    stats = torch.stack([per_chunk(lo, "amin"), per_chunk(hi, "amax"), per_chunk(hi - lo, "amax")], 1).tolist()
    for c, (s_begin, s_end, width) in enumerate(stats):
        yield c * chunk, min(T, (c + 1) * chunk), s_begin, s_end, max(width, 0)


def _full_scores(q, w, k, lo, hi, s_begin, s_end, width):
    """Doc-relative scores [n, width] of n queries over their whole visible ranges; -inf where invisible."""
    n, NH, DI = q.shape
    out = torch.full((n, width), NEG_INF, dtype=torch.float32, device=q.device)
    if width:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_T"]),)
        _score_kernel[grid](q, w, k, lo, hi, out, n, s_begin, s_end, width, NH, DI=DI, NH_P=_heads_p(NH),
                            WHILE_LOOP=INTERPRET)
    return out


def _dedup_sorted(cand: torch.Tensor) -> torch.Tensor:
    """Candidate block ids sorted per query with repeats and negatives turned into -1 (each block scored once)."""
    cand = cand.long().sort(-1).values
    repeat = torch.zeros_like(cand, dtype=torch.bool)
    repeat[:, 1:] = cand[:, 1:] == cand[:, :-1]
    return cand.masked_fill(repeat | (cand < 0), -1)


def _cand_scores(q, w, k, lo, hi, cand, block_size):
    """Scores [n, NC*block_size] of each query's candidate entries (column = slot*block_size + i)."""
    n, NH, DI = q.shape
    NC = cand.shape[1]
    out = new_output((n, NC * block_size), torch.float32, q.device)
    _cand_score_kernel[(n,)](q, w, k, lo, hi, cand, out, NH, DI=DI, NH_P=_heads_p(NH), BS=block_size, NC=NC)
    return out


def _top_blocks(block_scores, block_ids, newest, has_entry, keep):
    """Best ``keep`` block ids (-1 where fewer), the newest visible block always first.

    The newest block is appended as an extra +inf column (-inf when the query sees no entry) and masked out of
    ``block_ids`` so it is never counted twice.
    """
    block_scores = block_scores.masked_fill(block_ids == newest[:, None], NEG_INF)
    forced = torch.where(has_entry, float("inf"), NEG_INF).to(block_scores.dtype)
    scores = torch.cat([block_scores, forced[:, None]], 1)
    ids = torch.cat([block_ids.expand_as(block_scores), newest[:, None]], 1)
    cols = _top(scores, keep, ties_by_index=False)
    return torch.where(cols >= 0, ids.gather(1, cols.clamp(min=0)), -1)


def _chunk_blocks(scores, cand, lo, hi, block_size: int, keep: int):
    """Candidate blocks of one chunk: block max of its scores (doc-relative columns, or candidate columns)."""
    n = scores.shape[0]
    if cand is None:
        n_blocks = -(-scores.shape[1] // block_size)
        padded = F.pad(scores, (0, n_blocks * block_size - scores.shape[1]), value=NEG_INF)
        block_scores = padded.view(n, n_blocks, block_size).amax(-1)
        ids = torch.arange(n_blocks, device=scores.device)[None, :]
    else:
        block_scores = scores.view(n, cand.shape[1], block_size).amax(-1)
        ids = cand
    newest = torch.div(hi - 1 - lo, block_size, rounding_mode="floor").long()
    return _top_blocks(block_scores, ids, newest, hi > lo, keep)


def _select_chunk(q, w, k, lo, hi, s_begin, s_end, width, cand, topk, block_size, keep_blocks):
    """(top-k entry ids, candidate blocks or None) of one chunk of queries of one batch row."""
    if cand is None:
        scores = _full_scores(q, w, k, lo, hi, s_begin, s_end, width)
        cols = _top(scores, topk, ties_by_index=False)
        entries = cols + lo[:, None]
    else:
        cand = _dedup_sorted(cand)
        scores = _cand_scores(q, w, k, lo, hi, cand, block_size)
        cols = _top(scores, topk, ties_by_index=False)
        slot_block = cand.gather(1, cols.clamp(min=0) // block_size)
        entries = lo[:, None] + slot_block * block_size + cols % block_size
    topk_idx = torch.where(cols >= 0, entries, -1)
    blocks = _chunk_blocks(scores, cand, lo, hi, block_size, keep_blocks) if keep_blocks else None
    return topk_idx, blocks


def indexer_select(q, w, k, vis_lo, vis_hi, topk: int, cand_blocks=None, block_size: int = 8, keep_blocks: int = 0):
    """Same contract as ``kernels.reference.indexer_select``, in chunks of queries (memory linear in T)."""
    with torch.no_grad():
        B, T = q.shape[:2]
        q, w, k = q.contiguous(), w.contiguous(), k.contiguous()
        if cand_blocks is None:
            per_row = int((vis_hi - vis_lo).max().clamp(min=1))
        else:
            per_row = cand_blocks.shape[-1] * block_size
        chunk = max(1, min(T, SCORE_CHUNK_BYTES // (4 * per_row)))
        topk_idx = new_output((B, T, topk), torch.long, q.device)
        blocks = new_output((B, T, keep_blocks), torch.long, q.device) if keep_blocks else None
        for b in range(B):
            lo, hi = vis_lo[b].contiguous(), vis_hi[b].contiguous()
            for t0, t1, s_begin, s_end, width in _chunks(lo, hi, chunk):
                cand = None if cand_blocks is None else cand_blocks[b, t0:t1]
                idx, blk = _select_chunk(q[b, t0:t1], w[b, t0:t1], k[b], lo[t0:t1], hi[t0:t1], s_begin, s_end, width,
                                         cand, topk, block_size, keep_blocks)
                topk_idx[b, t0:t1] = idx
                if keep_blocks:
                    blocks[b, t0:t1] = blk
        return topk_idx, blocks


class IndexLogits(torch.autograd.Function):
    """Student logits of the selected entries; backward adds dk into shared rows with fp32 atomics."""

    @staticmethod
    def forward(ctx, q, w, k, topk_idx):
        B, T, NH, DI = q.shape
        q, w, k, topk_idx = q.contiguous(), w.contiguous(), k.contiguous(), topk_idx.contiguous()
        K = topk_idx.shape[-1]
        out = new_output((B, T, K), torch.float32, q.device)
        _logits_fwd_kernel[(B * T,)](q, w, k, topk_idx, out, T, k.shape[1], NH, DI=DI, NH_P=_heads_p(NH), K=K)
        ctx.save_for_backward(q, w, k, topk_idx)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, w, k, topk_idx = ctx.saved_tensors
        B, T, NH, DI = q.shape
        K = topk_idx.shape[-1]
        dq = new_output(q.shape, q.dtype, q.device)
        dw = new_output(w.shape, w.dtype, w.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        _logits_bwd_kernel[(B * T,)](q, w, k, topk_idx, dout.contiguous().float(), dq, dw, dk, T, k.shape[1], NH,
                                     DI=DI, NH_P=_heads_p(NH), K=K)
        return dq, dw, dk.to(k.dtype), None


def index_logits(q, w, k, topk_idx):
    """Same contract as ``kernels.reference.index_logits``: [B,T,K] fp32, -inf on empty slots."""
    return IndexLogits.apply(q, w, k, topk_idx)
