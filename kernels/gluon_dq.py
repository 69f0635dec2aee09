"""The sparse-attention backward's dq for Hopper, in Gluon: ``triton_attention._bwd_dq_kernel``'s contract
(dq [tokens, H, D] of a chunk of tokens from their dS rows [n, H, W + K] and their slots' rows).

Why: the Triton kernel (one program per token, 8 warps, 235 registers, one CTA per SM) gathers each block of rows
by ``cp.async`` in the warps that run its MMAs: 11.4 ms at 64K (241 TFLOP/s), L2 at 45% and the issue slots at 41%
of their peaks (Nsight Compute, ``ncu_attention_v15.json``). Here the gathers run ahead in a producer warpgroup:

- A producer warpgroup loads, per 64-slot block, the dS tile [64 heads, 64 slots] by TMA (heads past H and slots
  outside 0..W+K-1 read 0) and the slots' rows [64, D] by ``cp.async`` (invalid rows become zeros) into a ring of
  ``STAGES`` buffers (READY_DS / READY_KV / FREE mbarriers).
- Two consumer warpgroups, each one half of D: dq[:, half] += dS_tile @ rows[:, half] (wgmma M = 64 heads, N = D/2,
  K = 64 slots, both operands from shared memory; 128 fp32 registers a thread at D = 512), the buffer freed once
  both halves have read it; at the token's end the RoPE tail turned back to q's frame and the rows stored 16 bytes
  a thread.
- Persistent: one program per SM takes tokens pid, pid + programs, ... of the chunk.

Gluon runs only on the GPU: the CPU tests compile it (``kernels.hopper_compile``); ``bench/bench_kernels.py check``
compares the backward with the fp32 reference.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.gluon_common import (BLOCK_H, block_rows, hopper_heads_dtype, opaque_zero, rope_tail, sixteen_byte_rows,
                                  tma_descriptor, tokens_of_program)

HEADS = gl.constexpr(BLOCK_H)  # a token's heads (padded): the wgmma M
BLOCK_N = gl.constexpr(64)  # slots per block: the wgmma K
STAGES = gl.constexpr(3)  # blocks in flight: 3 x (64 rows x D + dS tile) = 216 KiB at D = 512
PRODUCER_WARPS = gl.constexpr(4)
# Barriers (one array): READY_DS, READY_KV and FREE per stage.
_READY_DS, _READY_KV, _FREE = gl.constexpr(0), gl.constexpr(STAGES.value), gl.constexpr(2 * STAGES.value)
# Registers per thread (12 warps share the SM's 64K): a consumer holds its dq half [64, D/2] fp32 (128 at D = 512).
CONSUMER_REGS, PRODUCER_REGS, KERNEL_MAXNREG = gl.constexpr(208), gl.constexpr(88), 168


@gluon.jit
def _consumer(args, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr, ROPE: gl.constexpr, W_P: gl.constexpr,
              N_BLOCKS: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup WG: dq's features WG * D/2 ... of each of the program's tokens."""
    (KV, WIN_LO, IDX, ds_desc, ROT, DQ, tok0, comp_offset, T, S, H, n_tokens, ds_smem, kv_smem, bars) = args
    HALF: gl.constexpr = D // 2
    ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    OUT_L: gl.constexpr = sixteen_byte_rows(HALF)
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(1, OUT_L))
    dims = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, OUT_L))
    for it in range(tokens_of_program(n_tokens)):
        tok = tok0 + (gl.program_id(0) + it * gl.num_programs(0)).to(gl.int64)
        acc = gl.zeros([HEADS, HALF], gl.float32, ACC_L)
        for i in range(N_BLOCKS):
            n = it * N_BLOCKS + i  # the program's block count: its ring stage and phase
            stage = n % STAGES
            phase = (n // STAGES) & 1
            zero = opaque_zero(i)
            mbarrier.wait(bars.index(_READY_DS + stage), phase)
            mbarrier.wait(bars.index(_READY_KV + stage), phase)
            fence_async_shared()  # rows written by cp.async (generic proxy) are read by wgmma (async proxy)
            ds = ds_smem.index(stage + zero).reshape([HEADS, BLOCK_N])
            rows = kv_smem.index(stage + zero).slice(WG * HALF, HALF, dim=1)
            acc = warpgroup_mma(ds, rows, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))  # the previous block's MMA is done: its stage goes back
            mbarrier.arrive(bars.index(_FREE + (n + STAGES - 1) % STAGES), count=1, pred=i > 0)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(bars.index(_FREE + (it * N_BLOCKS + N_BLOCKS - 1) % STAGES), count=1)
        acc = rope_tail(acc, ROT, tok, WG * HALF, D, ROPE, True)  # the rotated q's gradient, back to q's frame
        dq = gl.convert_layout(acc.to(DQ.dtype.element_ty), OUT_L)
        gl.store(DQ + (tok * H + heads[:, None]) * D + dims[None, :], dq, mask=(heads < H)[:, None])


