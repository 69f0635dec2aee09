"""The MoE FFN (model/moe.py) against an fp64 reference written here from SPEC §5.1, token by token.

The reference reads the weights under the checkpoint's names (``gate.weight``, ``experts.{j}.w1.weight``, ...), so it
shares nothing with the module but the values."""
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import kernels
from model.config import ModelArgs, MoEArgs
from model.moe import Expert, Gate, MoE, RoutedExperts, routing_stats, sort_by_expert, update_bias
from tests.support.moe import ARGS, DIM, INTER, make_moe, ref_expert, ref_moe, ref_params, ref_route, tokens


# ------------------------------------------------------------------------------------------------ the reference


# -------------------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_gate_matches_reference(score_func, norm_topk_prob):
    """Picks and weights of every score function, normalised or not, with temperature and route scale; the bias
    changes the picks (checked: some token picks differently without it) but the weights are the unbiased scores.
    Planted: weights gathered from ``scores + bias`` (fails: weights differ); the temperature dropped (fails)."""
    args = MoEArgs(n_routed_experts=6, n_activated_experts=3, score_func=score_func, gate_temp=0.7,
                   norm_topk_prob=norm_topk_prob, route_scale=1.5)
    torch.manual_seed(0)
    gate = Gate(DIM, args).double()
    torch.nn.init.normal_(gate.weight, std=0.5)
    gate.bias.copy_(torch.randn(6, dtype=torch.float64) * 0.5)
    x = tokens(20)
    weights, indices = gate(x)
    assert weights.dtype == torch.float64 and indices.dtype == torch.int64
    unbiased = [ref_route(x_t, gate.weight.detach(), torch.zeros(6), args)[0] for x_t in x]
    assert any(set(i) != set(u) for i, u in zip(indices.tolist(), unbiased)), "the bias must change some pick"
    for t, x_t in enumerate(x):
        chosen, ref_weights = ref_route(x_t, gate.weight.detach(), gate.bias, args)
        assert indices[t].tolist() == chosen
        torch.testing.assert_close(weights[t].detach(), torch.stack(ref_weights), rtol=1e-12, atol=1e-12)


