"""Several tensors cast to one dtype in a single launch, into one flat buffer (the weights of a layer under autocast;
weights that share an input come back stacked, as one GEMM's operand).

Under bf16 autocast each fp32 master weight is cast on its own before its matmul, a launch per weight and
forward. Here a layer's weights are cast together: each program copies one block of the concatenated output
from whichever weight it falls in. The backward is one cast of the flat gradient back to the weights' dtype.
"""
from itertools import accumulate

import torch
import triton
import triton.language as tl

from kernels.triton_common import new_output

BLOCK = 4096


@triton.jit
def _cast_kernel(SRC, OUT, STARTS: tl.constexpr, ENDS: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[STARTS[i]:ENDS[i]] = SRC[i] (flat) for each source; a program handles BLOCK outputs.

    The bounds are read from the constexpr tuples where they are used: a name annotated ``tl.constexpr`` inside
    ``static_range`` is an error in compiled Triton (it is defined once per unrolled iteration), not in the interpreter.
    """
    start = tl.program_id(0) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    for i in tl.static_range(len(SRC)):
        if (start < ENDS[i]) & (start + BLOCK > STARTS[i]):
            inside = (offs >= STARTS[i]) & (offs < ENDS[i])
            source = tl.load(SRC[i] + (offs - STARTS[i]), mask=inside)
            tl.store(OUT + offs, source.to(OUT.dtype.element_ty), mask=inside)


class _Cast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dtype, *tensors):
        ends = tuple(accumulate(t.numel() for t in tensors))
        flat = new_output((ends[-1],), dtype, tensors[0].device)
        _cast_kernel[(triton.cdiv(ends[-1], BLOCK),)](tuple(t.contiguous() for t in tensors), flat, (0, *ends[:-1]),
                                                             ends, BLOCK=BLOCK)
        ctx.source_dtype, ctx.shapes = tensors[0].dtype, [t.shape for t in tensors]
        return flat

    @staticmethod
    def backward(ctx, grad):
        grads = grad.to(ctx.source_dtype).split([shape.numel() for shape in ctx.shapes])
        return None, *(g.view(shape) for g, shape in zip(grads, ctx.shapes))


def cast(groups: list[list[torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
    """``kernels.reference.cast`` in one launch: tensors of one dtype; each group comes back as one tensor, its
    members stacked along dim 0, and every result is a view of one buffer."""
    tensors = [t for group in groups for t in group]
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"cast takes tensors of one dtype, got {sorted({str(t.dtype) for t in tensors})}")
    flat = _Cast.apply(dtype, *tensors)
    parts = flat.split([sum(t.numel() for t in group) for group in groups])
    return [part.view(-1, *group[0].shape[1:]) for part, group in zip(parts, groups)]
