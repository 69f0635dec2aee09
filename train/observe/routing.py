"""Routing health of the MoE layers: what the training log and ``experts.png`` show of them.

After every optimizer step the engine holds, per MoE layer of its stage, the expert loads of the step summed over
the data-parallel replicas (``parallel/engine.py``, the auxiliary-loss-free balance). On a logged step every
rank of a pipeline gathers its stage's loads and routing biases to the others (``gather``), and rank 0 writes:
- into ``metrics.jsonl`` and wandb, per layer ``moe/<layer>/load_max_over_mean`` (1 is perfect balance),
  ``moe/<layer>/load_entropy`` (nats; log(experts) is perfect balance), ``moe/<layer>/idle_experts`` (experts that
  received no token in the step), ``moe/<layer>/bias_min`` and ``bias_max``;
- under expert parallelism, per layer ``moe/<layer>/received_max_over_mean``: the rows the busiest rank of an
  expert-parallel group received, over the group's mean (1 under uniform routing, E when every token goes to one
  rank's experts), and ``moe/<layer>/received_max``, those rows (``received_rows``);
- into ``experts.jsonl``, the loads themselves (each layer's normalised to a mean of 1), from which
  ``experts.png`` draws one heatmap per layer: experts by steps, a hot row is an overloaded expert;
- ``routing.png``: the scalars above as layer-by-step heatmaps (max/mean load, idle experts, the bias's range
  ``bias_max - bias_min``, the load's entropy): a collapse shows as a bright band from some depth on.
Layers are named ``layer<N>`` (``layers.N.ffn``) and ``mtp<K>`` (the draft head's ``mtp.K.ffn``).
"""
import json
import math
import re
from pathlib import Path

import torch
import torch.distributed as dist

from model.moe import routing_stats
from train.observe.dashboards import _binned, _number, _pyplot, heatmaps

EXPERTS_FILE = "experts.jsonl"
EXPERTS_PLOT = "experts.png"
ROUTING_PLOT = "routing.png"
PREFIX = "moe/"
_ROUTED_LAYER = re.compile(r"moe/layer(\d+)/load_max_over_mean")


def layer_key(module_name: str) -> str:
    """``layers.3.ffn`` -> ``layer3``, ``mtp.0.ffn`` -> ``mtp0``."""
    kind, index = module_name.split(".")[:2]
    return f"{'layer' if kind == 'layers' else kind}{index}"


def gather(engine, group=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(loads, bias) of every MoE layer of the pipeline ``group`` (a collective on its ranks; no group: this
    stage only), from the engine's last step."""
    moes = engine.module.stage.model.experts()
    local = {layer_key(name): (load.float().cpu(), moes[name].gate.bias.detach().float().cpu())
             for name, load in engine.expert_loads.items()}
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    stages = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, local, group=group)
    return {key: value for stage in stages for key, value in stage.items()}


def received_rows(engine) -> dict[str, tuple[float, float]]:
    """Per MoE layer, ``(max, mean)`` over the expert-parallel ranks of the rows each received at the step's last
    dispatch (a collective over the world; empty without expert parallelism)."""
    groups = engine.module.expert_groups
    if groups is None:
        return {}
    dispatch, moes = groups.dispatch, engine.module.stage.model.experts()
    mine = {layer_key(name): dispatch.received[moe.experts][0] for name, moe in moes.items()
            if moe.experts in dispatch.received}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    rows = {}
    for rank in ranks:
        for key, got in rank.items():
            rows.setdefault(key, []).append(got)
    return {key: (max(got), sum(got) / len(got)) for key, got in rows.items()}


def received_scalars(rows: dict[str, tuple[float, float]]) -> dict[str, float]:
    out = {}
    for key, (most, mean) in sorted(rows.items()):
        out[f"{PREFIX}{key}/received_max_over_mean"] = most / mean if mean else 1.0
        out[f"{PREFIX}{key}/received_max"] = most
    return out


def scalars(layers: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """The ``moe/<layer>/<stat>`` scalars of a step's loads and biases."""
    return {f"{PREFIX}{key}/{stat}": value for key, (load, bias) in sorted(layers.items())
            for stat, value in routing_stats(load, bias).items()}


def normalised_loads(layers: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list[float]]:
    """Each layer's loads over their mean (1 = its share under perfect balance), for ``experts.jsonl``."""
    return {key: (load / load.mean().clamp_min(1e-12)).tolist() for key, (load, _) in sorted(layers.items())}


def append(path: Path, step: int, loads: dict[str, list[float]]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "loads": loads}) + "\n")


def plot_experts(path: Path, out: Path) -> bool:
    """``experts.png`` from ``experts.jsonl``: per layer a heatmap of the normalised load of every expert over the
    logged steps. False (and no file) without MoE rows."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    if not rows:
        return False
    from matplotlib.ticker import MaxNLocator

    layers = sorted({key for row in rows for key in row["loads"]}, key=_layer_order)
    columns = min(4, len(layers))
    plt = _pyplot()
    fig, axes = plt.subplots(math.ceil(len(layers) / columns), columns, squeeze=False,
                             figsize=(4.5 * columns, 3.2 * math.ceil(len(layers) / columns)))
    for ax in axes.flat[len(layers):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, layers):
        kept = [row for row in rows if key in row["loads"]]
        steps = [row["step"] for row in kept]
        values = [list(expert) for expert in zip(*(row["loads"][key] for row in kept))]  # [expert][step]
        steps, values = _binned(steps, values)
        image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="magma", vmin=0)
        ticks = sorted({round(i * (len(steps) - 1) / 3) for i in range(4)})
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="step", ylabel="expert", title=f"{key}: load / mean")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return True


def routing_series(rows: list[dict], value) -> tuple[list[int], list[int], list[list[float]]]:
    """(steps, layers, values[layer][step]) over the rows with routing scalars; ``value(row, layer)`` reads one
    (NaN where the row lacks it). The draft head's MoE (``mtp<K>``) is left out: it trains on its own loss."""
    rows = [r for r in rows if any(_ROUTED_LAYER.fullmatch(k) for k in r)]
    layers = sorted({int(m.group(1)) for r in rows for k in r if (m := _ROUTED_LAYER.fullmatch(k))})
    return [r["step"] for r in rows], layers, [[value(r, layer) for r in rows] for layer in layers]


def _stat(stat: str):
    return lambda row, layer: _number(row.get(f"{PREFIX}layer{layer}/{stat}"))


def _bias_range(row: dict, layer: int) -> float:
    return _stat("bias_max")(row, layer) - _stat("bias_min")(row, layer)


def plot_routing(rows: list[dict], path: Path) -> bool:
    """``routing.png`` from the training rows of ``metrics.jsonl``. False (and no file) without MoE layers."""
    train = [r for r in rows if r.get("split") != "eval"]
    panels = [(title, *routing_series(train, value)) for title, value in (
        ("max / mean expert load (1: balanced)", _stat("load_max_over_mean")),
        ("idle experts", _stat("idle_experts")),
        ("routing bias range (max - min)", _bias_range),
        ("load entropy (nats)", _stat("load_entropy")))]
    if not panels[0][2]:
        return False
    heatmaps(panels, path, columns=4)
    return True


def _layer_order(key: str) -> tuple[int, int]:
    return (key.startswith("mtp"), int(key.lstrip("layermtp")))
