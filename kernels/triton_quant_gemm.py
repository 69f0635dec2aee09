"""GEMMs on a frozen matrix kept in DeepSeek's released block-scaled form (SPEC §6): ``x Wᵀ`` and its backward to
the input ``dy W``, with W dequantised one tile at a time in registers and never written out whole.

W is ``[E, N, K]`` (E = 1: one linear; E > 1: a stack of routed experts whose rows of x arrive sorted by expert,
``counts[e]`` of each). Its codes are FP8 e4m3 bytes ``[E, N, K]`` or FP4 e2m1 nibbles packed two a byte along K
(``[E, N, K / 2]``, the low nibble the even column), its scales e8m0 bytes ``[E, ⌈N/R⌉, ⌈K/C⌉]``, one per R x C
block (32 x 32 for FP8 matrices, 1 x 32 for FP4 experts). The codes are decoded from their bits here (sign,
exponent, mantissa) rather than by a hardware conversion, so the same kernel runs under the interpreter on a CPU
and on any GPU; a code times its power-of-two scale is exact in bf16, so a tile equals the dequantise-then-bf16
path's bit for bit and the product differs from it only by the GEMM's summation order.

Grouping without a host sync: the row tiles of every expert are laid out on the device (``tile_table``: a tile's
expert, first row and end row, from ``counts`` by a cumulative sum and a ``searchsorted``), over a grid sized by
the bound ``⌈M / BM⌉ + E``; the tiles past the last expert's exit at once.
"""
import torch
import triton
import triton.language as tl

from kernels.triton_common import INTERPRET, new_output

# rows of x, output columns, reduced columns per program and step (the interpreter's are small: tests cross tiles)
BM, BP, BQ = (16, 16, 32) if INTERPRET else (64, 128, 64)
WARPS, STAGES = 4, 3
E8M0_BIAS = tl.constexpr(127)  # a global a @triton.jit body reads must be a constexpr (the compiler refuses others)


@triton.jit
def _decode(CODES, SCALE, expert, rows, cols, N, K, scale_rows, scale_cols, R: tl.constexpr, C: tl.constexpr,
            FP4: tl.constexpr):
    """fp32 values of ``W[expert][rows, cols]`` (broadcastable int64 index tiles), 0 outside ``N x K``."""
    inside = (rows < N) & (cols < K)
    if FP4:
        byte = tl.load(CODES + (expert * N + rows) * (K // 2) + cols // 2, mask=inside, other=0).to(tl.int32)
        code = (byte >> ((cols & 1) * 4).to(tl.int32)) & 15
        exponent, mantissa, sign = (code >> 1) & 3, (code & 1).to(tl.float32), code & 8
        magnitude = tl.where(exponent == 0, mantissa * 0.5,
                             (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32)))
    else:  # e4m3fn: bias 7, subnormals at exponent 0, S.1111.111 the only NaN
        code = tl.load(CODES + (expert * N + rows) * K + cols, mask=inside, other=0).to(tl.int32)
        exponent, mantissa, sign = (code >> 3) & 15, (code & 7).to(tl.float32), code & 128
        magnitude = tl.where(exponent == 0, mantissa * 0.001953125,  # m / 8 * 2^-6
                             (1.0 + mantissa * 0.125) * tl.exp2((exponent - 7).to(tl.float32)))
        magnitude = tl.where((code & 127) == 127, float("nan"), magnitude)
    value = tl.where(sign != 0, -magnitude, magnitude)
    scale_at = (expert * scale_rows + rows // R) * scale_cols + cols // C
    byte = tl.load(SCALE + scale_at, mask=inside, other=E8M0_BIAS).to(tl.int32)
    scale = tl.where(byte == 255, float("nan"), tl.exp2((byte - E8M0_BIAS).to(tl.float32)))
    return tl.where(inside, value * scale, 0.0)


@triton.jit
def _quant_gemm_kernel(X, CODES, SCALE, OUT, TILE_EXPERT, TILE_ROW, TILE_END, N, K, P, Q: tl.constexpr, scale_rows,
                       scale_cols, R: tl.constexpr, C: tl.constexpr, FP4: tl.constexpr, TRANSPOSE: tl.constexpr,
                       PRECISION: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr):
    """``OUT[m, p] = Σ_q X[m, q] · W'[q, p]`` for the rows m of one row tile (one expert's), one column block p:
    ``W' = W[e]ᵀ`` (forward: P = N, Q = K) or with ``TRANSPOSE`` ``W' = W[e]`` (backward to x: P = K, Q = N). Q, the
    reduced width, is a compile-time constant: the loop's bound (a model has a handful of widths)."""
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows = tl.load(TILE_ROW + tile).to(tl.int64) + tl.arange(0, BM)
    live = rows < tl.load(TILE_END + tile)
    p = tl.program_id(1) * BP + tl.arange(0, BP).to(tl.int64)
    acc = tl.zeros([BM, BP], dtype=tl.float32)
    for start in range(0, Q, BQ):
        q = start + tl.arange(0, BQ).to(tl.int64)
        a = tl.load(X + rows[:, None] * Q + q[None, :], mask=live[:, None] & (q < Q)[None, :], other=0.0)
        if TRANSPOSE:
            w = _decode(CODES, SCALE, expert, q[:, None], p[None, :], N, K, scale_rows, scale_cols, R, C, FP4)
        else:
            w = _decode(CODES, SCALE, expert, p[None, :], q[:, None], N, K, scale_rows, scale_cols, R, C, FP4)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
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


def quant_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor | None,
               fp4: bool, block: tuple[int, int], shape: tuple[int, int], transpose: bool = False) -> torch.Tensor:
    """``x [M, K] -> [M, N]``, row ``m`` (of expert e) times ``W[e]ᵀ``; with ``transpose`` ``x [M, N] -> [M, K]``
    times ``W[e]``. ``codes``/``scale`` as the module docstring says (uint8 views, experts first), ``shape`` the
    dequantised ``(N, K)``, ``counts`` [E] rows per expert (None: E = 1). Output in x's dtype."""
    x = x.contiguous()
    (M, Q), (N, K) = x.shape, shape
    P = K if transpose else N
    if Q != (N if transpose else K):
        raise ValueError(f"quant_gemm: x has {Q} columns, the matrix is {N} x {K} (transpose={transpose})")
    if counts is None:
        counts = torch.full((1,), M, dtype=torch.int64, device=x.device)
    out = new_output((M, P), x.dtype, x.device)
    if M == 0:
        return out
    experts, first, end = tile_table(counts, M, BM)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 exactly; tf32 is unused for 16-bit inputs
    grid = (experts.numel(), triton.cdiv(P, BP))
    _quant_gemm_kernel[grid](x, codes.view(torch.uint8), scale.view(torch.uint8), out, experts, first, end, N, K, P,
                             Q, scale.shape[-2], scale.shape[-1], block[0], block[1], fp4, transpose, precision,
                             BM=BM, BP=BP, BQ=BQ, num_warps=WARPS, num_stages=STAGES)
    return out


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
                 block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Differentiable ``quant_gemm`` (forward ``x W[e]ᵀ``, backward ``dy W[e]``)."""
    return QuantMatmul.apply(x, codes, scale, counts, fp4, tuple(block), tuple(shape))
