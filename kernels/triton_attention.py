"""Sparse attention of CSA2 in Triton: sliding window + selected compressed entries + per-head sink.

Work layout (forward and backward): one program per query token, all heads of that token together. A token's
entries (the latent row is both key and value) are gathered once per block of BLOCK_N entries and shared by
every head, so the heads are the M dimension of the matmuls (M = H = 64 at V4.1 width; N = entries; the
contraction is over D = 512). The window rows of token t are the contiguous rows t-W+1..t of ``kv_window``
(masked below ``win_lo[t]``); the selected rows are ``kv_comp[topk_idx[t]]`` (-1 = empty slot, masked).

Softmax runs in the log2 domain (scores pre-multiplied by scale*log2(e)). The running max starts at the sink
logit and the running sum at 1 (the sink's own term), so the sink is in the denominator from the start and a
fully masked block can never produce exp(-inf - -inf). The saved LSE is natural-log and includes the sink.

Backward: dq stays in registers per token. dkv rows are shared by many queries (and duplicate slots): each
block's [BLOCK_N, D] contribution ``P^T dO + scale * dS^T Q`` is stored as a partial row per (token, slot) for a
chunk of tokens, and ``kernels/triton_dkv.py`` sums the partials of each row in a fixed order (deterministic, no
atomics). dsink is written per token and summed by torch, so it is deterministic too.
"""
import torch
import triton
import triton.language as tl

from kernels import triton_dkv
from kernels.triton_common import configs, load_rows, new_output

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: kernels may only read constexpr globals
# Stages the benchmark switches off to time the rest ("mass_pass", "dkv_reduce"); empty in real use.
ABLATE: set[str] = set()
# Partial dKV rows of one backward chunk (bf16 at real width: 655 KB per token, 6,553 tokens per chunk).
PARTIAL_CHUNK_BYTES = 4 << 30

# Hopper: acc [64, 512] fp32 is 128 registers/thread over 8 warps; q [64, 512] bf16 (64 KB) plus the gathered
# KV tiles (BLOCK_N x 1 KB per stage) must fit the 227 KB of shared memory.
_FWD_CONFIGS = configs(
    hopper=[dict(BLOCK_N=32, num_warps=8, num_stages=2), dict(BLOCK_N=64, num_warps=8, num_stages=2),
            dict(BLOCK_N=32, num_warps=8, num_stages=3)],
    interpret=dict(BLOCK_N=16, num_warps=4, num_stages=1))
# Backward holds dq [64, 512] and one dkv tile [BLOCK_N, 512] in fp32 registers at once. (num_stages=1 was
# dropped: on the H200 its first launch raised an illegal memory access, the pipelined configs ran clean.)
_BWD_CONFIGS = configs(
    hopper=[dict(BLOCK_N=32, num_warps=8, num_stages=2), dict(BLOCK_N=16, num_warps=8, num_stages=2)],
    interpret=dict(BLOCK_N=16, num_warps=4, num_stages=1))


@triton.jit
def _window_slots(t, lo, start, W: tl.constexpr, BLOCK_N: tl.constexpr):
    """Window slots start..start+BLOCK_N of token t: rows t-W+1+slot, valid when inside [win_lo, t]."""
    offs = start + tl.arange(0, BLOCK_N)
    rows = t - W + 1 + offs
    return rows, (offs < W) & (rows >= lo)


@triton.jit
def _selected_slots(idx_row, start, K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Selected slots start..start+BLOCK_N of one token: entry indices and validity (-1 = empty)."""
    offs = start + tl.arange(0, BLOCK_N)
    idx = tl.load(idx_row + offs, mask=offs < K, other=-1)
    return idx, idx >= 0


@triton.jit
def _probs(q, kv, valid, lse2, scale_log2):
    """Final attention probabilities [heads, entries] of one block, given the log2-domain LSE per head."""
    s = tl.dot(q, tl.trans(kv)) * scale_log2
    return tl.where(valid[None, :], tl.exp2(s - lse2[:, None]), 0.0)


@triton.jit
def _online_softmax_step(q, kv, valid, m, l, acc, scale_log2):
    """Fold one block of entries into the running max m, running sum l and unnormalised output acc.

    Also returns the block's p = exp2(s - m_new), the probabilities relative to the new running max."""
    s = tl.dot(q, tl.trans(kv)) * scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None])
    return m_new, l, acc, p


