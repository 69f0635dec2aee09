"""SwiGLU of the FFN's stacked projection, silu(gate) * up of h = [gate | up] ([..., 2I]), one launch each way.

The FFN computes gate and up with one GEMM (w1 and w3 stacked), so both are strided halves of h. In PyTorch the
product is a silu and a multiply forward, and backward two multiplies, the silu's derivative and a cat of the two
halves' gradients back into h's layout: passes over [T, I] that read the strided halves without vector loads. On an
H200 at 64K those add up to ~0.3 s of a 7 s training step (``kernel_table`` of
``bench/results/train/train_step_csa2_65536.json``: the [65536, 4096] multiplies, silu, strided elementwise kernels
and the cat, forward, recomputed forward and backward of 40 layers). Here the forward reads h once and writes the
product, the backward reads h and the product's gradient and writes dh in h's layout; both compute in fp32 and round
once.
"""
import torch
import triton
import triton.language as tl

from kernels.triton_common import new_output

BLOCK = 1024  # columns of one row per program at most (fewer for a narrower FFN)


@triton.jit
def _swiglu_fwd_kernel(H, OUT, I: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[r, c] = silu(H[r, c]) * H[r, I + c] for the program's row r and block of columns c."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < I
    gate = tl.load(H + row * 2 * I + cols, mask=inside).to(tl.float32)
    up = tl.load(H + row * 2 * I + I + cols, mask=inside).to(tl.float32)
    tl.store(OUT + row * I + cols, (gate * tl.sigmoid(gate) * up).to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def _swiglu_bwd_kernel(H, DOUT, DH, I: tl.constexpr, BLOCK: tl.constexpr):
    """DH[r, c] = dOUT up silu'(gate) and DH[r, I + c] = dOUT silu(gate), with silu' = s (1 + gate (1 - s)), s the
    sigmoid of gate."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < I
    gate = tl.load(H + row * 2 * I + cols, mask=inside).to(tl.float32)
    up = tl.load(H + row * 2 * I + I + cols, mask=inside).to(tl.float32)
    dout = tl.load(DOUT + row * I + cols, mask=inside).to(tl.float32)
    s = tl.sigmoid(gate)
    dtype = DH.dtype.element_ty
    tl.store(DH + row * 2 * I + cols, (dout * up * s * (1 + gate * (1 - s))).to(dtype), mask=inside)
    tl.store(DH + row * 2 * I + I + cols, (dout * gate * s).to(dtype), mask=inside)


def _launch(kernel, h: torch.Tensor, *tensors: torch.Tensor) -> None:
    """kernel over h's rows x blocks of its I = width / 2 columns."""
    half = h.shape[-1] // 2
    block = min(BLOCK, triton.next_power_of_2(half))
    kernel[(h.numel() // h.shape[-1], triton.cdiv(half, block))](h, *tensors, I=half, BLOCK=block)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        h = h.contiguous()
        out = new_output((*h.shape[:-1], h.shape[-1] // 2), h.dtype, h.device)
        _launch(_swiglu_fwd_kernel, h, out)
        ctx.save_for_backward(h)
        return out

    @staticmethod
    def backward(ctx, dout):
        (h,) = ctx.saved_tensors
        dh = new_output(h.shape, h.dtype, h.device)
        _launch(_swiglu_bwd_kernel, h, dout.contiguous(), dh)
        return dh


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.swiglu``: silu(gate) * up of h = [gate | up] (last dim 2I, even)."""
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu takes [gate | up] stacked along the last dim, got an odd width {h.shape[-1]}")
    return _SwiGLU.apply(h)
