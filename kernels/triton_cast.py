"""Several tensors cast to one dtype in a single launch (the weights of a layer under autocast; weights that share
an input come back stacked, as one GEMM's operand).

Under bf16 autocast each fp32 master weight is cast on its own before its matmul, a launch per weight and
forward. Here a layer's weights are cast together: the programs run over the outputs laid end to end, each copying
one block from whichever weight it falls in. Weights that share an input are stacked by rows (``reference.stack_rows``):
plain matrices one above the other, stacks of experts ``[E, rows_i, cols]`` expert by expert (``[E, Σ rows_i,
cols]``: the routed experts' w1 and w3 as one grouped GEMM's operand), so the cast is the stacking copy too. The
backward is the same kernel the other way: one launch reads the groups' gradients and writes each weight's
gradient in its own dtype and layout.
"""
from itertools import accumulate

import torch
import triton
import triton.language as tl

from kernels.triton_common import new_output

BLOCK = 4096


@triton.jit
def _cast_kernel(SRC, OUT, GROUP: tl.constexpr, GROUP_START: tl.constexpr, GROUP_END: tl.constexpr,
                 GROUP_CHUNK: tl.constexpr, OFFSET: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 SPLIT: tl.constexpr):
    """Source i fills its place in OUT[GROUP[i]], its group's output, which covers GROUP_START[i]:GROUP_END[i] of the
    groups' concatenation: the group holds a run of GROUP_CHUNK[i] outputs per leading index, and source i the
    CHUNK[i] of them from OFFSET[i] on (its leading index's matrix). A program handles BLOCK outputs of the
    concatenation. SPLIT: the other way, the outputs' values into the sources (the backward).

    The bounds are read from the constexpr tuples where they are used: a name annotated ``tl.constexpr`` inside
    ``static_range`` is an error in compiled Triton (it is defined once per unrolled iteration), not in the interpreter.
    """
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    for i in tl.static_range(len(SRC)):
        if (start < GROUP_END[i]) & (start + BLOCK > GROUP_START[i]):
            at = offs - GROUP_START[i]
            if GROUP_CHUNK[i] == GROUP_END[i] - GROUP_START[i]:  # one leading index: no division
                within = at - OFFSET[i]
                source = within
            else:
                within = at % GROUP_CHUNK[i] - OFFSET[i]
                source = at // GROUP_CHUNK[i] * CHUNK[i] + within
            inside = (at >= 0) & (offs < GROUP_END[i]) & (within >= 0) & (within < CHUNK[i])
            if SPLIT:
                value = tl.load(OUT[GROUP[i]] + at, mask=inside)
                tl.store(SRC[i] + source, value.to(SRC[i].dtype.element_ty), mask=inside)
            else:
                value = tl.load(SRC[i] + source, mask=inside)
                tl.store(OUT[GROUP[i]] + at, value.to(OUT[GROUP[i]].dtype.element_ty), mask=inside)


def _layout(groups: list[list[torch.Size]]) -> tuple[dict, int]:
    """The kernel's per-source constexprs and the total size of groups of shapes (a group's members share their
    leading dims and columns)."""
    sizes = [sum(shape.numel() for shape in group) for group in groups]
    starts = [0, *accumulate(sizes)]
    names = ("GROUP", "GROUP_START", "GROUP_END", "GROUP_CHUNK", "OFFSET", "CHUNK")
    layout = {name: [] for name in names}
    for g, (group, size, group_start) in enumerate(zip(groups, sizes, starts)):
        chunks = [shape.numel() if len(group) == 1 else shape[-2] * shape[-1] for shape in group]
        for offset, chunk in zip([0, *accumulate(chunks)], chunks):
            for name, value in zip(names, (g, group_start, group_start + size, sum(chunks), offset, chunk)):
                layout[name].append(value)
    return {name: tuple(values) for name, values in layout.items()}, starts[-1]


def _stacked_shape(group: list[torch.Size]) -> tuple[int, ...]:
    """A group's shape stacked by rows (one member: its own)."""
    return tuple(group[0]) if len(group) == 1 else (*group[0][:-2], sum(s[-2] for s in group), group[0][-1])


class _Cast(torch.autograd.Function):
    """One output per group (a gradient per group comes back: no concatenation of the groups' gradients)."""

    @staticmethod
    def forward(ctx, dtype, groups, *tensors):
        layout, total = _layout(groups)
        outs = tuple(new_output(_stacked_shape(group), dtype, tensors[0].device) for group in groups)
        _cast_kernel[(triton.cdiv(total, BLOCK),)](tuple(t.contiguous() for t in tensors), outs, **layout,
                                                   BLOCK=BLOCK, SPLIT=False)
        ctx.layout, ctx.total, ctx.source_dtype = layout, total, tensors[0].dtype
        ctx.shapes = [t.shape for t in tensors]
        return outs

    @staticmethod
    def backward(ctx, *grads):
        sources = tuple(new_output(shape, ctx.source_dtype, grads[0].device) for shape in ctx.shapes)
        _cast_kernel[(triton.cdiv(ctx.total, BLOCK),)](sources, tuple(g.contiguous() for g in grads), **ctx.layout,
                                                       BLOCK=BLOCK, SPLIT=True)
        return None, None, *sources


def cast(groups: list[list[torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
    """``kernels.reference.cast`` in one launch: tensors of one dtype; each group comes back as one tensor, its
    members stacked by rows (``reference.stack_rows``)."""
    tensors = [t for group in groups for t in group]
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"cast takes tensors of one dtype, got {sorted({str(t.dtype) for t in tensors})}")
    unlike = [i for i, group in enumerate(groups) if len(group) > 1 and len({(*t.shape[:-2], t.shape[-1])
                                                                             for t in group}) > 1]
    if unlike:
        raise ValueError(f"cast stacks a group's matrices by rows: group {unlike[0]} has shapes "
                         f"{[tuple(t.shape) for t in groups[unlike[0]]]} (their leading dims and columns must agree)")
    return list(_Cast.apply(dtype, [[t.shape for t in group] for group in groups], *tensors))
