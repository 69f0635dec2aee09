"""Staggered manifold-constrained hyper-connections (mHC, SPEC §5.2): a residual stream of ``hc`` copies.

The stream ``X [B,T,hc,D]`` (fp32 in training) enters a sublayer through ``collapse`` (a weighted sum of the copies)
and takes its output back through ``expand``: each copy receives ``post_k`` times the output plus a doubly
stochastic mix of the old copies, ``out_k = post_k y + sum_j comb[j,k] X_j``. The three coefficient sets come from
the stream itself (``mixes``): one projection of the flattened copies, divided by one RMS statistic over all
``hc * D`` values, then squashed (``split_sinkhorn``). Staggered: the ``pre`` a sublayer computes collapses the
input of the *next* sublayer (``staggered_block``), so a block's attention reads the previous block's FFN mix.

``split_sinkhorn`` is the reference's ``hc_split_sinkhorn`` kernel written out. The reference inference code only
calls it; its details were checked against public ports of it (NVIDIA TensorRT-LLM's fused
``auto_deploy::hc_split_sinkhorn`` Triton kernel and several PyTorch re-implementations of V4's
``kernel.py``): comb is ``[j, k]`` with the softmax over the last index k (a "row" is a fixed j), ``hc_eps`` is
added after the softmax and to every denominator, the first normalisation after the softmax is the column one
(over j), then ``iters - 1`` rounds of (row, column).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels

# The mHC paper's init of the gating factors alpha (here ``hc_*_scale``): 0.01 (arXiv 2512.24880, Appendix A.1,
# Table 5, "mHC/HC Gating Factor Init"). With ``fn`` drawn at init_std 0.006 the dynamic logits are
# 0.01 * 0.006 * sqrt(hc D) ~ 0.009 at V4 width (hc D = 20480): at init the coefficients are the static ones below.
SCALE_INIT = 0.01
# Diagonal weight of comb at init (each row's softmax keeps this much on its own copy). See ``add_mix_parameters``.
COMB_KEEP = 0.95


def mix_width(hc: int) -> int:
    """Coefficients one ``mixes`` call makes per token: hc pre, hc post, hc x hc comb."""
    return (2 + hc) * hc


def add_mix_parameters(module: nn.Module, hc: int, dim: int) -> None:
    """Register the attention and FFN mix parameters of one block on ``module`` (the released checkpoint's names):
    fp32 ``hc_{attn,ffn}_fn [mix, hc*dim]``, ``hc_{attn,ffn}_base [mix]``, ``hc_{attn,ffn}_scale [3]``.

    Initial values (``fn`` is a placeholder: the model's init draws every matrix from a normal). The static part
    makes a freshly built stack the plain pre-norm residual stream, as the HC paper initialises its connections
    (Zhu et al. 2024, equivalent to Pre-Norm at init) and as the mHC paper's fixed mappings of its ablation read
    (Table 1: pre 1/n, post 1, res identity). Copies start equal (the embedding repeated), and then:
    - pre: ``sigmoid(base) = 1/hc``, so collapsing equal copies gives the copy itself (the first block's one-hot
      pre-mix also sums to 1). Only its ratios matter to the sublayer, whose input is normalised right after.
    - post: ``2 sigmoid(0) = 1``: every copy adds the sublayer output once, as ``x + f(x)`` does.
    - comb: the diagonal logit makes each row's softmax keep ``COMB_KEEP`` on its own copy and spread the rest
      evenly, a symmetric matrix that is already doubly stochastic (Sinkhorn leaves it). Equal copies stay equal
      and each copy keeps mostly its own residual path (mHC's identity-mapping property); 0.95 rather than an
      exact identity so that the softmax is not saturated and the off-diagonal logits still get gradient.
    - scale: ``SCALE_INIT`` (the paper's alpha), so the input-dependent part starts small.
    Public mHC re-implementations mostly start the biases at 0 (comb uniform, post 1, pre 1/2): the same stream
    while copies are equal, but a comb that averages the copies at every sublayer."""
    if hc < 2:
        raise ValueError(f"model.hc_mult={hc}: hyper-connections need >= 2 copies (1 is the plain residual stream)")
    base = torch.zeros(mix_width(hc))
    base[:hc] = -math.log(hc - 1)  # sigmoid(-log(hc - 1)) = 1/hc
    base[2 * hc:].view(hc, hc).diagonal().fill_(math.log(COMB_KEEP * (hc - 1) / (1 - COMB_KEEP)))
    for part in ("attn", "ffn"):
        module.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix_width(hc), hc * dim)))
        module.register_parameter(f"hc_{part}_base", nn.Parameter(base.clone()))
        module.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.full((3,), SCALE_INIT)))


def _exact(t: torch.Tensor):
    """No autocast: the coefficients and the stream's mixing run in (at least) fp32 even inside a bf16 region."""
    return torch.autocast(t.device.type, enabled=False)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, norm_eps: float,
          hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [B,T,hc], post [B,T,hc], comb [B,T,hc,hc]) of the stream x [B,T,hc,D], fp32 (fp64 for fp64 inputs).

    ``m = flatten(x) fn^T * rsqrt(mean(flatten(x)^2) + norm_eps)``: one statistic over all hc*D values of a token
    (not one per copy), the division after the projection (the paper's reordering; the same function)."""
    hc = x.shape[-2]
    dtype = _compute_dtype(x, fn)
    with _exact(x):
        flat = x.flatten(-2).to(dtype)
        m = F.linear(flat, fn.to(dtype)) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return split_sinkhorn(m, scale.to(dtype), base.to(dtype), hc, iters, hc_eps)


def split_sinkhorn(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                   hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The coefficients of ``mixes`` from its logits m [..., (2+hc)hc]: ``pre = sigmoid(.) + hc_eps``, ``post =
    2 sigmoid(.)``, ``comb = softmax_k(.) + hc_eps`` as [j, k], divided by its column sums (over j) + hc_eps, then
    ``iters - 1`` rounds of row then column normalisation, each dividing by (sum + hc_eps). The last step is a
    column normalisation, so columns sum to 1 (up to hc_eps) and rows to within Sinkhorn's convergence."""
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc)).softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def collapse(x: torch.Tensor, pre: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``sum_c pre_c X_c`` [B,T,D] of x [B,T,hc,D], summed in fp32 and returned in x's dtype (``kernels``'
    ``hc_collapse`` of ``backend``)."""
    with _exact(x):
        return kernels.ops(backend, x.device).hc_collapse(x, pre).to(x.dtype)


def expand(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
           backend: str = "auto") -> torch.Tensor:
    """The stream after a sublayer: ``out_k = post_k y + sum_j comb[j,k] X_j`` [B,T,hc,D] for its output y [B,T,D],
    in fp32 (fp64 for fp64 inputs) whatever y's dtype: the residual stream is kept in fp32 (``kernels``'
    ``hc_expand`` of ``backend``)."""
    with _exact(x):
        return kernels.ops(backend, x.device).hc_expand(y, x, post, comb)


def first_pre_mix(x: torch.Tensor) -> torch.Tensor:
    """The pre-mix of the first block's attention [B,T,hc] for the stream x [B,T,hc,D]: one-hot on copy 0."""
    pre = x.new_zeros(x.shape[:-1], dtype=_compute_dtype(x))
    pre[..., 0] = 1.0
    return pre


def copies(h: torch.Tensor, hc: int) -> torch.Tensor:
    """The stream [B,T,hc,D] that starts the blocks: the embedding h [B,T,D] repeated into hc copies."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], hc, h.shape[-1]).contiguous()


def staggered_block(module: nn.Module, x: torch.Tensor, pre_in: torch.Tensor, attn_branch, ffn_branch, iters: int,
                    norm_eps: float, hc_eps: float, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One block on the stream x [B,T,hc,D] with ``module``'s mix parameters (``add_mix_parameters``); the
    branches are callables [B,T,D] -> [B,T,D] (norm + sublayer). Returns (x'', the pending pre-mix of the next
    block's attention). The attention collapses with ``pre_in`` (the previous block's FFN pre, or
    ``first_pre_mix``), the FFN with the attention's pre: each sublayer's pre serves the sublayer after it."""
    attn_pre, attn_post, attn_comb = mixes(x, module.hc_attn_fn, module.hc_attn_scale, module.hc_attn_base, iters,
                                           norm_eps, hc_eps)
    x = expand(attn_branch(collapse(x, pre_in, backend)), x, attn_post, attn_comb, backend)
    ffn_pre, ffn_post, ffn_comb = mixes(x, module.hc_ffn_fn, module.hc_ffn_scale, module.hc_ffn_base, iters,
                                        norm_eps, hc_eps)
    x = expand(ffn_branch(collapse(x, attn_pre, backend)), x, ffn_post, ffn_comb, backend)
    return x, ffn_pre


def residual_block(module: nn.Module, x: torch.Tensor, pre: torch.Tensor | None, attn_branch, ffn_branch,
                   iters: int, norm_eps: float, hc_eps: float,
                   backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block on either stream: the plain pre-norm residual (``pre`` None: ``x + attn``, then ``+ ffn``, exactly
    the stack without hyper-connections) or ``staggered_block``."""
    if pre is None:
        x = x + attn_branch(x)
        return x + ffn_branch(x), None
    return staggered_block(module, x, pre, attn_branch, ffn_branch, iters, norm_eps, hc_eps, backend)


def begin(h: torch.Tensor, hc: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stream an embedding starts: itself (``hc`` 1), or its copies with the one-hot first pre-mix."""
    if hc == 1:
        return h, None
    x = copies(h, hc)
    return x, first_pre_mix(x)


def end(x: torch.Tensor, pre: torch.Tensor | None, backend: str = "auto") -> torch.Tensor:
    """What a head reads of the stream: itself, or the copies collapsed with the last block's pre-mix."""
    return x if pre is None else collapse(x, pre, backend)
