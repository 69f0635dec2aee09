"""Lightning-indexer scoring for Hopper, in Gluon: ``triton_indexer._score_kernel``'s contract (levels 0 and 1 of a
chunk's pyramid rows), warp-specialized so that one tile's epilogue runs while the next tile's MMA does.

Why: the Triton kernel computes a tile's dots ([64-128 entries, 8 queries x 32 heads], K = 128) and then its
epilogue (ReLU, head weights, head sum, the scores' and block maxima's stores) in the same warps, one program per
SM, so the tensor cores idle through every epilogue: 42 ms at 64K, 58% of the rate of a plain GEMM of the same
FLOPs (v8, ``bench_kernels.py bench``). Here:

- A producer warpgroup loads the queries' q rows [QUERIES x NH, DI] once by TMA, their head weights into shared
  memory, then the key tiles [64 entries, DI] by TMA into a ring of ``STAGES`` buffers, each with a READY / FREE
  mbarrier.
- Four consumer warpgroups: consumers 0 and 1 take the even tiles, 2 and 3 the odd ones, each half of the program's
  queries: S = K q^T by wgmma (M = 64 entries, N = 128 = half the queries x NH, A and B from shared memory), the
  buffer goes back to the producer once both consumers of the tile are done, then relu(S) * w summed over each
  query's heads (in-thread adds and lane shuffles in the wgmma layout), stored at the tile's doc-relative columns
  with its block maxima. While a tile's two consumers run their epilogues, the other tile's run their MMA, two
  epilogues sharing each scheduler (with two consumers of N = 256, one consumer's epilogue outlasted the other's
  MMA). At 64K: 32.7-33.4 ms against 40.0-40.7 for the Triton kernel in the same runs (two consumers: 33.7 against
  39.6; docs/KERNELS.md, "Indexer").

Tiles, documents and splits follow the Triton kernel: a program takes QUERIES queries and the columns
[SPLIT * program_id(1), + SPLIT); queries of different documents are swept one document after the other, every
partition walking the same sequence of tiles (``_next_document``). Keys past the tensor read 0 (TMA), and columns
past a query's width are not stored. Gluon runs only on the GPU: the CPU tests compile it (``kernels.hopper_compile``);
``bench/bench_kernels.py check`` compares its picks with the fp32 reference (exact ties included).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.gluon_common import FEATURES, tma_descriptor

BLOCK_S = gl.constexpr(64)  # entries per tile: the wgmma M
N = gl.constexpr(256)  # a program's queries' heads: QUERIES = N // NH queries
HALF = gl.constexpr(128)  # the heads of half the queries: one consumer's wgmma N
STAGES = gl.constexpr(6)  # key tiles in flight (16 KiB each at DI = 128)
# Barriers (one array): q and the weights landed, then READY and FREE per key buffer.
_Q, _READY, _FREE = gl.constexpr(0), gl.constexpr(1), gl.constexpr(1 + STAGES.value)
PRODUCER_WARPS = gl.constexpr(4)
# Registers per thread (20 warps share the SM's 64K): a consumer holds S [64, 128] fp32 (64); the weights are read
# from shared memory at each tile; the producer only coordinates.
CONSUMER_REGS, PRODUCER_REGS, KERNEL_MAXNREG = gl.constexpr(112), gl.constexpr(32), 96


@gluon.jit
def _queries(VIS_LO, VIS_HI, n_queries, first, QUERIES: gl.constexpr, L: gl.constexpr):
    """Queries first.. first + QUERIES - 1: their rows' offsets in LEVELS (in units of row_len), first visible entry
    and width, laid out as L (a 1-D layout)."""
    r = first + gl.arange(0, QUERIES, layout=L)
    live = r < n_queries
    lo = gl.load(VIS_LO + r, mask=live, other=0)
    width = gl.maximum(gl.load(VIS_HI + r, mask=live, other=0) - lo, 0)
    return r, lo, width


@gluon.jit
def _next_document(pending, lo, width, begin, SPLIT: gl.constexpr):
    """The next document among the pending queries: its first entry, its queries, and the end of its columns in
    this program's split (int32: tile counters index the buffers)."""
    doc_lo = gl.min(gl.where(pending, lo, 2 ** 62), 0)
    active = pending & (lo == doc_lo)
    sweep = gl.minimum(gl.max(gl.where(active, width, 0), 0), begin + SPLIT).to(gl.int32)
    return doc_lo, active, sweep


