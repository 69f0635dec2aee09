"""Routing health (train/observe/routing.py) from the real engine: which module feeds which series, against values
counted by hand from the MoE layers' own inputs; the auxiliary-loss-free bias step (SPEC §5.1) as the engine applies it;
the per-expert loads of experts.jsonl and the heatmap drawn from them."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.pipeline_harness import job_of
from train.observe import routing
from train.processes import distributed
from train.run.engine import build_engine

MICROBATCHES = 2


@pytest.fixture(scope="module")
def step():
    """One training step of v41_mini (every MoE: 10 layers and the draft head's), the inputs of every MoE and its
    gate's weight and bias as each forward saw them."""
    distributed.init(torch.device("cpu"))
    job = job_of(["model=v41_mini", "train.dspark_loss_coef=1.0", "data.seq_len=64", "data.micro_batch_size=2",
                  f"train.grad_accum_steps={MICROBATCHES}"])
    engine = build_engine(job)
    moes = engine.module.stage.model.experts()
    seen = {name: [] for name in moes}
    for name, moe in moes.items():
        moe.register_forward_hook(lambda m, inputs, out, name=name: seen[name].append(
            (inputs[0].detach().reshape(-1, inputs[0].shape[-1]).clone(), m.gate.weight.detach().clone(),
             m.gate.bias.clone())))
    bias_before = {name: moe.gate.bias.clone() for name, moe in moes.items()}
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (2, 65), generator=g) for _ in range(MICROBATCHES)]
    data = iter([((x[:, :-1], torch.zeros(2, 64, dtype=torch.long)), x[:, 1:]) for x in ids])
    engine.train_batch(data)
    return engine, moes, seen, bias_before, job.args.moe.bias_update_rate


def hand_loads(moe, inputs) -> torch.Tensor:
    """The loads of a MoE counted from its inputs: top-k of sqrt(softplus(x W^T)) + bias, every slot a token (in
    fp32, as the gate scores: the picks of near-ties depend on the rounding)."""
    args, load = moe.args, torch.zeros(moe.args.n_routed_experts)
    for x, weight, bias in inputs:
        scores = F.softplus(F.linear(x.float(), weight.float()) / args.gate_temp).sqrt()
        picks = (scores + bias).topk(args.n_activated_experts, dim=-1).indices
        load += torch.bincount(picks.flatten(), minlength=args.n_routed_experts).float()
    return load


def test_loads_are_counted_from_each_layers_own_routing(step):
    """Per MoE layer (its module name), the step's loads equal the picks counted by hand over both microbatches: a
    load taken from another layer, counted once per microbatch only, or counted again during a recomputation fails.
    The draft head's MoE (``mtp.0.ffn``) is counted too."""
    engine, moes, seen, _, _ = step
    assert set(engine.expert_loads) == set(moes) and "mtp.0.ffn" in moes
    for name, moe in moes.items():
        assert len(seen[name]) == MICROBATCHES
        assert torch.equal(engine.expert_loads[name], hand_loads(moe, seen[name])), name
        drafted = 5 if name.startswith("mtp.") else 1  # the draft head routes every anchor's 5 draft tokens
        assert engine.expert_loads[name].sum() == MICROBATCHES * 2 * 64 * drafted * moe.args.n_activated_experts


def test_bias_moves_against_the_load(step):
    """After the step each bias moved by rate * sign(mean load - load): an overloaded expert's went down."""
    engine, moes, _, before, rate = step
    for name, moe in moes.items():
        load = engine.expert_loads[name]
        assert torch.allclose(moe.gate.bias, before[name] + rate * torch.sign(load.mean() - load)), name
        assert (moe.gate.bias != before[name]).any()


def test_series_are_the_layers_statistics(step, tmp_path):
    """``moe/<layer>/...`` by hand from the loads and biases of that module, under its key (``layers.3.ffn`` ->
    ``layer3``, ``mtp.0.ffn`` -> ``mtp0``); experts.jsonl holds each layer's loads over their mean, and experts.png
    is drawn from it."""
    engine, moes, _, _, _ = step
    layers = routing.gather(engine)
    row = routing.scalars(layers)
    for name, moe in moes.items():
        key = routing.layer_key(name)
        load, bias = engine.expert_loads[name].double(), moe.gate.bias.double()
        share = load / load.sum()
        entropy = -sum(p * math.log(p) for p in share.tolist() if p > 0)
        assert row[f"moe/{key}/load_max_over_mean"] == pytest.approx((load.max() / load.mean()).item())
        assert row[f"moe/{key}/load_entropy"] == pytest.approx(entropy)
        assert row[f"moe/{key}/bias_min"] == pytest.approx(bias.min().item())
        assert row[f"moe/{key}/bias_max"] == pytest.approx(bias.max().item())
        assert row[f"moe/{key}/idle_experts"] == sum(1 for n in load.tolist() if n == 0)
    assert routing.layer_key("layers.3.ffn") == "layer3" and routing.layer_key("mtp.0.ffn") == "mtp0"
    path = tmp_path / routing.EXPERTS_FILE
    routing.append(path, 1, routing.normalised_loads(layers))
    saved = json.loads(path.read_text())
    load = engine.expert_loads["layers.3.ffn"]
    assert saved["step"] == 1 and saved["loads"]["layer3"] == pytest.approx((load / load.mean()).tolist())
    assert routing.plot_experts(path, tmp_path / routing.EXPERTS_PLOT) and (tmp_path / routing.EXPERTS_PLOT).stat().st_size
