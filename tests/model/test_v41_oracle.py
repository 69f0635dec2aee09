"""The whole DeepSeek-V4.1 stack (``model/transformer.py``: MoE FFNs, staggered mHC, Engram, the DSpark draft head)
against the fp64 oracle of ``tests/support/oracle.py``, which knows the parts from SPEC §5 and shares no code with
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

import pytest
import torch

from model import Transformer

from tests.support.oracle import oracle_forward
from tests.support.v41_oracle import (DOCS, DRAFT_WEIGHTS, MIN_GAP, T, _one_thread, assert_close_rel, batch,
                                      configured, objective, random_state)


VARIANTS = {
    "v41_mini": [],
    "hc_mult=1": ["model.hc_mult=1"],
    "ffn=dense": ["model.ffn=dense"],
    "no_engram": ["model.engram.layers=[]"],
    "no_dspark": ["model.dspark.blocks=0"],
    "engram_at_0": ["model.engram.layers=[0,5]"],
}


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
    the routing weight applied after W2 (W2 is linear: the same function; ``tests/model/test_moe.py`` spies on W2's
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
