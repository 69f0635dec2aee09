"""Sparse attention of CSA2 in Triton: sliding window + selected compressed entries + per-head sink.

Work layout: one program per query token, all heads of that token together. A token's "slots" are its W window
rows (the contiguous rows t-W+1..t of ``kv_window``, masked below ``win_lo[t]``) followed by its K selected rows
(``kv_comp[topk_idx[t]]``, -1 = empty); the latent row is both key and value. Every kernel walks the slots in
BLOCK_N-slot blocks from W - W_P (W_P: W rounded up to BLOCK_N; the slots before 0 are masked), so the selected
slots start a block (the forward in two loops, window then selected; the backward kernels in one). A block's rows are gathered once and shared by every head: the heads are the
64-row MMA dimension, the contraction is over D = 512. Rows are addressed as element offsets from ``kv_window``
(``slot_rows``); ``kv_comp`` is reached through its offset from ``kv_window``, so one pointer serves both.

Forward (``_fwd_kernel``): online softmax in the log2 domain; the running max starts at the sink logit and the
running sum at 1 (the sink's own term), so the sink is in the denominator and a fully masked block never gives
exp(-inf - -inf). The saved LSE is natural-log and includes the sink. The selected mass (head sum of the final
probabilities per selected slot, the indexer-loss target) needs the final LSE, so each selected block's p (relative
to the running max after that block) is staged, and the running max per block stays in registers; after the loop
the epilogue reads the token's staged [H, K] tile once and sums ``p * exp2(block max - lse)`` over heads. The
staging area is the token's own output rows (written last), so no scratch is allocated (unless K > D).

Backward, per chunk of tokens (docs/KERNELS.md, v6):
1. ``_bwd_dkv_kernel``: the operand ``[q; dO]`` is one stacked [2H, D] tile with the rows interleaved by 8
   (rows 16w+i: q of head 8w+i, rows 16w+8+i: dO of head 8w+i), so ``S`` and ``dP`` come from one MMA of M = 128
   in which each warpgroup computes distinct rows and every thread holds S and dP of the same (head, slot): the
   split is a register split, no data exchange. P = exp2(S - lse), dS = P (dP - delta) scale; dS goes to a buffer
   for step 2; the block's partial dKV rows ``[dS; P]^T [q; dO]`` (one M = BLOCK_N MMA over the same stacked tile)
   are stored per (token, slot).
2. ``_bwd_dq_kernel``: dq = dS KV per token, the slots' rows gathered again (a plain GEMM with K = W + K).
3. ``kernels/triton_dkv.py`` sums the partial rows of each KV row in a fixed order (window rows banded, selected
   entries through an inverse index): deterministic, no atomics. dsink is written per token and summed by torch.

RoPE (``rotation``): q arrives before RoPE; the forward rotates its tail on load and the output's back before the
store, the dKV kernel turns q and dO forward, the dq kernel turns dq back (``_operand_rows``; docs/KERNELS.md).

The op is the torch custom op ``csa2::sparse_attention`` (outputs out, lse, mass; backward
``csa2::sparse_attention_backward``), so activation checkpointing can keep its outputs instead of re-running it
(``kernels.checkpoint_policy``, used by ``parallel.keep_attention_layers``).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import gluon_attention, gluon_dkv, gluon_dq, triton_dkv
from kernels.op_names import SPARSE_ATTENTION_OP
from kernels.triton_common import configs, gluon_applies, new_output, rotate_pairs
from kernels.triton_slots import selected_rows, slot_rows, window_rows

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: kernels may only read constexpr globals
# Stages the benchmark switches off to time the rest ("mass_pass"); empty in real use.
ABLATE: set[str] = set()
# The forward kernel: "gluon" runs kernels/gluon_attention.py where it applies (Hopper, 33-64 heads, bf16/fp16: the
# warpgroups split S instead of both computing it), the Triton kernel elsewhere; "triton" forces the Triton one (the
# benchmark times both).
FORWARD_IMPL = "gluon"
# The backward's dKV step, likewise: "gluon" runs kernels/gluon_dkv.py where it applies (warp-specialized, slots as
# the wgmma M), "triton" forces ``_bwd_dkv_kernel``.
DKV_IMPL = "gluon"
# The backward's dq, likewise: "gluon" runs kernels/gluon_dq.py where it applies (the gathers in a producer
# warpgroup ahead of the MMAs), "triton" forces ``_bwd_dq_kernel``.
DQ_IMPL = "gluon"
# Partial dKV rows of one backward chunk (bf16 at real width: 655 KB per token, 6,553 tokens per chunk).
PARTIAL_CHUNK_BYTES = 4 << 30

# Hopper, one program per token, 227 KB of shared memory. Forward: q [64, 512] bf16 (64 KB) plus BLOCK_N x 1 KB of
# gathered rows per stage; acc [64, 512] fp32 is 128 registers/thread over 8 warps.
_FWD_CONFIGS = configs(
    hopper=[dict(BLOCK_N=64, num_warps=8, num_stages=2), dict(BLOCK_N=32, num_warps=8, num_stages=3),
            dict(BLOCK_N=32, num_warps=8, num_stages=2)],
    interpret=dict(BLOCK_N=16, num_warps=4, num_stages=1))
# dKV: the stacked [q; dO] (128 KB) stays in shared memory, which leaves room for one 64-row block (64 KB): no
# cp.async pipeline. PREFETCH=1 issues the next block's gather into registers (64 registers/thread) right after the
# S/dP MMA, so it lands while the softmax and the dKV MMAs run; PREFETCH=0 gathers each block when it starts.
_DKV_CONFIGS = configs(
    hopper=[dict(BLOCK_N=64, PREFETCH=1, num_warps=8, num_stages=1),
            dict(BLOCK_N=64, PREFETCH=0, num_warps=8, num_stages=1)],
    interpret=dict(BLOCK_N=16, PREFETCH=1, num_warps=4, num_stages=1))
# dq: dS [64, BLOCK_N] and the rows [BLOCK_N, 512] per buffer; acc [64, 512] fp32. The row offsets come from a load
# in the same loop, so num_stages - 1 blocks of rows are in flight.
_DQ_CONFIGS = configs(
    hopper=[dict(BLOCK_N=64, num_warps=8, num_stages=3), dict(BLOCK_N=32, num_warps=8, num_stages=5),
            dict(BLOCK_N=32, num_warps=8, num_stages=3)],
    interpret=dict(BLOCK_N=16, num_warps=4, num_stages=1))


@triton.jit
def _gather(KV, offset, valid, DIM0: tl.constexpr, DIM: tl.constexpr):
    """Columns DIM0..DIM0+DIM of the rows at ``offset`` (elements from KV) as a tile; invalid rows read as 0."""
    dims = DIM0 + tl.arange(0, DIM)
    return tl.load(KV + offset[:, None] + dims[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _gather_halves(KV, IDX, tok, b, t, win_lo, slots, T, S, comp_offset, D: tl.constexpr, W: tl.constexpr,
                   K: tl.constexpr):
    """The rows of any slots of token (b, t) as two column halves [len(slots), D/2] (invalid rows read 0), and
    their validity."""
    offset, valid = slot_rows(IDX, tok, b, t, win_lo, slots, T, S, comp_offset, D, W, K)
    return _gather(KV, offset, valid, 0, D // 2), _gather(KV, offset, valid, D // 2, D // 2), valid


@triton.jit
def _operand_rows(rows, live, DIM0: tl.constexpr, DIM: tl.constexpr, D: tl.constexpr, ROT, tok, ROPE: tl.constexpr,
                  SCRATCH, scratch_stride):
    """Columns DIM0..DIM0+DIM of the rows at ``rows`` ([M, 1] pointers; rows where ``live`` is False read 0) as an
    MMA operand; with ROPE, the pairs of the last ROPE features of D rotated by token ``tok``'s rotation (ROT row:
    interleaved cos, sin).

    The rotated tail is made first (each column recombined with its pair's other element, loaded again) and
    written to ``SCRATCH`` (this program's own [M, ROPE] area, rows ``scratch_stride`` apart); the tile is then a
    plain load from the rows and the scratch. A computed tile would work as well, but Triton then keeps the
    operand in registers (the forward's loop spilled) or stores it to shared memory once per use (the dKV kernel
    grew past the 227 KB of an SM)."""
    r = tl.arange(0, rows.shape[0])[:, None]
    dims = DIM0 + tl.arange(0, DIM)
    ptrs = rows + dims[None, :]
    if ROPE:
        tail = D - ROPE + tl.arange(0, ROPE)
        cos = tl.load(ROT + tok * ROPE + (tail - (D - ROPE)) // 2 * 2)
        sin = tl.load(ROT + tok * ROPE + (tail - (D - ROPE)) // 2 * 2 + 1)
        x = tl.load(rows + tail[None, :], mask=live, other=0.0).to(tl.float32)
        partner = tl.load(rows + (tail ^ 1)[None, :], mask=live, other=0.0).to(tl.float32)
        signed_sin = tl.where(tail % 2 == 0, -sin, sin)  # even: x cos - x' sin; odd: x' sin + x cos
        rotated = x * cos[None, :] + partner * signed_sin[None, :]
        tl.store(SCRATCH + r * scratch_stride + (tail - (D - ROPE))[None, :],
                 rotated.to(SCRATCH.dtype.element_ty), mask=live)
        tl.debug_barrier()  # the scratch is read back by other threads of this program
        in_tail = (dims >= D - ROPE)[None, :]
        ptrs = tl.where(in_tail, SCRATCH + r * scratch_stride + (dims - (D - ROPE))[None, :], ptrs)
    return tl.load(ptrs, mask=live, other=0.0)


@triton.jit
def _head_rows(BASE, tok, heads, H, DIM0: tl.constexpr, DIM: tl.constexpr, D: tl.constexpr):
    """Columns DIM0..DIM0+DIM of the token's head rows ``BASE[tok, heads]`` ([tokens, H, D]); padded heads read 0."""
    dims = DIM0 + tl.arange(0, DIM)
    ptrs = BASE + (tok * H + heads[:, None]).to(tl.int64) * D + dims[None, :]
    return tl.load(ptrs, mask=(heads < H)[:, None], other=0.0)


@triton.jit
def _softmax_step(KV, offset, valid, q, m, l, acc, scale_log2, D: tl.constexpr):
    """Fold one block of rows (at ``offset``, masked by ``valid``) into the running max m, running sum l and
    unnormalised output acc; also returns the block's p = exp2(s - m_new), relative to the new running max."""
    kv = _gather(KV, offset, valid, 0, D)
    s = tl.where(valid[None, :], tl.dot(q, tl.trans(kv)) * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, 1), tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None]), p


