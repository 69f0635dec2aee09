"""GEMMs on a frozen matrix kept in DeepSeek's released block-scaled form (SPEC §6): ``x Wᵀ`` and its backward to
the input ``dy W``, two ways on the same decode:
- fused (``quant_gemm``): W dequantised one tile at a time in registers, never written out, for few rows a matrix
  (a product bound by reading W);
- transient (``dequantize_stack``, then torch's GEMM): the matrix, or one rank's stack of an expert matrix, decoded
  into a buffer freed after the product, for many rows a matrix, where the fused kernel's decode in its main loop
  costs more than the buffer's bytes (``model/quantized_base.py``'s ``DEQUANT_ROWS`` says which).

W is ``[E, N, K]`` (E = 1: one linear; E > 1: a stack of routed experts whose rows of x arrive sorted by expert,
``counts[e]`` of each). Its codes are FP8 e4m3 bytes ``[E, N, K]`` or FP4 e2m1 nibbles packed two a byte along K
(``[E, N, K / 2]``, the low nibble the even column), its scales e8m0 bytes ``[E, ⌈N/R⌉, ⌈K/C⌉]``, one per R x C
block (32 x 32 for FP8 matrices, 1 x 32 for FP4 experts). The codes are decoded from their bits here (integer
shifts and masks, no hardware conversion), so the same kernel runs under the interpreter on a CPU and on any GPU;
a code times its power-of-two scale is exact in fp32 (and in bf16), so a tile equals the dequantise-then-bf16
path's bit for bit and the product differs from it only by the GEMM's summation order.

How a tile is decoded (``_decode_tile``), whichever product it feeds: always as ``W[e][n0:n0+TN, k0:k0+TK]``, read
in the codes' own layout, contiguous along K (coalesced, vector loads; an FP4 tile is ``[TN, TK/2]`` bytes whose two
nibbles are decoded apart and interleaved back with ``tl.join``); the forward multiplies by its transpose.
- A code's bits are moved into an fp32's exponent and mantissa fields, where they read as the code's value times a
  fixed power of two (e4m3's 4 exponent bits and 3 mantissa bits at fp32 bits 26..20: ``2^-120`` times its value,
  its subnormals landing on fp32 subnormals; e2m1's 2 + 1 at bits 24..22: ``2^-126``), the sign to bit 31; one
  multiply by ``2^120`` (``2^126``) gives the value, exactly. e4m3's S.1111.111 is NaN.
- The scale, one byte per block (a ``[TN/R, TK/C]`` tile, broadcast over its blocks by a reshape), is built from
  its bits: ``byte << 23`` is ``2^(byte-127)`` for 1..254, 0 is the subnormal ``2^-127``, 255 NaN. The second
  multiply, by it, is exact (every code times every scale is an fp32, or overflows to inf as the reference does).
  Both multiplies need fp32 subnormals kept (no flush to zero), which Triton's plain fp32 multiply does.
- Out of ``N x K`` a code reads 0 (its load masked), so its value is 0 times its block's scale: 0, or NaN where
  that scale is NaN (255). Such a NaN reaches only outputs the block's own codes inside the matrix already make NaN
  (the same row of W forward, the same column backward), so the tile needs no zeroing past the edge and the
  products' NaNs are the reference's. The full steps carry no mask on the reduced axis, the last, partial one
  does.
The decode costs 10 to 16 instructions an element (the whole loop's SASS for sm_90a over the tile's elements, loads,
conversion to bf16 and the tile's store to shared memory included: FP4 / FP8 about 10 / 11 at GROUPED's tiles, 15 /
16 at PLAIN's, whose steps decode half the elements), against ``2 BM`` tensor-core FLOPs: the row tiles are
large (``BM`` 128, and 256 where the matrices have many rows each) so that a decoded tile serves many rows, and the
grid's row tiles vary fastest, so the programs that decode the same column block of W run together and read its
bytes from L2. Each step's scale bytes (a few a row, too few for the compiler's asynchronous copies) are loaded a
step ahead.

Grouping without a host sync: the row tiles of every expert are laid out on the device (``tile_table``: a tile's
expert, first row and end row, from ``counts`` by a cumulative sum and a ``searchsorted``), over a grid sized by
the bound ``⌈M / BM⌉ + E``; the tiles past the last expert's exit at once.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.triton_common import INTERPRET, new_output


class Tiles(NamedTuple):
    """One launch shape: rows of x (BM), output columns (BP) and reduced columns (BQ) per program and step, and the
    launch's warps, pipeline stages and register cap (None: the compiler's choice)."""
    BM: int
    BP: int
    BQ: int
    warps: int
    stages: int
    maxnreg: int | None


# GROUPED: a stack of experts (about 128 rows each at the plan's shapes); PLAIN: matrices of many rows each (one
# linear, wo_a's groups), whose rows share every decoded tile: twice the rows, half the columns. Both hold two
# programs an SM (128 registers a thread, at most ~82 KB of shared memory; compiled without spills), so that one
# program's decode runs while the other's wgmma does: within a program the decoded tile goes through shared memory
# and the compiler waits for each wgmma before the next decode. The interpreter's are small (the tests cross tiles)
# but still hold whole 32 x 32 scale blocks.
GROUPED, PLAIN = ((Tiles(16, 32, 32, 4, 1, None),) * 2 if INTERPRET else
                  (Tiles(128, 128, 64, 8, 3, 128), Tiles(256, 64, 64, 8, 2, 128)))
PLAIN_ROWS = 2 * PLAIN.BM  # matrices of at least this many rows on average take PLAIN's tiles
# A code's bits moved into fp32's fields (these masks: the sign bit and the magnitude's) read as its value times
# 2^-120 (e4m3) / 2^-126 (e2m1). Globals a @triton.jit body reads must be constexprs; the masks as int32.
E4M3_BITS, E4M3_SHIFT = tl.constexpr(0x87F00000 - 2 ** 32), tl.constexpr(2.0 ** 120)
E2M1_BITS, E2M1_SHIFT = tl.constexpr(0x81C00000 - 2 ** 32), tl.constexpr(2.0 ** 126)


@triton.jit
def _scale_bytes(SCALE, expert, n0, k0, scale_rows, scale_cols, TN: tl.constexpr, TK: tl.constexpr, R: tl.constexpr,
                 C: tl.constexpr):
    """The e8m0 bytes (int32) of the blocks of ``W[expert][n0:n0+TN, k0:k0+TK]``: ``[TN / R, TK / C]``, those past
    the scale tensor's edge 127 (one)."""
    sr = n0 // R + tl.arange(0, TN // R)
    sc = k0 // C + tl.arange(0, TK // C)
    return tl.load(SCALE + (expert * scale_rows + sr.to(tl.int64))[:, None] * scale_cols + sc[None, :],
                   mask=(sr < scale_rows)[:, None] & (sc < scale_cols)[None, :], other=127).to(tl.int32)


