"""The sparse-attention forward for Hopper, in Gluon: the same contract as ``triton_attention._fwd_kernel``.

Why a second forward: Triton gives a dot whose result feeds another dot the warp layout [8, 1], so with 64 heads
(M = 64) and 8 warps both warpgroups compute the same S = q kv^T (docs/KERNELS.md, "Why the forward's S is computed
twice"). Gluon states layouts instead of inferring them, which allows FlashMLA's division of the work:

- S [64 heads, BLOCK_N slots] is split by slots over the two warpgroups (``warps_per_cta = [4, 2]``): each computes
  64 x BLOCK_N/2 against the whole q, which stays in shared memory for the token's life.
- The row max and row sum combine the two halves (a reduction across warpgroups); P goes to the PV product's
  operand layout (each warpgroup needs all of P) and O [64, D] is split by features: each warpgroup accumulates
  64 x D/2 from its half of the gathered rows' columns.
- The rows of blocks j + 1 .. j + STAGES - 1 are being gathered by ``cp.async`` into a ring of STAGES shared-memory
  buffers while block j is computed (64-slot blocks leave room for two buffers beside q, 32-slot blocks for four).

The selected mass, the sink, the window and -1 masks, RoPE on q (rotated in registers before q is stored to shared
memory: no scratch) and on the output (turned back before its one rounding), and the LSE follow the Triton kernel;
the selected blocks' p are staged in the token's output rows and their running max in shared memory.

Gluon runs only on the GPU (the interpreter cannot run it): the CPU tests compile it for sm_90a
(``kernels.hopper_compile``); the GPU check (``bench/bench_kernels.py check``) compares it with the fp32 reference.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels import triton_attention as tri
from kernels.triton_common import rotate_split_pairs

LOG2E = gl.constexpr(1.4426950408889634)
BLOCK_H = 64  # heads are the MMA's M: one token's heads fill one wgmma (64 rows)
# Slots per block (half of them per warpgroup in S) and gather buffers; shared memory: q 64 KB + STAGES x BLOCK_N KB.
# 32-slot blocks with 3 or 4 buffers were slower at 64K (25.8 and 26.2 ms against 21.3: S's wgmma is then
# 64 x 16 per warpgroup, and q is read from shared memory twice as often; bench_attention_gluon_v10.json).
# An L2 prefetch of the block after next (one cp.async.bulk.prefetch.L2 per row) was slower: 24.5 against 21.3 ms
# (bench_attention_prefetch_ablation.json, code d987d55).
_CONFIGS = [triton.Config(dict(BLOCK_N=64, STAGES=2), num_warps=8)]
# Stages the benchmark switches off to see what the rest costs ("gather": no rows copied after the first block, so
# the blocks compute on whatever the buffers hold: 19.4 ms against 21.3, so the copies are not what limits the
# kernel); empty in real use.
ABLATE: set[str] = set()

# The Triton helpers that only compute (row offsets, validity, pair rotation), run as Gluon functions: their
# tensors take the layouts of the tensors they are given.
_slot_rows = gluon.jit(tri._slot_rows.fn)
_rotate_split_pairs = gluon.jit(rotate_split_pairs.fn)


@gluon.jit
def _block_rows(IDX, start, tok, b, t, win_lo, T, S, comp_offset, D: gl.constexpr, W: gl.constexpr,
                K: gl.constexpr, BLOCK_N: gl.constexpr, SLOTS: gl.constexpr):
    """Row offsets and validity of block ``start``'s slots, laid out as ``SLOTS`` (a 1-D layout)."""
    slots = start + gl.arange(0, BLOCK_N, layout=SLOTS)
    return _slot_rows(IDX, tok, b, t, win_lo, slots, T, S, comp_offset, D, W, K)


@gluon.jit
def _gather(KV, buffer, offset, valid, D: gl.constexpr, LOAD: gl.constexpr):
    """Start the copy of the rows at ``offset`` into ``buffer`` (invalid rows become zeros) as one cp.async group
    (empty when no row is valid)."""
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    async_copy.async_copy_global_to_shared(buffer, KV + offset[:, None] + dims[None, :], mask=valid[:, None])
    async_copy.commit_group()


