"""The whole DeepSeek-V4.1 stack (``model/transformer.py``: MoE FFNs, staggered mHC, Engram, the DSpark draft head)
against the fp64 oracle of ``tests/oracle.py``, which knows the parts from SPEC §5 and shares no code with
``model/``: logits, every indexer KL, the draft head's loss parts and the gradient of every parameter.

``model=v41_mini`` (every part on), and variants that switch one part off, so that each switch is shown to give the
simpler model the oracle computes: ``hc_mult=1`` (the plain stream), ``ffn=dense``, no Engram, no draft head; and
Engram before layer 0, the one place where the first block's one-hot pre-mix is observable (elsewhere the copies
entering block 0 are equal and the attention norm hides which copy the pre-mix picks).

Parameters are random away from every symmetric init (hyper-connection biases, scales and projections drawn, gate
biases large enough to change some routes, expert inputs large enough to reach both sides of the SwiGLU clamps), and
``test_the_comparison_is_not_vacuous`` checks that they are. Every discrete choice (index top-k, candidate blocks,
expert top-k, draft argmax) has a gap of at least MIN_GAP at its boundary, so fp64 rounding cannot flip it.
"""
import dataclasses
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from model import Transformer
from model.cli import compose
from model.config import ModelArgs
from model.layout import layout_from_config

sys.path.insert(0, os.path.dirname(__file__))
from oracle import oracle_forward  # noqa: E402

B, T = 2, 48
DOCS = [[30, 18], [13, 35]]  # two documents per row
WORDS = 16  # token ids 0..15: repeated n-grams (duplicate Engram rows), and drafts that hit
MIN_GAP = 1e-6  # smallest gap at a discrete boundary; the two sides' fp64 scores differ by ~1e-15
TOL = 1e-10  # max |model - oracle| as a fraction of the oracle tensor's largest magnitude (measured: <= 5e-13)
DRAFT_WEIGHTS = {"ce": 0.7, "l1": 1.3, "confidence": 0.5}  # unequal, so that no two parts' gradients can swap

# The preset's 4 index heads give an index score of exactly 0 (every head's ReLU off) to 1 entry in 16, and ties at
# 0 make the top-k ambiguous for random weights in most seeds; with 8 heads (1 in 256) they are rare. Nothing of the
# V4.1 parts depends on it.
BASE = ["model.kernel_backend=torch", "model.index_n_heads=8"]
VARIANTS = {
    "v41_mini": [],
    "hc_mult=1": ["model.hc_mult=1"],
    "ffn=dense": ["model.ffn=dense"],
    "no_engram": ["model.engram.layers=[]"],
    "no_dspark": ["model.dspark.blocks=0"],
    "engram_at_0": ["model.engram.layers=[0,5]"],
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add contention on a loaded 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def configured(overrides):
    cfg = compose(["model=v41_mini", *BASE, *overrides])
    return ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)