@triton.jit
def _decode_tile(CODES, s, expert, n0, k0, N, K, code_stride, TN: tl.constexpr, TK: tl.constexpr, R: tl.constexpr,
                 C: tl.constexpr, FP4: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    """fp32 ``W[expert][n0:n0+TN, k0:k0+TK]`` (R | TN, C | TK), ``s`` its scale bytes (``_scale_bytes``). Loads are
    masked to ``N`` / ``K`` along the axes ``MASK_N`` / ``MASK_K`` name: a code outside reads 0, its value 0 times
    its block's scale (module docstring: why that is enough)."""
    n = n0 + tl.arange(0, TN)
    row = CODES + (expert * N + n.to(tl.int64)) * code_stride  # [TN] pointers to the rows' first codes
    if FP4:
        j = k0 // 2 + tl.arange(0, TK // 2)  # bytes: two columns each
        width = K // 2
    else:
        j = k0 + tl.arange(0, TK)
        width = K
    inside = None  # the load's mask, only along the axes that need one (an unmasked axis keeps vector loads)
    if MASK_N:
        inside = (n < N)[:, None]
    if MASK_K:
        inside = (j < width)[None, :] if inside is None else inside & (j < width)[None, :]
    byte = tl.load(row[:, None] + j[None, :], mask=inside, other=0 if inside is not None else None)
    # the byte sign-extended: its top bit fills bits 31..7, so that a shift that leaves bit 7 (FP8, FP4's high
    # nibble) or bit 3 (FP4's low nibble, shifted up to 31 and back) at or above bit 25 puts the sign at bit 31
    x = byte.to(tl.int8, bitcast=True).to(tl.int32)
    if FP4:  # e2m1: magnitude bits 2..0 to fp32 bits 24..22, the sign to 31; the low nibble the even column
        lo = ((x << 28) >> 6) & E2M1_BITS
        hi = (x << 18) & E2M1_BITS
        w = tl.reshape(tl.join(lo, hi), (TN, TK)).to(tl.float32, bitcast=True) * E2M1_SHIFT
    else:  # e4m3fn: magnitude bits 6..0 to fp32 bits 26..20, the sign to 31; S.1111.111 (read as ±480) is NaN
        w = ((x << 20) & E4M3_BITS).to(tl.float32, bitcast=True) * E4M3_SHIFT
        w = tl.where(tl.abs(w) == 480.0, float("nan"), w)
    # e8m0: 2^(s-127) as fp32 bits s << 23; 0 the subnormal 2^-127 (bit 22), 255 a NaN (exponent 255, bit 22)
    scale = ((s << 23) | (((s == 0) | (s == 255)).to(tl.int32) << 22)).to(tl.float32, bitcast=True)
    return tl.reshape(tl.reshape(w, (TN // R, R, TK // C, C)) * scale[:, None, :, None], (TN, TK))


@triton.jit
def _step_scales(SCALE, expert, p0, start, scale_rows, scale_cols, R: tl.constexpr, C: tl.constexpr,
                 TRANSPOSE: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr):
    """The scale bytes of the tile the step at reduced column ``start`` decodes."""
    if TRANSPOSE:
        s = _scale_bytes(SCALE, expert, start, p0, scale_rows, scale_cols, BQ, BP, R, C)
    else:
        s = _scale_bytes(SCALE, expert, p0, start, scale_rows, scale_cols, BP, BQ, R, C)
    return s


@triton.jit
def _step(acc, X, CODES, s, expert, rows, live, p0, start, N, K, Q: tl.constexpr, code_stride, R: tl.constexpr,
          C: tl.constexpr, FP4: tl.constexpr, TRANSPOSE: tl.constexpr, PRECISION: tl.constexpr, BP: tl.constexpr,
          BQ: tl.constexpr, TAIL: tl.constexpr):
    """``acc`` plus the product over the reduced columns ``[start, start + BQ)``, ``s`` the tile's scale bytes;
    ``TAIL``: the last, partial step (masked past ``Q``)."""
    q = start + tl.arange(0, BQ)
    if TAIL:
        a = tl.load(X + rows[:, None] * Q + q[None, :], mask=live[:, None] & (q < Q)[None, :], other=0.0)
    else:
        a = tl.load(X + rows[:, None] * Q + q[None, :], mask=live[:, None], other=0.0)
    if TRANSPOSE:  # W[e] itself: [BQ over N, BP over K]
        w = _decode_tile(CODES, s, expert, start, p0, N, K, code_stride, BQ, BP, R, C, FP4, TAIL, True)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    else:  # W[e]ᵀ: decoded as [BP over N, BQ over K]
        w = _decode_tile(CODES, s, expert, p0, start, N, K, code_stride, BP, BQ, R, C, FP4, True, TAIL)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _quant_gemm_kernel(X, CODES, SCALE, OUT, TILE_EXPERT, TILE_ROW, TILE_END, N, K, P, Q: tl.constexpr, code_stride,
                       scale_rows, scale_cols, R: tl.constexpr, C: tl.constexpr, FP4: tl.constexpr,
                       TRANSPOSE: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr,
                       BQ: tl.constexpr):
    """``OUT[m, p] = Σ_q X[m, q] · W'[q, p]`` for the rows m of one row tile (one expert's), one column block p:
    ``W' = W[e]ᵀ`` (forward: P = N, Q = K) or with ``TRANSPOSE`` ``W' = W[e]`` (backward to x: P = K, Q = N). Q, the
    reduced width, is a compile-time constant: the loop's bound (a model has a handful of widths); the full steps
    run unmasked along it, a partial last one masked. ``code_stride``: bytes a row of codes (K, or K / 2 for FP4),
    an argument so that the compiler sees it 16-divisible (vector loads) when it is."""
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows = tl.load(TILE_ROW + tile).to(tl.int64) + tl.arange(0, BM)
    live = rows < tl.load(TILE_END + tile)
    p0 = tl.program_id(1) * BP
    acc = tl.zeros([BM, BP], dtype=tl.float32)
    FULL: tl.constexpr = Q // BQ * BQ
    s = _step_scales(SCALE, expert, p0, 0, scale_rows, scale_cols, R, C, TRANSPOSE, BP, BQ)
    for start in range(0, FULL, BQ):
        s_next = _step_scales(SCALE, expert, p0, start + BQ, scale_rows, scale_cols, R, C, TRANSPOSE, BP, BQ)
        acc = _step(acc, X, CODES, s, expert, rows, live, p0, start, N, K, Q, code_stride, R, C, FP4, TRANSPOSE,
                    PRECISION, BP, BQ, False)
        s = s_next
    if FULL < Q:
        acc = _step(acc, X, CODES, s, expert, rows, live, p0, FULL, N, K, Q, code_stride, R, C, FP4, TRANSPOSE,
                    PRECISION, BP, BQ, True)
    p = p0 + tl.arange(0, BP)
    tl.store(OUT + rows[:, None] * P + p[None, :], acc.to(OUT.dtype.element_ty),
             mask=live[:, None] & (p < P)[None, :])


def tile_table(counts: torch.Tensor, n_rows: int, block_rows: int) -> tuple[torch.Tensor, ...]:
    """Per row tile (``⌈n_rows / block_rows⌉ + E`` of them, a bound that needs no host sync): its expert (-1: idle),
    first row and end row, each expert's rows ``[start_e, start_e + counts[e])`` cut into tiles of ``block_rows``."""
    n_experts = counts.numel()
    ends = counts.cumsum(0)
    starts = ends - counts
    tiles = (counts + block_rows - 1) // block_rows
    tile_ends = tiles.cumsum(0)
    index = torch.arange(triton.cdiv(n_rows, block_rows) + n_experts, device=counts.device)
    expert = torch.searchsorted(tile_ends, index, right=True)
    held = expert.clamp(max=n_experts - 1)
    first = starts[held] + (index - (tile_ends - tiles)[held]) * block_rows
    return (torch.where(expert < n_experts, held, -1).to(torch.int32), first.to(torch.int64),
            ends[held].to(torch.int64))


def tiles_for(n_rows: int, n_experts: int) -> Tiles:
    """The launch shape: PLAIN where the matrices have ``PLAIN_ROWS`` rows each on average, else GROUPED."""
    return PLAIN if n_rows >= PLAIN_ROWS * n_experts else GROUPED


def _check_block(block: tuple[int, int], t: Tiles):
    """A scale block must tile the kernel's tiles: R and C powers of two no larger than the smallest tile side."""
    side = min(t.BP, t.BQ)
    if any(b < 1 or b & (b - 1) or b > side for b in block):
        raise ValueError(f"quant_gemm: scale blocks {block} do not tile {side} x {side}: use powers of two <= {side}")


def quant_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor | None,
               fp4: bool, block: tuple[int, int], shape: tuple[int, int], transpose: bool = False,
               tiles: Tiles | None = None) -> torch.Tensor:
    """``x [M, K] -> [M, N]``, row ``m`` (of expert e) times ``W[e]ᵀ``; with ``transpose`` ``x [M, N] -> [M, K]``
    times ``W[e]``. ``codes``/``scale`` as the module docstring says (uint8 views, experts first, contiguous),
    ``shape`` the dequantised ``(N, K)``, ``counts`` [E] rows per expert (None: E = 1). Output in x's dtype.
    ``tiles``: another launch shape than ``tiles_for``'s (a benchmark's sweep, ``bench/quant_gemm.py``)."""
    x = x.contiguous()
    (M, Q), (N, K) = x.shape, shape
    P = K if transpose else N
    if Q != (N if transpose else K):
        raise ValueError(f"quant_gemm: x has {Q} columns, the matrix is {N} x {K} (transpose={transpose})")
    if counts is None:
        counts = torch.full((1,), M, dtype=torch.int64, device=x.device)
    t = tiles or tiles_for(M, counts.numel())
    _check_block(block, t)
    out = new_output((M, P), x.dtype, x.device)
    if M == 0:
        return out
    experts, first, end = tile_table(counts, M, t.BM)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 exactly; tf32 is unused for 16-bit inputs
    codes, scale = codes.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)
    grid = (experts.numel(), triton.cdiv(P, t.BP))  # row tiles fastest: a column block's programs run together
    _quant_gemm_kernel[grid](x, codes, scale, out, experts, first, end, N, K, P, Q, codes.shape[-1], scale.shape[-2],
                             scale.shape[-1], block[0], block[1], fp4, transpose, precision, BM=t.BM, BP=t.BP,
                             BQ=t.BQ, num_warps=t.warps, num_stages=t.stages,
                             **({"maxnreg": t.maxnreg} if t.maxnreg else {}))
    return out


@triton.jit
def _dequant_kernel(CODES, SCALE, OUT, N, K, code_stride, scale_rows, scale_cols, out_stride, TN: tl.constexpr,
                    TK: tl.constexpr, R: tl.constexpr, C: tl.constexpr, FP4: tl.constexpr, MASK_N: tl.constexpr,
                    MASK_K: tl.constexpr):
    """``OUT[e, n0:n0+TN, k0:k0+TK]`` = the tile ``_decode_tile`` gives the GEMM; OUT's matrices ``out_stride``
    values apart, each ``[N, K]`` contiguous."""
    n0, k0, expert = tl.program_id(0) * TN, tl.program_id(1) * TK, tl.program_id(2).to(tl.int64)
    s = _scale_bytes(SCALE, expert, n0, k0, scale_rows, scale_cols, TN, TK, R, C)
    w = _decode_tile(CODES, s, expert, n0, k0, N, K, code_stride, TN, TK, R, C, FP4, MASK_N, MASK_K)
    n, k = n0 + tl.arange(0, TN), k0 + tl.arange(0, TK)
    tl.store(OUT + expert * out_stride + n.to(tl.int64)[:, None] * K + k[None, :], w.to(OUT.dtype.element_ty),
             mask=(n < N)[:, None] & (k < K)[None, :])


DEQUANT_TILE = (32, 32) if INTERPRET else (32, 256)  # (TN, TK), holding whole 32 x 32 scale blocks
DEQUANT_WARPS = 4


def dequantize_stack(codes: torch.Tensor, scale: torch.Tensor, fp4: bool, block: tuple[int, int],
                     shape: tuple[int, int], dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``codes * scale`` of every matrix of the stack, ``[E, N, K]`` in ``dtype``: one pass over the stored bytes,
    each tile decoded exactly as the GEMM decodes it (``model/quant.py``'s ``dequantize``, bit for bit). ``out``: where
    to write it, a ``[E, N, K]`` view whose rows are contiguous (the matrix's rows of a stack of several)."""
    (N, K), (TN, TK) = shape, DEQUANT_TILE
    codes, scale = codes.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)
    _check_block(block, Tiles(0, TN, TK, 0, 0, None))
    if out is None:
        out = new_output((codes.shape[0], N, K), dtype, codes.device)
    if out.shape != (codes.shape[0], N, K) or out.stride()[1:] != (K, 1):
        raise ValueError(f"dequantize_stack: out is {tuple(out.shape)} with strides {out.stride()}, the stack "
                         f"[{codes.shape[0]}, {N}, {K}] with contiguous rows")
    if out.numel():
        _dequant_kernel[(triton.cdiv(N, TN), triton.cdiv(K, TK), codes.shape[0])](
            codes, scale, out, N, K, codes.shape[-1], scale.shape[-2], scale.shape[-1], out.stride(0), TN=TN,
            TK=TK, R=block[0], C=block[1], FP4=fp4, MASK_N=N % TN != 0, MASK_K=K % TK != 0,
            num_warps=DEQUANT_WARPS)
    return out


def _product(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor | None, transpose: bool) -> torch.Tensor:
    """``x W[e]ᵀ`` (``transpose``: ``x W[e]``) of the rows of each expert, W ``[E, N, K]`` dense: torch's GEMMs."""
    if counts is None:
        return x @ w[0] if transpose else F.linear(x, w[0])
    return F.grouped_mm(x, w if transpose else w.mT, offs=counts.cumsum(0, dtype=torch.int32))


class StackedTransientMatmul(torch.autograd.Function):
    """One or more matrices of one input width stacked by rows (w1 over w3: ``[E, ΣN, K]``) decoded into one buffer
    and multiplied once, forward and backward to x: one GEMM, where a GEMM per matrix would join the outputs by
    columns and sum the inputs' gradients."""

    @staticmethod
    def forward(ctx, x, counts, fp4, block, widths, K, *stored):
        ctx.save_for_backward(counts, *stored)
        ctx.meta = fp4, block, widths, K
        return _product(x.contiguous(), StackedTransientMatmul.stack(stored, *ctx.meta, x.dtype), counts, False)

    @staticmethod
    def backward(ctx, grad):
        counts, *stored = ctx.saved_tensors
        dx = _product(grad.contiguous(), StackedTransientMatmul.stack(stored, *ctx.meta, grad.dtype), counts, True)
        return dx, None, None, None, None, None, *([None] * len(stored))

    @staticmethod
    def stack(stored, fp4, block, widths, K, dtype) -> torch.Tensor:
        codes = stored[0::2]
        w = new_output((codes[0].shape[0], sum(widths), K), dtype, codes[0].device)
        start = 0
        for c, s, n in zip(codes, stored[1::2], widths):
            dequantize_stack(c, s, fp4, block, (n, K), dtype, out=w[:, start:start + n])
            start += n
        return w


def stacked_transient_matmul(x: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, int]],
                             counts: torch.Tensor | None, fp4: bool, block: tuple[int, int], K: int) -> torch.Tensor:
    """``x [M, K] -> [M, ΣN]``: the product with the matrices ``parts`` (``(codes, scale, N)`` each, one format and
    input width K) stacked by rows, through one transient buffer (``StackedTransientMatmul``)."""
    stored = [t for codes, scale, _ in parts for t in (codes, scale)]
    return StackedTransientMatmul.apply(x, counts, fp4, tuple(block), tuple(n for *_, n in parts), K, *stored)


class QuantMatmul(torch.autograd.Function):
    """``quant_gemm`` with its backward to x (the matrix is frozen: no gradient of its own)."""

    @staticmethod
    def forward(ctx, x, codes, scale, counts, fp4, block, shape):
        ctx.save_for_backward(codes, scale, counts)
        ctx.meta = fp4, block, shape
        return quant_gemm(x, codes, scale, counts, fp4, block, shape)

    @staticmethod
    def backward(ctx, grad):
        codes, scale, counts = ctx.saved_tensors
        return quant_gemm(grad, codes, scale, counts, *ctx.meta, transpose=True), None, None, None, None, None, None


def quant_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor | None, fp4: bool,
                 block: tuple[int, int], shape: tuple[int, int], dequantize: bool = False) -> torch.Tensor:
    """Differentiable ``x W[e]ᵀ`` (backward ``dy W[e]``): fused (``QuantMatmul``), or with ``dequantize`` through a
    transient copy (``stacked_transient_matmul`` of one matrix), whose rows must be 16-byte multiples (torch's
    grouped GEMM strides them so)."""
    if dequantize:
        return stacked_transient_matmul(x, [(codes, scale, shape[0])], counts, fp4, block, shape[1])
    return QuantMatmul.apply(x, codes, scale, counts, fp4, tuple(block), tuple(shape))