@gluon.jit
def _load_q(Q, ROT, tok, H, D: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, LOAD: gl.constexpr):
    """The token's q [BLOCK_H, D] (padded heads 0) with its last ROPE features rotated by the token's RoPE."""
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LOAD))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    rows = Q + (tok * H + heads[:, None]).to(gl.int64) * D
    live = (heads < H)[:, None]
    q = gl.load(rows + dims[None, :], mask=live, other=0.0)
    if ROPE:
        tail = (dims >= D - ROPE)[None, :]
        angle = tok * ROPE + (dims - (D - ROPE)) // 2 * 2
        cos = gl.load(ROT + angle, mask=dims >= D - ROPE, other=1.0)
        sin = gl.load(ROT + angle + 1, mask=dims >= D - ROPE, other=0.0)
        partner = gl.load(rows + (dims ^ 1)[None, :], mask=live & tail, other=0.0).to(gl.float32)
        signed_sin = gl.where(dims % 2 == 0, -sin, sin)  # even: x cos - x' sin; odd: x' sin + x cos
        rotated = q.to(gl.float32) * cos[None, :] + partner * signed_sin[None, :]
        q = gl.where(tail, rotated.to(q.dtype), q)
    return q


@gluon.jit
def _selected_mass(STAGE, stage_head_stride, block_max, lse2, MASS, H, K: gl.constexpr, K_P: gl.constexpr,
                   BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """MASS[slot] = sum over heads of the staged p [H, K] (at STAGE, heads ``stage_head_stride`` apart), each
    selected block's times exp2(its running max - lse2), from one load of the whole tile ([heads, blocks, slots];
    blocks past K are masked, so ``block_max``'s rows for them are never used)."""
    TILE: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // (BLOCK_N // 8), BLOCK_N // 8], [num_warps, 1, 1],
                                          [2, 1, 0])
    BY_BLOCK: gl.constexpr = gl.SliceLayout(2, TILE)  # [heads, blocks]
    BY_SLOT: gl.constexpr = gl.SliceLayout(0, TILE)  # [blocks, slots of a block]
    slots = (gl.arange(0, K_P // BLOCK_N, layout=gl.SliceLayout(1, BY_SLOT))[:, None] * BLOCK_N
             + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, BY_SLOT))[None, :])
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, BY_BLOCK))[:, None, None]
    p = gl.load(STAGE + heads * stage_head_stride + slots[None, :, :], mask=(heads < H) & (slots < K)[None, :, :],
                other=0.0)
    rows = block_max._reinterpret(gl.float32, [K_P // BLOCK_N, BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    maxima = gl.convert_layout(gl.permute(rows.load(gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])),
                                          (1, 0)), BY_BLOCK)
    to_final = gl.exp2(maxima - gl.convert_layout(lse2, gl.SliceLayout(1, BY_BLOCK))[:, None])
    gl.store(MASS + slots, gl.sum(p.to(gl.float32) * to_final[:, :, None], 0), mask=slots < K)


