"""The hyper-connected stream's collapse and expand (``model/hyper.py``, SPEC §5.2), one pass over the stream each way.

Both are tiny per-token mixes of the ``hc`` fp32 copies, ``collapse: sum_c pre_c X_c`` and ``expand: out_k = post_k
y + sum_j comb[j,k] X_j``, so they are bound by the bytes of the stream ([T, hc, D] fp32: 1 GiB at 64K x 4 x 1,024).
PyTorch runs them as batched matmuls of one token each ([65536, 4, 4] x [65536, 4, 1024]), which cuBLAS tiles as
32 x 64 fp32 FFMA GEMMs, and their backward as more of them plus outer products: on an H200 at 64K those took ~1.4
s of small_moe's 8.8 s step (``kernel_table`` of ``bench/results/train/train_step_small_moe_65536.json``: the
[65536,4,4]x[65536,4,1024] bmm 763 ms, the [65536,4,1]x[65536,1,1024] outer product 301 ms, ...). Here the
forward reads the stream once and writes its result; the backward reads the stream and the output gradient once and
writes the input gradients, the coefficients' gradients (sums over D) accumulated in registers over the row. All in
fp32; y and dy in y's dtype.
"""
import torch
import triton
import triton.language as tl

from kernels.triton_common import INTERPRET, new_output

BLOCK_D = 32 if INTERPRET else 256  # columns of a row per step: [hc, hc, BLOCK_D] products live in registers


@triton.jit
def _rows(base, copies, cols, HC: tl.constexpr, D: tl.constexpr):
    """Offsets of copies x columns of one token's [HC, D] block and its mask."""
    return base + copies[:, None] * D + cols[None, :], (copies[:, None] < HC) & (cols[None, :] < D)


@triton.jit
def _coefficients(POST, COMB, row, copies, HC: tl.constexpr):
    """post [HC_P] and comb [HC_P (j), HC_P (k)] of a token, zero in the padding."""
    valid = copies < HC
    post = tl.load(POST + row * HC + copies, mask=valid, other=0.0)
    comb = tl.load(COMB + row * HC * HC + copies[:, None] * HC + copies[None, :],
                   mask=valid[:, None] & valid[None, :], other=0.0)
    return post, comb