@gluon.jit
def _producer(args, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr, ROPE: gl.constexpr, W_P: gl.constexpr,
              N_BLOCKS: gl.constexpr, WG: gl.constexpr):
    """The producer warpgroup: each token's blocks into the ring, once both consumers have freed the stage."""
    (KV, WIN_LO, IDX, ds_desc, ROT, DQ, tok0, comp_offset, T, S, H, n_tokens, ds_smem, kv_smem, bars) = args
    PIECES: gl.constexpr = min(16, D // 8)  # 16-byte pieces of a row per thread row
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // PIECES, PIECES], [PRODUCER_WARPS, 1], [1, 0])
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    for it in range(tokens_of_program(n_tokens)):
        row = gl.program_id(0) + it * gl.num_programs(0)
        tok = tok0 + row.to(gl.int64)
        b = tok // T
        t = tok - b * T
        win_lo = gl.load(WIN_LO + tok)
        for i in range(N_BLOCKS):
            n = it * N_BLOCKS + i
            stage = n % STAGES
            start = W - W_P + i * BLOCK_N  # the block's first slot (negative: window padding, read as 0)
            offset, valid = block_rows(IDX, start, tok, b, t, win_lo, T, S, comp_offset, D, W, K, BLOCK_N,
                                       gl.SliceLayout(1, LOAD))
            # A fresh barrier's previous phase counts as complete, so the first pass over the ring does not wait.
            mbarrier.wait(bars.index(_FREE + stage), ((n // STAGES) & 1) ^ 1)
            mbarrier.expect(bars.index(_READY_DS + stage), ds_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(ds_desc, [row, 0, start], bars.index(_READY_DS + stage),
                                            ds_smem.index(stage))
            async_copy.async_copy_global_to_shared(kv_smem.index(stage), KV + offset[:, None] + dims[None, :],
                                                   mask=valid[:, None])
            async_copy.mbarrier_arrive(bars.index(_READY_KV + stage), increment_count=False)


@triton.autotune(configs=[triton.Config({}, num_warps=4, maxnreg=KERNEL_MAXNREG)], key=["H", "D", "W", "K"])
@gluon.jit(do_not_specialize=["tok0"])  # one compiled kernel for every chunk
def _bwd_dq_kernel(KV, WIN_LO, IDX, ds_desc, ROT, DQ, tok0, comp_offset, T, S, H, n_tokens, D: gl.constexpr,
                   W: gl.constexpr, K: gl.constexpr, ROPE: gl.constexpr, num_warps: gl.constexpr):
    """dq of tokens tok0 + r for r = pid, pid + programs, ... below n_tokens, from their dS rows (``ds_desc``:
    [n, H, W + K], r-th row set for token tok0 + r) and their slots' rows."""
    gl.static_assert(num_warps == 4, "one wgmma M of heads per consumer warpgroup")
    W_P: gl.constexpr = (W + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # the window's slots start a block: first at W - W_P
    N_BLOCKS: gl.constexpr = (W_P + K + BLOCK_N - 1) // BLOCK_N
    dtype: gl.constexpr = ds_desc.dtype
    ds_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, HEADS, BLOCK_N], ds_desc.layout)
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D],
                                        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    bars = gl.allocate_shared_memory(gl.int64, [3 * STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3 * STAGES):
        # READY_DS: the producer's expect (the TMA bytes complete it); READY_KV: one cp.async arrival per producer
        # thread; FREE: one per consumer.
        mbarrier.init(bars.index(i), count=1 if i < _READY_KV else (PRODUCER_WARPS * 32 if i < _FREE else 2))
    fence_async_shared()  # the TMA loads complete READY_DS through the async proxy: it must see the barriers
    args = (KV, WIN_LO, IDX, ds_desc, ROT, DQ, tok0, comp_offset, T, S, H, n_tokens, ds_smem, kv_smem, bars)
    gl.warp_specialize([
        (_consumer, (args, D, W, K, ROPE, W_P, N_BLOCKS, 0)),
        (_consumer, (args, D, W, K, ROPE, W_P, N_BLOCKS, 1)),
        (_producer, (args, D, W, K, ROPE, W_P, N_BLOCKS, 1)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def usable(q: torch.Tensor, window: int, k: int) -> bool:
    """Hopper, 33-64 heads, 16-bit, aligned (``gluon_common.hopper_heads_dtype``), D a power of two from 64 to 512
    (a consumer's half is one wgmma N <= 256) and W + K a multiple of 8 (dS rows 16-byte aligned for TMA)."""
    return hopper_heads_dtype(q) and q.shape[-1] in (64, 128, 256, 512) and (window + k) % 8 == 0


def ds_descriptor(ds: torch.Tensor) -> TensorDescriptor:
    """dS rows [n, H, W + K] read [1, 64 heads, 64 slots] at a time (heads past H and slots outside the row read 0)."""
    return tma_descriptor(ds, [1, BLOCK_H, BLOCK_N.value])


def launch(kv_window, win_lo, idx, ds, rot, dq, tok0, comp_offset, T, S, H, **constexprs):
    """dq of the chunk's n = ds.shape[0] tokens on one program per SM at most."""
    n_tokens = ds.shape[0]
    programs = min(n_tokens, torch.cuda.get_device_properties(ds.device).multi_processor_count)
    _bwd_dq_kernel[(programs, )](kv_window, win_lo, idx, ds_descriptor(ds), rot, dq, tok0, comp_offset, T, S, H,
                                 n_tokens, **constexprs)
