"""The sparse-attention forward for Hopper, in Gluon: the same contract as ``triton_attention._fwd_kernel``.

Why a second forward: Triton gives a dot whose result feeds another dot the warp layout [8, 1], so with 64 heads
(M = 64) and 8 warps both warpgroups compute the same S = q kv^T (docs/KERNELS.md, "Why the forward's S is computed
twice"). Gluon states layouts and lets warpgroups run different code (``gl.warp_specialize``), which allows the
schedule of FlashMLA's sparse prefill on Hopper ("seesaw"), one token (its 64 heads) per program:

- Three warpgroups. A producer gathers the slots' rows by ``cp.async`` into two 64-row buffers, a half of D at a
  time, each half with its own READY / FREE mbarriers, so a half is refilled as soon as its last reader is done.
- Blocks go in pairs: consumer WG0 computes S = q K^T [64 heads, 64 slots] of the pair's first block, WG1 of the
  second, each against the whole q (in shared memory for the token's life) and each as one full 64 x 64 wgmma tile
  (no reduction across warpgroups). O [64, D] is split by features: WG0 accumulates the left half from both blocks,
  WG1 the right half; each takes its own P from registers and the other's through shared memory.
- The softmax max is handed over once a pair: WG0's new max to WG1, which takes the pair's max and hands it back;
  WG0 rescales its P and O to it. While one warpgroup runs its softmax the other's MMAs keep the tensor cores busy.

The selected mass, the sink, the window and -1 masks (a per-slot logit bias the producer publishes with each
block), RoPE on q (q lands by TMA, its tail is turned in shared memory) and on the output (turned back before its
one rounding), and the LSE follow the Triton kernel; the selected blocks' p are staged in rows of the program's
own (not the token's output rows, as the Triton kernel does) and their max in shared memory; each consumer stores
its half of the output, then sums the mass of the blocks it computed.

Gluon runs only on the GPU (the interpreter cannot run it): the CPU tests compile it for sm_90a
(``kernels.hopper_compile``) and hold it to its shared memory and its MMA loops to no spills; the GPU check
(``bench/bench_kernels.py check``) compares it with the fp32 reference.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from kernels.gluon_common import (BLOCK_H, FEATURES, LOG2E, block_rows, head_rows_descriptor, head_tile,
                                  hopper_heads_dtype, opaque_zero, rope_tail, sixteen_byte_rows, tokens_of_program)

# Stages the benchmark switches off to see what the rest costs (the outputs are then wrong); empty in real use.
# "gather": the producer copies no rows (the blocks compute on whatever the buffers hold); "mass_stage": no p is
# staged; "mass_sum": the token's end sums no mass. The kernel takes them as the bits of SKIP. (Not storing the
# output is no ablation: the compiler then drops the PV MMAs that only the output reads.)
STAGES = ("gather", "mass_stage", "mass_sum")
ABLATE: set[str] = set()
_SKIP_GATHER, _SKIP_MASS_STAGE, _SKIP_MASS_SUM = (gl.constexpr(1 << i) for i in range(len(STAGES)))


# Barriers (one array): READY / FREE per buffer half (index 2 * buffer + half), then the consumers' hand-overs.
_READY, _FREE, _MAX, _P, _L, _VALID, _Q, _Q_FREE, _Q_LANDED = (gl.constexpr(i) for i in (0, 4, 8, 10, 12, 14, 16,
                                                                                         17, 18))
_N_BARRIERS = gl.constexpr(19)
PRODUCER_WARPS = gl.constexpr(4)
# Registers per thread: 12 warps share the SM's 64K (kernel limit 168 = 504 a triple); a consumer holds its O half
# [64, D/2] fp32 (128 registers at D = 512), S [64, 64] fp32 and P; the producer only row offsets and addresses.
CONSUMER_REGS, PRODUCER_REGS, KERNEL_MAXNREG = gl.constexpr(216), gl.constexpr(72), 168


@gluon.jit
def _stage_block(STAGE, stage_program_stride, stage_head_stride, block_max, p, m, start, H, W: gl.constexpr,
                 K: gl.constexpr, BLOCK_N: gl.constexpr):
    """Stage a selected block's p (fp16, in the program's stage rows) and the max it is relative to. The wgmma
    layout gives a thread pairs of slots 8 apart, i.e. 16 4-byte stores a block; each warp first turns its own 16 rows
    (``stmatrix`` / ``ldmatrix`` through 7.5 KB of shared memory) so that a thread stores 8 consecutive slots at once,
    4 16-byte stores: the forward 17.48 -> 16.66 ms, the global stores being what fills the LSU queue the producer's
    gathers use (Nsight Compute: ``lg_throttle``)."""
    gl.static_assert(p.shape[0] == 64 and BLOCK_N == 64, "a wgmma m64 tile of 64 slots")
    ROWS_8: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [4, 0], [8, 0]], lane_bases=[[0, 8], [0, 16], [0, 32], [1, 0], [2, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64])
    p = gl.convert_layout(p.to(STAGE.dtype.element_ty), ROWS_8)
    heads = gl.arange(0, 64, layout=gl.SliceLayout(1, ROWS_8))
    slots = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ROWS_8))
    stage = STAGE + gl.program_id(0) * stage_program_stride + heads[:, None] * stage_head_stride
    # Kept in L2 until the token's end reads it back (evict_last; 8.6 MB over 132 programs): at 64K the row gathers
    # churn L2 (132 tokens at a time ask for up to 84 MB of rows, against its 50), and without the hint the mass
    # sum found part of its p gone to HBM (the forward 14.50 -> 14.08 ms, `bench/results/kernels/ab_fwd_v17_l2.json`).
    gl.store(stage + (slots - W)[None, :], p, mask=(heads < H)[:, None] & (slots < W + K)[None, :],
             eviction_policy="evict_last")
    block_max.index((start - W) // BLOCK_N).store(m)


@gluon.jit
def _consumer(args, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr, K_P: gl.constexpr, BLOCK_H: gl.constexpr,
              ROPE: gl.constexpr, MASS_PASS: gl.constexpr, BLOCK_N: gl.constexpr, W_P: gl.constexpr,
              N_PAIRS: gl.constexpr, SKIP: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup WG (0 or 1) over the program's tokens: computes S and P of each pair's block WG, and O's
    columns WG*D/2.. from both blocks (its own P from registers, the other's through shared memory)."""
    (KV, q_desc, WIN_LO, IDX, SINK, ROT, OUT, LSE, MASS, STAGE, comp_offset, stage_program_stride, stage_head_stride,
     T, S, H, scale_log2, n_tokens, q_smem, kv_smem, p_smem, row_smem, block_max, bias_smem, bars) = args
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))
    sink = gl.load(SINK + heads, mask=heads < H, other=0.0).to(gl.float32) * LOG2E
    for it in range(tokens_of_program(n_tokens)):
        tok = (gl.program_id(0) + it * gl.num_programs(0)).to(gl.int64)
        mbarrier.wait(bars.index(_Q), it & 1)  # the producer has stored this token's q
        m, l, acc = _token_pairs(it, tok, sink, args, D, W, K, BLOCK_H, MASS_PASS, BLOCK_N, W_P, N_PAIRS, WG, SKIP)
        _token_epilogue(it, tok, m, l, acc, args, D, W, K, BLOCK_H, ROPE, MASS_PASS, BLOCK_N, W_P, N_PAIRS, WG,
                        SKIP)


