"""The backward's dKV step for Hopper, in Gluon: ``triton_attention._bwd_dkv_kernel``'s contract (a chunk's partial
dKV rows PART, its dS rows DS and dsink), warp-specialized and persistent.

Why: the Triton kernel keeps the stacked [q; dO] (128 KB) and one 64-row block in shared memory, which leaves no room
for a ring of gathers, and its 255 registers allow one program per SM: it waits on every block's rows (v8 profile:
issue slots 18%, tensor pipe 29%; 41.5 ms of the backward's 67 at 64K). Per token the step is three products over
each block of slots: S = q K^T, dP = dO K^T (K = D) and the partial rows dS^T q + P^T dO (K = the heads). Here they
are computed transposed, slots as the wgmma M, in blocks of 64 slots shared by two consumer warpgroups:

- A producer warpgroup loads each token's q and dO into shared memory by TMA, as [64 heads, 64 features] tiles, and
  turns their RoPE tails forward in place (the step works in the rotated frame, as the Triton kernel does); it
  computes the next token's delta = rowsum(dO O) from global memory while the consumers finish the current token,
  and gathers each block's 64 rows by ``cp.async`` into one buffer (64 KB), publishing the block's -inf / 0 slot
  bias.
- Consumer 0 computes S^T = K q^T, consumer 1 dP^T = K dO^T (wgmma 64 slots x 64 heads, K = D: both operands 64
  wide, so every wgmma reads as many bytes as it computes at the tensor pipe's rate). The rows are then not read
  again and go back to the producer. Consumer 0 makes P^T = exp2(S^T - lse) and hands it over in fp32 (through its
  staging tiles, free at that point); consumer 1 makes dS^T = P^T (dP^T - delta) scale, stores it (read by TMA for
  the dq kernel, and by consumer 0).
- Each consumer then makes the block's partial rows for half of the features: dKV [64 slots, 64 features] =
  dS^T q_f + P^T dO_f, A (dS^T, P^T) from registers and B the q / dO tile of those features, so only B is read from
  shared memory; each result is staged and stored by TMA as whole 128-byte lines.

The v1 kernel (blocks of 32 slots, each consumer its own blocks whole, S and dP with heads as M) read shared memory
for both operands of 64 x 32 wgmma: bound by shared-memory reads (72% busy, tensor pipe 36%; 33.4 ms at 64K).

Shared memory at D = 512: q and dO 128 KiB, the block's rows 64 KiB, dS 8 KiB, consumer 0's two staging tiles (the
fp32 exchange between blocks) 16 KiB and consumer 1's one 8 KiB: 224 KiB with the barriers, of the 227 KiB a block
may take. Every TMA store is clipped to the tensor, so slots before 0 or past W + K and padded heads write nothing.
Gluon runs only on the GPU: the CPU tests compile it (``kernels.hopper_compile``); ``bench/bench_kernels.py check``
compares it with the fp32 reference and with the Triton kernel.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.gluon_common import (BLOCK_H, FEATURES, LOG2E, block_rows, head_cols, head_rows_descriptor, head_tile,
                                  hopper_heads_dtype, opaque_zero, rope_tail, tma_descriptor, tokens_of_program)

# Stages the benchmark switches off to see what each costs (``bench_kernels.py bench_dkv_step``; the outputs are then
# wrong): the producer's TMA loads of q and dO, its row gathers, the consumers' TMA stores of the partial rows, and
# the partial rows altogether (their wgmma, staging and stores). The kernel takes them as the bits of SKIP.
STAGES = ("operands", "gather", "stores", "partial_rows")
ABLATE: set[str] = set()
_SKIP_OPERANDS, _SKIP_GATHER, _SKIP_STORES, _SKIP_PARTIAL_ROWS = (gl.constexpr(1 << i) for i in range(len(STAGES)))
BLOCK_N = gl.constexpr(64)  # slots per block: the M of every wgmma
# FEATURES (gluon_common): features per q / dO tile, per partial-rows wgmma (its N) and per staged TMA store
HEADS = gl.constexpr(BLOCK_H)
# Barriers (one array): the block's rows landed (READY), read by both score MMAs (FREE), its bias stored (VALID); the
# token's operands landed by TMA, ready for the consumers (RoPE turned, delta stored), released by both; P^T handed
# to consumer 1, dS^T stored for consumer 0, read by it.
_READY, _FREE, _VALID, _LANDED, _Q, _Q_FREE, _P, _DS, _DS_FREE = (gl.constexpr(i) for i in range(9))
_N_BARRIERS = gl.constexpr(9)
PRODUCER_WARPS = gl.constexpr(4)
# Registers per thread (12 warps share the SM's 64K): a consumer holds S^T or dP^T [64, 64] (32), then P^T and dS^T
# as wgmma A operands (16 each) and two partial-row accumulators (32 each); the producer the next token's dO and O in
# [64, 128] chunks (delta) and the gathers' row offsets.
CONSUMER_REGS, PRODUCER_REGS, KERNEL_MAXNREG = gl.constexpr(184), gl.constexpr(136), 168


@gluon.jit
def _consumer(args, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr, ROPE: gl.constexpr, W_P: gl.constexpr,
              N_BLOCKS: gl.constexpr, WG: gl.constexpr, SKIP: gl.constexpr):
    """Consumer warpgroup WG over the program's tokens: its role in every block of each, and dsink (WG 0)."""
    (KV, DOUT, OUT, WIN_LO, IDX, SINK, ROT, LSE, DSINK, q_desc, do_desc, part_desc, ds_desc, tok0, comp_offset, T,
     S, H, scale, n_tokens, q_smem, do_smem, kv_smem, ds_smem, exchange_smem, stage_smem, delta_smem, bias_smem,
     bars) = args
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEADS, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)  # P^T and dS^T as wgmma A
    HEAD: gl.constexpr = gl.SliceLayout(0, S_L)
    heads = gl.arange(0, HEADS, layout=HEAD)
    hmask = heads < H
    sink2 = gl.load(SINK + heads, mask=hmask, other=0.0).to(gl.float32) * LOG2E
    for it in range(tokens_of_program(n_tokens)):
        row = gl.program_id(0) + it * gl.num_programs(0)
        tok = tok0 + row.to(gl.int64)
        # Padded heads get lse = +inf: their probabilities are exactly 0 and add nothing.
        lse2 = gl.load(LSE + tok * H + heads, mask=hmask, other=float("inf")) * LOG2E
        mbarrier.wait(bars.index(_Q), it & 1)  # the producer has stored this token's q, dO and delta
        delta = delta_smem.load(HEAD)
        if WG == 0:  # d loss / d sink_h = -p_sink * (dO . O): the sink takes mass from every slot in proportion
            gl.store(DSINK + tok * H + heads, -gl.exp2(sink2 - lse2) * delta, mask=hmask)
        for j in range(N_BLOCKS):
            phase = (it * N_BLOCKS + j) & 1  # the barriers' phases run on over the program's blocks
            start = W - W_P + j * BLOCK_N
            if WG == 0:
                _probabilities_block(args, phase, row, start, lse2, opaque_zero(j), D, S_L, A_L, SKIP)
            else:
                _gradient_block(args, phase, row, start, delta, opaque_zero(j), D, S_L, A_L, SKIP)
        mbarrier.arrive(bars.index(_Q_FREE), count=1)  # this warpgroup's last MMA has read q and dO
    tma.store_wait(0)  # the last stores have read their tiles before the program (and its shared memory) ends


