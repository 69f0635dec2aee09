"""Exact top-k of score rows through a pyramid of group maxima: a few small loads per row instead of a sort.

A chunk's scores live in one fp32 buffer with a row per query (``Pyramid``): level 0 holds the query's scores at
doc-relative columns, level l+1 the max of each group of G consecutive level-l entries (level 1 is the block
max of candidate blocks, G = block size). The k best entries (by score, then lower column) lie inside the k
best groups (by group max, then lower group): every group ranked above an entry's group holds an entry ranked
above it. So ``_select_kernel`` picks the k best entries of the top level (at most G * k wide), then, one level
down at a time, the k best among the G * k children of the previous pick, and finally orders its k columns.
Work per row: G * k loads per level, independent of the row's width.

Each pick is exact, ties included: a radix-16 search for the k-th largest order key, then, only when several
entries share that key, a search for the largest column to keep among them (lower column first, as
``kernels.reference``'s stable sort), so a token's selection does not depend on how many columns its chunk has.
The key search starts from what the level above knows: each kept group's maximum is one of its children, so the
k-th best kept maximum is a lower bound of the k-th best child, and the best one the children's maximum; only the
bits below the highest bit where the two differ are searched (~6 rounds of 4 bits on random scores instead of 8).
Entries that are -inf (invisible, not a candidate) never count; fewer than k finite entries give -1 slots.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from kernels.triton_common import configs, new_output

NEG_INF = float("-inf")
KERNEL_NEG_INF = tl.constexpr(NEG_INF)
EMPTY_KEY = tl.constexpr(-(2 ** 63))  # sorts after every packed (score, column) key
_INT64_MIN = -(2 ** 63)
_LOW32 = (1 << 32) - 1
# Selection is a chain of block-wide reductions (latency-bound), one program per row: the launch shapes trade rows
# in flight per SM (registers: the G * K_P candidates live in registers) against threads per row. 8 warps capped at
# 128 registers run two rows per SM (v7's fixed choice); the autotuner times them on the first chunk of each number
# of levels (``top``: rows searched through one level and through three do different amounts of work).
_SELECT_CONFIGS = configs(
    hopper=[dict(num_warps=8, num_stages=1, maxnreg=128), dict(num_warps=4, num_stages=1, maxnreg=128),
            dict(num_warps=4, num_stages=1), dict(num_warps=16, num_stages=1, maxnreg=64)],
    interpret=dict(num_warps=4, num_stages=1))


class Pyramid:
    """Row layout of a chunk's score buffer: level widths for a level-0 width ``width`` and group ``group``.

    Levels go up until one is at most ``cap`` wide (the top, where selection starts, at least ``min_top``), and
    at least to level 1 (block maxima, which candidate-block production reads). Candidate rows start at level 1:
    their level 0 is written only inside candidate blocks."""

    def __init__(self, width: int, group: int, cap: int, min_top: int = 0):
        self.group = group
        self.widths = [max(width, 1)]
        while len(self.widths) < max(2, min_top + 1) or self.widths[-1] > cap:
            self.widths.append(-(-self.widths[-1] // group))
        self.top = next(level for level, w in enumerate(self.widths) if w <= cap and level >= min_top)
        self.offsets = np.concatenate([[0], np.cumsum(self.widths)]).tolist()
        self.row = self.offsets[-1]  # floats per query

    def level(self, buffer: torch.Tensor, level: int) -> torch.Tensor:
        """View [rows, width of level] of ``buffer`` [rows, row]."""
        return buffer[:, self.offsets[level]:self.offsets[level + 1]]


@triton.jit
def _order_key(score):
    """uint32 key ordered like the fp32 scores (both zeros equal: ReLU terms weighted by w < 0 give -0.0); 0 for
    -inf and NaN (no finite score has key 0 or below -inf's), so a key > 0 marks a usable entry."""
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(score == 0.0, 0, bits)
    key = (bits ^ ((bits >> 31) | (-2147483648))).to(tl.uint32, bitcast=True)
    return tl.where(score > KERNEL_NEG_INF, key, 0)


@triton.jit
def _level_width(width, level, LOG_G: tl.constexpr):
    """Entries of ``level`` that cover a row's first ``width`` columns."""
    shift = LOG_G * level
    return (width + (1 << shift) - 1) >> shift


@triton.jit
def _level_offset(width0, level, LOG_G: tl.constexpr):
    """Offset of ``level`` in a buffer row whose level 0 is ``width0`` wide (the sum of the lower widths)."""
    offset = width0 * 0
    lower = 0
    while lower < level:
        offset += _level_width(width0, lower, LOG_G)
        lower += 1
    return offset


@triton.jit
def _count_max_min(a_count, a_max, a_min, b_count, b_max, b_min):
    return a_count + b_count, tl.maximum(a_max, b_max), tl.minimum(a_min, b_min)


@triton.jit
def _first_reached(a_bin, a_reached, a_count, b_bin, b_reached, b_count):
    """Of two (bin, values reached, values in the bin): the lower bin."""
    b_wins = b_bin < a_bin
    return tl.where(b_wins, b_bin, a_bin), tl.where(b_wins, b_reached, a_reached), tl.where(b_wins, b_count, a_count)


@triton.jit
def _kth_largest(value, valid, K, lo, hi):
    """Largest v with at least K valid values >= v (the K-th largest valid value) of uint32 ``value``, given bounds
    lo <= v <= hi: at least K valid values are >= lo and none is above hi. Also returns how many valid values are
    above v and how many equal it.

    v shares the bits of lo and hi above their highest differing bit, so only the bits below it are searched, four
    per round (radix 16, at least one round): a histogram of the next digit among the values that match the prefix
    found so far, then the largest digit whose count of values at or above it (plus those above the prefix) reaches
    K. Bins hold 15 - digit, so that count is a forward cumsum (a reverse one costs two lane reversals in Triton).
    """
    diff = lo ^ hi
    unknown = 32  # low bits of v not yet known, a multiple of 4
    while (unknown > 4) & ((diff >> (unknown - 4)) == 0):
        unknown -= 4
    kth = ((lo.to(tl.int64) >> unknown) << unknown).to(tl.uint32)
    above = tl.zeros([], tl.int32)  # valid values above every value with kth's known bits (none above hi)
    equal = tl.zeros([], tl.int32)
    one = tl.full([], 1, tl.int64)
    bins = tl.arange(0, 16)
    while unknown > 0:
        shift = unknown - 4
        match = valid & ((value ^ kth) <= ((one << unknown) - 1).to(tl.uint32))
        count = tl.histogram(15 - ((value >> shift) & 15).to(tl.int32), 16, mask=match)
        reached = above + tl.cumsum(count, 0)  # valid values >= kth with digit 15 - bin
        pick, reached, equal = tl.reduce((tl.where(reached >= K, bins, 16), reached, count), 0, _first_reached)
        above = reached - equal
        kth = kth | ((15 - pick).to(tl.uint32) << shift)
        unknown = shift
    return kth, above, equal


@triton.jit
def _best(key, col, width, K: tl.constexpr, bound):
    """Mask of the K best usable entries (key > 0; by key, then lower ``col`` < ``width``), all usable ones if at
    most K, how many it keeps, and the K-th best key (1, the least usable key, if all were kept): a lower bound of
    the K-th best key among the children of the kept entries, since each kept entry's value is one of its children's.

    ``bound``: a key that at least K usable entries reach, or 1."""
    valid = key > 0
    count, top, least = tl.reduce((valid.to(tl.int32), key, tl.where(valid, key, 0xFFFFFFFF)), 0, _count_max_min)
    chosen = valid
    kth = tl.full([], 1, tl.uint32)
    if count > K:
        kth, above, equal = _kth_largest(key, valid, K, tl.maximum(bound, least), top)
        need = K - above
        tied = valid & (key == kth)
        if equal > need:  # keep the `need` lowest columns of the tie: the largest values of flipped
            flipped = (2147483647 - col).to(tl.uint32)  # columns are in [0, width)
            low = (2147483647 - tl.maximum(width - 1, 0)).to(tl.uint32)
            last, _, _ = _kth_largest(flipped, tied, need, low, tl.full([], 2147483647, tl.uint32))
            tied = tied & (flipped >= last)
        chosen = (valid & (key > kth)) | tied
    return chosen, tl.minimum(count, K), kth


@triton.jit
def _compact(chosen, n_chosen, values, SCRATCH, K_P: tl.constexpr, other):
    """The ``n_chosen`` chosen ``values`` (at most K_P) as a [K_P] tensor, ``other`` after them, through a scratch
    row."""
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.debug_barrier()  # earlier readers of the scratch row are done
    tl.store(SCRATCH + slot, values.to(tl.int64), mask=chosen)
    tl.debug_barrier()
    offs = tl.arange(0, K_P)
    return tl.load(SCRATCH + offs, mask=offs < n_chosen, other=other)


@triton.autotune(configs=_SELECT_CONFIGS, key=["K", "G", "top"])
@triton.jit
def _select_kernel(LEVELS, VIS_LO, VIS_HI, SCRATCH, OUT, row_len, width0, top, K: tl.constexpr,
                   K_P: tl.constexpr, G: tl.constexpr, LOG_G: tl.constexpr):
    """One query: the K best entries of its pyramid row, as entry ids (vis_lo + column) best first, -1 after.

    Only the K_P picked columns of a level are carried to the next (their G * K_P children are its candidates);
    the top level is the children of columns 0..K_P-1 of a virtual level above it."""
    CAND: tl.constexpr = G * K_P
    r = tl.program_id(0).to(tl.int64)
    lo = tl.load(VIS_LO + r)
    width = tl.maximum(tl.load(VIS_HI + r) - lo, 0)
    row = LEVELS + r * row_len
    scratch = SCRATCH + r * K_P
    picked = tl.arange(0, K_P).to(tl.int64)
    bound = tl.full([], 1, tl.uint32)
    level = top + 1
    while level > 0:
        level -= 1
        child = picked[:, None] * G + tl.arange(0, G)[None, :]
        col = tl.reshape(child, [CAND]).to(tl.int32)
        level_width = _level_width(width, level, LOG_G)
        usable = tl.reshape(child >= 0, [CAND]) & (col < level_width)
        key = _order_key(tl.load(row + _level_offset(width0, level, LOG_G) + col, mask=usable,
                                 other=KERNEL_NEG_INF))
        chosen, n_chosen, bound = _best(key, col, level_width, K, bound)
        picked = _compact(chosen, n_chosen, col, scratch, K_P, -1)
    key = _order_key(tl.load(row + picked, mask=picked >= 0, other=KERNEL_NEG_INF))
    packed = tl.where(picked >= 0, ((key.to(tl.int64) - 2147483648) << 32) | (((1 << 32) - 1) - picked), EMPTY_KEY)
    packed = tl.sort(packed, descending=True)
    offs = tl.arange(0, K_P)
    entry = lo + ((1 << 32) - 1) - (packed & 0xFFFFFFFF)
    tl.store(OUT + r * K + offs, tl.where(packed == EMPTY_KEY, -1, entry), mask=offs < K)


@triton.jit
def _group_max_kernel(LEVELS, VIS_LO, VIS_HI, row_len, src, dst, dst_width, level, G: tl.constexpr,
                      LOG_G: tl.constexpr, BLOCK: tl.constexpr):
    """Level ``level`` + 1 of one row from level ``level``: max of G entries, over the query's own entries only
    (a chunk's rows are as wide as its widest query; past a query's width level entries are unwritten)."""
    r = tl.program_id(0).to(tl.int64)
    width = tl.maximum(tl.load(VIS_HI + r) - tl.load(VIS_LO + r), 0)
    out = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    child = out[:, None] * G + tl.arange(0, G)[None, :]
    row = LEVELS + r * row_len
    values = tl.load(row + src + child, mask=child < _level_width(width, level, LOG_G), other=KERNEL_NEG_INF)
    tl.store(row + dst + out, tl.max(values, 1), mask=out < dst_width)


def build_upper_levels(buffer, pyramid: Pyramid, vis_lo, vis_hi):
    """Levels 2..top of ``buffer`` from level 1 (the scoring kernels write levels 0 and 1)."""
    n, G = buffer.shape[0], pyramid.group
    for level in range(1, pyramid.top):
        width = pyramid.widths[level + 1]
        block = min(256, triton.next_power_of_2(width))
        _group_max_kernel[(n, triton.cdiv(width, block))](
            buffer, vis_lo, vis_hi, pyramid.row, pyramid.offsets[level], pyramid.offsets[level + 1], width, level,
            G=G, LOG_G=G.bit_length() - 1, BLOCK=block)


def select_entries(buffer, pyramid: Pyramid, vis_lo, vis_hi, k: int, out=None) -> torch.Tensor:
    """[rows, k] entry ids (vis_lo + column), best first, -1 where a row has fewer than k finite scores; written
    into ``out`` (contiguous) if given."""
    n, G = buffer.shape[0], pyramid.group
    K_P = triton.next_power_of_2(k)
    out = new_output((n, k), torch.long, buffer.device) if out is None else out
    scratch = new_output((n, K_P), torch.long, buffer.device)
    _select_kernel[(n,)](buffer, vis_lo, vis_hi, scratch, out, pyramid.row, pyramid.widths[0], pyramid.top, K=k,
                         K_P=K_P, G=G, LOG_G=G.bit_length() - 1)
    return out


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered like fp32 ``scores`` (zeros equal), as ``_order_key`` in the kernel."""
    bits = torch.where(scores == 0, 0, scores.view(torch.int32))
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()


def select_blocks(buffer, pyramid: Pyramid, vis_lo, vis_hi, keep: int) -> torch.Tensor:
    """[rows, keep] best blocks by block max (level 1), then lower block, the newest visible block first; -1 after.

    Scores and block ids are packed into int64 keys, so ``torch.topk`` (k = keep is large here) has no ties."""
    G = pyramid.group
    blocks = pyramid.level(buffer, 1)
    width = (vis_hi - vis_lo).clamp(min=0)
    ids = torch.arange(blocks.shape[1], device=buffer.device)
    usable = (ids < (width[:, None] + G - 1) // G) & (blocks > NEG_INF)
    keys = torch.where(usable, (order_keys(blocks) << 32) | (_LOW32 - ids), _INT64_MIN)
    newest = ((width - 1).clamp(min=0) // G)[:, None]
    forced = torch.where(width[:, None] > 0, ((2 ** 31 - 1) << 32) | (_LOW32 - newest), _INT64_MIN)
    keys = keys.scatter(1, newest, forced)
    top = keys.topk(min(keep, keys.shape[1]), dim=1).values
    picked = torch.where(top == _INT64_MIN, -1, _LOW32 - (top & _LOW32))
    return torch.nn.functional.pad(picked, (0, keep - picked.shape[1]), value=-1)
