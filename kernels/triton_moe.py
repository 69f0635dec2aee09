"""The MoE's permutations without atomics: tokens to their routing slots (``permute_rows``) and the slots' expert
outputs back into their tokens (``unpermute_rows``), each the other's backward.

A token's k routing slots sit wherever the sort by expert put them, ``slot[t, j]`` (a permutation of the N·k
slots). PyTorch's way, ``x[token]`` forward and ``index_add_`` for the combine and for the gather's backward, adds
rows atomically into their tokens: on an H200 at 64K tokens of ``small_moe`` those atomics took 255 ms a step, and
their order (hence the fp32 sums' rounding) changes from run to run. Both directions here are driven by the token
instead: a program holds a few tokens and, per column block,

- spread: reads each token's row once and writes it to its k slots (and, optionally, to a copy: the shared
  expert's input, cast in the same pass); every slot is written exactly once, so no two programs meet;
- gather-sum: reads each token's k slot rows (and optionally one more row to add: the shared expert's output, or
  the copy's gradient), sums them in fp32 in the order j = 0..k-1 and writes the token's row, rounded once.

The combine's backward is a spread of the output gradient (the slots' gradients, and the shared expert's), the
dispatch's backward a gather-sum of the slots' gradients plus the copy's: a gather either way, bitwise
deterministic.
"""
import torch
import triton
import triton.language as tl

from kernels.triton_common import INTERPRET, new_output

BLOCK = 32 if INTERPRET else 1024  # columns per step (the interpreter's is small: tests cross blocks)
TILE = 128 if INTERPRET else 2048  # elements per program and step: tokens per program = TILE / columns per step


@triton.jit
def _token_rows_kernel(ROWS, SLOT, TOKEN_ROWS, OTHER, n_tokens, D: tl.constexpr, K: tl.constexpr,
                       SPREAD: tl.constexpr, WITH_OTHER: tl.constexpr, TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    """A program's TOKENS tokens, one column block at a time, either way:

    - SPREAD: ROWS[SLOT[t, j]] = TOKEN_ROWS[t] for j < K (and OTHER[t] = TOKEN_ROWS[t]: the copy), in each output's
      dtype;
    - else: TOKEN_ROWS[t] = (OTHER[t] +) Σ_{j < K} ROWS[SLOT[t, j]], summed in fp32 in that order and rounded once.
    """
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    live = tokens < n_tokens
    tokens = tokens.to(tl.int64)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = live[:, None] & (cols < D)[None, :]
        at = tokens[:, None] * D + cols[None, :]
        if SPREAD:
            row = tl.load(TOKEN_ROWS + at, mask=inside)
            if WITH_OTHER:
                tl.store(OTHER + at, row.to(OTHER.dtype.element_ty), mask=inside)
        elif WITH_OTHER:
            row = tl.load(OTHER + at, mask=inside, other=0.0).to(tl.float32)
        else:
            row = tl.zeros([TOKENS, BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            slot = tl.load(SLOT + tokens * K + j, mask=live, other=0)
            if SPREAD:
                tl.store(ROWS + slot[:, None] * D + cols[None, :], row.to(ROWS.dtype.element_ty), mask=inside)
            else:
                row += tl.load(ROWS + slot[:, None] * D + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        if not SPREAD:
            tl.store(TOKEN_ROWS + at, row.to(TOKEN_ROWS.dtype.element_ty), mask=inside)


def _launch(slot: torch.Tensor, rows, token_rows, other, spread: bool) -> None:
    """The kernel over the tokens of ``slot`` [N, k], a program holding a few tokens' whole rows."""
    (n_tokens, k), D = slot.shape, token_rows.shape[1]
    if n_tokens == 0:
        return
    block = min(BLOCK, triton.next_power_of_2(D))
    tokens = max(1, TILE // block)
    _token_rows_kernel[(triton.cdiv(n_tokens, tokens),)](rows, slot, token_rows, other, n_tokens, D, k, spread,
                                                         other is not None, TOKENS=tokens, BLOCK=block)


def _spread(x: torch.Tensor, slot: torch.Tensor, rows_dtype: torch.dtype, copy_dtype: torch.dtype | None):
    """(rows [N·k, D] in rows_dtype, copy [N, D] in copy_dtype or None) of x [N, D] (contiguous)."""
    N, D = x.shape
    rows = new_output((N * slot.shape[1], D), rows_dtype, x.device)
    copy = None if copy_dtype is None else new_output((N, D), copy_dtype, x.device)
    _launch(slot, rows, x, copy, spread=True)
    return rows, copy


def _gather_sum(rows: torch.Tensor, slot: torch.Tensor, add: torch.Tensor | None, dtype: torch.dtype):
    """[N, D] in dtype: each token's k rows (contiguous [N·k, D]) summed, plus add (contiguous [N, D]) if given."""
    out = new_output((slot.shape[0], rows.shape[1]), dtype, rows.device)
    _launch(slot, rows, out, add, spread=False)
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot, dtype, copy):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(slot)
        ctx.x_dtype = x.dtype
        return _spread(x.contiguous(), slot, dtype, dtype if copy else None)

    @staticmethod
    def backward(ctx, drows, dcopy):
        (slot,) = ctx.saved_tensors
        if drows is None:  # only the copy was used
            return dcopy.to(ctx.x_dtype), None, None, None
        dcopy = None if dcopy is None else dcopy.contiguous()
        return _gather_sum(drows.contiguous(), slot, dcopy, ctx.x_dtype), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, slot, add, dtype):
        ctx.save_for_backward(slot)
        ctx.rows_dtype, ctx.add_dtype = rows.dtype, None if add is None else add.dtype
        return _gather_sum(rows.contiguous(), slot, None if add is None else add.contiguous(), dtype)

    @staticmethod
    def backward(ctx, dy):
        (slot,) = ctx.saved_tensors
        drows, dadd = _spread(dy.contiguous(), slot, ctx.rows_dtype, ctx.add_dtype)
        return drows, None, dadd, None


def _check(name: str, slot: torch.Tensor, n_rows: int, expected: int) -> None:
    if slot.dim() != 2 or slot.dtype != torch.int64 or n_rows != expected:
        raise ValueError(f"{name}: slot must be [N, k] int64 with {expected} rows against it, got "
                         f"{tuple(slot.shape)} {slot.dtype} and {n_rows} rows")


def permute_rows(x: torch.Tensor, slot: torch.Tensor, dtype: torch.dtype,
                 copy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``kernels.reference.permute_rows``: x [N, D] to its slots ``rows[slot[t, j]] = x[t]`` in ``dtype`` (and x
    in ``dtype`` with ``copy``); one launch each way."""
    _check("permute_rows", slot, x.shape[0], slot.shape[0])
    return _Permute.apply(x, slot.contiguous(), dtype, copy)


def unpermute_rows(rows: torch.Tensor, slot: torch.Tensor, add: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """``kernels.reference.unpermute_rows``: ``y[t] = add[t] + Σ_j rows[slot[t, j]]`` in fp32, rounded once to
    ``dtype`` (default rows'); one launch each way."""
    _check("unpermute_rows", slot, rows.shape[0], slot.numel())
    return _Unpermute.apply(rows, slot.contiguous(), add, dtype or rows.dtype)
