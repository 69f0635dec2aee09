"""Staggered manifold-constrained hyper-connections (mHC, SPEC §5.2): a residual stream of ``hc`` copies.

The stream ``X [B,T,hc,D]`` enters a sublayer through ``hc_pre``, which collapses the copies into the sublayer's
input (a weighted sum) and makes the stream's mixes, and takes the sublayer's output back through ``hc_post``: each
copy receives ``post_k`` times the output plus a doubly stochastic mix of the old copies, ``out_k = post_k y +
sum_j comb[j,k] X_j``. The mixes come from the stream itself: one projection of the flattened copies, divided by
one RMS statistic over all ``hc * D`` values, then squashed by a Sinkhorn-normalised split
(``kernels.reference.hc_mixes``, the formulas; the Triton ops read the stream once per pass). Staggered: the ``pre``
a sublayer's mixes hold collapses the input of the *next* sublayer (``staggered_block``), so a block's attention
reads the previous block's FFN mix.

The stream is kept in the compute dtype (``stream_dtype``: bf16 under bf16 autocast, as the reference's inference
keeps it: its ``hc_post`` rounds to the sublayer output's dtype), and every mix is computed in fp32 from it.
"""
import math

import torch
from torch import nn

import kernels
from kernels.reference import StreamMix

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


def stream_dtype(h: torch.Tensor) -> torch.dtype:
    """The stream's dtype for an embedding h: the compute dtype (bf16 under bf16 autocast, as the reference's
    inference keeps the stream; fp32 or fp64 outside autocast). Each expand rounds the stream to it once; the mixes,
    collapse and expand compute in (at least) fp32 inside."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


def hc_pre(module: nn.Module, part: str, x: torch.Tensor, pre_in: torch.Tensor, iters: int, norm_eps: float,
           hc_eps: float, backend: str = "auto") -> tuple[torch.Tensor, StreamMix]:
    """A sublayer's view of the stream x [B,T,hc,D]: its input ``sum_c pre_in_c X_c`` [B,T,D] (in x's dtype) and the
    mixes ``part`` ("attn" or "ffn") of ``module``'s parameters make of x (``StreamMix``: this sublayer's post and
    comb, the next sublayer's pre), from one RMS statistic over the hc*D values of a token and a Sinkhorn-normalised
    comb (``kernels.reference.hc_mixes``). One op of ``kernels``, which reads the stream once."""
    fn, scale, base = (getattr(module, f"hc_{part}_{name}") for name in ("fn", "scale", "base"))
    with _exact(x):
        return kernels.ops(backend, x.device).hc_pre(x, pre_in, fn, scale, base, iters, norm_eps, hc_eps)


def hc_post(y: torch.Tensor, x: torch.Tensor, mix: StreamMix, backend: str = "auto") -> torch.Tensor:
    """The stream after a sublayer with output y [B,T,D]: ``out_k = post_k y + sum_j comb[j,k] X_j``, in x's dtype."""
    with _exact(x):
        return kernels.ops(backend, x.device).hc_post(y, x, mix)


def collapse(x: torch.Tensor, pre: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``sum_c pre_c X_c`` [B,T,D] of x [B,T,hc,D], summed in fp32 and returned in x's dtype (what the head reads)."""
    with _exact(x):
        return kernels.ops(backend, x.device).hc_collapse(x, pre).to(x.dtype)


def first_pre_mix(x: torch.Tensor) -> torch.Tensor:
    """The pre-mix of the first block's attention [B,T,hc] for the stream x [B,T,hc,D]: one-hot on copy 0."""
    pre = x.new_zeros(x.shape[:-1], dtype=torch.promote_types(x.dtype, torch.float32))
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
    h, attn = hc_pre(module, "attn", x, pre_in, iters, norm_eps, hc_eps, backend)
    x = hc_post(attn_branch(h), x, attn, backend)
    h, ffn = hc_pre(module, "ffn", x, attn.pre, iters, norm_eps, hc_eps, backend)
    x = hc_post(ffn_branch(h), x, ffn, backend)
    return x, ffn.pre


PLAIN = StreamMix(None, None, None)  # the plain stream's "mixes": the input is the stream, the output is added


def sublayer_input(module: nn.Module, part: str, x: torch.Tensor, pre_in: torch.Tensor | None, iters: int,
                   norm_eps: float, hc_eps: float, backend: str = "auto") -> tuple[torch.Tensor, StreamMix]:
    """``hc_pre`` on either stream: the plain stream (``pre_in`` None) is the one-copy case, whose sublayer reads it
    as it is (``PLAIN``, whose ``pre`` stays None for the next sublayer)."""
    if pre_in is None:
        return x, PLAIN
    return hc_pre(module, part, x, pre_in, iters, norm_eps, hc_eps, backend)


def sublayer_output(y: torch.Tensor, x: torch.Tensor, mix: StreamMix, backend: str = "auto") -> torch.Tensor:
    """``hc_post`` on either stream: the plain stream adds the sublayer output, ``x + y``."""
    return x + y if mix is PLAIN else hc_post(y, x, mix, backend)


class HyperConnected:
    """The stream steps of a block with ``args`` (``ModelArgs``) and, for hc > 1, the mix parameters
    (``add_mix_parameters``): a sublayer reads ``hc_pre``'s input, and ``hc_post`` takes its output back."""

    def hc_pre(self, part: str, x: torch.Tensor, pre: torch.Tensor | None) -> tuple[torch.Tensor, StreamMix]:
        """The input of sublayer ``part`` ("attn" or "ffn") and the mixes it makes of the stream."""
        args = self.args
        return sublayer_input(self, part, x, pre, args.hc_sinkhorn_iters, args.norm_eps, args.hc_eps,
                              args.kernel_backend)

    def hc_post(self, y: torch.Tensor, x: torch.Tensor, mix: StreamMix) -> torch.Tensor:
        """The stream after a sublayer whose output is ``y``."""
        return sublayer_output(y, x, mix, self.args.kernel_backend)


def mean_copy(x: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
    """The copies' mean [B,T,D] in the mixes' dtype (what the draft head reads of the stream); the plain stream
    itself."""
    return x if pre is None else x.mean(2, dtype=pre.dtype)


def begin(h: torch.Tensor, hc: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stream an embedding starts: itself (``hc`` 1), or its copies in the stream's dtype (``stream_dtype``)
    with the one-hot first pre-mix."""
    if hc == 1:
        return h, None
    x = copies(h.to(stream_dtype(h)), hc)
    return x, first_pre_mix(x)


def end(x: torch.Tensor, pre: torch.Tensor | None, backend: str = "auto") -> torch.Tensor:
    """What a head reads of the stream: itself, or the copies collapsed with the last block's pre-mix."""
    return x if pre is None else collapse(x, pre, backend)
