"""Helpers shared by the Triton kernels: autotune config lists, output allocation, gathered-row loads.

Under ``TRITON_INTERPRET=1`` (the CPU test path) every kernel gets one small config: autotuning there would
only multiply the interpreter's cost, and block sizes must stay tiny for the test shapes.
"""
import importlib
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Triton 3.6 lowers an fp32 tl.atomic_add to one scalar `atom` per element; on the GPU add_rows issues 16-byte
# `red.global.add.v4.f32` (sm_90) through inline PTX instead. The interpreter cannot run PTX.
VECTOR_ATOMICS = tl.constexpr(not INTERPRET)
POISON_ENV = "CSA2_KERNEL_POISON"


def configs(hopper: list[dict], interpret: dict) -> list[triton.Config]:
    """Autotune configs: the Hopper list on a GPU, the single interpreter config under TRITON_INTERPRET.

    Each dict holds the kernel's block-size constexprs plus ``num_warps``, ``num_stages`` and optionally ``maxnreg``.
    """
    chosen = [interpret] if INTERPRET else hopper
    launch = ("num_warps", "num_stages", "maxnreg")
    return [triton.Config({k: v for k, v in c.items() if k not in launch}, num_warps=c["num_warps"],
                          num_stages=c["num_stages"], maxnreg=c.get("maxnreg")) for c in chosen]


def gluon_applies(impl: str, x: torch.Tensor, module: str, *shape) -> bool:
    """Whether an op runs its Gluon kernel: its switch ``impl`` is "gluon", x is on a GPU (not the interpreter) and
    ``kernels.<module>.usable(x, *shape)`` accepts it. The module is imported only then: Gluon only runs on a GPU."""
    if impl != "gluon" or INTERPRET or not x.is_cuda:
        return False
    return importlib.import_module(f"kernels.{module}").usable(x, *shape)


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer every element of which a kernel must write.

    With ``CSA2_KERNEL_POISON=1`` (set by the tests) it is filled with NaN (floats) or -7 (ints) instead of
    left uninitialised, so an element a kernel forgets to write fails the comparison with the reference.
    """
    if os.environ.get(POISON_ENV) != "1":
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else -7
    return torch.full(shape, fill, dtype=dtype, device=device)


@triton.jit
def load_rows(base, rows, valid, D: tl.constexpr):
    """Rows ``base[rows]`` of a row-major [*, D] tensor as a [len(rows), D] tile; invalid rows read as 0.

    Row offsets are widened to int64: at real width a row index times D can pass 2**31.
    """
    dims = tl.arange(0, D)
    return tl.load(base + rows[:, None].to(tl.int64) * D + dims[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def add_rows(base, rows, valid, values, D: tl.constexpr):
    """Atomically add a [len(rows), D] fp32 tile into rows ``base[rows]``; rows may repeat (selected slots)."""
    if VECTOR_ATOMICS:
        # Element (r, 4j + i) of values is v_i[r, j]: one vector reduction per 4 consecutive floats.
        quads = tl.reshape(values, [values.shape[0], D // 4, 2, 2])
        even, odd = tl.split(quads)
        v0, v2 = tl.split(even)
        v1, v3 = tl.split(odd)
        ptrs = base + rows[:, None].to(tl.int64) * D + 4 * tl.arange(0, D // 4)[None, :]
        flags = tl.broadcast_to(valid[:, None].to(tl.int32), ptrs.shape)
        tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            setp.ne.b32 p, $6, 0;
            @p red.relaxed.gpu.global.add.v4.f32 [$1], {$2, $3, $4, $5};
            mov.b32 $0, 0;
            }""",
            "=r,l,f,f,f,f,r", [ptrs.to(tl.int64), v0, v1, v2, v3, flags], dtype=tl.int32, is_pure=False, pack=1)
    else:
        dims = tl.arange(0, D)
        tl.atomic_add(base + rows[:, None].to(tl.int64) * D + dims[None, :], values, mask=valid[:, None],
                      sem="relaxed")


@triton.jit
def rotate_pairs(y, ROT, rot_row, rows_live, DIM0: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
                 CONJ: tl.constexpr):
    """RoPE on a tile: y [M, N] fp32 holds columns DIM0..DIM0+N of rows of width D whose last ROPE features are
    rotated pairs (2i, 2i+1); those pairs come back rotated by rotation row ``rot_row`` of ROT ([M, 1] row ids or
    one scalar for every row; ROPE floats a row, interleaved cos, sin), by the conjugate if CONJ. Every other
    column, and rows where ``rows_live`` ([M, 1]) is False, come back as they are."""
    M: tl.constexpr = y.shape[0]
    N: tl.constexpr = y.shape[1]
    even, odd = tl.split(tl.reshape(y, [M, N // 2, 2]))
    pair = tl.arange(0, N // 2)[None, :] + (DIM0 // 2 - (D - ROPE) // 2)  # index among the rotated pairs
    return tl.reshape(rotate_split_pairs(even, odd, pair, ROT, rot_row, rows_live, ROPE, CONJ), [M, N])


@triton.jit
def rotate_split_pairs(even, odd, pair, ROT, rot_row, rows_live, ROPE: tl.constexpr, CONJ: tl.constexpr):
    """``rotate_pairs`` on a tile already split into its pairs' elements (even, odd [M, N/2]); ``pair`` ([1, N/2])
    is each column's index among the rotated pairs (outside 0..ROPE/2-1: not rotated). Takes no ``tl.arange``, so
    the Gluon kernels run it too. Returns the [M, N/2, 2] tile."""
    tail = rows_live & (pair >= 0) & (pair < ROPE // 2)
    angle = rot_row * ROPE + 2 * pair
    cos = tl.load(ROT + angle, mask=tail, other=1.0)
    sin = tl.load(ROT + angle + 1, mask=tail, other=0.0)
    if CONJ:
        sin = -sin
    return tl.join(even * cos - odd * sin, even * sin + odd * cos)
