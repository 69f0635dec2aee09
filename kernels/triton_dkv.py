"""Deterministic dKV of the sparse-attention backward: per-slot partial rows, then a segmented reduction.

Phase 1 (the backward kernel in ``kernels/triton_attention.py``) writes one partial row ``dKV_t[slot]`` per token
and slot, densely, into ``PART [tokens, W+K, D]`` for a chunk of tokens: plain coalesced stores instead of fp32
atomics into rows shared by many queries (on the H200 at T = 65,536 the atomics cost at most ~27 ms of a 131 ms
backward, this reduction 15 ms: 131 -> 119 ms, docs/KERNELS.md).
Phase 2 sums, in a fixed order, every partial row each KV row receives, into an fp32 buffer:
- window rows are banded: row r receives slot W-1-k of token r+k for k = 0..W-1 (``_window_reduce_kernel``);
- selected entries come from the top-k indices: a stable sort of the chunk's entry ids is the inverse index
  (CSR: ``order`` and ``offsets`` per entry), and ``_entry_reduce_kernel`` sums each entry's rows.
Chunks run one after another on the stream, so a row that receives from two chunks is updated by one program at a
time: no atomics, and the result is bitwise reproducible.
"""
import torch
import triton
import triton.language as tl

from kernels.triton_common import configs

_WINDOW_CONFIGS = configs(hopper=[dict(BLOCK_R=16, num_warps=4, num_stages=1), dict(BLOCK_R=32, num_warps=8, num_stages=1)],
                          interpret=dict(BLOCK_R=4, num_warps=4, num_stages=1))
_ENTRY_CONFIGS = configs(hopper=[dict(BLOCK_C=16, num_warps=4, num_stages=1), dict(BLOCK_C=32, num_warps=4, num_stages=1)],
                         interpret=dict(BLOCK_C=4, num_warps=4, num_stages=1))


# restore_value: autotuning runs every config on the real arguments, and these kernels add into DKV.
@triton.autotune(configs=_WINDOW_CONFIGS, key=["W", "K", "D"], restore_value=["DKV"])
@triton.jit(do_not_specialize=["tok0", "n_tok", "row0", "n_rows"])  # one compiled kernel for every chunk
def _window_reduce_kernel(PART, DKV, tok0, n_tok, row0, n_rows, W: tl.constexpr, K: tl.constexpr, D: tl.constexpr,
                          BLOCK_R: tl.constexpr):
    """DKV[r] += sum_k PART[r+k-tok0, W-1-k] over the chunk's tokens r+k, for flat rows r of [row0, row0+n_rows).

    A token's slots that fall before its window start (or before its batch row) hold zero partials, so rows are
    flat indices b*T + t and need no batch bookkeeping."""
    rows = row0 + tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < row0 + n_rows
    dims = tl.arange(0, D)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for k in range(W):
        tok = rows + k - tok0
        valid = in_range & (tok >= 0) & (tok < n_tok)
        part_row = tok.to(tl.int64) * (W + K) + (W - 1 - k)
        acc += tl.load(PART + part_row[:, None] * D + dims[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    ptrs = DKV + rows[:, None].to(tl.int64) * D + dims[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=in_range[:, None]) + acc, mask=in_range[:, None])


@triton.autotune(configs=_ENTRY_CONFIGS, key=["W", "K", "D"], restore_value=["DKV"])
@triton.jit
def _entry_reduce_kernel(PART, ORDER, OFFSETS, DKV, W: tl.constexpr, K: tl.constexpr, D: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    """DKV[e] += sum of the partial rows of entry e: chunk slots ORDER[OFFSETS[e]:OFFSETS[e+1]] (token*K + slot).

    A ``while`` loop: its bounds are loaded values, which Triton's interpreter cannot take as ``range`` bounds, and
    pipelining is not needed here: thousands of small programs keep enough loads in flight. The next block's slot
    ids are loaded before this block's rows are summed, so that an iteration waits for one memory latency, not for
    the ids and then the rows."""
    e = tl.program_id(0).to(tl.int64)
    lo = tl.load(OFFSETS + e)
    hi = tl.load(OFFSETS + e + 1)
    dims = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    block = tl.arange(0, BLOCK_C)
    c0 = lo
    pos = tl.load(ORDER + c0 + block, mask=c0 + block < hi, other=0)
    while c0 < hi:
        part_row = (pos // K) * (W + K) + W + pos % K
        rows = tl.load(PART + part_row[:, None] * D + dims[None, :], mask=(c0 + block < hi)[:, None], other=0.0)
        c0 += BLOCK_C
        pos = tl.load(ORDER + c0 + block, mask=c0 + block < hi, other=0)  # the next block's ids, before the sum
        acc += tl.sum(rows.to(tl.float32), 0)
    if hi > lo:
        tl.store(DKV + e * D + dims, tl.load(DKV + e * D + dims) + acc)


def reduce_window(part: torch.Tensor, dkv: torch.Tensor, tok0: int, window: int) -> None:
    """Add the window partials of chunk tokens [tok0, tok0+n) into dkv [B*T, D] (fp32): rows tok0-W+1 .. tok0+n-1."""
    n, slots, D = part.shape
    row0 = max(0, tok0 - window + 1)
    n_rows = tok0 + n - row0
    grid = lambda meta: (triton.cdiv(n_rows, meta["BLOCK_R"]),)
    _window_reduce_kernel[grid](part, dkv, tok0, n, row0, n_rows, W=window, K=slots - window, D=D)


def inverse_index(entries: torch.Tensor, n_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of a chunk's selections: ``entries [n, K]`` flat entry ids (-1 = empty) -> (order, offsets).

    ``order`` lists the slots (token*K + slot) grouped by entry, in slot order within an entry (stable sort, so
    the reduction order is fixed); entry e owns ``order[offsets[e]:offsets[e+1]]``. Empty slots sort first and
    belong to no entry."""
    keys, order = entries.flatten().sort(stable=True)
    offsets = torch.searchsorted(keys, torch.arange(n_entries + 1, device=keys.device, dtype=keys.dtype))
    return order, offsets


def reduce_selected(part: torch.Tensor, dkv: torch.Tensor, entries: torch.Tensor, window: int) -> None:
    """Add the selected-slot partials of a chunk into dkv [n_entries, D] (fp32); ``entries`` [n, K] flat ids."""
    n_entries, D = dkv.shape
    if n_entries == 0:
        return
    order, offsets = inverse_index(entries, n_entries)
    _entry_reduce_kernel[(n_entries,)](part, order, offsets, dkv, W=window, K=entries.shape[1], D=D)
