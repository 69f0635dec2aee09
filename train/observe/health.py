"""Training-health diagnostics: activation RMS per layer, and the plot of them with the per-group gradient norms.

``ActivationStats`` records, during the training forwards of a logged step, the RMS of every block's attention
output, FFN output and residual stream (the block's output), and of the logits. Forward hooks take
``||x|| / sqrt(numel)`` accumulated in fp32 without a copy: three reductions per layer, cheap enough to leave on.
They record only inside the stage's own forward, so neither the recomputation of a checkpointed layer in backward
nor an evaluation forward is counted. A value is the RMS over every token of the step (the mean square over its
microbatches) on this data-parallel replica; ``collect`` gathers the layers of every pipeline stage.

The per-group gradient norms (``grad_norm/<group>``, model/groups.py) come from the engine's clipping pass.
``plot_health`` draws both from ``metrics.jsonl``.
"""
import json
import math
import statistics
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from train.observe.metric_rows import read_rows, series_of

ACT_PREFIX = "act_rms/"
GRAD_PREFIX = "grad_norm/"
SITES = ("attn", "ffn", "resid")  # per layer; plus "logits" once


class ActivationStats:
    def __init__(self, model: torch.nn.Module, scope: torch.nn.Module | None = None):
        """Hooks on a ``model.transformer.Transformer`` (or a stage's slice of it): its blocks, and its head if
        it has one, are measured while the forward of ``scope`` (default: the model; a pipeline stage) runs."""
        self._squares: dict[str, list[torch.Tensor]] = {}
        self._enabled = self._in_forward = False
        scope = model if scope is None else scope
        scope.register_forward_pre_hook(lambda *_: self._set_in_forward(True))
        scope.register_forward_hook(lambda *_: self._set_in_forward(False))
        for layer_id, block in model.layers.items():
            block.attn.register_forward_hook(self._recorder(f"attn/layer{layer_id}"))
            block.ffn.register_forward_hook(self._recorder(f"ffn/layer{layer_id}"))
            block.register_forward_hook(self._recorder(f"resid/layer{layer_id}"))
        if model.has_head:
            model.head.register_forward_hook(self._recorder("logits"))

    def _set_in_forward(self, value: bool) -> None:
        self._in_forward = value

    def _recorder(self, key: str):
        def record(module, inputs, output):
            if self._enabled and self._in_forward:
                x = (output[0] if isinstance(output, tuple) else output).detach()
                square = torch.linalg.vector_norm(x, dtype=torch.float32).square() / max(x.numel(), 1)
                self._squares.setdefault(key, []).append(square)
        return record

    @contextmanager
    def recording(self, enabled: bool = True):
        """Record the forwards run inside this block (a training step) when ``enabled``."""
        self._enabled = enabled
        try:
            yield
        finally:
            self._enabled = False

    def collect(self, group=None) -> dict[str, float]:
        """``act_rms/<site>/layer<N>`` and ``act_rms/logits`` of what was recorded, over every stage of the
        pipeline ``group`` (a collective: every rank of the group calls it); then starts afresh."""
        keys = sorted(self._squares)
        means = torch.stack([torch.stack(self._squares[k]).mean() for k in keys]).sqrt().cpu().tolist() if keys \
            else []
        self._squares = {}
        local = {ACT_PREFIX + k: v for k, v in zip(keys, means)}
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return local
        stages = [None] * dist.get_world_size(group)
        dist.all_gather_object(stages, local, group=group)
        return {k: v for stage in stages for k, v in stage.items()}


def plot_health(rows: list[dict], path: Path) -> bool:
    """Gradient norm per parameter group and logits RMS against step; residual-stream, attention-output and
    FFN-output RMS per layer against step as heatmaps. Returns False (nothing drawn) when no row has them."""
    train = [r for r in rows if r.get("split") != "eval"]
    groups = sorted({k for r in train for k in r if k.startswith(GRAD_PREFIX)})
    if not groups:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    fig, axes = plt.subplot_mosaic([["grad", "grad", "logits"], ["resid", "attn", "ffn"]], figsize=(15, 8))
    for key in groups:
        steps, values = series_of(train, key)
        axes["grad"].plot(steps, values, label=key.removeprefix(GRAD_PREFIX), lw=1)
    axes["grad"].plot(*series_of(train, "grad_norm"), "k", label="trunk (clipped by)", lw=1.5)
    axes["grad"].set(yscale="log", xlabel="step", title="gradient norm per parameter group (before clipping)")
    axes["grad"].legend(fontsize=7, ncol=2)
    axes["logits"].plot(*series_of(train, ACT_PREFIX + "logits"), lw=1)
    axes["logits"].set(xlabel="step", title="logits RMS")
    for site in SITES:
        keys = sorted({k for r in train for k in r if k.startswith(f"{ACT_PREFIX}{site}/layer")},
                      key=lambda k: int(k.rsplit("layer", 1)[-1]))
        logged = [r for r in train if keys and keys[0] in r]
        ax = axes[site]
        ax.set(xlabel="step", ylabel="layer", title={"resid": "residual stream RMS", "attn": "attention output RMS",
                                                    "ffn": "FFN output RMS"}[site])
        if not logged:
            continue
        grid = [[math.nan if r.get(k) is None else r[k] for r in logged] for k in keys]
        values = [v for row in grid for v in row if v == v and v > 0]
        image = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest",
                          extent=(logged[0]["step"] - 0.5, logged[-1]["step"] + 0.5, -0.5, len(keys) - 0.5),
                          norm=LogNorm(min(values), max(values)) if values else None)
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def stability(rows: list[dict], warmup_steps: int) -> dict:
    """Issue 11's two criteria of a healthy run, from its ``metrics.jsonl`` rows: after the warm-up, no step's
    loss above the first step's, and no gradient norm above 10x the median of the norms before it."""
    train = [r for r in rows if r.get("split") != "eval" and r.get("lm_loss") is not None]
    ratios = [(r["grad_norm"] / statistics.median(x["grad_norm"] for x in train[:i]), r["step"])
              for i, r in enumerate(train) if i > 0]
    after = [r for r in train if r["step"] > warmup_steps]
    worst_loss = max(((r["lm_loss"], r["step"]) for r in after), default=(math.nan, None))
    worst_ratio = max((x for x in ratios if x[1] > warmup_steps), default=(math.nan, None))
    first = train[0]["lm_loss"]
    return {"steps": len(train), "warmup_steps": warmup_steps, "first_lm_loss": first,
            "max_lm_loss_after_warmup": worst_loss[0], "at_step": worst_loss[1],
            "max_grad_norm_over_running_median_after_warmup": worst_ratio[0], "ratio_at_step": worst_ratio[1],
            "max_grad_norm_over_running_median": max(ratios, default=(math.nan, None))[0],
            "healthy": worst_loss[0] <= first and worst_ratio[0] <= 10}


def main(argv: list[str]) -> int:
    """``python -m train.health <run dir>... [--warmup N]``: the stability criteria of each run as one JSON line
    (the warm-up length from the run's config.yaml, or ``--warmup``)."""
    import argparse

    import yaml

    parser = argparse.ArgumentParser(prog="python -m train.health", description=stability.__doc__.split(":")[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--warmup", type=int, default=None)
    a = parser.parse_args(argv)
    for run in map(Path, a.runs):
        config = run / "config.yaml"
        warmup = a.warmup if a.warmup is not None else int(yaml.safe_load(config.read_text())["train"]["warmup_steps"])
        print(json.dumps({"run": str(run), **stability(read_rows(run / "metrics.jsonl"), warmup)}))
    return 0
