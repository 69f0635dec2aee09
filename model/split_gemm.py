"""``x·Wᵀ`` to about fp32 precision on bf16 tensor cores: the MoE gate's scores under bf16 autocast.

The gate picks experts by the top-k of its scores, so it runs in fp32 (``model/moe.py``, ``Gate``); an fp32 GEMM
runs on the GPU's FMA units (a bf16 GEMM of the same shape is ~15x faster on Hopper), and TF32's 10-bit mantissa
would move near-ties. Here each fp32 operand is split into two bf16 parts, ``t = hi + lo`` with ``hi = bf16(t)``
and ``lo = bf16(t - hi)`` (together 16 of fp32's 24 significant bits: the residue is at most 2^-16 of |t|), and
``x·Wᵀ`` is the sum of the parts' products but ``lo·lo`` (2^-16 of the product): three bf16 GEMMs, or two when x is
bf16 already (the stream in bf16), each accumulating in fp32 and returning fp32 (``torch.mm(..., out_dtype=
torch.float32)`` on CUDA). A bf16 x bf16 product is exact in fp32, so on the CPU, where that call does not exist,
the same products are fp32 GEMMs of the parts. ``bench/moe_ffn.py`` reports how often the top-k picks agree with
the fp32 GEMM's.

The backward is bf16, as autocast's for any projection: the score gradient rounded to bf16 against the ``hi``
parts, fp32 outputs.
"""
import torch


def split_bf16(t: torch.Tensor) -> list[torch.Tensor]:
    """[hi, lo] bf16 parts of t (hi + lo = t to 2^-16 relative), or [t] when t is bf16 already."""
    if t.dtype == torch.bfloat16:
        return [t]
    hi = t.to(torch.bfloat16)
    return [hi, (t - hi.to(t.dtype)).to(torch.bfloat16)]


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 matrices with an fp32 result: tensor cores on CUDA; exact products in fp32 elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        xs, ws = split_bf16(x), split_bf16(weight)
        products = [(i, j) for i in range(len(xs)) for j in range(len(ws)) if i + j < 2]  # lo·lo left out
        out = None
        for i, j in reversed(products):  # the small products first, the hi·hi product last
            term = mm_fp32(xs[i], ws[j].t())
            out = term if out is None else out + term
        ctx.save_for_backward(xs[0], ws[0])
        ctx.dtypes = x.dtype, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        x_hi, w_hi = ctx.saved_tensors
        g = grad.to(torch.bfloat16)
        dx = mm_fp32(g, w_hi).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        dw = mm_fp32(g.t(), x_hi).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return dx, dw


def split_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x·Wᵀ`` in fp32 (x [N, in] fp32 or bf16, weight [out, in] fp32) from bf16 GEMMs of their split parts;
    backward in bf16 GEMMs with fp32 outputs (the gradients in x's and weight's dtypes)."""
    return _SplitLinear.apply(x, weight)
