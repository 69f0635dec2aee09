"""Where a token's slots live: the row addressing that the Triton attention kernels (``triton_attention``) and
the Gluon ones (``gluon_common`` runs these as Gluon functions) share. A token's slots are its window rows (slots
0..W-1) then its selected entries (W..W+K-1); rows are element offsets from ``kv_window``, and ``kv_comp`` is reached
through its offset from ``kv_window``, so one pointer serves both."""
import triton
import triton.language as tl


@triton.jit
def window_rows(b, t, win_lo, slots, T, D: tl.constexpr, W: tl.constexpr):
    """Window slots (0..W-1) of token (b, t): element offsets of the rows t-W+1+slot from ``kv_window``, and
    validity (from win_lo, which is >= t-W+1, so slots below 0 are invalid)."""
    row = t - W + 1 + slots
    return (b * T + row) * D, row >= win_lo


@triton.jit
def selected_rows(IDX, tok, b, slots, S, comp_offset, D: tl.constexpr, W: tl.constexpr, K: tl.constexpr):
    """Selected slots (W..W+K-1) of token tok: element offsets of the entries ``IDX[tok, slot - W]`` (kv_comp is at
    ``comp_offset`` from kv_window) and validity (-1 = empty; slots outside W..W+K-1 are invalid)."""
    idx = tl.load(IDX + tok * K + (slots - W), mask=(slots >= W) & (slots < W + K), other=-1)
    return comp_offset + (b * S + idx) * D, idx >= 0


@triton.jit
def slot_rows(IDX, tok, b, t, win_lo, slots, T, S, comp_offset, D: tl.constexpr, W: tl.constexpr, K: tl.constexpr):
    """Any slots of token (b, t): window rows below W, selected entries from W (row offsets and validity)."""
    window_offset, window_valid = window_rows(b, t, win_lo, slots, T, D, W)
    selected_offset, selected_valid = selected_rows(IDX, tok, b, slots, S, comp_offset, D, W, K)
    in_window = slots < W
    return tl.where(in_window, window_offset, selected_offset), tl.where(in_window, window_valid, selected_valid)