@triton.jit
def _expand_fwd(X, Y, POST, COMB, OUT, D: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """OUT[r, k, c] = POST[r, k] Y[r, c] + sum_j COMB[r, j, k] X[r, j, c] for the program's token r, columns c."""
    row = tl.program_id(0).to(tl.int64)
    copies, cols = tl.arange(0, HC_P), tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offsets, inside = _rows(row * HC * D, copies, cols, HC, D)
    post, comb = _coefficients(POST, COMB, row, copies, HC)
    x = tl.load(X + offsets, mask=inside, other=0.0)
    y = tl.load(Y + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    out = tl.sum(comb[:, :, None] * x[:, None, :], axis=0) + post[:, None] * y[None, :]
    tl.store(OUT + offsets, out, mask=inside)


@triton.jit
def _expand_bwd(X, Y, POST, COMB, G, DX, DY, DPOST, DCOMB, D: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """dX_j = sum_k comb[j,k] G_k, dY = sum_k post_k G_k, dCOMB[j,k] = <X_j, G_k>, dPOST_k = <G_k, Y> of token r."""
    row = tl.program_id(0).to(tl.int64)
    copies = tl.arange(0, HC_P)
    post, comb = _coefficients(POST, COMB, row, copies, HC)
    dcomb = tl.zeros((HC_P, HC_P), dtype=tl.float32)
    dpost = tl.zeros((HC_P,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        offsets, inside = _rows(row * HC * D, copies, cols, HC, D)
        x = tl.load(X + offsets, mask=inside, other=0.0)
        g = tl.load(G + offsets, mask=inside, other=0.0)
        y = tl.load(Y + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(DX + offsets, tl.sum(comb[:, :, None] * g[None, :, :], axis=1), mask=inside)
        tl.store(DY + row * D + cols, tl.sum(post[:, None] * g, axis=0).to(DY.dtype.element_ty), mask=cols < D)
        dcomb += tl.sum(x[:, None, :] * g[None, :, :], axis=2)
        dpost += tl.sum(g * y[None, :], axis=1)
    valid = copies < HC
    tl.store(DPOST + row * HC + copies, dpost, mask=valid)
    tl.store(DCOMB + row * HC * HC + copies[:, None] * HC + copies[None, :], dcomb,
             mask=valid[:, None] & valid[None, :])


@triton.jit
def _collapse_fwd(X, PRE, OUT, D: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[r, c] = sum_j PRE[r, j] X[r, j, c]."""
    row = tl.program_id(0).to(tl.int64)
    copies, cols = tl.arange(0, HC_P), tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offsets, inside = _rows(row * HC * D, copies, cols, HC, D)
    pre = tl.load(PRE + row * HC + copies, mask=copies < HC, other=0.0)
    x = tl.load(X + offsets, mask=inside, other=0.0)
    tl.store(OUT + row * D + cols, tl.sum(pre[:, None] * x, axis=0), mask=cols < D)


@triton.jit
def _collapse_bwd(X, PRE, G, DX, DPRE, D: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """dX_j = pre_j G, dPRE_j = <G, X_j> of token r."""
    row = tl.program_id(0).to(tl.int64)
    copies = tl.arange(0, HC_P)
    pre = tl.load(PRE + row * HC + copies, mask=copies < HC, other=0.0)
    dpre = tl.zeros((HC_P,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        offsets, inside = _rows(row * HC * D, copies, cols, HC, D)
        x = tl.load(X + offsets, mask=inside, other=0.0)
        g = tl.load(G + row * D + cols, mask=cols < D, other=0.0)
        tl.store(DX + offsets, pre[:, None] * g[None, :], mask=inside)
        dpre += tl.sum(g[None, :] * x, axis=1)
    tl.store(DPRE + row * HC + copies, dpre, mask=copies < HC)


def _launch(x: torch.Tensor) -> tuple[int, dict]:
    """The tokens of a stream x [..., hc, D] and the kernels' constexprs."""
    hc, dim = x.shape[-2:]
    return x.numel() // (hc * dim), dict(D=dim, HC=hc, HC_P=triton.next_power_of_2(hc),
                                         BLOCK_D=min(BLOCK_D, triton.next_power_of_2(dim)))


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, x, post, comb):
        y, x, post, comb = (t.contiguous() for t in (y, x, post, comb))
        rows, consts = _launch(x)
        out = new_output(x.shape, torch.float32, x.device)
        _expand_fwd[(rows, triton.cdiv(consts["D"], consts["BLOCK_D"]))](x, y, post, comb, out, **consts)
        ctx.save_for_backward(y, x, post, comb)
        return out

    @staticmethod
    def backward(ctx, grad):
        y, x, post, comb = ctx.saved_tensors
        rows, consts = _launch(x)
        dx, dy = new_output(x.shape, torch.float32, x.device), new_output(y.shape, y.dtype, y.device)
        dpost, dcomb = new_output(post.shape, torch.float32, x.device), new_output(comb.shape, torch.float32, x.device)
        _expand_bwd[(rows,)](x, y, post, comb, grad.float().contiguous(), dx, dy, dpost, dcomb, **consts)
        return dy, dx, dpost, dcomb


class _Collapse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pre):
        x, pre = x.contiguous(), pre.contiguous()
        rows, consts = _launch(x)
        out = new_output((*x.shape[:-2], x.shape[-1]), torch.float32, x.device)
        _collapse_fwd[(rows, triton.cdiv(consts["D"], consts["BLOCK_D"]))](x, pre, out, **consts)
        ctx.save_for_backward(x, pre)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, pre = ctx.saved_tensors
        rows, consts = _launch(x)
        dx, dpre = new_output(x.shape, torch.float32, x.device), new_output(pre.shape, torch.float32, x.device)
        _collapse_bwd[(rows,)](x, pre, grad.float().contiguous(), dx, dpre, **consts)
        return dx, dpre


def _check(x: torch.Tensor, *coefficients: torch.Tensor) -> None:
    if x.dtype != torch.float32 or any(c.dtype != torch.float32 for c in coefficients):
        raise ValueError(f"Triton hc_collapse/hc_expand take the fp32 stream and fp32 mixes; got "
                         f"{x.dtype} and {[c.dtype for c in coefficients]} (use kernel_backend=torch)")


def hc_expand(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.hc_expand``: y [..., D] (fp32/bf16/fp16), x [..., hc, D], post [..., hc], comb [..., hc,
    hc] fp32 -> [..., hc, D] fp32."""
    _check(x, post, comb)
    return _Expand.apply(y, x, post, comb)


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.hc_collapse``: x [..., hc, D], pre [..., hc] fp32 -> [..., D] fp32."""
    _check(x, pre)
    return _Collapse.apply(x, pre)