@gluon.jit
def _consumer(args, NH: gl.constexpr, G: gl.constexpr, SPLIT: gl.constexpr, DI: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup WG: the queries of half WG % 2 in tiles WG // 2, WG // 2 + 2, ... of every document of the
    program (every consumer walks the documents of all the program's queries: the producer's tile sequence)."""
    (q_desc, key_desc, WGT, VIS_LO, VIS_HI, LEVELS, n_queries, row_len, level1, q_smem, key_smem, w_smem, bars) = args
    QUERIES: gl.constexpr = N // NH
    MINE: gl.constexpr = HALF // NH  # this consumer's queries
    ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    # The tile's scores [64 columns, MINE]: a thread holds 2 consecutive columns of a query, a warp 64 of one.
    OUT_L: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [1, 4], [0, 1])
    first = gl.program_id(0) * QUERIES
    _, lo_all, width_all = _queries(VIS_LO, VIS_HI, n_queries, first, QUERIES, gl.SliceLayout(0, OUT_L))
    r, lo, width = _queries(VIS_LO, VIS_HI, n_queries, first + (WG % 2) * MINE, MINE, gl.SliceLayout(0, OUT_L))
    rows = LEVELS + r.to(gl.int64) * row_len
    begin = gl.program_id(1) * SPLIT
    pending_all = width_all > begin
    pending = width > begin
    mbarrier.wait(bars.index(_Q), 0)
    w = w_smem.slice((WG % 2) * HALF, HALF)  # this half's weights, read at each tile
    n0 = 0  # the program's tiles before this document's
    while gl.max(pending_all.to(gl.int32), 0) > 0:
        doc_lo, active_all, sweep = _next_document(pending_all, lo_all, width_all, begin, SPLIT)
        active = pending & (lo == doc_lo)
        for c0 in range(begin + (WG // 2) * BLOCK_S, sweep, 2 * BLOCK_S):
            n = n0 + (c0 - begin) // BLOCK_S
            score = _tile_scores(q_smem, key_smem, w, bars, n, WG % 2, NH, DI, ACC_L)
            _store_tile(gl.convert_layout(score, OUT_L), rows, c0, active, width, level1, G)
        n0 += (sweep - begin + BLOCK_S - 1) // BLOCK_S
        pending_all = pending_all & ~active_all
        pending = pending & ~active


@gluon.jit
def _tile_scores(q_smem, key_smem, w, bars, n, half, NH: gl.constexpr, DI: gl.constexpr, ACC_L: gl.constexpr):
    """The program's n-th tile for the queries of ``half``: sum_h w[t,h] relu(q[t,h] . k[j]) for its 64 entries j."""
    KT: gl.constexpr = DI // FEATURES
    stage = n % STAGES
    mbarrier.wait(bars.index(_READY + stage), (n // STAGES) & 1)
    acc = gl.zeros([BLOCK_S, HALF], gl.float32, ACC_L)
    for c in gl.static_range(KT):  # K = DI, a TMA box of features at a time
        acc = warpgroup_mma(key_smem.index(stage * KT + c), q_smem.index(2 * c + half).permute((1, 0)), acc,
                            use_acc=c > 0, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(bars.index(_FREE + stage), count=1)  # read by this half: the producer refills it after both
    weighted = gl.maximum(acc, 0.0) * w.load(gl.SliceLayout(0, ACC_L))[None, :]
    return gl.sum(gl.reshape(weighted, [BLOCK_S, HALF // NH, NH]), 2)


@gluon.jit
def _store_tile(score, rows, c0, active, width, level1, G: gl.constexpr):
    """A tile's scores at columns c0.. of the active queries' rows (level 0), and their block maxima (level 1)."""
    OUT_L: gl.constexpr = score.type.layout
    col = c0 + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, OUT_L))
    visible = active[None, :] & (col[:, None] < width[None, :])
    gl.store(rows[None, :] + col[:, None], score, mask=visible)
    blocks = gl.max(gl.reshape(gl.where(visible, score, float("-inf")), [BLOCK_S // G, G, score.shape[1]]), 1)
    blocks = gl.convert_layout(blocks, OUT_L)
    block = c0 // G + gl.arange(0, BLOCK_S // G, layout=gl.SliceLayout(1, OUT_L))
    gl.store(rows[None, :] + level1 + block[:, None], blocks,
             mask=active[None, :] & (block[:, None] * G < width[None, :]))


@gluon.jit
def _producer(args, NH: gl.constexpr, G: gl.constexpr, SPLIT: gl.constexpr, DI: gl.constexpr, WG: gl.constexpr):
    """The producer: q and the head weights, then every tile's keys as the consumers free the buffers."""
    (q_desc, key_desc, WGT, VIS_LO, VIS_HI, LEVELS, n_queries, row_len, level1, q_smem, key_smem, w_smem, bars) = args
    QUERIES: gl.constexpr = N // NH
    KT: gl.constexpr = DI // FEATURES
    first = gl.program_id(0) * QUERIES
    W_L: gl.constexpr = gl.BlockedLayout([N // (32 * PRODUCER_WARPS)], [32], [PRODUCER_WARPS], [0])
    head_row = first * NH + gl.arange(0, N, layout=W_L)
    w_smem.store(gl.load(WGT + head_row, mask=head_row < n_queries * NH, other=0.0).to(gl.float32))
    # The expect arrives with release semantics: the weights stored above are seen by every consumer that waits.
    mbarrier.expect(bars.index(_Q), 2 * KT * q_desc.block_type.nbytes)
    for c in gl.static_range(KT):
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(q_desc, [first * NH + half * HALF, c * FEATURES], bars.index(_Q),
                                            q_smem.index(2 * c + half))
    _, lo, width = _queries(VIS_LO, VIS_HI, n_queries, first, QUERIES,
                            gl.BlockedLayout([1], [32], [PRODUCER_WARPS], [0]))
    begin = gl.program_id(1) * SPLIT
    pending = width > begin
    n = 0
    while gl.max(pending.to(gl.int32), 0) > 0:
        doc_lo, active, sweep = _next_document(pending, lo, width, begin, SPLIT)
        for c0 in range(begin, sweep, BLOCK_S):
            stage = n % STAGES
            # A fresh barrier's previous phase counts as complete: the first round of buffers does not wait.
            mbarrier.wait(bars.index(_FREE + stage), ((n // STAGES) & 1) ^ 1)
            mbarrier.expect(bars.index(_READY + stage), KT * key_desc.block_type.nbytes)
            for c in gl.static_range(KT):
                tma.async_copy_global_to_shared(key_desc, [(doc_lo + c0).to(gl.int32), c * FEATURES],
                                                bars.index(_READY + stage), key_smem.index(stage * KT + c))
            n += 1
        pending = pending & ~active


@triton.autotune(configs=[triton.Config({}, num_warps=4, maxnreg=KERNEL_MAXNREG)], key=["NH", "DI", "G"])
@gluon.jit
def _score_kernel(q_desc, key_desc, WGT, VIS_LO, VIS_HI, LEVELS, n_queries, row_len, level1, NH: gl.constexpr,
                  DI: gl.constexpr, G: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr):
    """Scores of the queries N // NH * program_id(0) + [0, N // NH) over their visible entries in columns
    [SPLIT * program_id(1), + SPLIT) (level 0 of their pyramid rows in LEVELS [n_queries, row_len]) and the block
    maxima (level 1, at offset level1); entries past a query's range are left unwritten."""
    gl.static_assert((num_warps == 4) & (N % NH == 0) & (DI % FEATURES == 0) & (BLOCK_S % G == 0)
                     & (SPLIT % BLOCK_S == 0))
    KT: gl.constexpr = DI // FEATURES
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * KT, HALF, FEATURES], q_desc.layout)  # [feature box, half]
    key_smem = gl.allocate_shared_memory(dtype, [STAGES * KT, BLOCK_S, FEATURES], key_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float32, [N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [16, 1], mbarrier.MBarrierLayout())  # 1 + 2 * STAGES, to a power of 2
    for i in gl.static_range(1 + 2 * STAGES):
        mbarrier.init(bars.index(i), count=2 if i >= _FREE else 1)  # a key buffer is freed by both halves
    args = (q_desc, key_desc, WGT, VIS_LO, VIS_HI, LEVELS, n_queries, row_len, level1, q_smem, key_smem, w_smem, bars)
    # Worker partitions share one signature: each takes every shape argument, used or not.
    gl.warp_specialize([
        (_consumer, (args, NH, G, SPLIT, DI, 0)),
        (_consumer, (args, NH, G, SPLIT, DI, 1)),
        (_consumer, (args, NH, G, SPLIT, DI, 2)),
        (_consumer, (args, NH, G, SPLIT, DI, 3)),
        (_producer, (args, NH, G, SPLIT, DI, 0)),
    ], [4, 4, 4, PRODUCER_WARPS], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


def usable(q: torch.Tensor, k: torch.Tensor, group: int) -> bool:
    """Hopper, 16-bit q and k of the same dtype, index heads a power of two from 16 to 256 (N = 256 holds whole
    queries), a head dimension of 64 or 128 (one or two TMA boxes; q 64 KiB in shared memory) and blocks that
    divide a tile."""
    NH, DI = q.shape[-2:]
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9 and q.dtype in (torch.bfloat16,
            torch.float16) and k.dtype == q.dtype and NH in (16, 32, 64, 128) and DI in (64, 128)
            and BLOCK_S.value % group == 0)


def descriptors(q: torch.Tensor, k: torch.Tensor) -> list[TensorDescriptor]:
    """TMA descriptors of a chunk's q rows [n * NH, DI] (read [128, 64] at a time: half a program's queries; rows
    past the chunk read 0) and of the keys [S, DI] ([64, 64] at a time; entries past S read 0)."""
    return [tma_descriptor(q.reshape(-1, q.shape[-1]), [HALF.value, FEATURES.value]),
            tma_descriptor(k.reshape(-1, k.shape[-1]), [BLOCK_S.value, FEATURES.value])]


def launch(q, w, k, lo, hi, levels, row_len: int, level1: int, width: int, group: int, split: int):
    """Levels 0 and 1 of the chunk's rows ``levels`` (q [n, NH, DI], w [n, NH], keys k [S, DI], visible ranges
    [lo, hi) per query, the widest ``width``)."""
    n, NH, DI = q.shape
    grid = (triton.cdiv(n, N.value // NH), triton.cdiv(width, split))
    _score_kernel[grid](*descriptors(q, k), w, lo, hi, levels, n, row_len, level1, NH=NH, DI=DI, G=group, SPLIT=split)