@triton.autotune(configs=_FWD_CONFIGS, key=["H", "D", "W", "K"])
@triton.jit  # comp_offset stays specialized: its 16-divisibility is what lets the gathers use 16-byte copies
def _fwd_kernel(KV, Q, WIN_LO, IDX, SINK, ROT, OUT, LSE, MASS, STAGE, comp_offset, stage_token_stride,
                stage_head_stride, T, S, H, scale_log2, D: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
                K_P: tl.constexpr, BLOCK_H: tl.constexpr, ROPE: tl.constexpr, MASS_PASS: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Out, LSE and selected mass of one token. The selected blocks' p go to STAGE (the token's output rows, read
    back by the epilogue before the output overwrites them); K_P (K padded to a power of two >= every BLOCK_N)
    makes the staged tile [H, K_P / BLOCK_N, BLOCK_N] blocks, each weighed by its block's max."""
    W_P: tl.constexpr = (W + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    tok = tl.program_id(0).to(tl.int64)  # flat b*T + t
    b = tok // T
    t = tok - b * T
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < H
    # With RoPE, the rotated tail of q passes through the tail of the token's output rows, written last.
    q = _operand_rows(Q + (tok * H + heads[:, None]).to(tl.int64) * D, hmask[:, None], 0, D, D, ROT, tok, ROPE,
                      OUT + tok * H * D + D - ROPE, D)
    m = tl.load(SINK + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    win_lo = tl.load(WIN_LO + tok)
    stage = STAGE + tok * stage_token_stride + heads[:, None] * stage_head_stride
    blocks = tl.arange(0, K_P // BLOCK_N)[None, :]
    # -inf for blocks past K: their factor exp2(-inf) is 0, never inf * 0.
    block_max = tl.full([BLOCK_H, K_P // BLOCK_N], float("-inf"), tl.float32)
    for start in range(W - W_P, W, BLOCK_N):
        offset, valid = window_rows(b, t, win_lo, start + tl.arange(0, BLOCK_N), T, D, W)
        m, l, acc, _ = _softmax_step(KV, offset, valid, q, m, l, acc, scale_log2, D)
    for start in range(W, W + K, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        offset, valid = selected_rows(IDX, tok, b, slots, S, comp_offset, D, W, K)
        m, l, acc, p = _softmax_step(KV, offset, valid, q, m, l, acc, scale_log2, D)
        if MASS_PASS:
            tl.store(stage + (slots - W)[None, :], p.to(STAGE.dtype.element_ty),
                     mask=hmask[:, None] & (slots < W + K)[None, :])
            block_max = tl.where(blocks == (start - W) // BLOCK_N, m[:, None], block_max)

    lse2 = m + tl.log2(l)
    tl.store(LSE + tok * H + heads, lse2 / LOG2E, mask=hmask)
    out = acc / l[:, None]  # before the mass epilogue: acc's registers are free there
    if ROPE:
        out = rotate_pairs(out, ROT, tok, hmask[:, None], 0, D, ROPE, True)
    out = out.to(OUT.dtype.element_ty)
    if MASS_PASS:
        tl.debug_barrier()  # the stage is read back by other threads of this program
        for j in tl.static_range(0, K_P // BLOCK_N):  # one block at a time: [H, BLOCK_N] in registers
            cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
            p = tl.load(stage + cols[None, :], mask=hmask[:, None] & (cols < K)[None, :], other=0.0)
            to_final = tl.exp2(tl.max(tl.where(blocks == j, block_max, float("-inf")), 1) - lse2)
            tl.store(MASS + tok * K + cols, tl.sum(p.to(tl.float32) * to_final[:, None], 0), mask=cols < K)
        tl.debug_barrier()  # every thread has read the stage before the output overwrites it
    dims = tl.arange(0, D)
    tl.store(OUT + (tok * H + heads[:, None]) * D + dims[None, :], out, mask=hmask[:, None])


@triton.jit
def _stacked_rows(BLOCK_H: tl.constexpr):
    """Head and source (True: q, False: dO) of each row of the stacked [2 BLOCK_H, D] operand, interleaved by 8 so
    that an MMA accumulator thread (rows r and r + 8 of its warp's 16) holds q and dO results of one head."""
    rows = tl.arange(0, 2 * BLOCK_H)
    return rows // 16 * 8 + rows % 8, (rows // 8) % 2 == 0


@triton.jit
def _stacked_tile(Q, DOUT, tok, H, DIM0: tl.constexpr, DIM: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  ROT, ROPE: tl.constexpr, SCRATCH):
    """Columns DIM0..DIM0+DIM of the token's stacked [q; dO] operand ([2 BLOCK_H, DIM]; padded heads are 0). With
    ROPE both q and dO turn by the token's rotation (through SCRATCH, [2 BLOCK_H, ROPE]): the kernel works in the
    rotated frame, in which dO is the gradient of the rotated-back output turned forward (RoPE is orthogonal)."""
    head, is_q = _stacked_rows(BLOCK_H)
    offset = (tok * H + head[:, None]).to(tl.int64) * D
    return _operand_rows(tl.where(is_q[:, None], Q + offset, DOUT + offset), (head < H)[:, None], DIM0, DIM, D, ROT,
                         tok, ROPE, SCRATCH, ROPE)


@triton.jit
def _unstack(x, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """[2 BLOCK_H, BLOCK_N] in the stacked row order -> (q rows, dO rows), each [BLOCK_H, BLOCK_N] by head."""
    a, b = tl.split(tl.permute(tl.reshape(x, [BLOCK_H // 8, 2, 8, BLOCK_N]), [0, 2, 3, 1]))
    return tl.reshape(a, [BLOCK_H, BLOCK_N]), tl.reshape(b, [BLOCK_H, BLOCK_N])


@triton.jit
def _stack(a, b, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Inverse of ``_unstack``: (q-row values, dO-row values) [BLOCK_H, BLOCK_N] -> [2 BLOCK_H, BLOCK_N]."""
    pair = tl.join(tl.reshape(a, [BLOCK_H // 8, 8, BLOCK_N]), tl.reshape(b, [BLOCK_H // 8, 8, BLOCK_N]))
    return tl.reshape(tl.permute(pair, [0, 3, 1, 2]), [2 * BLOCK_H, BLOCK_N])


@triton.autotune(configs=_DKV_CONFIGS, key=["H", "D", "W", "K"])
@triton.jit(do_not_specialize=["tok0"])  # one compiled kernel for every chunk
def _bwd_dkv_kernel(KV, Q, DOUT, OUT, WIN_LO, IDX, SINK, ROT, SCRATCH, LSE, PART, DS, DSINK, tok0, comp_offset, T, S, H,
                    scale, D: tl.constexpr, W: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr,
                    ROPE: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    """Token tok0 + program id: its W + K partial dKV rows PART[program id] and dS rows DS[program id] (every slot
    written; masked slots get zeros), and dsink. D is handled in two halves (two MMAs per product), which keeps the
    dKV accumulator at [BLOCK_N, D/2]."""
    W_P: tl.constexpr = (W + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    HALF: tl.constexpr = D // 2
    row = tl.program_id(0).to(tl.int64)
    tok = tok0 + row
    b = tok // T
    t = tok - b * T
    qdo_lo = _stacked_tile(Q, DOUT, tok, H, 0, HALF, D, BLOCK_H, ROT, 0, ROT)  # the RoPE tail lies in the upper half
    qdo_hi = _stacked_tile(Q, DOUT, tok, H, HALF, HALF, D, BLOCK_H, ROT, ROPE, SCRATCH + row * 2 * BLOCK_H * ROPE)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < H
    # delta = rowsum(dO * O), in chunks of at most 128 columns (registers).
    CHUNK: tl.constexpr = 128 if D > 128 else D
    delta = tl.zeros([BLOCK_H], tl.float32)
    for c in tl.static_range(0, D, CHUNK):
        delta += tl.sum(_head_rows(DOUT, tok, heads, H, c, CHUNK, D).to(tl.float32)
                        * _head_rows(OUT, tok, heads, H, c, CHUNK, D).to(tl.float32), 1)
    # Padded heads get lse = +inf: their probabilities are exactly 0 and add nothing to dkv.
    lse2 = tl.load(LSE + tok * H + heads, mask=hmask, other=float("inf")) * LOG2E
    # d loss / d sink_h = -p_sink * (dO . O): the sink takes mass from every entry in proportion.
    sink2 = tl.load(SINK + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
    tl.store(DSINK + tok * H + heads, -tl.exp2(sink2 - lse2) * delta, mask=hmask)

    win_lo = tl.load(WIN_LO + tok)
    part = PART + row * (W + K) * D
    ds_rows = DS + (row * H + heads[:, None]) * (W + K)
    half = tl.arange(0, HALF)
    if PREFETCH:
        next_lo, next_hi, next_valid = _gather_halves(KV, IDX, tok, b, t, win_lo, W - W_P + tl.arange(0, BLOCK_N),
                                                      T, S, comp_offset, D, W, K)
    for start in range(W - W_P, W + K, BLOCK_N):
        if PREFETCH:
            kv_lo, kv_hi, valid = next_lo, next_hi, next_valid
        else:
            kv_lo, kv_hi, valid = _gather_halves(KV, IDX, tok, b, t, win_lo, start + tl.arange(0, BLOCK_N), T, S,
                                                 comp_offset, D, W, K)
        sdp = tl.dot(qdo_hi, tl.trans(kv_hi), tl.dot(qdo_lo, tl.trans(kv_lo)))
        if PREFETCH:  # issued after the MMA has taken this block's rows, so the two tiles never live together
            next_lo, next_hi, next_valid = _gather_halves(KV, IDX, tok, b, t, win_lo,
                                                          start + BLOCK_N + tl.arange(0, BLOCK_N), T, S,
                                                          comp_offset, D, W, K)
        s, dp = _unstack(sdp, BLOCK_H, BLOCK_N)
        p = tl.where(valid[None, :], tl.exp2(s * (scale * LOG2E) - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None]) * scale
        slots = start + tl.arange(0, BLOCK_N)
        stored = (slots >= 0) & (slots < W + K)
        tl.store(ds_rows + slots[None, :], ds.to(DS.dtype.element_ty), mask=hmask[:, None] & stored[None, :])
        dsp_t = tl.trans(_stack(ds.to(Q.dtype.element_ty), p.to(Q.dtype.element_ty), BLOCK_H, BLOCK_N))
        part_rows = part + slots[:, None] * D + half[None, :]
        tl.store(part_rows, tl.dot(dsp_t, qdo_lo).to(PART.dtype.element_ty), mask=stored[:, None])
        tl.store(part_rows + HALF, tl.dot(dsp_t, qdo_hi).to(PART.dtype.element_ty), mask=stored[:, None])


@triton.autotune(configs=_DQ_CONFIGS, key=["H", "D", "W", "K"])
@triton.jit(do_not_specialize=["tok0"])
def _bwd_dq_kernel(KV, WIN_LO, IDX, DS, ROT, DQ, tok0, comp_offset, T, S, H, D: tl.constexpr, W: tl.constexpr,
                   K: tl.constexpr, BLOCK_H: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq of token tok0 + program id: its dS rows DS[program id] [H, W + K] times its slots' rows."""
    W_P: tl.constexpr = (W + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    row = tl.program_id(0).to(tl.int64)
    tok = tok0 + row
    b = tok // T
    t = tok - b * T
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < H
    win_lo = tl.load(WIN_LO + tok)
    ds_rows = DS + (row * H + heads[:, None]) * (W + K)
    dq = tl.zeros([BLOCK_H, D], tl.float32)
    for start in range(W - W_P, W + K, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        offset, valid = slot_rows(IDX, tok, b, t, win_lo, slots, T, S, comp_offset, D, W, K)
        ds = tl.load(ds_rows + slots[None, :], mask=hmask[:, None] & ((slots >= 0) & (slots < W + K))[None, :],
                     other=0.0)
        dq = tl.dot(ds, _gather(KV, offset, valid, 0, D), dq)
    if ROPE:  # the gradient of the rotated q, turned back to q's own frame
        dq = rotate_pairs(dq, ROT, tok, hmask[:, None], 0, D, ROPE, True)
    dims = tl.arange(0, D)
    tl.store(DQ + (tok * H + heads[:, None]) * D + dims[None, :], dq.to(DQ.dtype.element_ty), mask=hmask[:, None])


def _rope_args(rotation: Optional[torch.Tensor], q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(ROT pointer, ROPE constexpr): the rotation's pairs and the rotated width, or (q, 0) without RoPE (a valid
    pointer the kernels never read)."""
    return (rotation.contiguous(), 2 * rotation.shape[2]) if rotation is not None else (q, 0)


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


def _compressed_rows(kv_window: torch.Tensor, kv_comp: Optional[torch.Tensor]) -> tuple[int, int]:
    """(entries per batch row S, element offset of ``kv_comp`` from ``kv_window``); (0, 0) without selection.

    The kernels address both row sets from one base pointer (one gather per block instead of a select between
    two 64-bit pointers per row); the offset is exact because both tensors hold the same dtype."""
    if kv_comp is None:
        return 0, 0
    if kv_comp.dtype != kv_window.dtype:
        raise TypeError(f"sparse_attention: kv_comp is {kv_comp.dtype} but kv_window is {kv_window.dtype}")
    return kv_comp.shape[1], (kv_comp.data_ptr() - kv_window.data_ptr()) // kv_window.element_size()


def _check(q, kv_window, win_lo, kv_comp, topk_idx, sink, rotation):
    B, T, H, D = q.shape
    if rotation is not None and (rotation.dtype != torch.float32 or rotation.dim() != 4
                                 or rotation.shape[:2] != (B, T) or rotation.shape[-1] != 2
                                 or 2 * rotation.shape[2] > D // 2):
        raise ValueError(f"sparse_attention: the rotation for q {tuple(q.shape)} is [B,T,rope_dim/2] complex64 with "
                         f"rope_dim <= D/2 (the tail the backward rotates lies in D's upper half); got "
                         f"{tuple(rotation.shape)} {rotation.dtype} as real pairs")
    if kv_window.shape != (B, T, D) or win_lo.shape != (B, T) or sink.shape != (H,):
        raise ValueError(f"sparse_attention: q {tuple(q.shape)} needs kv_window [B,T,D], win_lo [B,T] and sink [H]; "
                         f"got {tuple(kv_window.shape)}, {tuple(win_lo.shape)}, {tuple(sink.shape)}")
    if kv_window.dtype != q.dtype:
        raise TypeError(f"sparse_attention: q is {q.dtype} but kv_window is {kv_window.dtype}")
    if (kv_comp is None) != (topk_idx is None):
        raise ValueError("sparse_attention: kv_comp and topk_idx come together (both None for a window-only layer)")
    if topk_idx is not None and (kv_comp.shape[0] != B or kv_comp.shape[2] != D or topk_idx.shape[:2] != (B, T)):
        raise ValueError(f"sparse_attention: kv_comp {tuple(kv_comp.shape)} / topk_idx {tuple(topk_idx.shape)} do not "
                         f"match q {tuple(q.shape)}")


@torch.library.custom_op(SPARSE_ATTENTION_OP, mutates_args=())
def _sparse_attention_fwd(q: torch.Tensor, kv_window: torch.Tensor, win_lo: torch.Tensor,
                          kv_comp: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor], sink: torch.Tensor,
                          rotation: Optional[torch.Tensor], scale: float, window: int,
                          with_mass: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [B,T,H,D], lse [B,T,H] fp32 natural log incl. the sink, selected mass [B,T,K] fp32; K = 0 without
    selection or ``with_mass``, whose kernel then skips the staging and the mass epilogue). ``rotation`` (cos, sin
    pairs [B,T,rope_dim/2,2] fp32, or None): RoPE on q's tail as it is loaded, its inverse on the output's as it is
    stored."""
    _check(q, kv_window, win_lo, kv_comp, topk_idx, sink, rotation)
    B, T, H, D = q.shape
    q, kv_window, win_lo = q.contiguous(), kv_window.contiguous(), win_lo.contiguous()
    kv_comp = kv_comp.contiguous() if kv_comp is not None else None
    S, comp_offset = _compressed_rows(kv_window, kv_comp)
    idx = topk_idx.contiguous() if topk_idx is not None else win_lo  # a valid pointer, never read when K = 0
    K = topk_idx.shape[-1] if topk_idx is not None else 0
    out = new_output(q.shape, q.dtype, q.device)
    lse = new_output((B, T, H), torch.float32, q.device)
    mass = new_output((B, T, K if with_mass else 0), torch.float32, q.device)
    mass_pass = K > 0 and with_mass and "mass_pass" not in ABLATE
    rot, rope = _rope_args(rotation, q)
    rows = (kv_window, q, win_lo, idx, sink, rot, out, lse, mass)
    shape = dict(D=D, W=window, K=K, K_P=_padded_k(K), BLOCK_H=_block_h(H), ROPE=rope, MASS_PASS=mass_pass)
    if gluon_forward_applies(q):  # stages p in rows of each program's own
        gluon_attention.launch(B * T, *rows, comp_offset, T, S, H, scale * LOG2E.value, **shape)
    else:
        # p in [0, 1] is staged in fp16 (11 bits; bf16 keeps 8), fp32 for fp32 inputs (the CPU tests' 1e-4 bound):
        # the same element size as out, so the token's output rows hold its [H, K] tile when K <= D.
        p_dtype = torch.float32 if q.dtype == torch.float32 else torch.float16
        if not mass_pass or (K <= D and out.element_size() == p_dtype.itemsize):
            stage, strides = out.view(p_dtype), (H * D, D)
        else:
            stage, strides = torch.empty((B, T, H, K), dtype=p_dtype, device=q.device), (H * K, K)
        _fwd_kernel[(B * T,)](*rows, stage, comp_offset, *strides, T, S, H, scale * LOG2E.value, **shape)
    return out, lse, mass


def gluon_forward_applies(q: torch.Tensor) -> bool:
    """Whether the forward for q runs the Gluon kernel (``FORWARD_IMPL``, a GPU, ``gluon_attention.usable``)."""
    return gluon_applies(FORWARD_IMPL, q, "gluon_attention")


def gluon_dkv_applies(q: torch.Tensor, window: int, k: int) -> bool:
    """Whether the backward's dKV step for q runs the Gluon kernel (``DKV_IMPL``, a GPU, ``gluon_dkv.usable``)."""
    return gluon_applies(DKV_IMPL, q, "gluon_dkv", window, k)


def gluon_dq_applies(q: torch.Tensor, window: int, k: int) -> bool:
    """Whether the backward's dq for q runs the Gluon kernel (``DQ_IMPL``, a GPU, ``gluon_dq.usable``)."""
    return gluon_applies(DQ_IMPL, q, "gluon_dq", window, k)


@_sparse_attention_fwd.register_fake
def _(q, kv_window, win_lo, kv_comp, topk_idx, sink, rotation, scale, window, with_mass):
    B, T, H, _ = q.shape
    K = topk_idx.shape[-1] if topk_idx is not None and with_mass else 0
    return q.new_empty(q.shape), q.new_empty((B, T, H), dtype=torch.float32), q.new_empty((B, T, K),
                                                                                          dtype=torch.float32)


@torch.library.custom_op(SPARSE_ATTENTION_OP + "_backward", mutates_args=())
def _sparse_attention_bwd(dout: torch.Tensor, q: torch.Tensor, kv_window: torch.Tensor, win_lo: torch.Tensor,
                          kv_comp: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor], sink: torch.Tensor,
                          rotation: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, scale: float,
                          window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dkv_window, dkv_comp (empty without selection), dsink); bitwise reproducible."""
    B, T, H, D = q.shape
    W = window
    q, kv_window, win_lo, out = q.contiguous(), kv_window.contiguous(), win_lo.contiguous(), out.contiguous()
    kv_comp = kv_comp.contiguous() if kv_comp is not None else None
    dout = dout.contiguous().to(q.dtype)
    S, comp_offset = _compressed_rows(kv_window, kv_comp)
    K = topk_idx.shape[-1] if topk_idx is not None else 0
    idx = topk_idx.contiguous() if topk_idx is not None else win_lo
    dq = new_output(q.shape, q.dtype, q.device)
    dsink = new_output((B, T, H), torch.float32, q.device)
    dkvw = torch.zeros((B * T, D), dtype=torch.float32, device=q.device)
    dkvc = torch.zeros((B * S, D), dtype=torch.float32, device=q.device)
    rot, rope = _rope_args(rotation, q)
    entries = _flat_entries(topk_idx, S) if K else None
    # Partials in the input dtype: bf16 rounding of a token's contribution is the rounding its P and dS already
    # get as bf16 MMA operands; fp32 inputs (the CPU tests) keep fp32.
    chunk = min(B * T, max(1, PARTIAL_CHUNK_BYTES // ((W + K) * D * q.element_size())))
    chunk_part = new_output((chunk, W + K, D), q.dtype, q.device)  # both buffers reused by every chunk
    chunk_ds = new_output((chunk, H, W + K), q.dtype, q.device)
    use_gluon = gluon_dkv_applies(q, W, K)
    use_gluon_dq = gluon_dq_applies(q, W, K)
    # the Triton dKV kernel's scratch: the rotated tails of each token's [q; dO] (the Gluon one turns them on chip)
    chunk_rope = new_output((chunk, 2 * _block_h(H), rope), q.dtype, q.device) if rope and not use_gluon else q
    shape = dict(D=D, W=W, K=K, BLOCK_H=_block_h(H), ROPE=rope)
    for tok0 in range(0, B * T, chunk):
        n = min(chunk, B * T - tok0)
        part = chunk_part[:n]
        dkv_step(use_gluon, part, chunk_ds[:n], dsink, tok0, kv_window, q, dout, out, win_lo, idx, sink, rot, lse,
                 chunk_rope, comp_offset, S, scale, W, rope)
        if use_gluon_dq:
            gluon_dq.launch(kv_window, win_lo, idx, chunk_ds[:n], rot, dq, tok0, comp_offset, T, S, H, D=D, W=W,
                            K=K, ROPE=rope)
        else:
            _bwd_dq_kernel[(n,)](kv_window, win_lo, idx, chunk_ds, rot, dq, tok0, comp_offset, T, S, H, **shape)
        triton_dkv.reduce_window(part, dkvw, tok0, W)
        if K:
            triton_dkv.reduce_selected(part, dkvc, entries[tok0:tok0 + n], W)
    return (dq, dkvw.view(kv_window.shape).to(kv_window.dtype), dkvc.view(B, S, D).to(q.dtype),
            dsink.sum((0, 1)).to(sink.dtype))


def dkv_step(gluon: bool, part, ds, dsink, tok0, kv_window, q, dout, out, win_lo, idx, sink, rot, lse, scratch,
             comp_offset, S, scale, window, rope):
    """The backward's first step for a chunk of tokens tok0 + [0, n): their partial dKV rows ``part`` [n, W + K, D],
    dS rows ``ds`` [n, H, W + K] and dsink, by the Gluon kernel (``gluon_dkv``) or ``_bwd_dkv_kernel`` (``scratch``:
    its [n, 2 BLOCK_H, rope] rotated tails)."""
    B, T, H, D = q.shape
    K = part.shape[1] - window
    if gluon:
        gluon_dkv.launch(kv_window, q, dout, out, win_lo, idx, sink, rot, lse, part, ds, dsink, tok0, comp_offset, T, S,
                         H, scale, D=D, W=window, K=K, ROPE=rope)
    else:
        _bwd_dkv_kernel[(part.shape[0],)](kv_window, q, dout, out, win_lo, idx, sink, rot, scratch, lse, part, ds,
                                          dsink, tok0, comp_offset, T, S, H, scale, D=D, W=window, K=K,
                                          BLOCK_H=_block_h(H), ROPE=rope)


@_sparse_attention_bwd.register_fake
def _(dout, q, kv_window, win_lo, kv_comp, topk_idx, sink, rotation, out, lse, scale, window):
    n_entries = kv_comp.shape[1] if topk_idx is not None else 0
    return (q.new_empty(q.shape), kv_window.new_empty(kv_window.shape),
            q.new_empty((q.shape[0], n_entries, q.shape[-1])), sink.new_empty(sink.shape))


def _setup_context(ctx, inputs, output):
    q, kv_window, win_lo, kv_comp, topk_idx, sink, rotation, scale, window, _ = inputs
    out, lse, _ = output
    ctx.save_for_backward(q, kv_window, win_lo, kv_comp, topk_idx, sink, rotation, out, lse)
    ctx.scale, ctx.window = scale, window


def _backward(ctx, dout, _dlse, _dmass):
    """Gradients of out only: lse and the selected mass are outputs without gradient (the mass is the indexer's
    detached target, as in the reference)."""
    q, kv_window, win_lo, kv_comp, topk_idx, sink, rotation, out, lse = ctx.saved_tensors
    dq, dkvw, dkvc, dsink = _sparse_attention_bwd(dout, q, kv_window, win_lo, kv_comp, topk_idx, sink, rotation, out,
                                                  lse, ctx.scale, ctx.window)
    return dq, dkvw, None, (dkvc if kv_comp is not None else None), None, dsink, None, None, None, None


_sparse_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def sparse_attention(q, kv_window, win_lo, kv_comp, topk_idx, sink, scale: float, window: int, rotation=None,
                     with_mass: bool = True):
    """Same contract as ``kernels.reference.sparse_attention``: (out, selected_mass or None)."""
    if rotation is not None and rotation.dtype != torch.complex64:
        raise ValueError(f"sparse_attention: Triton takes a complex64 rotation, got {rotation.dtype}")
    pairs = torch.view_as_real(rotation.contiguous()) if rotation is not None else None
    out, _, mass = _sparse_attention_fwd(q, kv_window, win_lo, kv_comp, topk_idx, sink, pairs, scale, window,
                                         with_mass)
    return out, (mass.detach() if topk_idx is not None and with_mass else None)

