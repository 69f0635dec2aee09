"""The FFNs' SwiGLU in one launch each way: the dense FFN's ``silu(gate) * up`` and a MoE expert's clamped,
weighted ``silu(min(gate, L)) * clamp(up, ±L) * w`` are one kernel family (``limit`` 0: no clamp; no weights: none).

Both FFNs compute gate and up with one GEMM (w1 and w3 stacked), so both are strided halves of h. In PyTorch the
clamped, weighted product is a chain of fp32 elementwise passes forward (two clamps, a silu, two multiplies, a cast)
and more backward (the clamps' masks, the silu's derivative, the routing weight's row sums, a cat of the halves'
gradients into h's layout): on an H200 at 64K tokens those passes took ~0.3 s of a ``small_moe`` step. Here the
forward reads h (and the row weights) once and writes the product; the backward reads h and the product's gradient
and writes dh in h's layout and, in the same pass, each row's weight gradient ``Σ_c dout · silu · up`` (a program
holds whole rows, looping over their columns, so the row sum needs no atomics). Both compute in fp32 and round once.
"""
import torch
import triton
import triton.language as tl

from kernels.triton_common import INTERPRET, new_output

BLOCK = 32 if INTERPRET else 512  # columns of a row per step (the interpreter's is small: tests cross blocks)
TILE = 128 if INTERPRET else 2048  # elements per program and step: rows per program = TILE / columns per step


@triton.jit
def _clamped(gate, up, LIMIT: tl.constexpr):
    """(min(gate, L), clamp(up, ±L)); no clamp for L = 0."""
    if LIMIT > 0:
        return tl.minimum(gate, LIMIT), tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    return gate, up


@triton.jit
def _swiglu_fwd_kernel(H, W, OUT, n_rows, I: tl.constexpr, LIMIT: tl.constexpr, WEIGHTED: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[r, c] = silu(min(H[r, c], L)) * clamp(H[r, I + c], ±L) (* W[r]) for the program's ROWS rows."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    rows = rows.to(tl.int64)
    if WEIGHTED:
        w = tl.load(W + rows, mask=live, other=0.0).to(tl.float32)
    for start in range(0, I, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = live[:, None] & (cols < I)[None, :]
        at = rows[:, None] * 2 * I + cols[None, :]
        gate, up = _clamped(tl.load(H + at, mask=inside).to(tl.float32),
                            tl.load(H + at + I, mask=inside).to(tl.float32), LIMIT)
        out = gate * tl.sigmoid(gate) * up
        if WEIGHTED:
            out = out * w[:, None]
        tl.store(OUT + rows[:, None] * I + cols[None, :], out.to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def _swiglu_bwd_kernel(H, W, DOUT, DH, DW, n_rows, I: tl.constexpr, LIMIT: tl.constexpr, WEIGHTED: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """DH[r, c] = d u' silu'(g') and DH[r, I + c] = d silu(g'), each 0 where its clamp held the value at the bound
    (clamp's convention: a value on the bound lets its gradient through), with d = dOUT (* W[r]), g', u' the clamped
    halves and silu' = s (1 + g' (1 - s)), s the sigmoid of g'; DW[r] = Σ_c dOUT silu(g') u'."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    rows = rows.to(tl.int64)
    if WEIGHTED:
        w = tl.load(W + rows, mask=live, other=0.0).to(tl.float32)
        dw = tl.zeros([ROWS], dtype=tl.float32)
    dtype = DH.dtype.element_ty
    for start in range(0, I, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = live[:, None] & (cols < I)[None, :]
        at = rows[:, None] * 2 * I + cols[None, :]
        g = tl.load(H + at, mask=inside).to(tl.float32)
        u = tl.load(H + at + I, mask=inside).to(tl.float32)
        gate, up = _clamped(g, u, LIMIT)
        d = tl.load(DOUT + rows[:, None] * I + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        s = tl.sigmoid(gate)
        silu = gate * s
        if WEIGHTED:
            dw += tl.sum(d * silu * up, axis=1)
            d = d * w[:, None]
        dgate, dup = d * up * s * (1 + gate * (1 - s)), d * silu
        if LIMIT > 0:
            dgate = tl.where(g <= LIMIT, dgate, 0.0)
            dup = tl.where((u >= -LIMIT) & (u <= LIMIT), dup, 0.0)
        tl.store(DH + at, dgate.to(dtype), mask=inside)
        tl.store(DH + at + I, dup.to(dtype), mask=inside)
    if WEIGHTED:
        tl.store(DW + rows, dw.to(DW.dtype.element_ty), mask=live)


def _launch(kernel, h: torch.Tensor, limit: float, weights: torch.Tensor | None, *tensors: torch.Tensor) -> None:
    """kernel over h's rows, a program holding whole rows (their I = width / 2 columns in steps of ``BLOCK``)."""
    half, n_rows = h.shape[-1] // 2, h.numel() // h.shape[-1]
    if n_rows == 0:
        return
    block = min(BLOCK, triton.next_power_of_2(half))
    rows = max(1, TILE // block)
    kernel[(triton.cdiv(n_rows, rows),)](h, weights, *tensors, n_rows, I=half, LIMIT=float(limit),
                                         WEIGHTED=weights is not None, ROWS=rows, BLOCK=block)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weights, limit):
        h = h.contiguous()
        flat = None if weights is None else weights.reshape(-1).contiguous()
        out = new_output((*h.shape[:-1], h.shape[-1] // 2), h.dtype, h.device)
        _launch(_swiglu_fwd_kernel, h, limit, flat, out)
        ctx.save_for_backward(h, flat)
        ctx.limit, ctx.weights_shape = limit, None if weights is None else weights.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        h, flat = ctx.saved_tensors
        dh = new_output(h.shape, h.dtype, h.device)
        dw = None if flat is None else new_output(flat.shape, flat.dtype, flat.device)
        _launch(_swiglu_bwd_kernel, h, ctx.limit, flat, dout.contiguous(), dh, dw)
        return dh, None if dw is None else dw.view(ctx.weights_shape), None


def swiglu(h: torch.Tensor, limit: float = 0.0, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.reference.swiglu``: silu(min(gate, limit)) * clamp(up, ±limit) (* weights) of h = [gate | up]
    (last dim 2I, even; ``weights`` one per row of h)."""
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu takes [gate | up] stacked along the last dim, got an odd width {h.shape[-1]}")
    if weights is not None and weights.numel() != h.numel() // h.shape[-1]:
        raise ValueError(f"swiglu takes one weight per row of h: {weights.numel()} weights for "
                         f"{h.numel() // h.shape[-1]} rows")
    return _SwiGLU.apply(h, weights, limit)