@gluon.jit
def _token_pairs(it, tok, sink, args, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr, BLOCK_H: gl.constexpr,
                 MASS_PASS: gl.constexpr, BLOCK_N: gl.constexpr, W_P: gl.constexpr, N_PAIRS: gl.constexpr,
                 WG: gl.constexpr, SKIP: gl.constexpr):
    """Consumer WG's part of one token's pairs of blocks, from the sink's logits (log2, one per head, in S's row
    layout): (m, l, acc) after the last pair. Per pair: WG0's max goes
    to WG1, which takes the pair's max (both blocks) and hands it back; WG0 rescales its P and O to it, so both halves
    of O, both P and both partial row sums are relative to one max after every pair."""
    (KV, q_desc, WIN_LO, IDX, SINK, ROT, OUT, LSE, MASS, STAGE, comp_offset, stage_program_stride, stage_head_stride,
     T, S, H, scale_log2, n_tokens, q_smem, kv_smem, p_smem, row_smem, block_max, bias_smem, bars) = args
    HALF: gl.constexpr = D // 2
    ROW: gl.constexpr = sink.type.layout
    S_L: gl.constexpr = ROW.parent
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_L)
    dtype: gl.constexpr = q_desc.dtype
    TILE: gl.constexpr = q_desc.block_type.shape[2]
    m = sink
    l = gl.full([BLOCK_H], 1.0 - WG, gl.float32, ROW)  # the sink's term, counted once (by WG0)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_L)
    for i in range(N_PAIRS):
        phase = (it * N_PAIRS + i) & 1  # the barriers' phases run on over the program's tokens
        start = W - W_P + (2 * i + WG) * BLOCK_N
        zero = opaque_zero(i)
        own = kv_smem.index(WG + zero)
        own_v = own.slice(WG * HALF, HALF, dim=1)
        other_v = kv_smem.index(1 - WG + zero).slice(WG * HALF, HALF, dim=1)
        # S = q K^T by halves of D, each issued once its half of the rows has landed: first the half this
        # warpgroup frees first (WG0: left, WG1: right), so that S starts while the other half is still landing.
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
        for h in gl.static_range(2):  # the half of D: WG0 takes 0 then 1, WG1 1 then 0
            mbarrier.wait(bars.index(_READY + 2 * WG + (h + WG) % 2), phase)
            fence_async_shared()  # rows written by cp.async (generic proxy) are read by wgmma (async proxy)
            for c in gl.static_range(HALF // TILE):  # q a TMA tile at a time
                s = warpgroup_mma(head_tile(q_smem, (h + WG) % 2 * (HALF // TILE) + c),
                                  own.slice((h + WG) % 2 * HALF + c * TILE, TILE, dim=1).permute((1, 0)), s,
                                  use_acc=h + c > 0, is_async=True)
        mbarrier.wait(bars.index(_VALID + WG), phase)
        bias = bias_smem.index(WG).load(gl.SliceLayout(0, S_L))
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(bars.index(_Q_FREE), count=1, pred=i == N_PAIRS - 1)  # the token's last S has read q
        s = s * scale_log2 + bias[None, :]
        if WG == 0:
            m_new = gl.maximum(m, gl.max(s, 1))
        else:
            mbarrier.wait(bars.index(_MAX), phase)
            m_new = gl.maximum(row_smem.index(0).load(ROW), gl.max(s, 1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        l = l * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, O_ROW)[:, None]
        row_smem.index(WG).store(m_new)
        mbarrier.arrive(bars.index(_MAX + WG), count=1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), P_L), own_v, acc, is_async=True)
        if WG == 0:  # to the pair's max, which WG1 took from both blocks
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(bars.index(_FREE + 0), count=1)  # block 0's left half: read by S and this PV
            mbarrier.wait(bars.index(_MAX + 1), phase)
            m_pair = row_smem.index(1).load(ROW)
            rescale = gl.exp2(m_new - m_pair)
            p = p * rescale[:, None]
            l = l * rescale
            acc = acc * gl.convert_layout(rescale, O_ROW)[:, None]
            m_new = m_pair
        p_smem.index(WG).store(p.to(dtype))
        fence_async_shared()  # P is read by the other warpgroup's wgmma
        mbarrier.arrive(bars.index(_P + WG), count=1)
        mbarrier.wait(bars.index(_P + 1 - WG), phase)
        acc = warpgroup_mma(p_smem.index(1 - WG), other_v, acc, is_async=True)
        if MASS_PASS and (SKIP & _SKIP_MASS_STAGE) == 0:
            if (start >= W) & (start < W + K):
                _stage_block(STAGE, stage_program_stride, stage_head_stride, block_max, p, m_new, start, H, W, K,
                             BLOCK_N)
        if WG == 0:
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(bars.index(_FREE + 2), count=1)  # block 1's left half
        else:
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mbarrier.arrive(bars.index(_FREE + 3), count=1)  # block 1's right half
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(bars.index(_FREE + 1), count=1)  # block 0's right half
        m = m_new
    return m, l, acc


@gluon.jit
def _token_epilogue(it, tok, m, l, acc, args, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr,
                    BLOCK_H: gl.constexpr, ROPE: gl.constexpr, MASS_PASS: gl.constexpr, BLOCK_N: gl.constexpr,
                    W_P: gl.constexpr, N_PAIRS: gl.constexpr, WG: gl.constexpr, SKIP: gl.constexpr):
    """Consumer WG's end of a token: the row sums of both warpgroups, LSE, its half of the output, then the mass of
    its blocks."""
    (KV, q_desc, WIN_LO, IDX, SINK, ROT, OUT, LSE, MASS, STAGE, comp_offset, stage_program_stride, stage_head_stride,
     T, S, H, scale_log2, n_tokens, q_smem, kv_smem, p_smem, row_smem, block_max, bias_smem, bars) = args
    HALF: gl.constexpr = D // 2
    ROW: gl.constexpr = m.type.layout
    O_ROW: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    heads = gl.arange(0, BLOCK_H, layout=ROW)
    hmask = heads < H
    # Row sums: each warpgroup summed its own blocks' P.
    row_smem.index(2 + WG).store(l)
    mbarrier.arrive(bars.index(_L + WG), count=1)
    mbarrier.wait(bars.index(_L + 1 - WG), it & 1)
    l = l + row_smem.index(3 - WG).load(ROW)
    lse2 = m + gl.log2(l)
    if WG == 1:
        gl.store(LSE + tok * H + heads, lse2 / LOG2E, mask=hmask)
    out = acc / gl.convert_layout(l, O_ROW)[:, None]
    out = rope_tail(out, ROT, tok, WG * HALF, D, ROPE, True)  # back to q's frame, in fp32
    out = out.to(OUT.dtype.element_ty)
    OUT_L: gl.constexpr = sixteen_byte_rows(HALF)  # 16-byte stores: 15.2 -> 14.9 ms (4-byte: 16.3-17.7)
    out = gl.convert_layout(out, OUT_L)
    out_heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, OUT_L))
    dims = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, OUT_L))
    gl.store(OUT + (tok * H + out_heads[:, None]) * D + dims[None, :], out, mask=(out_heads < H)[:, None])
    if MASS_PASS:  # after the output: O's registers are free for the staged blocks' loads
        gl.thread_barrier()  # this warpgroup's staged p is read by its other threads
        if (SKIP & _SKIP_MASS_SUM) == 0:
            _selected_mass_of(WG, STAGE + gl.program_id(0) * stage_program_stride, stage_head_stride, block_max, lse2,
                              MASS + tok * K, H, W_P, K, N_PAIRS, BLOCK_H, BLOCK_N)
        gl.thread_barrier()  # read before this warpgroup stages the next token's blocks there


