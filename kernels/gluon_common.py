"""What the Gluon kernels (the forward, ``gluon_attention``, and the backward's dKV step, ``gluon_dkv``) share: a
token's slot rows, its head rows with RoPE on their tail and their TMA boxes, the persistent programs' token split,
the index that keeps wgmma descriptors in their loop, and a layout for 16-byte stores of a wgmma tile's rows (the
indexer's scoring, ``gluon_index_score``, takes the TMA box width).

Both kernels hold one token's 64 heads as the wgmma M (a Hopper warpgroup's tile) and gather the rows of its slots
(window rows, then selected entries) from one base pointer, as the Triton kernels do (``triton_attention``)."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.triton_common import rotate_split_pairs as triton_rotate_split_pairs
from kernels.triton_slots import slot_rows as triton_slot_rows

LOG2E = gl.constexpr(1.4426950408889634)
BLOCK_H = 64  # heads are the MMA's M: one token's heads fill one wgmma (64 rows)
FEATURES = gl.constexpr(64)  # features per TMA box of a token's head rows: one 128-byte swizzle span

# The Triton helpers that only compute (row offsets, validity, pair rotation), run as Gluon functions: their
# tensors take the layouts of the tensors they are given.
_slot_rows = gluon.jit(triton_slot_rows.fn)
rotate_split_pairs = gluon.jit(triton_rotate_split_pairs.fn)


def hopper_heads_dtype(q: torch.Tensor) -> bool:
    """q on a Hopper GPU, 33-64 heads (padded to 64, one wgmma M, as ``triton_attention._block_h`` pads them),
    16-bit and 16-byte aligned (both kernels read it by TMA, whose descriptor refuses another base): what every Gluon
    kernel here needs."""
    H = q.shape[-2]
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9 and 32 < H <= BLOCK_H
            and q.dtype in (torch.bfloat16, torch.float16) and q.data_ptr() % 16 == 0)


@gluon.jit
def block_rows(IDX, start, tok, b, t, win_lo, T, S, comp_offset, D: gl.constexpr, W: gl.constexpr,
               K: gl.constexpr, BLOCK_N: gl.constexpr, SLOTS: gl.constexpr):
    """Row offsets and validity of block ``start``'s slots, laid out as ``SLOTS`` (a 1-D layout)."""
    slots = start + gl.arange(0, BLOCK_N, layout=SLOTS)
    return _slot_rows(IDX, tok, b, t, win_lo, slots, T, S, comp_offset, D, W, K)


@gluon.jit
def head_cols(BASE, tok, H, col0: gl.constexpr, COLS: gl.constexpr, D: gl.constexpr, BLOCK_H: gl.constexpr,
              LOAD: gl.constexpr):
    """Columns col0..col0+COLS of the token's head rows ``BASE[tok, heads]`` ([tokens, H, D]) as [BLOCK_H, COLS]
    laid out as LOAD; padded heads read 0."""
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LOAD))
    dims = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, LOAD))
    return gl.load(BASE + (tok * H + heads[:, None]).to(gl.int64) * D + dims[None, :], mask=(heads < H)[:, None],
                   other=0.0)


@gluon.jit
def rope_tail(x, ROT, tok, col0: gl.constexpr, D: gl.constexpr, ROPE: gl.constexpr, CONJ: gl.constexpr = False):
    """x (columns col0.. of a token's head rows) with those among the last ROPE features rotated by the token's
    RoPE (``CONJ``: turned back), in fp32, in x's dtype."""
    if ROPE > 0:
        ROWS: gl.constexpr = x.shape[0]
        COLS: gl.constexpr = x.shape[1]
        dtype: gl.constexpr = x.dtype
        if col0 + COLS > D - ROPE:
            even, odd = gl.split(gl.reshape(x.to(gl.float32), [ROWS, COLS // 2, 2]))
            pair = (gl.arange(0, COLS // 2, layout=gl.SliceLayout(0, even.type.layout))[None, :]
                    + (col0 - (D - ROPE)) // 2)
            x = gl.reshape(rotate_split_pairs(even, odd, pair, ROT, tok, True, ROPE, CONJ), [ROWS, COLS])
            x = x.to(dtype)
    return x


@gluon.constexpr_function
def sixteen_byte_rows(cols):
    """A layout of a [64, cols] 16-bit tile (cols >= 32) held by 4 warps as a wgmma accumulator is (16 rows a
    warp, rows r and r + 8 in each thread), but with 8 consecutive columns in a thread where the accumulator gives
    2: its rows go to memory in 16-byte stores, 4 times fewer than from the accumulator. Only lanes of the same row
    quad trade values; Triton 3.6 still routes the conversion through a warp's share of shared-memory scratch
    (``stmatrix`` / ``ldmatrix``, as for the forward's staged p)."""
    wide = [[0, c] for c in (32, 64, 128, 256) if c < cols]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]] + wide,
                                      lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, cols])


def tma_descriptor(x: torch.Tensor, box: list[int]) -> TensorDescriptor:
    """TMA descriptor of a 16-bit tensor x read ``box`` at a time into the wgmma operand layout (elements past x's
    bounds read 0)."""
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor.from_tensor(x, box, gl.NVMMASharedLayout.get_default_for(box, dtype))


def head_rows_descriptor(x: torch.Tensor, features: int = FEATURES.value) -> TensorDescriptor:
    """TMA descriptor of head rows x [..., H, D] seen as [tokens, H, D], read [1, 64 heads, features] at a time
    (heads past H read 0, as the kernels' padded heads must)."""
    return tma_descriptor(x.view(-1, *x.shape[-2:]), [1, BLOCK_H, features])


@gluon.jit
def head_tile(tiles, c):
    """Tile c ([heads, features]) of a token's head rows landed by ``head_rows_descriptor``'s boxes. Indexed through
    an opaque zero made at each use, so that its wgmma descriptors are made there too (made once for all tiles, they
    stay live across the block and spill)."""
    return tiles.index(c + opaque_zero(c)).reshape([tiles.shape[2], tiles.shape[3]])


@gluon.jit
def tokens_of_program(n_tokens):
    """How many of the tokens pid, pid + programs, ... below n_tokens this program takes."""
    return (n_tokens - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)


@gluon.jit
def opaque_zero(i):
    """0, computed in the loop by an instruction the compiler cannot see through. Indexing the shared buffers with
    it makes their wgmma descriptors loop-variant: otherwise LLVM hoists all of them out of the loop (the forward's
    S alone takes 32 k-steps x 2 64-bit descriptors) and ptxas spills them to local memory (390 spill instructions
    in the forward's loop)."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)
