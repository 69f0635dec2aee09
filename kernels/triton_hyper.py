"""The hyper-connected stream's mixing (``model/hyper.py``, SPEC §5.2): a sublayer's ``hc_pre`` and ``hc_post`` and the
head's ``hc_collapse``, forward and backward, in a few passes over the stream.

A sublayer reads the stream X [N, hc, D] (bf16 under bf16 autocast, as the reference keeps it) three ways: the mixes'
projection ``X fn^T`` with one RMS statistic, the collapse ``sum_c pre_c X_c`` into its input, and the expand ``out_k =
post_k y + sum_j comb[j,k] X_j`` of its output. Everything here is bound by the stream's bytes; the arithmetic (a
[N, hc D] x [hc D, (2+hc) hc] projection, the Sinkhorn iterations on hc x hc per token) is small. So:
- forward, ``_pre_fwd``: one read of X makes the projection (tensor cores: a bf16 stream against fn's two bf16
  parts, ~2^-16 of fp32; an fp32 stream in tf32x3), the statistic and the collapse, each program over a token block
  and a share of the columns (partial projections and statistics), then ``_sinkhorn_fwd`` adds the partials and
  turns the projection into pre, post and comb: all ``iters`` Sinkhorn rounds of a token in registers, one launch
  (PyTorch runs them as ~300 launches of [N, hc, hc] elementwise ops per sublayer);
  ``_expand_fwd`` reads X and y once and writes the new stream, a program per tile of tokens x columns.
- backward: ``_expand_bwd`` reads X and the output gradient G once and writes dX_j = sum_k comb[j,k] G_k, dy, and
  each column block's partial dpost, dcomb (summed over the blocks after). ``hc_post`` leaves that dX in the
  ``StreamGrad`` link instead of returning it, and ``_pre_bwd``, which reads X once more to write dX = the collapse's,
  the projection's and the statistic's gradients, adds it in the same pass, in place: the stream's gradient is
  accumulated there, not by autograd's separate add over the stream. (Handing over G and comb instead, for
  ``_pre_bwd`` to form the expand's dX itself, saves a write and a read of the stream, but each copy's program then
  reads all hc copies of G: at V4.1's width on an H100 its pass took 1.8x as long, the sublayer's 1.3x.)
  ``_sinkhorn_bwd`` runs the Sinkhorn rounds again, keeping each round's matrix in a scratch buffer, and goes back
  through them.
  Sums over tokens (dfn, dscale, dbase, dpre) are per-program partials added once after: no atomics, bitwise
  repeatable.
Each kernel computes in fp32 and rounds once to its output's dtype.
"""
import torch
import triton
import triton.language as tl

from kernels.reference import StreamMix
from kernels.triton_common import INTERPRET, new_output

# Tiles and warps, each kernel's fastest of those timed on an H100 at 64K x 4 x 5,120 and x 1,024 (a bf16 stream;
# bench_kernels.bench_hyper times the alternatives).
BLOCK_N, BLOCK_D, WARPS = (16, 32, 8) if INTERPRET else (128, 64, 8)  # _pre_fwd: tokens x columns of a copy a step
PRE_SPLITS = 2 if INTERPRET else 4  # column splits of _pre_fwd (partial projections, added by _sinkhorn_fwd)
BWD_BLOCK_N, BWD_BLOCK_D, BWD_WARPS = (16, 32, 8) if INTERPRET else (32, 64, 4)  # _pre_bwd's
BACKWARD_PROGRAMS = 4096  # programs of _pre_bwd: column blocks x token splits (each split's dfn is a partial)
SINKHORN_ROWS = 16 if INTERPRET else 128  # tokens per program of the Sinkhorn kernels
TOKEN_BLOCK_D = 32 if INTERPRET else 256  # columns per program of the per-token kernels (expand, collapse)
EXPAND_TOKENS, EXPAND_WARPS = 4, 4  # tokens per program of the expand's kernels (tiles of tokens x TOKEN_BLOCK_D)