@gluon.jit
def _probabilities_block(args, phase, row, start, lse2, zero, D: gl.constexpr, S_L: gl.constexpr,
                         A_L: gl.constexpr, SKIP: gl.constexpr):
    """Consumer 0's part of a block (its barriers at ``phase``): S^T, P^T to consumer 1, then the partial rows of the
    first half of the features."""
    (KV, DOUT, OUT, WIN_LO, IDX, SINK, ROT, LSE, DSINK, q_desc, do_desc, part_desc, ds_desc, tok0, comp_offset, T,
     S, H, scale, n_tokens, q_smem, do_smem, kv_smem, ds_smem, exchange_smem, stage_smem, delta_smem, bias_smem,
     bars) = args
    dtype: gl.constexpr = q_desc.dtype
    s = _transposed_scores(kv_smem.index(zero), q_smem, bars, phase, D, S_L)
    mbarrier.wait(bars.index(_VALID), phase)
    bias = bias_smem.load(gl.SliceLayout(1, S_L))
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(bars.index(_FREE), count=1)  # rows and bias read: the producer gathers the next block
    p = gl.exp2(s * (scale * LOG2E) + bias[:, None] - lse2[None, :])
    tma.store_wait(0)  # the last block's staged rows have left the tiles that carry P^T
    exchange_smem.store(p)
    mbarrier.arrive(bars.index(_P), count=1)
    p_a = gl.convert_layout(p.to(dtype), A_L)
    mbarrier.wait(bars.index(_DS), phase)  # consumer 1 has read P^T and stored dS^T
    ds_a = ds_smem.reshape([HEADS, BLOCK_N]).permute((1, 0)).load(A_L)
    mbarrier.arrive(bars.index(_DS_FREE), count=1)
    if (SKIP & _SKIP_PARTIAL_ROWS) == 0:
        stage = exchange_smem._reinterpret(dtype, [2, 1, BLOCK_N, FEATURES], part_desc.layout)  # P^T is read
        _partial_rows(q_smem, do_smem, ds_a, p_a, stage, part_desc, row, start, 0, (D // FEATURES + 1) // 2, 2, S_L,
                      SKIP)


@gluon.jit
def _gradient_block(args, phase, row, start, delta, zero, D: gl.constexpr, S_L: gl.constexpr, A_L: gl.constexpr,
                    SKIP: gl.constexpr):
    """Consumer 1's part of a block (its barriers at ``phase``): dP^T, dS^T (stored for consumer 0 and by TMA for
    the dq kernel), then the partial rows of the second half of the features."""
    (KV, DOUT, OUT, WIN_LO, IDX, SINK, ROT, LSE, DSINK, q_desc, do_desc, part_desc, ds_desc, tok0, comp_offset, T,
     S, H, scale, n_tokens, q_smem, do_smem, kv_smem, ds_smem, exchange_smem, stage_smem, delta_smem, bias_smem,
     bars) = args
    dtype: gl.constexpr = q_desc.dtype
    dp = _transposed_scores(kv_smem.index(zero), do_smem, bars, phase, D, S_L)
    dp = warpgroup_mma_wait(0, deps=(dp, ))
    mbarrier.arrive(bars.index(_FREE), count=1)
    mbarrier.wait(bars.index(_P), phase)
    p = exchange_smem.load(S_L)
    ds = p * (dp - delta[None, :]) * scale
    mbarrier.wait(bars.index(_DS_FREE), phase ^ 1)  # consumer 0 has read the last block's dS^T (a fresh barrier's
    tma.store_wait(0)  # previous phase counts as complete), and so have this warpgroup's TMA stores
    ds_smem.reshape([HEADS, BLOCK_N]).permute((1, 0)).store(ds.to(dtype))
    fence_async_shared()  # read by TMA (async proxy)
    mbarrier.arrive(bars.index(_DS), count=1)
    tma.async_copy_shared_to_global(ds_desc, [row, 0, start], ds_smem)
    if (SKIP & _SKIP_PARTIAL_ROWS) == 0:
        STEPS: gl.constexpr = D // FEATURES
        if STEPS > 1:
            _partial_rows(q_smem, do_smem, gl.convert_layout(ds.to(dtype), A_L), gl.convert_layout(p.to(dtype), A_L),
                          stage_smem, part_desc, row, start, (STEPS + 1) // 2, STEPS // 2, 1, S_L, SKIP)


@gluon.jit
def _transposed_scores(kv, tiles, bars, phase, D: gl.constexpr, S_L: gl.constexpr):
    """K tiles^T [64 slots, 64 heads] (S^T from q's tiles, dP^T from dO's), issued once the block's rows have landed;
    the caller waits for it."""
    mbarrier.wait(bars.index(_READY), phase)
    fence_async_shared()  # rows written by cp.async (generic proxy) are read by wgmma (async proxy)
    acc = gl.zeros([BLOCK_N, HEADS], gl.float32, S_L)
    for c in gl.static_range(D // FEATURES):  # K = D, a tile at a time
        acc = warpgroup_mma(kv.slice(c * FEATURES, FEATURES, dim=1), head_tile(tiles, c).permute((1, 0)), acc,
                            use_acc=c > 0, is_async=True)
    return acc


@gluon.jit
def _partial_rows(q_smem, do_smem, ds_a, p_a, stage, part_desc, row, start, FIRST: gl.constexpr, STEPS: gl.constexpr,
                  TILES: gl.constexpr, ACC_L: gl.constexpr, SKIP: gl.constexpr):
    """The block's partial rows for features FIRST * 64 .. (FIRST + STEPS) * 64, a tile of features at a time:
    dKV [64 slots, 64] = dS^T q_f + P^T dO_f (K = the heads, A from registers). The next pair of wgmma stays in
    flight while one result is staged (in the TILES staging tiles by turns) and stored by TMA."""
    dtype: gl.constexpr = ds_a.dtype
    acc = _features_mma(q_smem, do_smem, ds_a, p_a, FIRST, ACC_L)
    for m in gl.static_range(STEPS):
        if m + 1 < STEPS:
            following = _features_mma(q_smem, do_smem, ds_a, p_a, FIRST + m + 1, ACC_L)
        acc = warpgroup_mma_wait(2 * min(STEPS - 1 - m, 1), deps=(acc, ))  # two wgmma (one pair) a step
        tile = stage.index(m % TILES)
        tma.store_wait(TILES - 1)  # the store TILES steps back has read this staging tile
        tile.reshape([BLOCK_N, FEATURES]).store(acc.to(dtype))
        fence_async_shared()
        if (SKIP & _SKIP_STORES) == 0:
            tma.async_copy_shared_to_global(part_desc, [row, start, (FIRST + m) * FEATURES], tile)
        if m + 1 < STEPS:
            acc = following


@gluon.jit
def _features_mma(q_smem, do_smem, ds_a, p_a, f: gl.constexpr, ACC_L: gl.constexpr):
    """Issue dS^T q_f + P^T dO_f for the features of tile f (B: the head-major q and dO tiles as they are)."""
    acc = warpgroup_mma(ds_a, head_tile(q_smem, f), gl.zeros([BLOCK_N, FEATURES], gl.float32, ACC_L), use_acc=False,
                        is_async=True)
    return warpgroup_mma(p_a, head_tile(do_smem, f), acc, is_async=True)


@gluon.jit
def _producer(args, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr, ROPE: gl.constexpr, W_P: gl.constexpr,
              N_BLOCKS: gl.constexpr, WG: gl.constexpr, SKIP: gl.constexpr):
    """The producer warpgroup: per token, gathers its first block (the buffer frees up while the consumers finish
    the previous token's partial rows), then its q, dO and delta once both consumers are done with the previous
    ones, then the remaining blocks as the consumers free the buffer."""
    (KV, DOUT, OUT, WIN_LO, IDX, SINK, ROT, LSE, DSINK, q_desc, do_desc, part_desc, ds_desc, tok0, comp_offset, T,
     S, H, scale, n_tokens, q_smem, do_smem, kv_smem, ds_smem, exchange_smem, stage_smem, delta_smem, bias_smem,
     bars) = args
    PIECES: gl.constexpr = min(16, D // 8)  # 16-byte pieces of a row per thread row
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // PIECES, PIECES], [PRODUCER_WARPS, 1], [1, 0])
    programs = gl.num_programs(0)
    delta = _delta(DOUT, OUT, tok0 + gl.program_id(0).to(gl.int64), H, D)
    for it in range(tokens_of_program(n_tokens)):
        row = gl.program_id(0) + it * programs
        tok = tok0 + row.to(gl.int64)
        b = tok // T
        t = tok - b * T
        win_lo = gl.load(WIN_LO + tok)
        _gather_block(args, it * N_BLOCKS, 0, tok, b, t, win_lo, D, W, K, W_P, LOAD, SKIP)
        # A fresh barrier's previous phase counts as complete, so the first token does not wait.
        mbarrier.wait(bars.index(_Q_FREE), (it & 1) ^ 1)
        delta_smem.store(delta)
        if (SKIP & _SKIP_OPERANDS) == 0:
            _load_operands(args, it, tok0 + row, tok, D, ROPE)
        mbarrier.arrive(bars.index(_Q), count=1)
        for i in range(1, N_BLOCKS):
            _gather_block(args, it * N_BLOCKS + i, i, tok, b, t, win_lo, D, W, K, W_P, LOAD, SKIP)
        # The next token's delta (from global memory only) while the consumers finish this token's last blocks.
        delta = _delta(DOUT, OUT, tok0 + gl.minimum(row + programs, n_tokens - 1).to(gl.int64), H, D)

@gluon.jit
def _delta(DOUT, OUT, tok, H, D: gl.constexpr):
    """delta = rowsum(dO O) of the token's heads (padded heads 0), from the unrotated rows in [64, 128] chunks."""
    COLS: gl.constexpr = min(D, 128)
    CHUNK: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (COLS // 8), COLS // 8], [PRODUCER_WARPS, 1], [1, 0])
    delta = gl.zeros([HEADS], gl.float32, gl.SliceLayout(1, CHUNK))
    for c in gl.static_range(D // COLS):
        do = head_cols(DOUT, tok, H, c * COLS, COLS, D, HEADS, CHUNK)
        delta += gl.sum(do.to(gl.float32) * head_cols(OUT, tok, H, c * COLS, COLS, D, HEADS, CHUNK).to(gl.float32),
                        1)
    return delta


@gluon.jit
def _load_operands(args, it, tok32, tok, D: gl.constexpr, ROPE: gl.constexpr):
    """The token's q and dO into shared memory by TMA (heads past H read 0), then their RoPE tails turned forward
    in place."""
    (KV, DOUT, OUT, WIN_LO, IDX, SINK, ROT, LSE, DSINK, q_desc, do_desc, part_desc, ds_desc, tok0, comp_offset, T,
     S, H, scale, n_tokens, q_smem, do_smem, kv_smem, ds_smem, exchange_smem, stage_smem, delta_smem, bias_smem,
     bars) = args
    TILES: gl.constexpr = D // FEATURES
    mbarrier.expect(bars.index(_LANDED), 2 * TILES * q_desc.block_type.nbytes)
    for c in gl.static_range(TILES):
        tma.async_copy_global_to_shared(q_desc, [tok32, 0, c * FEATURES], bars.index(_LANDED), q_smem.index(c))
        tma.async_copy_global_to_shared(do_desc, [tok32, 0, c * FEATURES], bars.index(_LANDED), do_smem.index(c))
    mbarrier.wait(bars.index(_LANDED), it & 1)
    if ROPE > 0:
        TILE_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
        for c in gl.static_range(TILES):
            if (c + 1) * FEATURES > D - ROPE:
                q_tile = head_tile(q_smem, c)
                q_tile.store(rope_tail(q_tile.load(TILE_L), ROT, tok, c * FEATURES, D, ROPE))
                do_tile = head_tile(do_smem, c)
                do_tile.store(rope_tail(do_tile.load(TILE_L), ROT, tok, c * FEATURES, D, ROPE))
    fence_async_shared()  # q and dO are read by wgmma


@gluon.jit
def _gather_block(args, n, i, tok, b, t, win_lo, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr,
                  W_P: gl.constexpr, LOAD: gl.constexpr, SKIP: gl.constexpr):
    """Block i of the token (the program's n-th) into the buffer once both consumers' score MMAs have read the last
    one: the rows by cp.async (invalid rows become zeros; READY completes when every producer thread's copies have
    landed), then the slots' bias."""
    (KV, DOUT, OUT, WIN_LO, IDX, SINK, ROT, LSE, DSINK, q_desc, do_desc, part_desc, ds_desc, tok0, comp_offset, T,
     S, H, scale, n_tokens, q_smem, do_smem, kv_smem, ds_smem, exchange_smem, stage_smem, delta_smem, bias_smem,
     bars) = args
    offset, valid = block_rows(IDX, W - W_P + i * BLOCK_N, tok, b, t, win_lo, T, S, comp_offset, D, W, K, BLOCK_N,
                               gl.SliceLayout(1, LOAD))
    mbarrier.wait(bars.index(_FREE), (n & 1) ^ 1)
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    if (SKIP & _SKIP_GATHER) == 0:
        async_copy.async_copy_global_to_shared(kv_smem.index(0), KV + offset[:, None] + dims[None, :],
                                               mask=valid[:, None])
    async_copy.mbarrier_arrive(bars.index(_READY), increment_count=False)
    bias_smem.store(gl.where(valid, 0.0, float("-inf")))
    mbarrier.arrive(bars.index(_VALID), count=1)


@triton.autotune(configs=[triton.Config({}, num_warps=4, maxnreg=KERNEL_MAXNREG)], key=["H", "D", "W", "K"])
@gluon.jit(do_not_specialize=["tok0"])  # one compiled kernel for every chunk
def _bwd_dkv_kernel(KV, DOUT, OUT, WIN_LO, IDX, SINK, ROT, LSE, DSINK, q_desc, do_desc, part_desc, ds_desc, tok0,
                    comp_offset, T, S, H, scale, n_tokens, D: gl.constexpr, W: gl.constexpr, K: gl.constexpr,
                    ROPE: gl.constexpr, SKIP: gl.constexpr, num_warps: gl.constexpr):
    """Tokens tok0 + r for r = pid, pid + programs, ... below n_tokens: their partial rows PART[r] and dS rows DS[r]
    (through ``part_desc`` [tokens, W + K, D] and ``ds_desc`` [tokens, H, W + K]), and dsink."""
    gl.static_assert(num_warps == 4 and D % FEATURES == 0, "one wgmma M of slots per consumer warpgroup")
    W_P: gl.constexpr = (W + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # the window's slots start a block: first at W - W_P
    N_BLOCKS: gl.constexpr = (W_P + K + BLOCK_N - 1) // BLOCK_N
    operand: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [D // FEATURES, 1, HEADS, FEATURES], q_desc.layout)  # TMA boxes
    do_smem = gl.allocate_shared_memory(dtype, [D // FEATURES, 1, HEADS, FEATURES], q_desc.layout)
    kv_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D], operand)
    ds_smem = gl.allocate_shared_memory(dtype, [1, HEADS, BLOCK_N], ds_desc.layout)
    # P^T handed from consumer 0 to 1, then consumer 0's two staging tiles of the partial rows; consumer 1's one.
    exchange: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    exchange_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, HEADS], exchange)
    stage_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, FEATURES], part_desc.layout)
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    delta_smem = gl.allocate_shared_memory(gl.float32, [HEADS], rows)
    bias_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N], rows)  # 0 or -inf per slot of the block
    bars = gl.allocate_shared_memory(gl.int64, [16, 1], mbarrier.MBarrierLayout())  # _N_BARRIERS, to a power of 2
    for i in gl.static_range(_N_BARRIERS):
        # READY: one cp.async arrival per producer thread; FREE and Q_FREE: one per consumer; the rest: one arrival.
        mbarrier.init(bars.index(i), count=PRODUCER_WARPS * 32 if i == _READY else
                      (2 if (i == _FREE) or (i == _Q_FREE) else 1))
    # The TMA loads complete LANDED through the async proxy, which must see the initialised barriers (CUDA's TMA
    # examples fence here; without it the copies may update a stale barrier left by an earlier kernel).
    fence_async_shared()
    args = (KV, DOUT, OUT, WIN_LO, IDX, SINK, ROT, LSE, DSINK, q_desc, do_desc, part_desc, ds_desc, tok0, comp_offset,
            T, S, H, scale, n_tokens, q_smem, do_smem, kv_smem, ds_smem, exchange_smem, stage_smem, delta_smem,
            bias_smem, bars)
    # Worker partitions share one signature: each takes every shape argument, used or not.
    gl.warp_specialize([
        (_consumer, (args, D, W, K, ROPE, W_P, N_BLOCKS, 0, SKIP)),
        (_consumer, (args, D, W, K, ROPE, W_P, N_BLOCKS, 1, SKIP)),
        (_producer, (args, D, W, K, ROPE, W_P, N_BLOCKS, 1, SKIP)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def usable(q: torch.Tensor, window: int, k: int) -> bool:
    """Hopper, 33-64 heads, 16-bit (``gluon_common.hopper_heads_dtype``), D a multiple of 64 up to 512 (q, dO and
    a 64-row buffer in one SM's shared memory) and W + K a multiple of 8 (DS rows 16-byte aligned for TMA)."""
    D = q.shape[-1]
    return hopper_heads_dtype(q) and D % FEATURES.value == 0 and D <= 512 and (window + k) % 8 == 0


def descriptors(q: torch.Tensor, dout: torch.Tensor, part: torch.Tensor, ds: torch.Tensor) -> list[TensorDescriptor]:
    """TMA descriptors, in the kernel's order, of q and dO [tokens, H, D] (read [1, 64 heads, 64] at a time; heads
    past H read 0), of a chunk's partial rows [tokens, W + K, D] (stored [1, 64, 64] at a time) and of its dS rows
    [tokens, H, W + K] ([1, 64 heads, 64] at a time; heads past H are clipped)."""
    return [head_rows_descriptor(q), head_rows_descriptor(dout),
            tma_descriptor(part, [1, BLOCK_N.value, FEATURES.value]), tma_descriptor(ds, [1, BLOCK_H, BLOCK_N.value])]


def launch(kv_window, q, dout, out, win_lo, idx, sink, rot, lse, part, ds, dsink, tok0, comp_offset, T, S, H, scale,
           **constexprs):
    """The chunk's dKV step (``part`` [n, W + K, D], ``ds`` [n, H, W + K]) on one program per SM at most, each taking
    every programs-th token."""
    n_tokens = part.shape[0]
    programs = min(n_tokens, torch.cuda.get_device_properties(q.device).multi_processor_count)
    _bwd_dkv_kernel[(programs, )](kv_window, dout, out, win_lo, idx, sink, rot, lse, dsink,
                                  *descriptors(q, dout, part, ds), tok0, comp_offset, T, S, H, scale, n_tokens,
                                  **constexprs,
                                  SKIP=sum(1 << i for i, stage in enumerate(STAGES) if stage in ABLATE))