def random_state(model, seed: int) -> dict:
    """fp64 values for every floating entry of the model's state dict (its names: per-expert matrices, gate biases),
    away from the init: mix projections, biases and scales drawn; routing biases ~0.15 (routing scores differ by
    ~0.1); routed and shared experts' W1, W3 3x wider than unit scale, so that hidden values pass the SwiGLU limit."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            continue
        noise = torch.randn(t.shape, generator=g, dtype=torch.float64)
        if name.endswith(("embed.weight", "attn_sink", "_base")):
            value = noise
        elif name.endswith("gate.bias"):
            value = 0.15 * noise
        elif name.endswith(("_scale", "q_weight", "k_weight")) or t.dim() == 1:
            value = 1 + 0.3 * noise
        elif name == "head.weight":  # the rows of the batch's tokens larger: some drafts hit their target
            value = noise / math.sqrt(t.shape[-1]) * torch.where(torch.arange(t.shape[0]) < WORDS, 3.0, 1.0)[:, None]
        elif ".experts." in name and name.endswith(("w1.weight", "w3.weight")):
            value = 3 * noise / math.sqrt(t.shape[-1])
        else:
            value = noise / math.sqrt(t.shape[-1])
        state[name] = value.requires_grad_(not name.endswith("gate.bias"))  # the bias is a buffer: no gradient
    return state


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, WORDS, (B, T), generator=g)
    doc = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(lens)]) for lens in DOCS])
    return ids, doc


def model_grads(model, loss) -> dict:
    """The gradient of every parameter of ``model`` by state-dict name (stacked experts split per expert, the sparse
    Engram table gradients made dense)."""
    named = dict(model.named_parameters())
    grads = dict(zip(named, torch.autograd.grad(loss, list(named.values()), allow_unused=True)))
    out = {}
    for name, grad in grads.items():
        grad = torch.zeros_like(named[name]) if grad is None else grad
        grad = grad.to_dense() if grad.is_sparse else grad
        if name.rsplit(".", 1)[0].endswith(".experts"):
            prefix, matrix = name.rsplit(".", 1)
            out.update({f"{prefix}.{e}.{matrix}.weight": grad[e] for e in range(grad.shape[0])})
        else:
            out[name] = grad
    return out


def objective(logits, indexer_losses, draft_losses, ids):
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return ce + sum(indexer_losses.values()) + sum(DRAFT_WEIGHTS[k] * v for k, v in draft_losses.items())


def assert_close_rel(actual, expected, what, errors):
    """max |actual - expected| <= TOL * max |expected|; records the relative error in ``errors``."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    ref = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    errors[what] = err / ref if ref else err
    assert err <= TOL * ref + 1e-300, f"{what}: max abs error {err:.3e} vs max magnitude {ref:.3e} (tol {TOL:g})"


def setup(overrides, seed: int = 0, tries: int = 5):
    """(model, params, dims, layout, ids, doc, the oracle's outputs, its diag) with random params whose every
    discrete choice has a gap of at least MIN_GAP (the next seed otherwise)."""
    args, layout = configured(overrides)
    model = Transformer(args, layout, run_dspark=True).double()
    dims, layout_d = dataclasses.asdict(args), dataclasses.asdict(layout)
    ids, doc = batch(seed)
    for k in range(tries):
        params, diag = random_state(model, seed + 1000 * k), {}
        outputs = oracle_forward(params, dims, layout_d, ids, doc, diag=diag, draft=True)
        if min(diag[key] for key in ("topk_margin", "block_margin", "route_margin", "argmax_margin")) > MIN_GAP:
            model.load_state_dict({n: p.detach() for n, p in params.items()}, strict=True)
            return model, params, dims, layout_d, ids, doc, outputs, diag
    raise RuntimeError("no seed with unambiguous discrete choices")


