"""Lightning-indexer scoring, selection and index logits in Triton.

Score of query t and entry j: ``sum_h w[t,h] * relu(q[t,h] . k[j])``. In the scoring kernels the entries are the
M dimension of one matmul and the heads of a few queries the N dimension (N = BLOCK_T * 32), contraction over
128: on Hopper a wgmma whose head sum is a reduction inside each thread and its lane quad, so per-head dots never
leave registers.

Selection (``indexer_select``) never holds the T x S score matrix: queries are processed in chunks whose score
rows fit ``SCORE_CHUNK_BYTES``. A chunk's row per query is a pyramid (kernels/triton_select.py): its scores at
doc-relative columns (column c = entry vis_lo[t] + c, so candidate blocks are column groups), which the scoring
kernel writes together with their block maxima (level 1), then coarser group maxima. The top-k kernel walks the
pyramid down, reading G * k scores per level, and returns exact picks, best first, ties to the lower entry.
Candidate blocks (a candidate source) are the best blocks of level 1 by ``torch.topk`` on (score, block) keys.
Memory is O(chunk x S), linear in T.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from kernels import gluon_index_score
from kernels.triton_common import INTERPRET, add_rows, configs, gluon_applies, load_rows, new_output
from kernels.triton_select import Pyramid, build_upper_levels, select_blocks, select_entries

NEG_INF = float("-inf")
KERNEL_NEG_INF = tl.constexpr(NEG_INF)  # kernels may only read constexpr globals
# The pyramid rows of one chunk of queries. Each chunk is a few launches with their tails and host work: at 64K,
# 256 MiB chunks (39) took 47.3-47.9 ms a selection, 1 GiB (11) 44.3-46.4 ms (``bench_indexer``'s sweep).
SCORE_CHUNK_BYTES = 1 << 30
# Columns a scoring program sweeps (a multiple of every BLOCK_S): a late chunk at T = 65,536 holds ~1,000 queries,
# so without splitting its columns it would give ~130 programs of 8 queries for 132 SMs.
SCORE_SPLIT = 8192
# Candidate-restricted chunks whose rows are at most this many times a query's candidate entries (NC * G) wide are
# scored densely and masked to their candidate blocks: the dense kernel shares each key tile among 8 queries, while
# the gather kernel reads every candidate row once per query (L2-bound). At T = 65,536 with 2,048 x 8 candidates:
# queries before t = 32,768.
DENSE_CANDIDATES = 2.0
# The dense scoring kernel: "gluon" runs kernels/gluon_index_score.py where it applies (Hopper, warp-specialized: a
# tile's epilogue runs during the next tile's MMA), the Triton ``_score_kernel`` elsewhere; "triton" forces the Triton
# one (the benchmark times both).
SCORE_IMPL = "gluon"

# M = BLOCK_S entries (one or two wgmma M=64 per warpgroup), N = BLOCK_T * 32 heads; keys are L2-resident. Configs
# with <= 114 KB of shared memory and <= 64K registers per two CTAs run two per SM (one's epilogue hides behind the
# other's MMA); BLOCK_T = 8 halves the key traffic from L2 against BLOCK_T = 4. The best one depends on the row
# width (v7 at 64K: tuned on the first, narrow chunk, the autotuner kept BLOCK_S 64 at 46.5 ms for all chunks where
# BLOCK_S 128 with 8 warps took 41.6), so the autotune key holds the chunk's width class (``_width_class``).
_SCORE_CONFIGS = configs(
    hopper=[dict(BLOCK_T=8, BLOCK_S=64, num_warps=4, num_stages=2), dict(BLOCK_T=4, BLOCK_S=64, num_warps=4, num_stages=4),
            dict(BLOCK_T=8, BLOCK_S=128, num_warps=8, num_stages=3), dict(BLOCK_T=4, BLOCK_S=128, num_warps=8, num_stages=3)],
    interpret=dict(BLOCK_T=2, BLOCK_S=16, num_warps=4, num_stages=1))
# Candidate and index_logits kernels gather rows per query: BLOCK_E entries (M) against one query's heads (N).
_GATHER_CONFIGS = configs(
    hopper=[dict(BLOCK_E=64, num_warps=4, num_stages=4), dict(BLOCK_E=128, num_warps=4, num_stages=3),
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
def _relu_head_sum(keys, q, w, QUERIES: tl.constexpr, NH_P: tl.constexpr, N: tl.constexpr):
    """sum_h w * relu(q_h . k) for each (key, query): [N, QUERIES] fp32 from the [N, QUERIES*NH_P] dots."""
    dots = tl.dot(keys, tl.trans(q))
    weighted = tl.maximum(dots, 0.0) * w[None, :]
    return tl.sum(tl.reshape(weighted, [N, QUERIES, NH_P]), 2)


@triton.jit
def _score_tile(q, w, KEY, doc_lo, c0, sweep, width, active, rows, level1, DI: tl.constexpr, NH_P: tl.constexpr,
                G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """Columns c0..c0+BLOCK_S of the active queries (entries doc_lo + column) and their block maxima."""
    col = c0 + tl.arange(0, BLOCK_S)
    score = _relu_head_sum(load_rows(KEY, doc_lo + col, col < sweep, DI), q, w, BLOCK_T, NH_P, BLOCK_S)
    visible = active[None, :] & (col[:, None] < width[None, :])
    tl.store(rows[None, :] + col[:, None], score, mask=visible)
    blocks = tl.max(tl.reshape(tl.where(visible, score, KERNEL_NEG_INF), [BLOCK_S // G, G, BLOCK_T]), 1)
    block = c0 // G + tl.arange(0, BLOCK_S // G)
    tl.store(rows[None, :] + level1 + block[:, None], blocks, mask=active[None, :] & (block[:, None] * G < width[None, :]))


@triton.autotune(configs=_SCORE_CONFIGS, key=["NH", "DI", "G", "width_class"])
@triton.jit
def _score_kernel(Q, WGT, KEY, VIS_LO, VIS_HI, LEVELS, n_queries, row_len, level1, width_class, NH, DI: tl.constexpr,
                  NH_P: tl.constexpr, G: tl.constexpr, SPLIT: tl.constexpr, WHILE_LOOP: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """Scores of BLOCK_T queries over their visible entries in columns [SPLIT * program_id(1), + SPLIT), at
    doc-relative columns (level 0 of their pyramid rows), and the block maxima (level 1); entries past a
    query's range are left unwritten.

    Columns, not entries, are tiled, so blocks of G columns fall inside a tile for every query. Queries of
    different documents (a program straddling a document start) see different entries at the same column:
    they are swept one document after the other. ``width_class`` is read by the autotuner only. WHILE_LOOP (set
    under the interpreter only): Triton 3.6's interpreter cannot take a ``range`` bound from a runtime value
    under NumPy 2, while a ``for`` loop is what the GPU compiler pipelines.
    """
    tl.static_assert((BLOCK_S % G == 0) & (SPLIT % BLOCK_S == 0))
    first = tl.program_id(0) * BLOCK_T
    begin = tl.program_id(1) * SPLIT
    q, w = _head_rows(Q, WGT, first, n_queries, NH, DI, BLOCK_T, NH_P)
    r = first + tl.arange(0, BLOCK_T)
    live = r < n_queries
    lo = tl.load(VIS_LO + r, mask=live, other=0)
    width = tl.maximum(tl.load(VIS_HI + r, mask=live, other=0) - lo, 0)
    rows = LEVELS + r.to(tl.int64) * row_len
    pending = width > begin
    while tl.max(pending.to(tl.int32), 0) > 0:
        doc_lo = tl.min(tl.where(pending, lo, 2 ** 62), 0)
        active = pending & (lo == doc_lo)
        sweep = tl.minimum(tl.max(tl.where(active, width, 0), 0), begin + SPLIT)
        if WHILE_LOOP:
            c0 = begin
            while c0 < sweep:
                _score_tile(q, w, KEY, doc_lo, c0, sweep, width, active, rows, level1, DI, NH_P, G, BLOCK_T, BLOCK_S)
                c0 += BLOCK_S
        else:
            for c0 in range(begin, sweep, BLOCK_S):
                _score_tile(q, w, KEY, doc_lo, c0, sweep, width, active, rows, level1, DI, NH_P, G, BLOCK_T, BLOCK_S)
        pending = pending & ~active


@triton.autotune(configs=_GATHER_CONFIGS, key=["NH", "DI", "G", "NC"])
@triton.jit
def _cand_score_kernel(Q, WGT, KEY, VIS_LO, VIS_HI, CAND, LEVELS, row_len, level1, NH, DI: tl.constexpr,
                       NH_P: tl.constexpr, G: tl.constexpr, NC: tl.constexpr, BLOCK_E: tl.constexpr):
    """One query's candidate blocks (doc-relative ids, -1 = none, repeats allowed): their scores at their columns
    (level 0, -inf past the visible range) and block maxima (level 1, which the caller fills with -inf first)."""
    tl.static_assert(BLOCK_E % G == 0)
    SLOTS: tl.constexpr = BLOCK_E // G
    r = tl.program_id(0).to(tl.int64)
    q, w = _head_rows(Q, WGT, r, r + 1, NH, DI, 1, NH_P)
    lo = tl.load(VIS_LO + r)
    width = tl.maximum(tl.load(VIS_HI + r) - lo, 0)
    row = LEVELS + r * row_len
    for s0 in range(0, NC, SLOTS):
        slot = s0 + tl.arange(0, SLOTS)
        block = tl.load(CAND + r * NC + slot, mask=slot < NC, other=-1).to(tl.int64)
        used = (block >= 0) & (block * G < width)
        col = block[:, None] * G + tl.arange(0, G)[None, :]
        visible = used[:, None] & (col < width)
        col, visible = tl.reshape(col, [BLOCK_E]), tl.reshape(visible, [BLOCK_E])
        score = tl.reshape(_relu_head_sum(load_rows(KEY, lo + col, visible, DI), q, w, 1, NH_P, BLOCK_E), [BLOCK_E])
        score = tl.where(visible, score, KERNEL_NEG_INF)
        tl.store(row + col, score, mask=tl.reshape(tl.broadcast_to(used[:, None], [SLOTS, G]), [BLOCK_E]))
        tl.store(row + level1 + block, tl.max(tl.reshape(score, [SLOTS, G]), 1), mask=used)


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
        logit = tl.reshape(_relu_head_sum(load_rows(key, idx, valid, DI), q, w, 1, NH_P, BLOCK_E), [BLOCK_E])
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
    the N dimension of the ``tl.dot``s of candidate scoring and index logits, which needs 16 on the GPU (padding
    rows are 0 and weigh 0)."""
    return max(16, triton.next_power_of_2(n_heads))


