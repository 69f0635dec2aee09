"""RMSNorm in one launch, optionally with RoPE on its output: any input dtype, fp32 accumulation, one rounding.

PyTorch's fp32 RMSNorm of a bf16 activation is three launches (upcast, norm, downcast) and a RoPE after it a
fourth (kernels/triton_rope.py); here a row is read once, normalised and scaled in fp32, its last ``rope_dim``
features rotated pairwise by the row's rotation, and written once in the input dtype. The backward is one launch
too: the incoming gradient is rotated back (RoPE is orthogonal), then the RMSNorm gradient; the weight gradient
is reduced over rows from per-program partial sums (fixed order, so it is reproducible run to run).
"""
import torch
import triton
import triton.language as tl

from kernels.triton_common import new_output, rotate_pairs


@triton.jit
def _row_tile(R, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, x_stride):
    """This program's BLOCK_R rows of [R, D] tensors: row ids, live rows, columns, element mask, element offsets
    in a row-major one and in x (rows ``x_stride`` apart: x may be a column slice of a wider GEMM output)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    cols = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (cols[None, :] < D)
    return rows, live, cols, mask, rows.to(tl.int64)[:, None] * D + cols[None, :], \
        rows.to(tl.int64)[:, None] * x_stride + cols[None, :]


@triton.jit
def _rms_norm_fwd(X, W, ROT, OUT, RSTD, R, H, x_stride, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  ROPE: tl.constexpr, BLOCK_R: tl.constexpr):
    rows, live, cols, mask, offs, x_offs = _row_tile(R, D, BLOCK_D, BLOCK_R, x_stride)
    x = tl.load(X + x_offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    y = x * rstd[:, None] * tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if ROPE:
        y = rotate_pairs(y, ROT, (rows // H).to(tl.int64)[:, None], live[:, None], 0, D, ROPE, False)
    tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=live)


@triton.jit
def _rms_norm_bwd(X, W, ROT, DOUT, RSTD, DX, DW_PART, R, H, x_stride, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  ROPE: tl.constexpr, BLOCK_R: tl.constexpr):
    """dx and this program's partial dw (row DW_PART[program]) from the saved 1/rms."""
    rows, live, cols, mask, offs, x_offs = _row_tile(R, D, BLOCK_D, BLOCK_R, x_stride)
    dy = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    if ROPE:
        dy = rotate_pairs(dy, ROT, (rows // H).to(tl.int64)[:, None], live[:, None], 0, D, ROPE, True)
    rstd = tl.load(RSTD + rows, mask=live, other=0.0)
    xhat = tl.load(X + x_offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
    g = dy * tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    dx = rstd[:, None] * (g - xhat * (tl.sum(g * xhat, 1) / D)[:, None])
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + tl.program_id(0) * D + cols, tl.sum(dy * xhat, 0), mask=cols < D)


def _launch_shape(D: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_R, num_warps): a power-of-two row width and ~8K elements a program."""
    block_d = triton.next_power_of_2(D)
    return block_d, max(1, 8192 // block_d), 8 if block_d >= 2048 else 4


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [R, D] rows of unit column stride; a view (no copy) when x is a column slice of a row-major tensor, such
    as one projection's part of a fused GEMM's output."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, rotation, rope_dim):
        rows = _rows(x)
        (R, D), H = rows.shape, (x.shape[2] if x.dim() == 4 else 1)
        block_d, block_r, warps = _launch_shape(D)
        rot = torch.view_as_real(rotation) if rotation is not None else rows  # unread without RoPE
        out = new_output(x.shape, x.dtype, x.device)
        rstd = new_output((R,), torch.float32, x.device)
        _rms_norm_fwd[(triton.cdiv(R, block_r),)](rows, weight, rot, out, rstd, R, H, rows.stride(0), eps, D,
                                                  block_d, rope_dim, block_r, num_warps=warps)
        ctx.save_for_backward(rows, weight, rotation, rstd)
        ctx.rope_dim, ctx.shape, ctx.heads = rope_dim, x.shape, H
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, weight, rotation, rstd = ctx.saved_tensors
        R, D = rows.shape
        block_d, block_r, warps = _launch_shape(D)
        programs = triton.cdiv(R, block_r)
        dx = new_output(ctx.shape, rows.dtype, rows.device)
        dw_part = new_output((programs, D), torch.float32, rows.device)
        rot = torch.view_as_real(rotation) if rotation is not None else rows
        _rms_norm_bwd[(programs,)](rows, weight, rot, grad.contiguous(), rstd, dx, dw_part, R, ctx.heads,
                                   rows.stride(0), D, block_d, ctx.rope_dim, block_r, num_warps=warps)
        return dx, dw_part.sum(0).to(weight.dtype), None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rotation: torch.Tensor | None = None,
             rope_dim: int = 0) -> torch.Tensor:
    """``kernels.reference.rms_norm``: x [..., D] (fp32/bf16/fp16), weight [D]; rotation [B, N, rope_dim/2]
    complex64 for x [B, N, (H,) D] with RoPE."""
    if x.dtype == torch.float64 or (rotation is not None and (rotation.dtype != torch.complex64 or rope_dim % 2)):
        raise ValueError(f"Triton rms_norm takes fp32/bf16/fp16 x and a complex64 rotation of an even rope_dim; got "
                         f"{x.dtype}, {None if rotation is None else rotation.dtype}, rope_dim={rope_dim}")
    return _RmsNorm.apply(x, weight, eps, None if rotation is None else rotation.contiguous(),
                          rope_dim if rotation is not None else 0)