def compare(overrides, errors: dict):
    """The model against the oracle on one variant: logits, indexer losses, draft loss parts, every gradient."""
    model, params, dims, layout, ids, doc, (logits, indexer_losses, draft), _ = setup(overrides)
    out = model(ids, doc)
    assert out.logits.dtype == torch.float64
    assert_close_rel(out.logits, logits, "logits", errors)
    assert sorted(out.indexer_losses) == sorted(indexer_losses) == list(layout["index_source_layer_ids"])
    for s, kl in indexer_losses.items():
        assert_close_rel(out.indexer_losses[s], kl, f"indexer loss {s}", errors)
    assert sorted(out.draft_losses) == sorted(draft) == (sorted(DRAFT_WEIGHTS) if dims["dspark"]["blocks"] else [])
    for part, value in draft.items():
        assert_close_rel(out.draft_losses[part], value, f"draft {part}", errors)
    got = model_grads(model, objective(out.logits, out.indexer_losses, out.draft_losses, ids))
    leaves = [n for n, p in params.items() if p.requires_grad]
    want = torch.autograd.grad(objective(logits, indexer_losses, draft, ids), [params[n] for n in leaves],
                               allow_unused=True)
    assert sorted(got) == sorted(leaves)
    for name, grad in zip(leaves, want):
        assert_close_rel(got[name], torch.zeros_like(params[name]) if grad is None else grad, f"grad {name}", errors)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_matches_oracle(variant):
    """Measured worst relative errors (every variant): logits 4e-15, indexer KL 2e-15, draft parts 8e-16, gradients
    5e-13 (Engram gains and mix scales). Planted in ``model/`` and caught (by every variant that has the part): the
    FFN collapsing with its own pre-mix, or expanding with the attention's post/comb; a block handing on its
    attention pre-mix; the head collapsing with the one-hot pre-mix; Sinkhorn starting with the rows; comb
    transposed in expand; the mix statistic per copy; Engram after the block instead of before; the Engram gate
    without its sign; Engram n-grams across document starts; the gate bias in the routing weights; no top-k
    normalisation; the SwiGLU gate clamped from below too; the shared expert weighted by the routing weights; the
    draft features taken after the block; features detached nowhere, the main head, embedding or teacher not
    frozen for the draft head (gradients of embed/head). Only ``hc_mult=1`` caught the plain stream's FFN reading
    the block input; only ``engram_at_0`` the one-hot first pre-mix on copy 1. Not caught by any fp64 comparison:
    the routing weight applied after W2 (W2 is linear: the same function; ``tests/test_moe.py`` spies on W2's
    input for it); one of the two detaches of the draft features removed (the other still holds)."""
    compare(VARIANTS[variant], {})


def test_the_comparison_is_not_vacuous():
    """What the comparisons rest on, for v41_mini's parameters and batch (the oracle's diag): tokens go to
    different experts and every expert is used; the gate bias changes some routes, not all; routed hidden values pass
    the SwiGLU limit on all four sides; the copies differ from block 1 on (equal before: the embedding in every
    copy) and the pre-mixes differ across copies and tokens; the Engram gates are spread, per copy, far from 0 and
    1; some drafts hit their target and most do not; the index top-k and the candidate blocks restrict."""
    _, _, dims, layout, _, _, _, diag = setup(VARIANTS["v41_mini"])
    for name, (chosen, changed) in diag["routes"].items():
        experts = (dims["dspark"] if name.startswith("mtp.") else dims["moe"])["n_routed_experts"]
        assert len({tuple(sorted(c)) for c in chosen.tolist()}) >= 4, name
        assert set(chosen.flatten().tolist()) == set(range(experts)), name
        assert 0 < changed < chosen.shape[0], name
    assert all(n > 0 for n in torch.tensor(list(diag["clamped"].values())).sum(0).tolist())
    for i, X in diag["copies"].items():
        spread = ((X - X.mean(2, keepdim=True)).abs().amax() / X.abs().amax()).item()
        assert spread > 0.05 if i > 0 else spread == 0, (i, spread)
    for i, pre in diag["pre_mixes"].items():
        assert pre.std(-1).min() > 0.01 and pre.std((0, 1)).min() > 0.01, i
    assert sorted(diag["engram_gates"]) == list(dims["engram"]["layers"])
    for layer, gates in diag["engram_gates"].items():
        assert 0.02 < gates.min() and gates.max() < 0.98 and gates.std() > 0.05, layer
        assert (gates - gates.mean(-1, keepdim=True)).abs().max() > 0.05, layer
    hits, predicted = diag["draft_hits"]
    assert 0 < hits < predicted / 2
    positions = [p for lens in DOCS for n in lens for p in range(n)]  # doc-relative positions, row after row
    visible = {(i, b, t): (positions[b * T + t] + 1) // layout["compress_ratios"][i] for i, b, t in diag["selections"]}
    assert any(len(chosen) == dims["index_topk"] < visible[key] for key, chosen in diag["selections"].items())
    assert diag["block_margin"] < math.inf  # some query had more candidate blocks than it keeps