def _width_class(width: int) -> int:
    """Autotune bucket of a chunk's row width: widths within a factor of two tune together (5 classes at 64K)."""
    return max(width, 1).bit_length()


def _chunks(width: np.ndarray, group: int, budget: int):
    """(start, end) of consecutive query rows whose pyramid rows fit ``budget`` bytes together (at least one row).

    A chunk's rows are as wide as its widest query, so under causal visibility early chunks hold more rows. Whether
    the first r rows fit only turns from true to false as r grows (rows and their widest width only grow), so each
    chunk scans a window that doubles from twice the last chunk's rows until a row no longer fits: planning is O(T)
    host work with the GPU idle (scanning everything that could fit took ~6 ms at T = 65,536 on a 2-core host, when
    a whole selection takes ~45 ms of GPU time)."""
    def row_bytes(widest):
        return 4 * (widest * group / (group - 1) + 64)  # >= Pyramid(widest, group, ...).row floats
    start, rows = 0, 1
    while start < len(width):
        limit = min(len(width) - start, max(1, int(budget // row_bytes(width[start]))))
        window = min(limit, 2 * rows)
        while True:
            widest = np.maximum.accumulate(width[start:start + window])
            fits = np.arange(1, window + 1) * row_bytes(widest) <= budget
            if not fits.all() or window == limit:
                break
            window = min(limit, 2 * window)
        rows = window if fits.all() else max(1, int(np.argmin(fits)))
        yield start, start + rows
        start += rows


def _keep_candidate_blocks(blocks: torch.Tensor, cand: torch.Tensor) -> None:
    """Level 1 rows [n, blocks] set to -inf outside each query's candidate blocks (ids out of range ignored)."""
    usable = (cand >= 0) & (cand < blocks.shape[1])
    member = torch.zeros(blocks.shape, dtype=torch.int32, device=blocks.device)
    member.scatter_add_(1, torch.where(usable, cand, 0).long(), usable.int())
    blocks.masked_fill_(member == 0, NEG_INF)


def score_chunk(levels, pyramid: Pyramid, q, w, k, lo, hi, cand):
    """Levels 0 and 1 of the chunk's pyramid rows: every visible entry, or the candidate blocks' entries (level 0
    then holds scores of candidate blocks at least; level 1 is -inf outside them)."""
    n, NH, DI = q.shape
    args = dict(NH=NH, DI=DI, NH_P=_heads_p(NH), G=pyramid.group)
    if cand is None or pyramid.widths[0] <= DENSE_CANDIDATES * cand.shape[1] * pyramid.group:
        if gluon_score_applies(q, k, pyramid.group):
            gluon_index_score.launch(q, w, k, lo, hi, levels, pyramid.row, pyramid.offsets[1], pyramid.widths[0],
                                     pyramid.group, SCORE_SPLIT)
        else:
            splits = triton.cdiv(pyramid.widths[0], SCORE_SPLIT)
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK_T"]), splits)  # noqa: E731
            _score_kernel[grid](q, w, k, lo, hi, levels, n, pyramid.row, pyramid.offsets[1],
                                _width_class(pyramid.widths[0]), SPLIT=SCORE_SPLIT, WHILE_LOOP=INTERPRET, **args)
        if cand is not None:
            _keep_candidate_blocks(pyramid.level(levels, 1), cand)
    else:
        pyramid.level(levels, 1).fill_(NEG_INF)  # blocks that are not candidates
        _cand_score_kernel[(n,)](q, w, k, lo, hi, cand, levels, pyramid.row, pyramid.offsets[1], NC=cand.shape[1],
                                 **args)


def gluon_score_applies(q: torch.Tensor, k: torch.Tensor, group: int) -> bool:
    """Whether dense scoring runs the Gluon kernel (``SCORE_IMPL``, a GPU, ``gluon_index_score.usable``)."""
    return gluon_applies(SCORE_IMPL, q, "gluon_index_score", k, group)


def chunk_plan(widths: np.ndarray, topk: int, block_size: int, candidates: bool) -> list[tuple[int, int, Pyramid]]:
    """(start, end, pyramid) of each chunk of one batch row's queries, from their visible widths (host)."""
    cap = block_size * triton.next_power_of_2(topk)
    return [(t0, t1, Pyramid(int(widths[t0:t1].max()), block_size, cap, min_top=int(candidates)))
            for t0, t1 in _chunks(widths, block_size, SCORE_CHUNK_BYTES)]


def indexer_select(q, w, k, vis_lo, vis_hi, topk: int, cand_blocks=None, block_size: int = 8, keep_blocks: int = 0):
    """Same contract as ``kernels.reference.indexer_select``, in chunks of queries (memory linear in T); block_size
    must be a power of two >= 2 (the pyramid's group)."""
    if block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"the Triton indexer needs a power-of-two candidate block size >= 2, got {block_size}")
    with torch.no_grad():
        B, T = q.shape[:2]
        q, w, k = q.contiguous(), w.contiguous(), k.contiguous()
        topk_idx = new_output((B, T, topk), torch.long, q.device)
        blocks = new_output((B, T, keep_blocks), torch.long, q.device) if keep_blocks else None
        widths = (vis_hi - vis_lo).clamp(min=0).cpu().numpy()  # the one host sync
        for b in range(B):
            lo, hi = vis_lo[b].contiguous(), vis_hi[b].contiguous()
            plan = chunk_plan(widths[b], topk, block_size, cand_blocks is not None)
            pool = new_output((max((t1 - t0) * p.row for t0, t1, p in plan),), torch.float32, q.device)
            for t0, t1, pyramid in plan:
                levels = pool[:(t1 - t0) * pyramid.row].view(t1 - t0, pyramid.row)
                cand = None if cand_blocks is None else cand_blocks[b, t0:t1].contiguous()
                score_chunk(levels, pyramid, q[b, t0:t1], w[b, t0:t1], k[b], lo[t0:t1], hi[t0:t1], cand)
                build_upper_levels(levels, pyramid, lo[t0:t1], hi[t0:t1])
                select_entries(levels, pyramid, lo[t0:t1], hi[t0:t1], topk, out=topk_idx[b, t0:t1])
                if keep_blocks:
                    blocks[b, t0:t1] = select_blocks(levels, pyramid, lo[t0:t1], hi[t0:t1], keep_blocks)
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
