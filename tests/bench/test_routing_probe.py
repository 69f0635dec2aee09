"""bench/routing_probe.py's measures against slow obvious references: the mean pairwise cosine by a loop over the
pairs, and one layer's load and logit spreads from the MoE's own input recomputed by hand."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import routing_probe  # noqa: E402
from model import layout_from_config  # noqa: E402
from model.cli import compose, resolved  # noqa: E402
from model.transformer import Transformer  # noqa: E402


def test_mean_pairwise_cosine_is_the_mean_over_distinct_pairs():
    """Planted: the N self-pairs left in (the mean moves towards 1: fails)."""
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    pairs = [torch.cosine_similarity(x[i], x[j], dim=0).item() for i in range(7) for j in range(7) if i != j]
    assert abs(routing_probe.mean_pairwise_cosine(x) - sum(pairs) / len(pairs)) < 1e-12


def test_layer_rows_match_the_moe_input():
    """Each MoE layer's row from its own input: top-k counts (sum N*k), max/mean, idle experts, logit spreads.
    Planted: the load counted from the scores without the bias (a biased expert's share differs: fails)."""
    cfg = resolved(compose(["model=v41_mini", "data.seq_len=64"]))
    model = Transformer(cfg.model.args, layout_from_config(cfg.layout), seed=0).eval()
    moe = model.layers["3"].ffn
    with torch.no_grad():
        moe.gate.bias[2] = 10.0  # expert 2 in every token's top-k
    seen = []
    moe.register_forward_pre_hook(lambda m, args: seen.append(args[0].flatten(0, 1).clone()))
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    row = next(r for r in routing_probe.layer_rows(model, ids, torch.float32) if r["layer"] == 3)
    x = seen[0].double()
    logits = x @ moe.gate.weight.double().T
    scores = torch.nn.functional.softplus(logits).sqrt() + moe.gate.bias.double()
    counts = torch.bincount(scores.topk(moe.args.n_activated_experts, dim=-1).indices.flatten(),
                            minlength=moe.args.n_routed_experts).double()
    assert counts[2] == 64 and counts.sum() == 64 * moe.args.n_activated_experts
    assert abs(row["load_max_over_mean"] - (counts.max() / counts.mean()).item()) < 1e-12
    assert row["idle_experts"] == int((counts == 0).sum())
    assert abs(row["logit_std_tokens"] - logits.std(0).mean().item()) < 1e-9
    assert abs(row["logit_mean_std"] - logits.mean(0).std().item()) < 1e-9
    assert abs(row["cosine"] - routing_probe.mean_pairwise_cosine(x)) < 1e-12


def test_frozen_groups_stay_and_the_rest_moves():
    """--freeze gate: after a step every gate weight is bitwise as built, and the expert stacks moved.
    Planted: the freeze matching no parameter (the gate takes its sign step: fails)."""
    cfg = resolved(compose(["model=v41_mini", "data.seq_len=32"]))
    model = Transformer(cfg.model.args, layout_from_config(cfg.layout), seed=0)
    frozen = routing_probe.freeze(model, ["gate"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(1))
    assert next(routing_probe.train_steps(model, cfg, ids, 1, torch.float32))[0] == 1
    trunk = [n for n in before if n.startswith("layers.")]  # not the draft head's (group dspark, no loss here)
    gates = [n for n in trunk if n.endswith("ffn.gate.weight")]
    assert gates and sorted(frozen) == sorted(gates)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in gates)
    assert all(not torch.equal(after[n], before[n]) for n in trunk if n.endswith("ffn.experts.w2"))


def test_gradient_stats_are_the_clipped_gradient_adam_takes():
    """A step's ``grads`` row for the gate: norm, rms and share above eps of the clipped gradients left in ``.grad``,
    recomputed by hand. Planted: the stats taken before clipping (at grad_clip 1e-3 the norm differs: fails)."""
    cfg = resolved(compose(["model=v41_mini", "data.seq_len=32", "train.grad_clip=1e-3", "train.eps=1e-11"]))
    model = Transformer(cfg.model.args, layout_from_config(cfg.layout), seed=0)
    ids = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(1))
    _, _, stats = next(routing_probe.train_steps(model, cfg, ids, 1, torch.float32))
    g = torch.cat([p.grad.double().flatten() for n, p in model.named_parameters()
                   if n.startswith("layers.") and n.endswith("ffn.gate.weight")])
    gate = stats["gate"]
    assert abs(gate["norm"] - g.norm().item()) < 1e-12 * max(1.0, g.norm().item())
    assert abs(gate["rms"] - (g.square().sum() / g.numel()).sqrt().item()) < 1e-15
    assert gate["above_eps"] == sum(abs(v) > 1e-11 for v in g.tolist()) / g.numel()
    assert 0 < gate["above_eps"] < 1  # the eps chosen so that both sides of it occur