@triton.jit
def _pre_fwd(X, PRE_IN, FN, H, MPART, SQPART, n_rows, D: tl.constexpr, HC: tl.constexpr, MIX: tl.constexpr,
             MIX_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
             SPLIT_FN: tl.constexpr):
    """For the program's tokens and its share of the columns (program_id(1): SPLIT_BLOCKS column blocks): H = sum_c
    PRE_IN[c] X_c, and the partials MPART[split] = X_flat FN^T and SQPART[split] = sum(X_flat^2) over those columns,
    which ``_sinkhorn_fwd`` adds. Splitting the columns gives the GPU token blocks x splits programs (a 64K-token
    stream in blocks of 128 is 512 programs, fewer than the loads need in flight). Column block outer, copy inner,
    so that H's block is complete before it is stored. ``SPLIT_FN`` (a 16-bit stream): FN is [2, MIX, HC D] in X's
    dtype, fn's high and low parts (``_split``), so the projection is two 16-bit MMAs on X as it is, exact to ~2^-16
    of fn; else (fp32) one tf32x3 MMA, fp32's accuracy."""
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < n_rows
    rows64 = rows.to(tl.int64)
    mixes = tl.arange(0, MIX_P)
    m = tl.zeros((BLOCK_N, MIX_P), dtype=tl.float32)
    squares = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for block in range(SPLIT_BLOCKS):
        cols = (split * SPLIT_BLOCKS + block) * BLOCK_D + tl.arange(0, BLOCK_D)
        inside = live[:, None] & (cols[None, :] < D)
        h = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        for c in tl.static_range(HC):
            stored = tl.load(X + rows64[:, None] * (HC * D) + c * D + cols[None, :], mask=inside, other=0.0)
            x = stored.to(tl.float32)
            h += tl.load(PRE_IN + rows64 * HC + c, mask=live, other=0.0)[:, None] * x
            squares += x * x
            fn_t = FN + mixes[None, :] * (HC * D) + c * D + cols[:, None]  # [BLOCK_D, MIX_P] of fn^T
            fn_in = (mixes[None, :] < MIX) & (cols[:, None] < D)
            if SPLIT_FN:
                m = tl.dot(stored, tl.load(fn_t + MIX * HC * D, mask=fn_in, other=0.0), m)
                m = tl.dot(stored, tl.load(fn_t, mask=fn_in, other=0.0), m)
            else:
                m = tl.dot(x, tl.load(fn_t, mask=fn_in, other=0.0), m, input_precision="tf32x3")
        tl.store(H + rows64[:, None] * D + cols[None, :], h.to(H.dtype.element_ty), mask=inside)
    part = split * n_rows + rows64
    tl.store(MPART + part[:, None] * MIX + mixes[None, :], m, mask=live[:, None] & (mixes[None, :] < MIX))
    tl.store(SQPART + part, tl.sum(squares, axis=1), mask=live)


