"""RoPE in one launch: copy the unrotated features and rotate the last ``dim`` ones pairwise, in fp32 (optionally
into another dtype: a cast folded in).

The PyTorch formula (``kernels.reference.rope``) costs four launches per call (upcast, complex multiply,
downcast, concatenation), and a layer makes four calls; here each is one read and one write of x. The backward
is the same kernel with the conjugate rotation (RoPE is an orthogonal linear map of x).
"""
import torch
import triton
import triton.language as tl

from kernels.triton_common import configs, new_output

_CONFIGS = configs(
    [{"BLOCK_R": r, "num_warps": w, "num_stages": 2} for r, w in ((8, 4), (16, 4), (32, 8))],
    {"BLOCK_R": 4, "num_warps": 1, "num_stages": 1},
)


@triton.autotune(configs=_CONFIGS, key=["D", "DIM", "H"])
@triton.jit
def _rope_kernel(x, rotation, out, R, H, D: tl.constexpr, DIM: tl.constexpr, BLOCK_REST: tl.constexpr,
                 CONJ: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows of x [R, D]; row r rotates by rotation row r // H ([R / H, DIM] as interleaved cos, sin)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    row_base = rows.to(tl.int64)[:, None] * D
    rest = tl.arange(0, BLOCK_REST)[None, :]
    keep = live[:, None] & (rest < D - DIM)
    tl.store(out + row_base + rest, tl.load(x + row_base + rest, mask=keep), mask=keep)
    pair = 2 * tl.arange(0, DIM // 2)[None, :]
    tail = row_base + (D - DIM) + pair
    even = tl.load(x + tail, mask=live[:, None]).to(tl.float32)
    odd = tl.load(x + tail + 1, mask=live[:, None]).to(tl.float32)
    angle = (rows // H).to(tl.int64)[:, None] * DIM + pair
    cos = tl.load(rotation + angle, mask=live[:, None])
    sin = tl.load(rotation + angle + 1, mask=live[:, None])
    if CONJ:
        sin = -sin
    tl.store(out + tail, (even * cos - odd * sin).to(out.dtype.element_ty), mask=live[:, None])
    tl.store(out + tail + 1, (even * sin + odd * cos).to(out.dtype.element_ty), mask=live[:, None])


def _launch(x: torch.Tensor, rotation: torch.Tensor, dim: int, conj: bool, out_dtype: torch.dtype) -> torch.Tensor:
    x = x.contiguous()
    D, H = x.shape[-1], x.shape[2] if x.dim() == 4 else 1
    R = x.numel() // D
    out = new_output(x.shape, out_dtype, x.device)
    grid = lambda meta: (triton.cdiv(R, meta["BLOCK_R"]),)  # noqa: E731
    _rope_kernel[grid](x, torch.view_as_real(rotation), out, R, H, D, dim,
                       triton.next_power_of_2(max(D - dim, 1)), conj)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rotation, dim, out_dtype):
        ctx.save_for_backward(rotation)
        ctx.dim, ctx.in_dtype = dim, x.dtype
        return _launch(x, rotation, dim, False, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        (rotation,) = ctx.saved_tensors
        return _launch(grad, rotation, ctx.dim, True, ctx.in_dtype), None, None, None


def rope(x: torch.Tensor, rotation: torch.Tensor, dim: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``kernels.reference.rope``: x [B,N,(H,)D] (fp32/bf16/fp16), rotation [B,N,dim/2] complex64, the result in
    ``out_dtype`` (default x's; a cast folded into the rotation)."""
    if rotation.dtype != torch.complex64 or dim & (dim - 1) or torch.float64 in (x.dtype, out_dtype):
        raise ValueError(f"Triton rope takes fp32/bf16/fp16 x, a complex64 rotation and a power-of-two dim; got "
                         f"{x.dtype} -> {out_dtype}, {rotation.dtype}, dim={dim}")
    return _Rope.apply(x, rotation.contiguous(), dim, out_dtype or x.dtype)