@gluon.jit
def _selected_mass_of(WG: gl.constexpr, STAGE, stage_head_stride, block_max, lse2, MASS, H, W_P: gl.constexpr,
                      K: gl.constexpr, N_PAIRS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr):
    """MASS of the selected blocks warpgroup WG staged (its blocks 2r + WG): per block, the sum over heads of p
    times exp2(the block's max - lse2). The blocks' loads are independent (unrolled), so they are issued together."""
    # Heads within a warp (the sum over them stays in registers and shuffles), the warps side by side on slots.
    TILE: gl.constexpr = gl.BlockedLayout([BLOCK_H // 16, 8], [16, 2], [1, 4], [1, 0])
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, TILE))
    lse2 = gl.convert_layout(lse2, gl.SliceLayout(1, TILE))
    for r in gl.static_range(N_PAIRS):
        if (2 * r + WG) * BLOCK_N >= W_P:
            if (2 * r + WG) * BLOCK_N < W_P + K:
                first = (2 * r + WG) * BLOCK_N - W_P  # the block's first selected slot
                slots = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, TILE))
                p = gl.load(STAGE + heads[:, None] * stage_head_stride + slots[None, :],
                            mask=(heads < H)[:, None] & (slots < K)[None, :], other=0.0,
                            eviction_policy="evict_first")  # read once: first to go (_stage_block)
                weight = gl.exp2(block_max.index(first // BLOCK_N).load(gl.SliceLayout(1, TILE)) - lse2)
                gl.store(MASS + slots, gl.sum(p.to(gl.float32) * weight[:, None], 0), mask=slots < K)


@gluon.jit
def _producer(args, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr, K_P: gl.constexpr, BLOCK_H: gl.constexpr,
              ROPE: gl.constexpr, MASS_PASS: gl.constexpr, BLOCK_N: gl.constexpr, W_P: gl.constexpr,
              N_PAIRS: gl.constexpr, SKIP: gl.constexpr, WG: gl.constexpr):
    """The producer warpgroup: gathers each pair's two blocks by cp.async, a buffer half at a time in the order
    the consumers free them (block 0 left, block 1 right, block 0 right, block 1 left); each half's READY barrier
    completes when every producer thread's copies have landed (one arrival per thread)."""
    (KV, q_desc, WIN_LO, IDX, SINK, ROT, OUT, LSE, MASS, STAGE, comp_offset, stage_program_stride, stage_head_stride,
     T, S, H, scale_log2, n_tokens, q_smem, kv_smem, p_smem, row_smem, block_max, bias_smem, bars) = args
    HALF: gl.constexpr = D // 2
    PIECES: gl.constexpr = min(16, HALF // 8)  # 16-byte pieces of a row per thread row
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // PIECES, PIECES], [PRODUCER_WARPS, 1], [1, 0])
    ROWS: gl.constexpr = gl.SliceLayout(1, LOAD)
    for it in range(tokens_of_program(n_tokens)):
        tok = (gl.program_id(0) + it * gl.num_programs(0)).to(gl.int64)
        b = tok // T
        t = tok - b * T
        win_lo = gl.load(WIN_LO + tok)
        # q (its RoPE tail rotated) once both consumers' last S of the previous token has read the old one; a fresh
        # barrier's previous phase counts as complete, so the first token does not wait (nor does the first pair).
        mbarrier.wait(bars.index(_Q_FREE), (it & 1) ^ 1)
        _load_q(q_desc, ROT, q_smem, bars, it, tok, D, ROPE)
        mbarrier.arrive(bars.index(_Q), count=1)
        for i in range(N_PAIRS):
            phase = ((it * N_PAIRS + i) & 1) ^ 1
            start = W - W_P + 2 * i * BLOCK_N
            offset0, valid0 = block_rows(IDX, start, tok, b, t, win_lo, T, S, comp_offset, D, W, K, BLOCK_N, ROWS)
            offset1, valid1 = block_rows(IDX, start + BLOCK_N, tok, b, t, win_lo, T, S, comp_offset, D, W, K,
                                          BLOCK_N, ROWS)
            _gather_half(KV, kv_smem, bars, 0, 0, offset0, valid0, phase, HALF, LOAD, SKIP)
            _publish_bias(bias_smem, bars, 0, valid0)
            _gather_half(KV, kv_smem, bars, 1, 1, offset1, valid1, phase, HALF, LOAD, SKIP)
            _publish_bias(bias_smem, bars, 1, valid1)
            _gather_half(KV, kv_smem, bars, 0, 1, offset0, valid0, phase, HALF, LOAD, SKIP)
            _gather_half(KV, kv_smem, bars, 1, 0, offset1, valid1, phase, HALF, LOAD, SKIP)


@gluon.jit
def _load_q(q_desc, ROT, q_smem, bars, it, tok, D: gl.constexpr, ROPE: gl.constexpr):
    """The token's q into shared memory by TMA (heads past H read 0), then its RoPE tail turned in place. (Loaded
    through registers in 32-column chunks, each waiting for its loads, q took ~16 memory latencies a token.)"""
    TILE: gl.constexpr = q_desc.block_type.shape[2]
    mbarrier.expect(bars.index(_Q_LANDED), D // TILE * q_desc.block_type.nbytes)
    for c in gl.static_range(D // TILE):
        tma.async_copy_global_to_shared(q_desc, [tok.to(gl.int32), 0, c * TILE], bars.index(_Q_LANDED),
                                        q_smem.index(c))
    mbarrier.wait(bars.index(_Q_LANDED), it & 1)
    if ROPE > 0:
        TILE_L: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (TILE // 8), TILE // 8], [PRODUCER_WARPS, 1], [1, 0])
        for c in gl.static_range(D // TILE):
            if (c + 1) * TILE > D - ROPE:
                tile = head_tile(q_smem, c)
                tile.store(rope_tail(tile.load(TILE_L), ROT, tok, c * TILE, D, ROPE))
    fence_async_shared()  # q is read by wgmma


@gluon.jit
def _publish_bias(bias_smem, bars, buffer: gl.constexpr, valid):
    """The slots' logit bias (0, or -inf where the slot is empty) of the block now landing in ``buffer``; written
    once its consumer has freed the buffer's first half, i.e. after it read the previous bias."""
    bias_smem.index(buffer).store(gl.where(valid, 0.0, float("-inf")))
    mbarrier.arrive(bars.index(_VALID + buffer), count=1)


@gluon.jit
def _gather_half(KV, kv_smem, bars, buffer: gl.constexpr, half: gl.constexpr, offset, valid, phase,
                 HALF: gl.constexpr, LOAD: gl.constexpr, SKIP: gl.constexpr):
    """Wait until the consumers are done with half ``half`` of ``buffer``, then copy the rows' columns there
    (invalid rows become zeros) and let READY track the copies."""
    mbarrier.wait(bars.index(_FREE + 2 * buffer + half), phase)
    dims = half * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, LOAD))
    if (SKIP & _SKIP_GATHER) == 0:
        async_copy.async_copy_global_to_shared(kv_smem.index(buffer).slice(half * HALF, HALF, dim=1),
                                               KV + offset[:, None] + dims[None, :], mask=valid[:, None])
    async_copy.mbarrier_arrive(bars.index(_READY + 2 * buffer + half), increment_count=False)


@triton.autotune(configs=[triton.Config({}, num_warps=4, maxnreg=KERNEL_MAXNREG)], key=["H", "D", "W", "K"])
@gluon.jit
def _fwd_kernel(KV, q_desc, WIN_LO, IDX, SINK, ROT, OUT, LSE, MASS, STAGE, comp_offset, stage_program_stride,
                stage_head_stride, T, S, H, scale_log2, n_tokens, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr,
                K_P: gl.constexpr, BLOCK_H: gl.constexpr, ROPE: gl.constexpr, MASS_PASS: gl.constexpr,
                SKIP: gl.constexpr, num_warps: gl.constexpr):
    """``triton_attention._fwd_kernel``'s contract (plus ``n_tokens`` = B*T) with the seesaw schedule, persistent:
    each program takes tokens pid, pid + programs, ...; the producer loads the next token's q and gathers its first
    pair while the consumers finish the last token (its row sums, mass and output)."""
    gl.static_assert(BLOCK_H == 64 and num_warps == 4, "one wgmma M of heads per consumer warpgroup")
    BLOCK_N: gl.constexpr = 64
    W_P: gl.constexpr = (W + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # the window's slots start a block: first at W - W_P
    N_PAIRS: gl.constexpr = (W_P + K + 2 * BLOCK_N - 1) // (2 * BLOCK_N)  # pairs of blocks a token takes
    operand: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dtype: gl.constexpr = q_desc.dtype
    TILE: gl.constexpr = q_desc.block_type.shape[2]
    q_smem = gl.allocate_shared_memory(dtype, [D // TILE, 1, BLOCK_H, TILE], q_desc.layout)  # q's TMA boxes
    kv_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], operand)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_N], operand)
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    row_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], rows)  # the two maxima, the two row sums
    block_max = gl.allocate_shared_memory(gl.float32, [K_P // BLOCK_N, BLOCK_H], rows)
    bias_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], rows)  # 0 or -inf per slot of each buffer
    bars = gl.allocate_shared_memory(gl.int64, [32, 1], mbarrier.MBarrierLayout())  # _N_BARRIERS, to a power of 2
    for i in gl.static_range(_N_BARRIERS):
        # READY: one cp.async arrival per producer thread; Q_FREE: one per consumer; the rest: one arrival.
        mbarrier.init(bars.index(i), count=PRODUCER_WARPS * 32 if i < _FREE else (2 if i == _Q_FREE else 1))
    # The TMA loads complete Q_LANDED through the async proxy, which must see the initialised barriers.
    fence_async_shared()
    args = (KV, q_desc, WIN_LO, IDX, SINK, ROT, OUT, LSE, MASS, STAGE, comp_offset, stage_program_stride,
            stage_head_stride, T, S, H, scale_log2, n_tokens, q_smem, kv_smem, p_smem, row_smem, block_max, bias_smem,
            bars)
    # Worker partitions share one signature: each takes every shape argument, used or not.
    gl.warp_specialize([
        (_consumer, (args, D, W, K, K_P, BLOCK_H, ROPE, MASS_PASS, BLOCK_N, W_P, N_PAIRS, SKIP, 0)),
        (_consumer, (args, D, W, K, K_P, BLOCK_H, ROPE, MASS_PASS, BLOCK_N, W_P, N_PAIRS, SKIP, 1)),
        (_producer, (args, D, W, K, K_P, BLOCK_H, ROPE, MASS_PASS, BLOCK_N, W_P, N_PAIRS, SKIP, 1)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def usable(q: torch.Tensor) -> bool:
    """The Gluon forward runs on Hopper for 33-64 heads (padded to 64, one wgmma M, as ``triton_attention._block_h``
    pads them), D a power of two from 64 to 512 (O's D/2 columns per warpgroup are one wgmma N <= 256) and 16-bit
    inputs."""
    return hopper_heads_dtype(q) and q.shape[-1] in (64, 128, 256, 512)


def q_descriptor(q: torch.Tensor):
    """q [..., H, D] read by TMA [1, 64 heads, min(64, D/2)] at a time: S is issued by halves of D, a box at a time."""
    return head_rows_descriptor(q, min(FEATURES.value, q.shape[-1] // 2))


def launch(n_tokens, kv, q, win_lo, idx, sink, rot, out, lse, mass, comp_offset, T, S, H, scale_log2, **constexprs):
    """``triton_attention._fwd_kernel``'s launch over ``n_tokens`` = B*T tokens (its arguments less the stage: each
    program stages p in [64, K] fp16 rows of its own, so that a token's mass is summed after its output is stored,
    with no hand-over between the consumers: 15.2 -> 14.9 ms): one program per SM at most, each taking every
    programs-th token; q read through a TMA descriptor."""
    programs = min(n_tokens, torch.cuda.get_device_properties(q.device).multi_processor_count)
    K = constexprs["K"]
    stage = torch.empty((programs, BLOCK_H, K) if constexprs["MASS_PASS"] else (1, ), dtype=torch.float16,
                        device=q.device)
    _fwd_kernel[(programs, )](kv, q_descriptor(q), win_lo, idx, sink, rot, out, lse, mass, stage, comp_offset,
                              BLOCK_H * K, K, T, S, H, scale_log2, n_tokens, **constexprs,
                              SKIP=sum(1 << i for i, skipped in enumerate(STAGES) if skipped in ABLATE))