def test_gate_top1_is_not_normalised_and_runs_in_fp32_under_autocast():
    """k = 1 keeps the raw score (normalising one weight would make it 1) times the route scale; under bf16 autocast
    the scores stay fp32 (fp32 weights within 1e-6 of fp64; bf16 scores would be off by ~1e-2).
    Planted: normalising at k = 1 (fails: weights 1.5); the autocast guard removed (fails the fp32 check)."""
    args = MoEArgs(n_routed_experts=6, n_activated_experts=1, route_scale=1.5)
    torch.manual_seed(0)
    gate = Gate(DIM, args)
    torch.nn.init.normal_(gate.weight, std=0.5)
    x = tokens(20, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights, indices = gate(x)
    assert weights.dtype == torch.float32
    for t, x_t in enumerate(x.double()):
        chosen, ref_weights = ref_route(x_t, gate.weight.detach().double(), torch.zeros(6), args)
        assert indices[t].tolist() == chosen
        torch.testing.assert_close(weights[t].double().detach(), torch.stack(ref_weights), rtol=1e-6, atol=1e-6)


class LinearSpy:
    """Records the inputs of the matmuls whose contraction is over ``INTER``: W2's inputs h."""

    def __init__(self, monkeypatch):
        self.w2_inputs = []
        linear, grouped_mm = F.linear, F.grouped_mm

        def spy_linear(x, weight, *args, **kwargs):
            if weight.shape[-1] == INTER:
                self.w2_inputs.append(x.detach())
            return linear(x, weight, *args, **kwargs)

        def spy_grouped_mm(a, b, **kwargs):
            if b.shape[-2] == INTER:
                self.w2_inputs.append(a.detach())
            return grouped_mm(a, b, **kwargs)

        monkeypatch.setattr(F, "linear", spy_linear)
        monkeypatch.setattr(F, "grouped_mm", spy_grouped_mm)


def test_shared_expert_clamped_swiglu_weights_before_w2(monkeypatch):
    """The expert's output and W2's input h = silu(min(g, L)) · clamp(u, ±L) · w against the reference (both clamps
    active on these values, checked). The weight before or after W2 gives the same output in exact arithmetic, so
    W2's input is compared directly. Planted: the weight applied to W2's output (fails: h differs); the gate
    clamped from below too (fails)."""
    moe = make_moe()
    expert, p = moe.shared_experts, ref_params(moe)
    x, w = tokens(12), torch.rand(12, 1, dtype=torch.float64) + 0.5
    spy = LinearSpy(monkeypatch)
    out = expert(x, w)
    g, u = x @ p["shared_experts.w1.weight"].T, x @ p["shared_experts.w3.weight"].T
    assert (g > ARGS.swiglu_limit).any() and (g < -ARGS.swiglu_limit).any() and (u.abs() > ARGS.swiglu_limit).any()
    for t in range(12):
        ref_out, ref_h = ref_expert(x[t], *(p[f"shared_experts.{n}.weight"] for n in ("w1", "w2", "w3")), w[t],
                                    ARGS.swiglu_limit)
        torch.testing.assert_close(out[t].detach(), ref_out.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(spy.w2_inputs[0][t], ref_h.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("grouped", [False, True])
def test_routed_experts_weights_before_w2(monkeypatch, grouped):
    """The routed experts (loop and grouped path; fp32, as grouped_mm takes no fp64) on rows sorted by expert, one
    expert with no rows: outputs and W2's inputs against the reference, row by row, each with its own weight.
    Planted: the weight applied after W2 (fails: h differs); rows given the weights of other rows (fails)."""
    moe = make_moe(dtype=torch.float32)
    p = ref_params(moe)
    counts = torch.tensor([3, 0, 2, 4, 1, 2])
    expert_of_row = torch.repeat_interleave(torch.arange(6), counts)
    x, w = tokens(12, dtype=torch.float32), torch.rand(12) + 0.5
    spy = LinearSpy(monkeypatch)
    out = moe.experts(x, counts, w, grouped=grouped)
    h = torch.cat(spy.w2_inputs)
    for r, e in enumerate(expert_of_row.tolist()):
        ref_out, ref_h = ref_expert(x[r].double(), *(p[f"experts.{e}.{n}.weight"] for n in ("w1", "w2", "w3")),
                                    w[r].double(), ARGS.swiglu_limit)
        torch.testing.assert_close(out[r].double().detach(), ref_out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h[r].double(), ref_h.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_shared", [1, 0])
@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid"])
def test_moe_matches_reference(n_shared, score_func):
    """The whole MoE ([B, T, dim] in, same out) against the per-token reference: routed experts picked with the bias,
    weighted, plus the shared expert. Planted: the routing weights not put in expert order (``weights.flatten()``
    instead of ``[order]``: fails); the shared expert left out (fails); tokens taken as ``order % k`` (fails)."""
    args = MoEArgs(**{**ARGS.__dict__, "n_shared_experts": n_shared, "score_func": score_func})
    moe = make_moe(args)
    x = tokens(10).view(2, 5, DIM)
    y = moe(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.view(10, DIM).detach(), ref_moe(x.view(10, DIM), ref_params(moe), args).detach(),
                               rtol=1e-12, atol=1e-12)


def test_moe_gradients_match_reference():
    """Gradients of x, the gate's weight, every routed expert's and the shared expert's matrices against the
    reference's autograd in fp64 (the gate learns only through the routing weights). Planted: the gate's weights
    detached (fails: no gate gradient); the routing weight dropped from the backward by a detach in the expert
    (fails)."""
    moe = make_moe()
    p = ref_params(moe)
    x = tokens(10).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn(10, DIM, dtype=torch.float64)
    moe(x).backward(grad)
    ref_moe(x_ref, p, ARGS).backward(grad)
    close = partial(torch.testing.assert_close, rtol=1e-10, atol=1e-10)
    close(x.grad, x_ref.grad)
    close(moe.gate.weight.grad, p["gate.weight"].grad)
    assert moe.gate.weight.grad.abs().sum() > 0
    for i, j in enumerate(moe.experts.expert_ids):
        for n in ("w1", "w2", "w3"):  # an expert the reference never picked has no gradient there
            ref = p[f"experts.{j}.{n}.weight"]
            close(getattr(moe.experts, n).grad[i], torch.zeros_like(ref) if ref.grad is None else ref.grad)
    for n in ("w1", "w2", "w3"):
        close(getattr(moe.shared_experts, n).weight.grad, p[f"shared_experts.{n}.weight"].grad)
    assert not moe.gate.bias.requires_grad and "gate.bias" not in dict(moe.named_parameters())


@pytest.mark.parametrize("autocast", [False, True])
def test_grouped_mm_path_equals_loop(autocast):
    """grouped_mm and the per-expert loop compute the same outputs and gradients (x, routing weights, w1, w2, w3)
    on the CPU, with an expert of no rows: fp32 throughout, and bf16 autocast over fp32 weights (the cast the
    grouped path does itself: grouped_mm is not autocast-aware). CPU grouped_mm runs forward and backward in bf16 and
    fp32 when the incoming gradient is contiguous; an expanded one (``out.sum().backward()``) fails there with
    "Invalid strides/sizes". Under autocast both round to bf16 the same way (here bitwise: the CPU grouped_mm runs
    the same per-group mm), so they agree within one bf16 rounding (2^-8); in fp32 within fp32 rounding.
    Planted: the offsets as counts, not their cumulative sum (fails)."""
    moe = make_moe(dtype=torch.float32)
    counts = torch.tensor([3, 0, 2, 4, 1, 2])
    grad, weights = torch.randn(12, DIM), torch.rand(12) + 0.5
    results = []
    for grouped in (False, True):
        moe.zero_grad()
        x, w = tokens(12, dtype=torch.float32).requires_grad_(), weights.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = moe.experts(x, counts, w, grouped=grouped)
        assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
        out.backward(grad.to(out.dtype))
        results.append([out.float(), x.grad, w.grad, *(getattr(moe.experts, n).grad for n in ("w1", "w2", "w3"))])
    tol = 2 ** -8 if autocast else 1e-5
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop, rtol=tol, atol=tol)


def test_moe_under_autocast_matches_reference():
    """bf16 autocast over fp32 weights (the loop path): the output keeps x's dtype (fp32) and is within 1e-2 of the
    fp64 reference (5e-3 measured on outputs up to 0.67: a few bf16 roundings of 2^-8 each). Planted: the output
    left in the compute dtype (fails: bf16)."""
    moe = make_moe(dtype=torch.float32)
    x = tokens(10, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert y.dtype == torch.float32
    ref = ref_moe(x.double(), ref_params(moe), ARGS).detach()
    torch.testing.assert_close(y.double().detach(), ref, rtol=1e-2, atol=1e-2)


def test_state_dict_names_and_round_trip():
    """The checkpoint names are the reference's (one entry per expert, ``gate.bias`` included, ``load`` not) while the
    Parameters stay stacked; a state dict loads into a fresh module and reproduces the output; a missing expert is
    reported by its own name (strict=False: it keeps its values, the others load), a misshapen one too. Planted: the
    hook naming experts by their local index (fails the subset test below); the load hook not stacking (fails:
    unexpected keys)."""
    moe = make_moe()
    names = list(moe.state_dict())
    expected = ["gate.weight", "gate.bias",
                *(f"experts.{j}.{n}.weight" for j in range(6) for n in ("w1", "w2", "w3")),
                *(f"shared_experts.{n}.weight" for n in ("w1", "w2", "w3"))]
    assert sorted(names) == sorted(expected)
    assert {"experts.w1", "experts.w2", "experts.w3"} <= set(dict(moe.named_parameters()))
    assert moe.state_dict()["experts.4.w2.weight"].shape == (DIM, INTER)
    fresh = make_moe(seed=5)
    fresh.load_state_dict(moe.state_dict())
    x = tokens(10)
    torch.testing.assert_close(fresh(x), moe(x), rtol=0, atol=0)
    broken = {k: v for k, v in moe.state_dict().items() if k != "experts.2.w1.weight"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"experts.2.w1.weight\""):
        fresh.load_state_dict(broken)
    partial_load = make_moe(seed=6)
    kept = partial_load.experts.w1[2].detach().clone()
    assert partial_load.load_state_dict(broken, strict=False).missing_keys == ["experts.2.w1.weight"]
    assert torch.equal(partial_load.experts.w1[2], kept) and torch.equal(partial_load.experts.w1[3], moe.experts.w1[3])
    with pytest.raises(RuntimeError, match="size mismatch for experts.1.w3.weight"):
        fresh.load_state_dict({**moe.state_dict(), "experts.1.w3.weight": torch.zeros(3, 3)})


def test_expert_subsets_match_full_module():
    """A module holding experts 2..4 has their checkpoint names (global ids), loads them from the full module's
    state dict, gives the full module's outputs on their rows, and its ``reference_slices`` are views under those
    names; MoEs holding a partition of the experts sum to the full routed output. Planted: subset rows sliced from
    ``held.stop`` (fails); reference names by local index (fails)."""
    full = make_moe(MoEArgs(**{**ARGS.__dict__, "n_shared_experts": 0}))
    part = RoutedExperts(DIM, full.args, range(2, 5)).double()
    state = {k.removeprefix("experts."): v for k, v in full.state_dict().items() if k.startswith("experts.")}
    held = {k: v for k, v in state.items() if int(k.split(".")[0]) in range(2, 5)}
    assert sorted(part.state_dict()) == sorted(held)
    part.load_state_dict(held)
    counts = torch.tensor([1, 3, 2, 4, 1, 2])
    x, w = tokens(13), torch.rand(13, dtype=torch.float64)
    torch.testing.assert_close(part(x[4:11], counts[2:5], w[4:11]), full.experts(x, counts, w)[4:11], rtol=0, atol=0)
    slices = dict(part.reference_slices())
    assert sorted(slices) == sorted(held)
    with torch.no_grad():
        slices["3.w2.weight"].fill_(7.0)
    assert (part.w2[1] == 7.0).all()

    x = tokens(10)
    shares = []
    for ids in (range(0, 2), range(2, 6)):
        rank = MoE(DIM, full.args, expert_ids=ids).double()
        rank.load_state_dict({k: v for k, v in full.state_dict().items()
                              if not k.startswith("experts.") or int(k.split(".")[1]) in ids})
        shares.append(rank(x))
    torch.testing.assert_close(shares[0] + shares[1], full(x), rtol=1e-12, atol=1e-12)


def test_loads_counted_in_training_only_once_per_forward():
    """``load`` counts each expert's picks in a training forward (against the reference's picks), not in eval, and not
    again when a checkpointed layer recomputes its forward for the backward; ``take_load`` returns and zeroes it.
    Planted: the ``recomputing()`` guard removed (fails: counts doubled); the ``training`` guard removed (fails)."""
    moe = make_moe()
    p = ref_params(moe)
    x = tokens(10)
    expected = torch.zeros(6, dtype=torch.float64)
    for x_t in x:
        expected[ref_route(x_t, p["gate.weight"], p["gate.bias"], ARGS)[0]] += 1
    moe.eval()
    moe(x)
    assert moe.load.sum() == 0
    moe.train()
    moe(x)
    torch.testing.assert_close(moe.load, expected)
    moe.take_load()
    assert moe.load.sum() == 0
    x = x.requires_grad_()
    checkpoint(moe, x, use_reentrant=False, context_fn=partial(kernels.checkpoint_contexts, False)).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(moe.take_load(), expected)


@pytest.mark.parametrize("k", [1, 2])
def test_every_token_to_the_same_experts(k):
    """A bias that sends every token to the same k experts: the others get no rows (the loop and grouped_mm both run
    empty groups), the output still matches the reference, the load says so, and ``routing_stats`` gives max/mean
    E/k and entropy ln k; a uniform load gives 1 and ln E. Planted: zero-row experts skipped without keeping the
    offsets (fails); entropy of the raw load instead of the normalised one (fails)."""
    args = MoEArgs(**{**ARGS.__dict__, "n_activated_experts": k})
    moe = make_moe(args)
    with torch.no_grad():
        moe.gate.bias.copy_(torch.tensor([0.0, 0, 0, 50, 0, 40]))
    x = tokens(10)
    y = moe(x)
    torch.testing.assert_close(y.detach(), ref_moe(x, ref_params(moe), args).detach(), rtol=1e-12, atol=1e-12)
    load = moe.take_load()
    assert load.tolist() == ([0, 0, 0, 10, 0, 0] if k == 1 else [0, 0, 0, 10, 0, 10])
    stats = routing_stats(load, moe.gate.bias)
    assert stats["load_max_over_mean"] == pytest.approx(6 / k)
    assert stats["load_entropy"] == pytest.approx(math.log(k), abs=1e-12)
    assert (stats["bias_min"], stats["bias_max"]) == (0.0, 50.0)
    assert stats["idle_experts"] == 6 - k
    uniform = routing_stats(torch.full((6,), 4.0), torch.zeros(6))
    assert uniform["load_max_over_mean"] == pytest.approx(1.0)
    assert uniform["load_entropy"] == pytest.approx(math.log(6))
    assert uniform["idle_experts"] == 0

    moe32 = make_moe(args, dtype=torch.float32)
    with torch.no_grad():
        moe32.gate.bias.copy_(moe.gate.bias)
    _, indices = moe32.gate(x.float())
    order, counts = sort_by_expert(indices, 6)
    rows = x.float()[order // k]
    weights = torch.rand(len(order))
    torch.testing.assert_close(moe32.experts(rows, counts, weights, grouped=True),
                               moe32.experts(rows, counts, weights, grouped=False), rtol=1e-5, atol=1e-5)


def test_update_bias_sign():
    """The balance step: an overloaded expert's bias goes down by the rate, an idle one's up, one at the mean stays.
    Planted: the sign flipped (fails)."""
    gate = Gate(DIM, ARGS)
    gate.bias.fill_(0.25)
    update_bias(gate, torch.tensor([10.0, 0, 5, 5, 5, 5]), rate=0.125)
    assert gate.bias.tolist() == [0.125, 0.375, 0.25, 0.25, 0.25, 0.25]


def test_sort_by_expert_is_stable():
    """Slots ordered by expert and by slot (token) within an expert, counts per expert including empty ones, on a
    small case by hand and on 2,000 slots against a reference key sort. Planted: an unstable sort (fails on the
    large case: the CPU sort of 2,000 keys reorders equal ones)."""
    order, counts = sort_by_expert(torch.tensor([[2, 0], [0, 2], [2, 3]]), 5)
    assert order.tolist() == [1, 2, 0, 3, 4, 5] and counts.tolist() == [2, 0, 3, 1, 0]
    indices = torch.randint(0, 7, (1000, 2), generator=torch.Generator().manual_seed(0))
    order, counts = sort_by_expert(indices, 8)
    flat = indices.flatten().tolist()
    assert order.tolist() == sorted(range(len(flat)), key=lambda s: (flat[s], s))
    assert counts.tolist() == [flat.count(e) for e in range(8)]


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="expert_ids"):
        RoutedExperts(DIM, ARGS, range(4, 9))
    with pytest.raises(ValueError, match="multiples of 8"):
        RoutedExperts(12, ARGS)(torch.randn(3, 12), torch.tensor([3, 0, 0, 0, 0, 0]), torch.ones(3), grouped=True)
    with pytest.raises(ValueError, match="model.moe.score_func='relu' is not a choice"):  # checked on resolution
        ModelArgs.from_config({"ffn": "moe", "moe": {"score_func": "relu"}})
