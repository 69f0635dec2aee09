"""The MoE's fused ops against formulas written out here in fp64, forward and backward, on the CPU: the Triton
kernels through the interpreter (fp32 and fp16: the interpreter computes bf16 wrongly), their PyTorch references
beside them, and the pure-PyTorch pieces (the gate's split GEMM, the permutation helpers).

Kernel outputs are poisoned with NaN (``CSA2_KERNEL_POISON``), so an element a kernel forgets to write fails. The
shapes are odd and cross the interpreter's column blocks (32) and programs (128 elements); the whole MoE runs with
the kernels once, with an expert that gets no rows.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process
os.environ["CSA2_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import reference, triton_cast, triton_ops  # noqa: E402
from model import moe as moe_module  # noqa: E402
from model.config import MoEArgs  # noqa: E402
from model.moe import Gate, MoE, inverse_permutation, reorder, sort_by_expert  # noqa: E402
from model.split_gemm import split_linear  # noqa: E402
from tests.support.moe import ARGS, DIM, make_moe, ref_moe, ref_params, tokens  # noqa: E402

IMPLS = [pytest.param(triton_ops, id="triton"), pytest.param(reference, id="reference")]


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def rel_err(got, want) -> float:
    assert torch.isfinite(got).all(), "non-finite values (unwritten poisoned elements?)"
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


# ---------------------------------------------------------------------------------------------------------- SwiGLU

def swiglu_formula(h, limit, weights):
    """silu(min(g, L)) · clamp(u, ±L) · w in fp64 (torch.clamp's gradient convention: a value on the bound passes)."""
    g, u = h.chunk(2, dim=-1)
    if limit:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    out = g * torch.sigmoid(g) * u
    return out if weights is None else out * weights.reshape(*h.shape[:-1], 1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("limit, weights_shape", [(0.0, None), (0.75, (3, 7)), (0.75, None), (0.0, (3, 7, 1))])
def test_swiglu_clamped_and_weighted(impl, limit, weights_shape):
    """Output, dh and the weights' gradient (a row sum) against the formula: rows [3, 7] of I = 37 (two column
    blocks, several programs), values spread across the clamps and some exactly on them. Catches gate and up
    swapped, a clamp on the wrong side or its gradient let through, the weight's gradient summed over one column
    block only, a row of a later program not written."""
    h = torch.randn(3, 7, 2 * 37, dtype=torch.float64) * 1.5
    h[0, 0, :4] = limit  # gates on the bound
    h[0, 1, 37:41] = -limit  # ups on the lower bound
    h = h.float().requires_grad_()
    w = None if weights_shape is None else (torch.rand(weights_shape) + 0.5).requires_grad_()
    leaves = [h] if w is None else [h, w]
    out = impl.swiglu(h, limit, w)
    grad = torch.randn(out.shape)
    got = torch.autograd.grad(out, leaves, grad)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    want = swiglu_formula(leaves64[0], limit, leaves64[1] if w is not None else None)
    ref = torch.autograd.grad(want, leaves64, grad.double())
    assert out.dtype == torch.float32 and out.shape == (3, 7, 37)
    assert rel_err(out, want) < 1e-6
    for g, r in zip(got, ref):
        assert g.shape == r.shape and rel_err(g, r) < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_swiglu_half_inputs_round_once_and_take_no_rows(impl):
    """fp16 h with fp32 routing weights: the output and dh are fp16, within one fp16 rounding of the fp64 formula
    (computed in fp32, rounded once), and the weights' gradient is fp32; no rows give empty results. Catches the
    product rounded to fp16 before the weight is applied, a weight gradient rounded to h's dtype."""
    h = (torch.randn(5, 2 * 40) * 2).half().requires_grad_()
    w = (torch.rand(5) + 0.5).requires_grad_()
    out = impl.swiglu(h, 1.0, w)
    grad = torch.randn(5, 40).half()
    dh, dw = torch.autograd.grad(out, (h, w), grad)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = swiglu_formula(h64, 1.0, w64)
    want_dh, want_dw = torch.autograd.grad(want, (h64, w64), grad.double())
    assert (out.dtype, dh.dtype, dw.dtype) == (torch.float16, torch.float16, torch.float32)
    assert (out.double() - want).abs().max() <= 2 ** -11 * want.abs().max()
    assert (dh.double() - want_dh).abs().max() <= 2 ** -11 * want_dh.abs().max()
    assert rel_err(dw, want_dw) < 1e-6
    empty = torch.zeros(0, 8, requires_grad=True)
    out = impl.swiglu(empty, 1.0, torch.ones(0))
    assert out.shape == (0, 4) and torch.autograd.grad(out.sum(), empty)[0].shape == (0, 8)


# ------------------------------------------------------------------------------------------ permute and unpermute

def random_slots(N: int, k: int, E: int = 5, seed: int = 0) -> torch.Tensor:
    """slot [N, k] of a sort by expert of random picks (expert 1 gets none), as the MoE makes it."""
    indices = torch.randint(0, E, (N, k), generator=torch.Generator().manual_seed(seed))
    indices[indices == 1] = 0
    order, _ = sort_by_expert(indices, E)
    return inverse_permutation(order).view(N, k)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k, copy", [(3, True), (1, False), (2, False)])
def test_permute_rows(impl, k, copy):
    """rows[slot[t, j]] = x[t] cast to fp16 (and x cast too with ``copy``): exact; the gradient of x sums its k rows'
    gradients and its copy's, against the formula. 13 tokens of 37 features: several programs, two column blocks.
    Catches a slot written from the wrong token, a token's copy not written, the copy's gradient dropped, a choice j
    left out of the sum."""
    N, D = 13, 37
    slot = random_slots(N, k)
    x = torch.randn(N, D, requires_grad=True)
    rows, copied = impl.permute_rows(x, slot, torch.float16, copy=copy)
    token = torch.arange(N).repeat_interleave(k)[inverse_permutation(slot.flatten())]  # the token of each row
    assert rows.dtype == torch.float16 and torch.equal(rows, x.detach().half()[token])
    assert copied is None if not copy else torch.equal(copied, x.detach().half())
    grads = [torch.randn(N * k, D).half()] + ([torch.randn(N, D).half()] if copy else [])
    (dx,) = torch.autograd.grad([rows, copied] if copy else [rows], x, grads)
    want = grads[0].double().view(-1, D)[slot].sum(1) + (grads[1].double() if copy else 0)
    assert dx.dtype == torch.float32 and rel_err(dx, want) < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k, with_add", [(3, True), (2, False)])
def test_unpermute_rows(impl, k, with_add):
    """y[t] = add[t] + Σ_j rows[slot[t, j]] (fp16 rows and add, fp32 out) against the formula, and its backward: the
    rows' gradient the token's (a gather, in the rows' dtype), add's the output's. Catches a row summed twice, the
    add dropped or added to the wrong token, a gradient sent to the wrong slot."""
    N, D = 13, 37
    slot = random_slots(N, k, seed=1)
    rows = torch.randn(N * k, D).half().requires_grad_()
    add = torch.randn(N, D).half().requires_grad_() if with_add else None
    y = impl.unpermute_rows(rows, slot, add, torch.float32)
    want = rows.detach().double()[slot].sum(1) + (add.detach().double() if with_add else 0)
    assert y.dtype == torch.float32 and rel_err(y, want) < 1e-6
    grad = torch.randn(N, D)
    got = torch.autograd.grad(y, [rows, add] if with_add else [rows], grad)
    token = torch.arange(N).repeat_interleave(k)[inverse_permutation(slot.flatten())]
    assert got[0].dtype == torch.float16 and torch.equal(got[0], grad.half()[token])
    if with_add:
        assert got[1].dtype == torch.float16 and torch.equal(got[1], grad.half())


def test_permutations_are_deterministic_and_reject_bad_slots():
    """Run twice, the kernels' outputs and gradients are bitwise equal (fixed summation order, no atomics); a slot
    tensor of the wrong shape is a one-line error."""
    slot = random_slots(11, 3)
    x = torch.randn(11, 37, requires_grad=True)
    runs = []
    for _ in range(2):
        rows, _ = triton_ops.permute_rows(x, slot, torch.float32)
        y = triton_ops.unpermute_rows(rows * 1.5, slot)
        runs.append([y, *torch.autograd.grad(y, x, torch.ones_like(y))])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    with pytest.raises(ValueError, match="slot must be"):
        triton_ops.unpermute_rows(torch.randn(10, 4), slot)


def test_reorder_backward_is_the_inverse_gather():
    """``reorder`` is ``x[order]`` forward, and its backward (the inverse permutation's gather) gives index_select's
    gradient; ``inverse_permutation`` inverts. Catches the backward gathering by ``order`` instead of ``inverse``."""
    order = torch.randperm(17, generator=torch.Generator().manual_seed(3))
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(17)) and torch.equal(inverse[order], torch.arange(17))
    x = torch.randn(17, 5, requires_grad=True)
    grad = torch.randn(17, 5)
    got = reorder(x, order, inverse)
    assert torch.equal(got, x[order])
    assert torch.equal(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(x[order], x, grad)[0])


# ----------------------------------------------------------------------------------------------- the stacked cast

def test_cast_stacks_expert_matrices_by_rows(monkeypatch):
    """Expert stacks [E, rows_i, cols] come back as [E, Σ rows_i, cols] (each expert's w1 above its w3), beside a
    plain stacked pair and a lone tensor, bit-exact against ``torch.cat(dim=-2)``; the backward gives each source its
    gradient, contiguous and exact, in one launch. Blocks of 64 outputs, so groups and experts straddle programs.
    Catches experts stacked whole (w1 of every expert, then w3), a source's offset inside its expert's rows off by
    one, the backward reading the forward's layout."""
    monkeypatch.setattr(triton_cast, "BLOCK", 64)
    w1, w3 = torch.randn(3, 5, 7, requires_grad=True), torch.randn(3, 4, 7, requires_grad=True)
    a, b, lone = torch.randn(6, 9, requires_grad=True), torch.randn(2, 9, requires_grad=True), torch.randn(11,
                                                                                                          requires_grad=True)
    sources = [w1, w3, a, b, lone]
    got = triton_ops.cast([[w1, w3], [a, b], [lone]], torch.float16)
    want = [torch.cat([w1, w3], dim=-2).half(), torch.cat([a, b]).half(), lone.half()]
    assert [g.shape for g in got] == [(3, 9, 7), (8, 9), (11,)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip(reference.cast([[w1, w3], [a, b], [lone]], torch.float16), want))
    grads = [torch.randn(g.shape).half() for g in got]
    back = torch.autograd.grad(got, sources, grads)
    expected = torch.autograd.grad(want, sources, grads)
    assert all(g.is_contiguous() and g.dtype == torch.float32 and torch.equal(g, e) for g, e in zip(back, expected))
    with pytest.raises(ValueError, match="stacks a group's matrices by rows"):
        triton_ops.cast([[w1, torch.randn(3, 4, 6)]], torch.float16)


# ------------------------------------------------------------------------------------------------------- the gate

@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_split_linear_is_fp32_precise(x_dtype):
    """x·Wᵀ from the bf16 parts against fp64 on the same inputs: within 1e-5 (norm-wise; 2^-16 per split part),
    where a plain bf16 GEMM is ~1e-2 off; backward: the bf16 GEMMs of the rounded score gradient with the rounded
    operands. Catches the lo part of an operand left out (bf16 precision), a product counted twice."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 256, generator=g).to(x_dtype).requires_grad_()
    w = (torch.randn(48, 256, generator=g) * 0.05).requires_grad_()
    scores = split_linear(x, w)
    exact = x.detach().double() @ w.detach().double().T
    plain = (x.detach().bfloat16().double() @ w.detach().bfloat16().double().T)
    assert scores.dtype == torch.float32 and rel_err(scores, exact) < 1e-5 and rel_err(plain, exact) > 1e-3
    grad = torch.randn(300, 48, generator=g)
    dx, dw = torch.autograd.grad(scores, (x, w), grad)
    g16 = grad.bfloat16().double()
    assert dx.dtype == x_dtype and dw.dtype == torch.float32
    assert rel_err(dx, g16 @ w.detach().bfloat16().double()) < (1e-2 if x_dtype == torch.bfloat16 else 1e-6)
    assert rel_err(dw, g16.T @ x.detach().bfloat16().double()) < 1e-6


def test_gate_on_tensor_cores_picks_as_fp32(monkeypatch):
    """The gate's split path (turned on for the CPU here) under bf16 autocast against the fp32 gate on 2,000 tokens
    of 64 experts, top-6: the same picks for at least 99.9% of the tokens (near-ties may flip), and the weights of
    the tokens that agree within 1e-5; a plain bf16 gate agrees less often. Catches the split path not taken
    (checked), a plain bf16 GEMM in its place."""
    args = MoEArgs(n_routed_experts=64, n_activated_experts=6)
    torch.manual_seed(0)
    gate = Gate(256, args)
    torch.nn.init.normal_(gate.weight, std=256 ** -0.5)
    gate.bias.normal_(std=0.01)
    x = torch.randn(2000, 256, generator=torch.Generator().manual_seed(1))

    def by_expert(weights, picks):  # a token's picks in expert order (a near-tie may swap two), weights alike
        picks, order = picks.sort(1)
        return weights.gather(1, order), picks

    fp32_weights, fp32_picks = by_expert(*gate(x))
    monkeypatch.setattr(moe_module, "SPLIT_GATE_DEVICES", ("cuda", "cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gate.on_tensor_cores(x)
        weights, picks = by_expert(*gate(x))
    same = (picks == fp32_picks).all(1)
    assert same.float().mean() >= 0.999
    assert (weights[same] - fp32_weights[same]).abs().max() < 1e-5
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        plain = (x.bfloat16().float() @ gate.weight.bfloat16().float().T)
    plain_picks = (torch.nn.functional.softplus(plain).sqrt() + gate.bias).topk(6).indices
    assert (plain_picks.sort(1).values == fp32_picks).all(1).float().mean() < same.float().mean()


# ------------------------------------------------------------------------------------------------ the whole layer

def test_moe_with_the_kernels_matches_the_reference():
    """The MoE with ``kernel_backend=triton`` (the permutations and the clamped SwiGLU through the interpreter; fp32,
    the loop over experts) against the per-token fp64 reference of tests/model/test_moe.py: output and the gradients of
    x, the gate, every routed expert and the shared expert; one expert gets no rows (its bias), clamps active.
    Catches the shared expert's output added twice or not at all, the routing weights not in expert order."""
    moe = make_moe(dtype=torch.float32, kernel_backend="triton")
    with torch.no_grad():
        moe.gate.bias[4] = -50.0
    p = ref_params(moe)
    x = tokens(10, dtype=torch.float32).view(2, 5, DIM).requires_grad_()
    y = moe(x)
    assert moe.training and moe.take_load()[4] == 0
    x_ref = x.detach().double().view(10, DIM).requires_grad_()
    want = ref_moe(x_ref, p, ARGS)
    assert rel_err(y.view(10, DIM), want) < 1e-5
    grad = torch.randn(10, DIM, dtype=torch.float64)
    y.backward(grad.float().view(2, 5, DIM))
    want.backward(grad)
    assert rel_err(x.grad.view(10, DIM), x_ref.grad) < 1e-5
    assert rel_err(moe.gate.weight.grad, p["gate.weight"].grad) < 1e-5
    for i in range(6):
        for n in ("w1", "w2", "w3"):
            ref = p[f"experts.{i}.{n}.weight"].grad
            got = getattr(moe.experts, n).grad[i]
            assert (got.abs().max() == 0) if ref is None else rel_err(got, ref) < 1e-5, (i, n)
    for n in ("w1", "w2", "w3"):
        assert rel_err(getattr(moe.shared_experts, n).weight.grad, p[f"shared_experts.{n}.weight"].grad) < 1e-5
