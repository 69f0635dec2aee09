"""Staggered mHC (``model/hyper.py``, its formulas in ``kernels/reference.py``) against an fp64 reference written
here from SPEC §5.2, token by token.

The reference works on Python floats and per-token loops, so it shares no tensor code with the module. Each test
names the planted bug it caught when tried once (the module broken that way, the test run, the module restored).
"""

import pytest
import torch
from torch import nn

from kernels.reference import hc_expand as expand, hc_mixes as mixes, hc_split_sinkhorn as split_sinkhorn
from model.hyper import add_mix_parameters, begin, collapse, copies, first_pre_mix, hc_post, hc_pre, mix_width, \
    staggered_block

from tests.support.oracle import ref_split, ref_mixes, ref_collapse, ref_expand, ref_block

f64 = torch.float64


# ------------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------------
def mix_module(hc: int, dim: int, seed: int, fn_std: float = 0.3) -> nn.Module:
    """A module with random mix parameters (attention and FFN different, so that their pre-mixes differ)."""
    module = nn.Module()
    add_mix_parameters(module, hc, dim)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (fn_std if name.endswith("_fn") else 1.0))
    return module.double()


def random_stream(B, T, hc, D, seed):
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([3.0 ** c for c in range(hc)], dtype=f64).view(1, 1, hc, 1)  # copies of unequal size
    return torch.randn(B, T, hc, D, generator=g, dtype=f64) * scales