@triton.jit
def _mix_parts(MRAW, rows64, live, n_rows, HC: tl.constexpr, HC_P: tl.constexpr, MIX: tl.constexpr,
               SPLITS: tl.constexpr):
    """A token's projection split into its pre [R, HC_P], post [R, HC_P] and comb [R, HC_P (j), HC_P (k)] parts (0
    in the padding), the sum of the SPLITS partials MRAW [SPLITS, n_rows, MIX] holds, and the valid masks of the
    [R, HC_P] and [R, HC_P, HC_P] parts."""
    copies = tl.arange(0, HC_P)
    j, k = copies[None, :, None], copies[None, None, :]
    valid = live[:, None] & (copies[None, :] < HC)
    comb_valid = live[:, None, None] & (j < HC) & (k < HC)
    raw_pre = tl.zeros((rows64.shape[0], HC_P), dtype=tl.float32)
    raw_post = tl.zeros((rows64.shape[0], HC_P), dtype=tl.float32)
    raw_comb = tl.zeros((rows64.shape[0], HC_P, HC_P), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        row = (split * n_rows + rows64) * MIX
        raw_pre += tl.load(MRAW + row[:, None] + copies[None, :], mask=valid, other=0.0)
        raw_post += tl.load(MRAW + row[:, None] + HC + copies[None, :], mask=valid, other=0.0)
        raw_comb += tl.load(MRAW + row[:, None, None] + 2 * HC + j * HC + k, mask=comb_valid, other=0.0)
    return raw_pre, raw_post, raw_comb, valid, comb_valid


@triton.jit
def _logits(raw_pre, raw_post, raw_comb, rstd, SCALE, BASE, HC: tl.constexpr, HC_P: tl.constexpr):
    """The coefficients' logits ``m * scale + base`` of each part, m = MRAW * RSTD (padding: 0 * scale + 0)."""
    copies = tl.arange(0, HC_P)
    j, k = copies[None, :, None], copies[None, None, :]
    inner = copies < HC
    logit_pre = raw_pre * rstd[:, None] * tl.load(SCALE) + tl.load(BASE + copies, mask=inner, other=0.0)[None, :]
    logit_post = raw_post * rstd[:, None] * tl.load(SCALE + 1) + tl.load(BASE + HC + copies, mask=inner,
                                                                          other=0.0)[None, :]
    logit_comb = raw_comb * rstd[:, None, None] * tl.load(SCALE + 2) + tl.load(
        BASE + 2 * HC + j * HC + k, mask=(j < HC) & (k < HC), other=0.0)
    return logit_pre, logit_post, logit_comb


@triton.jit
def _softmax_k(logit, comb_valid, HC: tl.constexpr, HC_P: tl.constexpr):
    """softmax over k of [R, j, k] logits, 0 on padding (padded k read as -inf, padded j as a harmless 0 row)."""
    k = tl.arange(0, HC_P)[None, None, :]
    logit = tl.where(k < HC, logit, float("-inf"))
    e = tl.exp(logit - tl.max(logit, axis=2)[:, :, None])
    return tl.where(comb_valid, e / tl.sum(e, axis=2)[:, :, None], 0.0)


@triton.jit
def _step_sums(c, step):
    """The denominators of Sinkhorn step ``step`` (without hc_eps) broadcast over [R, j, k]: column sums (over j)
    on even steps, row sums (over k) on odd ones."""
    return tl.where(step % 2 == 1, tl.sum(c, axis=2)[:, :, None], tl.sum(c, axis=1)[:, None, :])


@triton.jit
def _sinkhorn_fwd(MPART, SQPART, SCALE, BASE, MRAW, RSTD, PRE, POST, COMB, n_rows, norm_eps, hc_eps,
                  D: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr, MIX: tl.constexpr, SPLITS: tl.constexpr,
                  STEPS: tl.constexpr, ROWS: tl.constexpr):
    """The projection MRAW (``_pre_fwd``'s SPLITS partials added; with one split MPART is MRAW) and RSTD =
    rsqrt(mean(X_flat^2) + norm_eps), kept for the backward; then PRE = sigmoid + hc_eps, POST = 2 sigmoid, COMB =
    softmax_k + hc_eps then STEPS normalisations (columns, then rows and columns in turn), each dividing by (sum +
    hc_eps)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    rows64 = rows.to(tl.int64)
    raw_pre, raw_post, raw_comb, valid, comb_valid = _mix_parts(MPART, rows64, live, n_rows, HC, HC_P, MIX, SPLITS)
    copies = tl.arange(0, HC_P)
    j, k = copies[None, :, None], copies[None, None, :]
    if SPLITS > 1:
        row = rows64 * MIX
        tl.store(MRAW + row[:, None] + copies[None, :], raw_pre, mask=valid)
        tl.store(MRAW + row[:, None] + HC + copies[None, :], raw_post, mask=valid)
        tl.store(MRAW + row[:, None, None] + 2 * HC + j * HC + k, raw_comb, mask=comb_valid)
    squares = tl.zeros((ROWS,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        squares += tl.load(SQPART + split * n_rows + rows64, mask=live, other=0.0)
    rstd = 1.0 / tl.sqrt(squares / (HC * D) + norm_eps)
    tl.store(RSTD + rows64, rstd, mask=live)
    logit_pre, logit_post, logit_comb = _logits(raw_pre, raw_post, raw_comb, rstd, SCALE, BASE, HC, HC_P)
    tl.store(PRE + (rows64 * HC)[:, None] + copies[None, :], tl.sigmoid(logit_pre) + hc_eps, mask=valid)
    tl.store(POST + (rows64 * HC)[:, None] + copies[None, :], 2 * tl.sigmoid(logit_post), mask=valid)
    c = tl.where(comb_valid, _softmax_k(logit_comb, comb_valid, HC, HC_P) + hc_eps, 0.0)
    for step in range(STEPS):
        c = c / (_step_sums(c, step) + hc_eps)
    tl.store(COMB + (rows64 * HC * HC)[:, None, None] + j * HC + k, c, mask=comb_valid)


@triton.jit
def _sinkhorn_bwd(MRAW, RSTD, SCALE, BASE, DPRE, DPOST, DCOMB, SCRATCH, DMRAW, COEF, PARTS, n_rows, hc_eps,
                  D: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr, MIX: tl.constexpr, STEPS: tl.constexpr,
                  ROWS: tl.constexpr):
    """From the coefficients' gradients: DMRAW = dL/dMRAW (= dL/dm * rstd), COEF = dL/drstd * drstd/dX / X per
    token (dX gets COEF * X), and this program's partial sums of dL/dbase [MIX] and dL/dscale [3] in PARTS[program].
    The forward's Sinkhorn steps run again, each step's input kept in SCRATCH [N, STEPS, HC_P, HC_P], and the
    gradient goes back through them: step t divides by s = sum + eps along its axis, so dc = (dout - sum_axis(dout *
    out)) / s."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    rows64 = rows.to(tl.int64)
    raw_pre, raw_post, raw_comb, valid, comb_valid = _mix_parts(MRAW, rows64, live, n_rows, HC, HC_P, MIX, 1)
    rstd = tl.load(RSTD + rows64, mask=live, other=0.0)
    logit_pre, logit_post, logit_comb = _logits(raw_pre, raw_post, raw_comb, rstd, SCALE, BASE, HC, HC_P)
    copies = tl.arange(0, HC_P)
    j, k = copies[None, :, None], copies[None, None, :]
    probs = _softmax_k(logit_comb, comb_valid, HC, HC_P)
    c = tl.where(comb_valid, probs + hc_eps, 0.0)
    scratch = SCRATCH + (rows64 * STEPS * HC_P * HC_P)[:, None, None] + j * HC_P + k
    for step in range(STEPS):
        tl.store(scratch + step * HC_P * HC_P, c, mask=live[:, None, None])
        c = c / (_step_sums(c, step) + hc_eps)
    g = tl.load(DCOMB + (rows64 * HC * HC)[:, None, None] + j * HC + k, mask=comb_valid, other=0.0)
    for back in range(STEPS):
        step = STEPS - 1 - back
        c = tl.load(scratch + step * HC_P * HC_P, mask=live[:, None, None], other=0.0)
        s = _step_sums(c, step) + hc_eps
        g = tl.where(comb_valid, (g - _step_sums(g * (c / s), step)) / s, 0.0)
    d_comb = tl.where(comb_valid, probs * (g - tl.sum(g * probs, axis=2)[:, :, None]), 0.0)  # softmax_k's backward
    sig_pre, sig_post = tl.sigmoid(logit_pre), tl.sigmoid(logit_post)
    d_pre = tl.load(DPRE + (rows64 * HC)[:, None] + copies[None, :], mask=valid, other=0.0) * sig_pre * (1 - sig_pre)
    d_post = tl.load(DPOST + (rows64 * HC)[:, None] + copies[None, :], mask=valid, other=0.0) * 2 * sig_post * (
        1 - sig_post)
    # d_* are the logits' gradients; the mixes' are d_* * scale, so dL/dMRAW = d_* * scale * rstd and
    # dL/drstd = sum over the mixes of d_* * scale * MRAW
    dm_pre, dm_post, dm_comb = d_pre * tl.load(SCALE), d_post * tl.load(SCALE + 1), d_comb * tl.load(SCALE + 2)
    out = DMRAW + (rows64 * MIX)[:, None]
    tl.store(out + copies[None, :], dm_pre * rstd[:, None], mask=valid)
    tl.store(out + HC + copies[None, :], dm_post * rstd[:, None], mask=valid)
    tl.store(DMRAW + (rows64 * MIX)[:, None, None] + 2 * HC + j * HC + k, dm_comb * rstd[:, None, None],
             mask=comb_valid)
    d_rstd = (tl.sum(dm_pre * raw_pre, axis=1) + tl.sum(dm_post * raw_post, axis=1)
              + tl.sum(tl.sum(dm_comb * raw_comb, axis=2), axis=1))
    tl.store(COEF + rows64, -d_rstd * rstd * rstd * rstd / (HC * D), mask=live)
    parts = PARTS + pid * (MIX + 3)
    inner = copies < HC
    tl.store(parts + copies, tl.sum(d_pre, axis=0), mask=inner)
    tl.store(parts + HC + copies, tl.sum(d_post, axis=0), mask=inner)
    tl.store(parts + 2 * HC + copies[:, None] * HC + copies[None, :], tl.sum(d_comb, axis=0),
             mask=inner[:, None] & inner[None, :])
    tl.store(parts + MIX, tl.sum(tl.sum(d_pre * raw_pre, axis=1) * rstd, axis=0))
    tl.store(parts + MIX + 1, tl.sum(tl.sum(d_post * raw_post, axis=1) * rstd, axis=0))
    tl.store(parts + MIX + 2, tl.sum(tl.sum(tl.sum(d_comb * raw_comb, axis=2), axis=1) * rstd, axis=0))


@triton.jit
def _pre_bwd_tile(X, PRE_IN, DH, DMRAW, COEF, STASH, DX, DPRE, fn, dfn, tile, column_block, c, cols,
                  col_in, mixes, mix_in, n_rows, D: tl.constexpr, HC: tl.constexpr, MIX: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_STASH: tl.constexpr):
    """``_pre_bwd`` on the tokens of one tile: writes their DX and DPRE, returns dfn with their DMRAW^T X added."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < n_rows
    rows64 = rows.to(tl.int64)
    inside = live[:, None] & col_in[None, :]
    stream = rows64[:, None] * (HC * D) + c * D + cols[None, :]
    x = tl.load(X + stream, mask=inside, other=0.0).to(tl.float32)
    dh = tl.load(DH + rows64[:, None] * D + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    dm = tl.load(DMRAW + rows64[:, None] * MIX + mixes[None, :], mask=live[:, None] & mix_in[None, :], other=0.0)
    dx = tl.load(PRE_IN + rows64 * HC + c, mask=live, other=0.0)[:, None] * dh
    dx += tl.dot(dm, fn, input_precision="tf32")
    dx += tl.load(COEF + rows64, mask=live, other=0.0)[:, None] * x
    if HAS_STASH:
        dx += tl.load(STASH + stream, mask=inside, other=0.0).to(tl.float32)
    tl.store(DX + stream, dx.to(DX.dtype.element_ty), mask=inside)
    tl.store(DPRE + (column_block * n_rows + rows64) * HC + c, tl.sum(dh * x, axis=1), mask=live)
    return tl.dot(tl.trans(dm), x, dfn, input_precision="tf32")


@triton.jit
def _pre_bwd(X, PRE_IN, FN, DH, DMRAW, COEF, STASH, DX, DFN, DPRE, n_rows, tiles_per_split, D: tl.constexpr,
             HC: tl.constexpr, MIX: tl.constexpr, MIX_P: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr, HAS_STASH: tl.constexpr, WHILE_LOOP: tl.constexpr):
    """One column block of one copy, over one split of the tokens (``tiles_per_split`` tiles of BLOCK_N): DX =
    PRE_IN[c] DH + DMRAW FN + COEF X (+ STASH, the expand's gradient, read and overwritten in place), and the
    partials DFN[split] = DMRAW^T X and DPRE[column block, token, c] = <DH, X_c> over the block's columns.
    WHILE_LOOP (the interpreter, whose ``range`` takes no runtime bound) walks the tiles with a while loop; compiled,
    a for loop, which Triton pipelines."""
    block, split = tl.program_id(0), tl.program_id(1)
    c, column_block = block % HC, block // HC  # a column block's copies side by side: they share DH in L2
    cols = column_block * BLOCK_D + tl.arange(0, BLOCK_D)
    col_in = cols < D
    mixes = tl.arange(0, MIX_P)
    mix_in = mixes < MIX
    fn = tl.load(FN + mixes[:, None] * (HC * D) + c * D + cols[None, :], mask=mix_in[:, None] & col_in[None, :],
                 other=0.0)  # [MIX_P, BLOCK_D]
    dfn = tl.zeros((MIX_P, BLOCK_D), dtype=tl.float32)
    first = split * tiles_per_split
    if WHILE_LOOP:
        tile = first
        while tile < first + tiles_per_split:
            dfn = _pre_bwd_tile(X, PRE_IN, DH, DMRAW, COEF, STASH, DX, DPRE, fn, dfn, tile, column_block,
                                c, cols, col_in, mixes, mix_in, n_rows, D, HC, MIX, BLOCK_N, BLOCK_D, HAS_STASH)
            tile += 1
    else:
        for tile in range(first, first + tiles_per_split):
            dfn = _pre_bwd_tile(X, PRE_IN, DH, DMRAW, COEF, STASH, DX, DPRE, fn, dfn, tile, column_block,
                                c, cols, col_in, mixes, mix_in, n_rows, D, HC, MIX, BLOCK_N, BLOCK_D, HAS_STASH)
    tl.store(DFN + split * MIX * HC * D + mixes[:, None] * (HC * D) + c * D + cols[None, :], dfn,
             mask=mix_in[:, None] & col_in[None, :])


@triton.jit
def _rows(base, copies, cols, HC: tl.constexpr, D: tl.constexpr):
    """Offsets of copies x columns of one token's [HC, D] block and its mask."""
    return base + copies[:, None] * D + cols[None, :], (copies[:, None] < HC) & (cols[None, :] < D)


@triton.jit
def _token_tile(n_rows, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The program's BLOCK_T tokens (int64) and BLOCK_D columns of a (token block, column block) grid, and their
    masks."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    return rows.to(tl.int64), rows < n_rows, cols, cols < D


@triton.jit
def _expand_fwd(X, Y, POST, COMB, OUT, n_rows, D: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[r, k, c] = POST[r, k] Y[r, c] + sum_j COMB[r, j, k] X[r, j, c] for the program's tokens r and columns c:
    a tile of BLOCK_T tokens, so that a program moves enough bytes to hide its loads' latency (a program per token
    moved 2 KB and left the pass at a third of HBM's rate)."""
    rows64, live, cols, col_in = _token_tile(n_rows, D, BLOCK_T, BLOCK_D)
    copies = tl.arange(0, HC_P)
    valid = live[:, None] & (copies[None, :] < HC)  # [T, k]
    inside = live[:, None] & col_in[None, :]  # [T, c]
    post = tl.load(POST + rows64[:, None] * HC + copies[None, :], mask=valid, other=0.0)
    y = tl.load(Y + rows64[:, None] * D + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    out = post[:, :, None] * y[:, None, :]
    for j in tl.static_range(HC):
        x = tl.load(X + rows64[:, None] * (HC * D) + j * D + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        comb = tl.load(COMB + rows64[:, None] * (HC * HC) + j * HC + copies[None, :], mask=valid, other=0.0)
        out += comb[:, :, None] * x[:, None, :]
    stream = rows64[:, None, None] * (HC * D) + copies[None, :, None] * D + cols[None, None, :]
    tl.store(OUT + stream, out.to(OUT.dtype.element_ty), mask=valid[:, :, None] & col_in[None, None, :])


@triton.jit
def _expand_bwd(X, Y, POST, COMB, G, DX, DY, DPOST, DCOMB, n_rows, D: tl.constexpr, HC: tl.constexpr,
                HC_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """dX_j = sum_k comb[j,k] G_k, dY = sum_k post_k G_k of the program's tokens and columns; and the column block's
    share of dCOMB[j,k] = <X_j, G_k>, dPOST_k = <G_k, Y>: partials [column block, token, ...], summed over the blocks
    after. The forward's tile of tokens x columns, one output copy k at a time."""
    rows64, live, cols, col_in = _token_tile(n_rows, D, BLOCK_T, BLOCK_D)
    copies = tl.arange(0, HC_P)
    valid = live[:, None] & (copies[None, :] < HC)  # [T, j]
    inside = live[:, None] & col_in[None, :]
    stream = rows64[:, None, None] * (HC * D) + copies[None, :, None] * D + cols[None, None, :]
    in_stream = valid[:, :, None] & col_in[None, None, :]
    x = tl.load(X + stream, mask=in_stream, other=0.0).to(tl.float32)  # [T, j, c]
    y = tl.load(Y + rows64[:, None] * D + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    dx = tl.zeros((BLOCK_T, HC_P, BLOCK_D), dtype=tl.float32)
    dy = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    part = tl.program_id(1) * n_rows + rows64
    for k in tl.static_range(HC):
        g = tl.load(G + rows64[:, None] * (HC * D) + k * D + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        comb = tl.load(COMB + rows64[:, None] * (HC * HC) + copies[None, :] * HC + k, mask=valid, other=0.0)
        dx += comb[:, :, None] * g[:, None, :]
        dy += tl.load(POST + rows64 * HC + k, mask=live, other=0.0)[:, None] * g
        tl.store(DPOST + part * HC + k, tl.sum(g * y, axis=1), mask=live)
        tl.store(DCOMB + part[:, None] * (HC * HC) + copies[None, :] * HC + k, tl.sum(x * g[:, None, :], axis=2),
                 mask=valid)
    tl.store(DX + stream, dx.to(DX.dtype.element_ty), mask=in_stream)
    tl.store(DY + rows64[:, None] * D + cols[None, :], dy.to(DY.dtype.element_ty), mask=inside)


@triton.jit
def _collapse_fwd(X, PRE, OUT, D: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[r, c] = sum_j PRE[r, j] X[r, j, c]."""
    row = tl.program_id(0).to(tl.int64)
    copies, cols = tl.arange(0, HC_P), tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offsets, inside = _rows(row * HC * D, copies, cols, HC, D)
    pre = tl.load(PRE + row * HC + copies, mask=copies < HC, other=0.0)
    x = tl.load(X + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(OUT + row * D + cols, tl.sum(pre[:, None] * x, axis=0).to(OUT.dtype.element_ty), mask=cols < D)


@triton.jit
def _collapse_bwd(X, PRE, G, DX, DPRE, D: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """dX_j = pre_j G, dPRE_j = <G, X_j> of token r."""
    row = tl.program_id(0).to(tl.int64)
    copies = tl.arange(0, HC_P)
    pre = tl.load(PRE + row * HC + copies, mask=copies < HC, other=0.0)
    dpre = tl.zeros((HC_P,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        offsets, inside = _rows(row * HC * D, copies, cols, HC, D)
        x = tl.load(X + offsets, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(G + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(DX + offsets, (pre[:, None] * g[None, :]).to(DX.dtype.element_ty), mask=inside)
        dpre += tl.sum(g[None, :] * x, axis=1)
    tl.store(DPRE + row * HC + copies, dpre, mask=copies < HC)


def _launch(x: torch.Tensor) -> tuple[int, dict]:
    """The tokens of a stream x [..., hc, D] and the per-token kernels' constexprs."""
    hc, dim = x.shape[-2:]
    return x.numel() // (hc * dim), dict(D=dim, HC=hc, HC_P=triton.next_power_of_2(hc),
                                         BLOCK_D=min(TOKEN_BLOCK_D, triton.next_power_of_2(dim)))


def _expand_grid(rows: int, consts: dict) -> tuple[int, int]:
    """The expand kernels' grid: token blocks x column blocks."""
    return triton.cdiv(rows, EXPAND_TOKENS), triton.cdiv(consts["D"], consts["BLOCK_D"])


def _split(fn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fn's high and low parts in a 16-bit ``dtype``, stacked [2, ...]: hi = fn rounded, lo = the rest rounded, so
    hi + lo holds ~16 of fp32's 24 significant bits (its own products with a 16-bit x are exact in fp32)."""
    hi = fn.to(dtype)
    return torch.stack([hi, (fn - hi.float()).to(dtype)])


class StreamGrad:
    """Where ``hc_post``'s backward leaves the expand's dX for the ``hc_pre`` backward of the same stream, which adds
    it in its own pass."""
    __slots__ = ("grad",)

    def __init__(self):
        self.grad = None


class _Pre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pre_in, fn, scale, base, iters: int, norm_eps: float, hc_eps: float, link: StreamGrad):
        x, pre_in, fn = x.contiguous(), pre_in.contiguous(), fn.contiguous()
        rows, consts = _launch(x)
        hc, dim, mix = consts["HC"], consts["D"], fn.shape[0]
        h = new_output((*x.shape[:-2], dim), x.dtype, x.device)
        block_d = min(BLOCK_D, triton.next_power_of_2(dim))
        split_blocks = triton.cdiv(triton.cdiv(dim, block_d), PRE_SPLITS)
        splits = triton.cdiv(triton.cdiv(dim, block_d), split_blocks)
        mpart = new_output((splits, rows, mix), torch.float32, x.device)
        sqpart = new_output((splits, rows), torch.float32, x.device)
        mraw = mpart[0] if splits == 1 else new_output((rows, mix), torch.float32, x.device)
        rstd = new_output((rows,), torch.float32, x.device)
        split_fn = x.dtype != torch.float32
        _pre_fwd[(triton.cdiv(rows, BLOCK_N), splits)](
            x, pre_in, _split(fn, x.dtype) if split_fn else fn, h, mpart, sqpart, rows, D=dim, HC=hc, MIX=mix,
            MIX_P=max(16, triton.next_power_of_2(mix)), BLOCK_N=BLOCK_N, BLOCK_D=block_d, SPLIT_BLOCKS=split_blocks,
            SPLIT_FN=split_fn, num_warps=WARPS)
        pre, post = (new_output(x.shape[:-1], torch.float32, x.device) for _ in range(2))
        comb = new_output((*x.shape[:-1], hc), torch.float32, x.device)
        _sinkhorn_fwd[(triton.cdiv(rows, SINKHORN_ROWS),)](mpart, sqpart, scale, base, mraw, rstd, pre, post, comb,
                                                           rows, norm_eps, hc_eps, D=dim, HC=hc, HC_P=consts["HC_P"],
                                                           MIX=mix, SPLITS=splits, STEPS=2 * iters - 1,
                                                           ROWS=SINKHORN_ROWS)
        ctx.save_for_backward(x, pre_in, fn, scale, base, mraw, rstd)
        ctx.iters, ctx.hc_eps, ctx.link = iters, hc_eps, link
        return h, pre, post, comb

    @staticmethod
    def backward(ctx, dh, dpre, dpost, dcomb):
        x, pre_in, fn, scale, base, mraw, rstd = ctx.saved_tensors
        rows, consts = _launch(x)
        hc, hc_p, dim, mix = consts["HC"], consts["HC_P"], consts["D"], fn.shape[0]
        steps = 2 * ctx.iters - 1
        programs = triton.cdiv(rows, SINKHORN_ROWS)
        scratch = torch.empty((rows, steps, hc_p, hc_p), dtype=torch.float32, device=x.device)
        dmraw = new_output((rows, mix), torch.float32, x.device)
        coef = new_output((rows,), torch.float32, x.device)
        parts = new_output((programs, mix + 3), torch.float32, x.device)
        _sinkhorn_bwd[(programs,)](mraw, rstd, scale, base, dpre.float().contiguous(), dpost.float().contiguous(),
                                   dcomb.float().contiguous(), scratch, dmraw, coef, parts, rows, ctx.hc_eps, D=dim,
                                   HC=hc, HC_P=hc_p, MIX=mix, STEPS=steps, ROWS=SINKHORN_ROWS)
        del scratch
        parts = parts.sum(0)
        stash = ctx.link.grad if ctx.link is not None else None
        if ctx.link is not None:
            ctx.link.grad = None
        dx = stash if stash is not None else new_output(x.shape, x.dtype, x.device)
        block_d = min(BWD_BLOCK_D, triton.next_power_of_2(dim))
        blocks = hc * triton.cdiv(dim, block_d)
        splits = max(1, min(triton.cdiv(rows, BWD_BLOCK_N), BACKWARD_PROGRAMS // blocks))
        tiles_per_split = triton.cdiv(triton.cdiv(rows, BWD_BLOCK_N), splits)
        splits = triton.cdiv(triton.cdiv(rows, BWD_BLOCK_N), tiles_per_split)
        dfn = new_output((splits, mix, hc * dim), torch.float32, x.device)
        dpre_in = new_output((blocks // hc, rows, hc), torch.float32, x.device)
        _pre_bwd[(blocks, splits)](x, pre_in, fn, dh.contiguous(), dmraw, coef, dx, dx, dfn, dpre_in, rows,
                                   tiles_per_split, D=dim, HC=hc, MIX=mix, MIX_P=max(16, triton.next_power_of_2(mix)),
                                   BLOCK_N=BWD_BLOCK_N, BLOCK_D=block_d, HAS_STASH=stash is not None,
                                   WHILE_LOOP=INTERPRET, num_warps=BWD_WARPS)
        return (dx, dpre_in.sum(0).view(pre_in.shape), dfn.sum(0), parts[mix:], parts[:mix],
                None, None, None, None)


class _Post(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, x, post, comb, link: StreamGrad | None):
        y, x, post, comb = (t.contiguous() for t in (y, x, post, comb))
        rows, consts = _launch(x)
        out = new_output(x.shape, x.dtype, x.device)
        _expand_fwd[_expand_grid(rows, consts)](x, y, post, comb, out, rows, **consts, BLOCK_T=EXPAND_TOKENS,
                                                 num_warps=EXPAND_WARPS)
        ctx.save_for_backward(y, x, post, comb)
        ctx.link = link
        return out

    @staticmethod
    def backward(ctx, grad):
        y, x, post, comb = ctx.saved_tensors
        rows, consts = _launch(x)
        dx, dy = new_output(x.shape, x.dtype, x.device), new_output(y.shape, y.dtype, y.device)
        blocks = triton.cdiv(consts["D"], consts["BLOCK_D"])
        dpost = new_output((blocks, *post.shape), torch.float32, x.device)
        dcomb = new_output((blocks, *comb.shape), torch.float32, x.device)
        _expand_bwd[_expand_grid(rows, consts)](x, y, post, comb, grad.contiguous(), dx, dy, dpost, dcomb, rows,
                                                **consts, BLOCK_T=EXPAND_TOKENS, num_warps=EXPAND_WARPS)
        if ctx.link is not None and ctx.needs_input_grad[1]:
            ctx.link.grad, dx = dx, None  # hc_pre's backward adds it into its own dX
        return dy, dx, dpost.sum(0), dcomb.sum(0), None


class _Collapse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pre):
        x, pre = x.contiguous(), pre.contiguous()
        rows, consts = _launch(x)
        out = new_output((*x.shape[:-2], x.shape[-1]), x.dtype, x.device)
        _collapse_fwd[(rows, triton.cdiv(consts["D"], consts["BLOCK_D"]))](x, pre, out, **consts)
        ctx.save_for_backward(x, pre)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, pre = ctx.saved_tensors
        rows, consts = _launch(x)
        dx, dpre = new_output(x.shape, x.dtype, x.device), new_output(pre.shape, torch.float32, x.device)
        _collapse_bwd[(rows,)](x, pre, grad.contiguous(), dx, dpre, **consts)
        return dx, dpre


def _check(x: torch.Tensor, *coefficients: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or any(
            c.dtype != torch.float32 for c in coefficients):
        raise ValueError(f"the Triton stream kernels take an fp32/bf16/fp16 stream and fp32 mixes; got {x.dtype} and "
                         f"{[c.dtype for c in coefficients]} (use kernel_backend=torch)")


def hc_pre(x: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           iters: int, norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, StreamMix]:
    """``kernels.reference.hc_pre``: x [..., hc, D], pre_in [..., hc], fn [(2+hc)hc, hc D], scale [3], base
    [(2+hc)hc] fp32 -> (collapsed [..., D] in x's dtype, ``StreamMix`` whose ``stream_grad`` links this pass's
    backward to ``hc_post``'s)."""
    _check(x, pre_in, fn, scale, base)
    link = StreamGrad()
    h, pre, post, comb = _Pre.apply(x, pre_in, fn, scale, base, iters, norm_eps, hc_eps, link)
    return h, StreamMix(pre, post, comb, link)


def hc_post(y: torch.Tensor, x: torch.Tensor, mix: StreamMix) -> torch.Tensor:
    """``kernels.reference.hc_post``: y [..., D], x [..., hc, D] -> [..., hc, D] in x's dtype."""
    _check(x, mix.post, mix.comb)
    return _Post.apply(y, x, mix.post, mix.comb, mix.stream_grad)


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.hc_collapse``: x [..., hc, D], pre [..., hc] fp32 -> [..., D] in x's dtype."""
    _check(x, pre)
    return _Collapse.apply(x, pre)