@triton.autotune(configs=_CONFIGS, key=["H", "D", "W", "K"])
@gluon.jit
def _fwd_kernel(KV, Q, WIN_LO, IDX, SINK, ROT, OUT, LSE, MASS, STAGE, comp_offset, stage_token_stride,
                stage_head_stride, T, S, H, scale_log2, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr,
                K_P: gl.constexpr, BLOCK_H: gl.constexpr, ROPE: gl.constexpr, MASS_PASS: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SKIP_GATHER: gl.constexpr, num_warps: gl.constexpr):
    """Out, LSE and selected mass of one token (``triton_attention._fwd_kernel``'s arguments). The running max after
    each selected block is kept in shared memory, one row per block of K_P (K padded to a power of two)."""
    gl.static_assert(BLOCK_H == 64 and num_warps == 8, "one wgmma M of heads, two warpgroups")
    W_P: gl.constexpr = (W + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    N_BLOCKS: gl.constexpr = (W_P + K + BLOCK_N - 1) // BLOCK_N
    # 16-byte pieces of rows, a warp on 4 rows x 128 bytes: a thread holds the row ids of BLOCK_N / 32 rows only.
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, S_L)
    COL: gl.constexpr = gl.SliceLayout(0, S_L)
    dtype: gl.constexpr = Q.dtype.element_ty
    operand: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D], operand)
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], operand)
    block_max = gl.allocate_shared_memory(gl.float32, [K_P // BLOCK_N, BLOCK_H],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))

    tok = gl.program_id(0).to(gl.int64)  # flat b*T + t
    b = tok // T
    t = tok - b * T
    win_lo = gl.load(WIN_LO + tok)
    rows: gl.constexpr = gl.SliceLayout(1, LOAD)
    for i in gl.static_range(STAGES - 1):
        first_offset, first_valid = _block_rows(IDX, W - W_P + i * BLOCK_N, tok, b, t, win_lo, T, S, comp_offset, D,
                                                W, K, BLOCK_N, rows)
        _gather(KV, kv_smem.index(i), first_offset, first_valid, D, LOAD)
    q_smem.store(_load_q(Q, ROT, tok, H, D, ROPE, BLOCK_H, LOAD))

    heads = gl.arange(0, BLOCK_H, layout=ROW)
    hmask = heads < H
    m = gl.load(SINK + heads, mask=hmask, other=0.0).to(gl.float32) * LOG2E
    l = gl.full([BLOCK_H], 1.0, gl.float32, ROW)
    acc = gl.zeros([BLOCK_H, D], gl.float32, O_L)
    stage = STAGE + tok * stage_token_stride + heads[:, None] * stage_head_stride
    # Row ids are loaded one block before they are used (the gather's and the mask's), so that their latency is
    # spent while a block computes.
    next_offset, next_valid = _block_rows(IDX, W - W_P + (STAGES - 1) * BLOCK_N, tok, b, t, win_lo, T, S,
                                          comp_offset, D, W, K, BLOCK_N, rows)
    _, valid_next = _block_rows(IDX, W - W_P, tok, b, t, win_lo, T, S, comp_offset, D, W, K, BLOCK_N, COL)
    for j in range(N_BLOCKS):
        start = W - W_P + j * BLOCK_N
        async_copy.wait_group(STAGES - 2)  # groups complete in order: block j's rows have landed
        fence_async_shared()  # the rows (and, at j = 0, q) are read by wgmma through the async proxy
        gl.thread_barrier()  # every thread's copies have landed; both warpgroups are done with block j - 1
        kv = kv_smem.index(j % STAGES)
        s = warpgroup_mma(q_smem, kv.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L), use_acc=False,
                          is_async=True)
        # Block j + STAGES - 1 into the buffer block j - 1 used (past the last block: an empty group).
        if SKIP_GATHER:
            async_copy.commit_group()
        else:
            _gather(KV, kv_smem.index((j + STAGES - 1) % STAGES), next_offset, next_valid, D, LOAD)
        valid = valid_next
        next_offset, next_valid = _block_rows(IDX, start + STAGES * BLOCK_N, tok, b, t, win_lo, T, S, comp_offset,
                                              D, W, K, BLOCK_N, rows)
        _, valid_next = _block_rows(IDX, start + BLOCK_N, tok, b, t, win_lo, T, S, comp_offset, D, W, K, BLOCK_N,
                                    COL)
        s = warpgroup_mma_wait(0, deps=(s, ))
        s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        l = l * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), P_L), kv, acc, is_async=True)
        m = m_new
        if MASS_PASS:
            if start >= W:
                slots = start + gl.arange(0, BLOCK_N, layout=COL)
                gl.store(stage + (slots - W)[None, :], p.to(STAGE.dtype.element_ty),
                         mask=hmask[:, None] & (slots < W + K)[None, :])
                block_max.index((start - W) // BLOCK_N).store(m)
        acc = warpgroup_mma_wait(0, deps=(acc, ))

    lse2 = m + gl.log2(l)
    gl.store(LSE + tok * H + heads, lse2 / LOG2E, mask=hmask)
    out = acc / gl.convert_layout(l, gl.SliceLayout(1, O_L))[:, None]  # before the epilogue: frees acc's registers
    if ROPE:  # back to q's frame: the conjugate rotation of the output's pairs, still in fp32
        even, odd = gl.split(gl.reshape(out, [BLOCK_H, D // 2, 2]))
        pair = gl.arange(0, D // 2, layout=gl.SliceLayout(0, even.type.layout))[None, :] - (D - ROPE) // 2
        out = gl.reshape(_rotate_split_pairs(even, odd, pair, ROT, tok, True, ROPE, True), [BLOCK_H, D])
    out = out.to(OUT.dtype.element_ty)
    if MASS_PASS:
        gl.thread_barrier()  # the stage is read back by other threads of this program
        _selected_mass(STAGE + tok * stage_token_stride, stage_head_stride, block_max, lse2, MASS + tok * K, H, K, K_P,
                       BLOCK_H, BLOCK_N, num_warps)
        gl.thread_barrier()  # every thread has read the stage before the output overwrites it
    OUT_L: gl.constexpr = out.type.layout
    out_heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, OUT_L))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, OUT_L))
    gl.store(OUT + (tok * H + out_heads[:, None]) * D + dims[None, :], out, mask=(out_heads < H)[:, None])


def usable(q: torch.Tensor) -> bool:
    """The Gluon forward runs on Hopper for 33-64 heads (padded to 64, one wgmma M, as ``triton_attention._block_h``
    pads them), D a power of two from 64 to 512 (O's D/2 columns per warpgroup are one wgmma N <= 256) and 16-bit
    inputs."""
    H, D = q.shape[-2:]
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9 and 32 < H <= BLOCK_H
            and D in (64, 128, 256, 512) and q.dtype in (torch.bfloat16, torch.float16))


def launch(grid, *args, **constexprs):
    """``triton_attention._fwd_kernel``'s launch (same arguments; the block shape is autotuned)."""
    _fwd_kernel[grid](*args, **constexprs, SKIP_GATHER="gather" in ABLATE)