# ------------------------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hc,iters", [(3, 1), (3, 2), (4, 5)])
def test_split_sinkhorn_matches_the_formula(hc, iters):
    """The split with a large hc_eps (0.05, so that where it enters shows). Caught: post without the factor 2;
    pre without + hc_eps; hc_eps inside the softmax instead of after it; the first column normalisation skipped
    (iters=1 then returns the softmax); (column, row) instead of (row, column) rounds; the softmax over j."""
    g = torch.Generator().manual_seed(hc * 10 + iters)
    m = torch.randn(2, 3, mix_width(hc), generator=g, dtype=f64) * 2
    scale, base = torch.rand(3, generator=g, dtype=f64) + 0.5, torch.randn(mix_width(hc), generator=g, dtype=f64)
    pre, post, comb = split_sinkhorn(m, scale, base, hc, iters, 0.05)
    for b in range(2):
        for t in range(3):
            p, q, c = ref_split(m[b, t].tolist(), scale.tolist(), base.tolist(), hc, iters, 0.05)
            torch.testing.assert_close(pre[b, t], torch.tensor(p, dtype=f64), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(post[b, t], torch.tensor(q, dtype=f64), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(comb[b, t], torch.tensor(c, dtype=f64), rtol=1e-12, atol=1e-12)


def test_comb_is_doubly_stochastic_after_the_iterations():
    """With V4's settings (20 iterations, hc_eps 1e-6): columns sum to 1 within ~hc_eps (the last step divides by
    colsum + eps); rows converge at a rate set by the logits' spread, measured on 4096 tokens: logits of std 0.5
    within 1.1e-6, std 1 within 7e-4 (std 2: 3e-2). One iteration normalises the columns only. Caught: the
    rounds' order swapped (rows then sum to 1 and columns do not); no rounds after the first normalisation."""
    g = torch.Generator().manual_seed(0)
    ones, base = torch.ones(3, dtype=f64), torch.zeros(mix_width(4), dtype=f64)
    for spread, row_tol in ((0.5, 2e-6), (1.0, 1e-3)):
        m = torch.randn(4096, mix_width(4), generator=g, dtype=f64) * spread
        _, _, comb = split_sinkhorn(m, ones, base, 4, 20, 1e-6)
        torch.testing.assert_close(comb.sum(-2), torch.ones(4096, 4, dtype=f64), rtol=0, atol=2e-6)
        torch.testing.assert_close(comb.sum(-1), torch.ones(4096, 4, dtype=f64), rtol=0, atol=row_tol)
    _, _, once = split_sinkhorn(m, ones, base, 4, 1, 1e-6)
    # a column sums to colsum / (colsum + hc_eps), and a softmax's column sums can be small
    torch.testing.assert_close(once.sum(-2), torch.ones(4096, 4, dtype=f64), rtol=0, atol=1e-4)
    assert (once.sum(-1) - 1).abs().max() > 0.1  # one column normalisation leaves the rows off


def test_mixes_uses_one_statistic_over_all_copies():
    """Copies of sizes 1, 3, 9: one rsqrt(mean square) over all hc*D values. Caught: a statistic per copy; the
    flattening in (d, c) order instead of copy after copy; norm_eps outside the square root."""
    hc, D = 3, 5
    module = mix_module(hc, D, seed=1)
    x = random_stream(2, 2, hc, D, seed=2)
    got = mixes(x, module.hc_attn_fn, module.hc_attn_scale, module.hc_attn_base, 4, 0.5, 1e-3)
    want = ref_mixes(x, module.hc_attn_fn, module.hc_attn_scale, module.hc_attn_base, 4, 0.5, 1e-3)
    for g, w in zip(got, want):
        assert g.dtype == f64
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_collapse_and_expand_match_the_formula():
    """A comb far from symmetric. Caught: comb used transposed (sum_j comb[k,j] X_j); collapse weighting the
    copies in reverse order."""
    B, T, hc, D = 2, 3, 3, 4
    g = torch.Generator().manual_seed(3)
    x, y = random_stream(B, T, hc, D, seed=4), torch.randn(B, T, D, generator=g, dtype=f64)
    pre, post = torch.rand(B, T, hc, generator=g, dtype=f64), torch.rand(B, T, hc, generator=g, dtype=f64) * 2
    comb = torch.rand(B, T, hc, hc, generator=g, dtype=f64) ** 4
    torch.testing.assert_close(collapse(x, pre), ref_collapse(x, pre), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(expand(y, x, post, comb), ref_expand(y, x, post, comb), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(expand(y, x, post, comb.transpose(-1, -2)), ref_expand(y, x, post, comb))


def test_the_stream_keeps_the_compute_dtype():
    """The stream starts in the compute dtype (bf16 under bf16 autocast, as the reference's inference keeps it) and
    every sublayer's expand rounds it back to the stream's dtype, whatever the output's; the collapse returns it too.
    Caught: ``begin`` leaving the embedding's fp32; ``hc_post`` returning fp32 (its computing dtype)."""
    module = mix_module(2, 4, seed=12).float()
    h = torch.randn(1, 2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x, pre = begin(h, 2)
        assert x.dtype == torch.bfloat16 and pre.dtype == torch.float32
        sub, mix = hc_pre(module, "attn", x, pre, 3, 1e-6, 1e-6)
        assert sub.dtype == torch.bfloat16 and mix.comb.dtype == torch.float32
        assert hc_post(torch.randn(1, 2, 4), x, mix).dtype == torch.bfloat16
        assert collapse(x, mix.pre).dtype == torch.bfloat16
    assert begin(h, 2)[0].dtype == torch.float32 and begin(h.double(), 2)[0].dtype == f64


def test_staggered_block_order():
    """The block of SPEC §5.2 with two different nonlinear branches and a random pending pre-mix. Caught: the FFN
    collapsing with its own mixes' pre (fP) instead of the attention's; the attention collapsing with its own
    pre (aP) instead of pre_in; the FFN's mixes computed from the block input instead of X'."""
    hc, D = 3, 4
    module = mix_module(hc, D, seed=5)
    g = torch.Generator().manual_seed(6)
    wa, wf = torch.randn(D, D, generator=g, dtype=f64), torch.randn(D, D, generator=g, dtype=f64)
    attn, ffn = (lambda h: torch.tanh(h @ wa)), (lambda h: torch.sin(h @ wf))
    x = random_stream(2, 2, hc, D, seed=7)
    pre_in = torch.rand(2, 2, hc, generator=g, dtype=f64)
    got, got_pre = staggered_block(module, x, pre_in, attn, ffn, 3, 1e-6, 1e-3)
    want, want_pre = ref_block(dict(module.named_parameters()), x, pre_in, attn, ffn, 3, 1e-6, 1e-3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_pre, want_pre, rtol=1e-10, atol=1e-12)


def test_gradcheck_mixes_collapse_expand():
    hc, D = 2, 3
    g = torch.Generator().manual_seed(8)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=f64).requires_grad_()

    x, fn, scale, base = leaf(1, 2, hc, D), leaf(mix_width(hc), hc * D), leaf(3), leaf(mix_width(hc))
    assert torch.autograd.gradcheck(lambda *a: mixes(*a, 4, 1e-6, 1e-3), (x, fn, scale, base))
    pre, y, post, comb = leaf(1, 2, hc), leaf(1, 2, D), leaf(1, 2, hc), leaf(1, 2, hc, hc)
    assert torch.autograd.gradcheck(collapse, (x, pre))
    assert torch.autograd.gradcheck(expand, (y, x, post, comb))


def test_mix_parameters_names_shapes_and_init():
    """The checkpoint's names and shapes in fp32; the static coefficients at init: pre 1/hc (+ hc_eps), post 1,
    comb with 0.95 on its diagonal and doubly stochastic. Caught: pre base 0 (pre 1/2), comb base 0 (uniform)."""
    module = nn.Module()
    add_mix_parameters(module, 4, 8)
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in module.named_parameters()}
    assert shapes == {f"hc_{part}_{kind}": (shape, torch.float32) for part in ("attn", "ffn")
                      for kind, shape in (("fn", (24, 32)), ("base", (24,)), ("scale", (3,)))}
    x = torch.randn(3, 5, 4, 8)
    pre, post, comb = mixes(x, module.hc_attn_fn, module.hc_attn_scale, module.hc_attn_base, 20, 1e-20, 1e-6)
    torch.testing.assert_close(pre, torch.full_like(pre, 0.25 + 1e-6))
    torch.testing.assert_close(post, torch.ones_like(post))
    want = torch.full((4, 4), 0.05 / 3).fill_diagonal_(0.95)
    torch.testing.assert_close(comb, want.expand_as(comb), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"model.hc_mult=1: hyper-connections need >= 2 copies"):
        add_mix_parameters(nn.Module(), 1, 8)


def test_a_fresh_stack_is_the_plain_residual_stream():
    """Copies of the embedding through two fresh blocks (fn drawn at the model's init_std 0.006) equal the plain
    pre-norm stream h + attn(h), then + ffn, in every copy. The branches here have no norm, so the sum of the
    pre-mix matters. Caught: pre base 0 (the branches then see 2h), post base other than 0."""
    hc, D = 4, 16
    g = torch.Generator().manual_seed(9)
    blocks = []
    for _ in range(2):
        module = nn.Module()
        add_mix_parameters(module, hc, D)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.endswith("_fn"):
                    p.normal_(std=0.006, generator=g)
        blocks.append(module.double())
    w = [torch.randn(D, D, generator=g, dtype=f64) / D ** 0.5 for _ in range(4)]
    branches = [(lambda h, a=a: torch.tanh(h @ a)) for a in w]
    h = torch.randn(2, 3, D, generator=g, dtype=f64)
    x = copies(h, hc)
    pre = first_pre_mix(x)
    assert x.shape == (2, 3, hc, D) and pre.tolist() == [[[1.0, 0.0, 0.0, 0.0]] * 3] * 2
    plain = h
    for i, module in enumerate(blocks):
        x, pre = staggered_block(module, x, pre, branches[2 * i], branches[2 * i + 1], 20, 1e-20, 1e-6)
        plain = plain + branches[2 * i](plain)
        plain = plain + branches[2 * i + 1](plain)
    torch.testing.assert_close(x, plain.unsqueeze(-2).expand_as(x), rtol=0, atol=2e-3)
    torch.testing.assert_close(collapse(x, pre), plain, rtol=0, atol=2e-3)


def test_hc_pre_and_post_ignore_autocast():
    """Under bf16 autocast (CPU) the coefficients and the stream's mixing of an fp32 stream stay fp32, equal to the
    run without it. Caught: the projection of the mixes or the matmuls of collapse/expand left to autocast (bf16
    GEMMs)."""
    hc, D = 4, 64
    module = mix_module(hc, D, seed=10, fn_std=0.05).float()
    x, y = random_stream(2, 8, hc, D, seed=11).float(), torch.randn(2, 8, D)
    pre_in = torch.rand(2, 8, hc)
    plain_h, plain = hc_pre(module, "attn", x, pre_in, 20, 1e-20, 1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, cast = hc_pre(module, "attn", x, pre_in, 20, 1e-20, 1e-6)
        stream = hc_post(y, x, cast)
    for a, b in zip((h, *cast[:3]), (plain_h, *plain[:3])):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stream, hc_post(y, x, plain), rtol=1e-6, atol=1e-5)