@triton.autotune(configs=_FWD_CONFIGS, key=["H", "D", "W", "K"])
@triton.jit
def _fwd_kernel(Q, KVW, WIN_LO, KVC, IDX, SINK, OUT, LSE, MASS, PSCR, T, S, H, scale_log2,
                D: tl.constexpr, W: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr, BLOCK_H: tl.constexpr,
                MASS_PASS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Selected mass without a second QK^T: the selected blocks' p (relative to the running max after the block)
    go to an fp16 scratch PSCR [tokens, H, K] and the running max after each block to registers (block_max);
    once the LSE is known, the epilogue reads the token's whole [H, K] scratch in one load (many requests in
    flight: a loop of one dependent load per block was latency-bound) and sums p * exp2(block max - lse) over
    heads. K_P (K padded to a power of two >= every BLOCK_N) makes the scratch a [H, K_P / BLOCK_N, BLOCK_N] tile."""
    tok = tl.program_id(0).to(tl.int64)  # flat b*T + t
    b = tok // T
    t = tok - b * T
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < H
    q = load_rows(Q + tok * H * D, heads, hmask, D)
    m = tl.load(SINK + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)

    lo = tl.load(WIN_LO + tok)
    kvw = KVW + b * T * D
    for start in range(0, W, BLOCK_N):
        rows, valid = _window_slots(t, lo, start, W, BLOCK_N)
        m, l, acc, _ = _online_softmax_step(q, load_rows(kvw, rows, valid, D), valid, m, l, acc, scale_log2)
    kvc = KVC + b * S * D
    pscr = PSCR + tok * H * K + heads[:, None] * K
    blocks = tl.arange(0, K_P // BLOCK_N)[None, :]
    # -inf for blocks past K: their factor exp2(-inf) is 0, never inf * 0.
    block_max = tl.full([BLOCK_H, K_P // BLOCK_N], float("-inf"), tl.float32)
    for start in range(0, K, BLOCK_N):
        idx, valid = _selected_slots(IDX + tok * K, start, K, BLOCK_N)
        m, l, acc, p = _online_softmax_step(q, load_rows(kvc, idx, valid, D), valid, m, l, acc, scale_log2)
        if MASS_PASS:
            offs = start + tl.arange(0, BLOCK_N)
            tl.store(pscr + offs[None, :], p.to(PSCR.dtype.element_ty), mask=hmask[:, None] & (offs < K)[None, :])
            block_max = tl.where(blocks == start // BLOCK_N, m[:, None], block_max)

    dims = tl.arange(0, D)
    tl.store(OUT + tok * H * D + heads[:, None] * D + dims[None, :], (acc / l[:, None]).to(OUT.dtype.element_ty),
             mask=hmask[:, None])
    lse2 = m + tl.log2(l)
    tl.store(LSE + tok * H + heads, lse2 / LOG2E, mask=hmask)

    if MASS_PASS:
        tl.debug_barrier()  # the scratch is read back by other threads of this program
        cols = tl.arange(0, K_P)
        p = tl.load(pscr + cols[None, :], mask=hmask[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
        to_final = tl.exp2(block_max - lse2[:, None])
        weighted = tl.reshape(p, [BLOCK_H, K_P // BLOCK_N, BLOCK_N]) * to_final[:, :, None]
        tl.store(MASS + tok * K + cols, tl.reshape(tl.sum(weighted, 0), [K_P]), mask=cols < K)


@triton.jit
def _grad_step(q, do, kv, valid, lse2, delta, dq, part, slots, in_part, scale, D: tl.constexpr):
    """Gradients of one block: returns dq updated and stores the block's partial dkv rows at ``part + slots``
    (masked slots get zero rows: their p and dS are 0)."""
    p = _probs(q, kv, valid, lse2, scale * LOG2E)
    dp = tl.dot(do, tl.trans(kv))
    ds = p * (dp - delta[:, None]) * scale
    dq = tl.dot(ds.to(kv.dtype), kv, dq)
    dkv_t = tl.dot(tl.trans(q), ds.to(kv.dtype))
    dkv_t = tl.dot(tl.trans(do), p.to(kv.dtype), dkv_t)
    dims = tl.arange(0, D)
    tl.store(part + slots[:, None] * D + dims[None, :], tl.trans(dkv_t).to(part.dtype.element_ty),
             mask=in_part[:, None])
    return dq


@triton.autotune(configs=_BWD_CONFIGS, key=["H", "D", "W", "K"])
@triton.jit(do_not_specialize=["tok0"])  # one compiled kernel for every chunk offset
def _bwd_kernel(Q, KVW, WIN_LO, KVC, IDX, SINK, OUT, DOUT, LSE, DQ, PART, DSINK, tok0, T, S, H, scale,
                D: tl.constexpr, W: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Token tok0 + program id: dq, dsink, and its W + K partial dkv rows PART[program id], every slot written
    (zero rows for masked slots), so the reductions may read any slot."""
    row = tl.program_id(0).to(tl.int64)
    tok = tok0 + row
    b = tok // T
    t = tok - b * T
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < H
    q = load_rows(Q + tok * H * D, heads, hmask, D)
    do = load_rows(DOUT + tok * H * D, heads, hmask, D)
    delta = tl.sum(do.to(tl.float32) * load_rows(OUT + tok * H * D, heads, hmask, D).to(tl.float32), 1)
    # Padded heads get lse = +inf: their probabilities are exactly 0 and add nothing to dkv.
    lse2 = tl.load(LSE + tok * H + heads, mask=hmask, other=float("inf")) * LOG2E
    dq = tl.zeros([BLOCK_H, D], tl.float32)
    part = PART + row * (W + K) * D

    lo = tl.load(WIN_LO + tok)
    kvw = KVW + b * T * D
    for start in range(0, W, BLOCK_N):
        rows, valid = _window_slots(t, lo, start, W, BLOCK_N)
        slots = start + tl.arange(0, BLOCK_N)
        dq = _grad_step(q, do, load_rows(kvw, rows, valid, D), valid, lse2, delta, dq, part, slots, slots < W, scale,
                        D)
    kvc = KVC + b * S * D
    for start in range(0, K, BLOCK_N):
        idx, valid = _selected_slots(IDX + tok * K, start, K, BLOCK_N)
        offs = start + tl.arange(0, BLOCK_N)
        dq = _grad_step(q, do, load_rows(kvc, idx, valid, D), valid, lse2, delta, dq, part, W + offs, offs < K, scale,
                        D)

    dims = tl.arange(0, D)
    tl.store(DQ + tok * H * D + heads[:, None] * D + dims[None, :], dq.to(DQ.dtype.element_ty), mask=hmask[:, None])
    # d loss / d sink_h = -p_sink * (dO . O): the sink takes mass from every entry in proportion.
    sink2 = tl.load(SINK + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
    tl.store(DSINK + tok * H + heads, -tl.exp2(sink2 - lse2) * delta, mask=hmask)


def _padded_k(k: int) -> int:
    """K padded to a power of two that every forward BLOCK_N divides (the epilogue's [H, K_P] tile)."""
    return max(64, triton.next_power_of_2(k))


def _block_h(n_heads: int) -> int:
    """Heads padded to a power of two of at least 16 (tl.dot's smallest M)."""
    return max(16, triton.next_power_of_2(n_heads))


def _flat_entries(topk_idx: torch.Tensor, n_entries: int) -> torch.Tensor:
    """Selections as flat entry ids b*S + idx over all batch rows ([B*T, K]), -1 kept for empty slots.

    int32 (B*S < 2**31 at any size that fits in memory): the inverse index's radix sort then makes half the
    passes of an int64 sort."""
    B, T, K = topk_idx.shape
    base = torch.arange(B, device=topk_idx.device, dtype=torch.int32).view(B, 1, 1) * n_entries
    return torch.where(topk_idx >= 0, topk_idx.int() + base, -1).view(B * T, K)


class SparseAttention(torch.autograd.Function):
    """Autograd wrapper; ``topk_idx is None`` (window-only layer) runs with K = 0 and a dummy kv_comp."""

    @staticmethod
    def forward(ctx, q, kv_window, win_lo, kv_comp, topk_idx, sink, scale, window):
        B, T, H, D = q.shape
        ctx.has_sel = topk_idx is not None
        q, kv_window, win_lo = q.contiguous(), kv_window.contiguous(), win_lo.contiguous()
        kv_comp = kv_comp.contiguous() if ctx.has_sel else kv_window
        topk_idx = topk_idx.contiguous() if ctx.has_sel else win_lo
        K = topk_idx.shape[-1] if ctx.has_sel else 0
        out = new_output(q.shape, q.dtype, q.device)
        lse = new_output((B, T, H), torch.float32, q.device)
        mass = new_output((B, T, K), torch.float32, q.device)
        mass_pass = K > 0 and "mass_pass" not in ABLATE
        # p in [0, 1]: fp16 keeps 11 bits (bf16 only 8); fp32 inputs keep fp32 (the CPU tests' 1e-4 bound).
        p_dtype = torch.float32 if q.dtype == torch.float32 else torch.float16
        p_scratch = torch.empty((B, T, H, K) if mass_pass else (0,), dtype=p_dtype, device=q.device)
        _fwd_kernel[(B * T,)](q, kv_window, win_lo, kv_comp, topk_idx, sink, out, lse, mass, p_scratch, T,
                              kv_comp.shape[1], H, scale * LOG2E.value, D=D, W=window, K=K, K_P=_padded_k(K),
                              BLOCK_H=_block_h(H), MASS_PASS=mass_pass)
        ctx.save_for_backward(q, kv_window, win_lo, kv_comp, topk_idx, sink, out, lse)
        ctx.scale, ctx.window, ctx.K = scale, window, K
        ctx.mark_non_differentiable(mass)
        return out, mass

    @staticmethod
    def backward(ctx, dout, _dmass):
        q, kv_window, win_lo, kv_comp, topk_idx, sink, out, lse = ctx.saved_tensors
        B, T, H, D = q.shape
        W, K = ctx.window, ctx.K
        dout = dout.contiguous().to(q.dtype)
        dq = new_output(q.shape, q.dtype, q.device)
        dsink = new_output((B, T, H), torch.float32, q.device)
        dkvw = torch.zeros((B * T, D), dtype=torch.float32, device=q.device)
        if ctx.has_sel:
            dkvc = torch.zeros((B * kv_comp.shape[1], D), dtype=torch.float32, device=q.device)
            entries = _flat_entries(topk_idx, kv_comp.shape[1])
        reduce = "dkv_reduce" not in ABLATE
        # Partials in the input dtype: bf16 rounding of a token's contribution is the rounding its P and dS already
        # get as bf16 MMA operands; fp32 inputs (the CPU tests) keep fp32.
        chunk = min(B * T, max(1, PARTIAL_CHUNK_BYTES // ((W + K) * D * q.element_size())))
        chunk_part = new_output((chunk, W + K, D), q.dtype, q.device)  # one buffer, reused by every chunk
        for tok0 in range(0, B * T, chunk):
            n = min(chunk, B * T - tok0)
            part = chunk_part[:n]
            _bwd_kernel[(n,)](q, kv_window, win_lo, kv_comp, topk_idx, sink, out, dout, lse, dq, part, dsink, tok0,
                              T, kv_comp.shape[1], H, ctx.scale, D=D, W=W, K=K, BLOCK_H=_block_h(H))
            if reduce:
                triton_dkv.reduce_window(part, dkvw, tok0, W)
                if ctx.has_sel:
                    triton_dkv.reduce_selected(part, dkvc, entries[tok0:tok0 + n], W)
        dkv_comp = dkvc.view(kv_comp.shape).to(kv_comp.dtype) if ctx.has_sel else None
        return (dq, dkvw.view(kv_window.shape).to(kv_window.dtype), None, dkv_comp, None,
                dsink.sum((0, 1)).to(sink.dtype), None, None)


def sparse_attention(q, kv_window, win_lo, kv_comp, topk_idx, sink, scale: float, window: int):
    """Same contract as ``kernels.reference.sparse_attention``: (out, selected_mass or None)."""
    out, mass = SparseAttention.apply(q, kv_window, win_lo, kv_comp, topk_idx, sink, scale, window)
    return out, (mass if topk_idx is not None else None)
