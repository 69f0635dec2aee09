"""Pictures of a run for people who would rather look than read ``metrics.jsonl``.

- ``layers.png``: per-layer heatmaps over steps: index recall of every reading layer (from the evaluations) and the
  indexer KL of every index source (from the training rows). A layout's weak layer shows as a dark row.
- ``synthetic.png``: the synthetic tasks' accuracy by distance bucket at the last evaluation, chance dashed: bars
  that stay at chance beyond the window mean the layout cannot fetch from there.
- in wandb: both pictures as images, the layout's per-layer plan as a Table, and the accuracies by distance as a
  bar chart per task at every evaluation.

Everything here draws from the rows ``train/observe/metrics.py`` writes, so a finished run can be redrawn from its
directory alone.
"""
import math
import re
from pathlib import Path

LAYERS_FILE = "layers.png"
SYNTHETIC_FILE = "synthetic.png"
_LAYER_KEY = re.compile(r"(index_recall|indexer_loss)/layer(\d+)")
_BUCKET_KEY = re.compile(r"synthetic/(\w+)_acc/dist(\d+)-(\d+)")
_MAX_COLUMNS = 200  # training steps are averaged into at most this many heatmap columns


def layer_series(rows: list[dict], name: str) -> tuple[list[int], list[int], list[list[float]]]:
    """(steps, layers, values[layer][step]) of ``<name>/layer<N>`` over the rows that have it (NaN: missing)."""
    rows = [r for r in rows if any(_is(k, name) for k in r)]
    layers = sorted({int(m.group(2)) for r in rows for k in r if (m := _LAYER_KEY.fullmatch(k)) and m.group(1) == name})
    values = [[_number(r.get(f"{name}/layer{layer}")) for r in rows] for layer in layers]
    return [r["step"] for r in rows], layers, values


def _is(key: str, name: str) -> bool:
    match = _LAYER_KEY.fullmatch(key)
    return match is not None and match.group(1) == name


def _number(value) -> float:
    return math.nan if value is None else float(value)


def _binned(steps: list[int], values: list[list[float]]) -> tuple[list[int], list[list[float]]]:
    """At most ``_MAX_COLUMNS`` columns: consecutive steps averaged (ignoring NaN), labelled by their last step."""
    size = max(1, math.ceil(len(steps) / _MAX_COLUMNS))
    if size == 1:
        return steps, values
    def mean(chunk):
        kept = [v for v in chunk if not math.isnan(v)]
        return sum(kept) / len(kept) if kept else math.nan
    edges = range(0, len(steps), size)
    return [steps[min(i + size, len(steps)) - 1] for i in edges], [[mean(row[i:i + size]) for i in edges]
                                                                  for row in values]


def plot_layers(rows: list[dict], path: Path) -> bool:
    """``layers.png``: index recall by reading layer and indexer KL by index source, over steps. False (and no
    file) when the run has neither (a window-only layout)."""
    train = [r for r in rows if r.get("split") != "eval"]
    evals = [r for r in rows if r.get("split") == "eval"]
    panels = [(title, *series) for title, series in
              (("index recall (held-out) by reading layer", layer_series(evals, "index_recall")),
               ("indexer KL (training) by index source", layer_series(train, "indexer_loss")))
              if series[1]]
    if not panels:
        return False
    heatmaps(panels, path)
    return True


def heatmaps(panels: list[tuple[str, list[int], list[int], list[list[float]]]], path: Path, columns: int = 2) -> None:
    """One layer-by-step heatmap per ``(title, steps, layers, values[layer][step])`` panel, ``columns`` a row,
    written to ``path``."""
    columns = min(columns, len(panels))
    rows = math.ceil(len(panels) / columns)
    plt = _pyplot()
    fig, axes = plt.subplots(rows, columns, squeeze=False,
                             figsize=(6 * columns, rows * (0.35 * max(len(p[2]) for p in panels) + 2.5)))
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, steps, layers, values) in zip(axes.flat, panels):
        steps, values = _binned(steps, values)
        image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        ticks = sorted({round(i * (len(steps) - 1) / 4) for i in range(5)})
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
        ax.set(xlabel="step", ylabel="layer", title=title)
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def distance_accuracy(row: dict) -> dict[str, list[tuple[str, float]]]:
    """Per task (in the row's order), ``(bucket label, accuracy)`` of an evaluation row's
    ``synthetic/<task>_acc/dist<lo>-<hi>``, by distance."""
    buckets: dict[str, list[tuple[int, str, float]]] = {}
    for key, value in row.items():
        match = _BUCKET_KEY.fullmatch(key)
        if match:
            task, lo, hi = match.group(1), int(match.group(2)), int(match.group(3))
            buckets.setdefault(task, []).append((lo, f"{lo}-{hi}", _number(value)))
    return {task: [(label, value) for _, label, value in sorted(entries)] for task, entries in buckets.items()}


def plot_synthetic(rows: list[dict], path: Path, window: int) -> bool:
    """``synthetic.png``: accuracy by distance bucket at the last evaluation, one panel per task, chance dashed.
    False (and no file) without synthetic evaluations."""
    evals = [r for r in rows if r.get("split") == "eval" and any(_BUCKET_KEY.fullmatch(k) for k in r)]
    if not evals:
        return False
    final = evals[-1]
    by_task = distance_accuracy(final)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(by_task), figsize=(4.5 * len(by_task), 3.6), squeeze=False)
    for ax, (task, buckets) in zip(axes[0], by_task.items()):
        labels, values = zip(*buckets)
        colors = ["tab:blue" if int(label.split("-")[0]) < window else "tab:orange" for label in labels]
        ax.bar(labels, [0 if math.isnan(v) else v for v in values], color=colors)
        ax.axhline(_number(final.get(f"synthetic/{task}_chance")), color="k", ls="--", lw=1, label="chance")
        ax.set(ylim=(0, 1.02), xlabel=f"distance (tokens; window {window})", ylabel="accuracy",
               title=f"{task} at step {final['step']}")
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------------ wandb

def log_layout_table(wandb_run, layout) -> None:
    """The layout's per-layer plan (``model.layout.Layout``) as a wandb Table."""
    import wandb

    columns = ["layer", "ratio", "mode", "kv source", "index source", "candidates"]
    data = [[p.layer_id, p.ratio, p.mode.value, p.kv_source, p.index_source,
             "produces" if p.makes_candidates else (f"from {p.candidate_source}" if p.candidate_source is not None
                                                    else None)]
            for p in layout.plan]
    wandb_run.log({"layout/plan": wandb.Table(columns=columns, data=data)}, step=0)


def log_synthetic_charts(wandb_run, row: dict) -> None:
    """A bar chart of accuracy by distance bucket per synthetic task of an evaluation row."""
    import wandb

    charts = {}
    for task, buckets in distance_accuracy(row).items():
        table = wandb.Table(columns=["distance", "accuracy"], data=[[label, value] for label, value in buckets])
        charts[f"synthetic/{task}_by_distance"] = wandb.plot.bar(table, "distance", "accuracy",
                                                                 title=f"{task} accuracy by distance")
    if charts:
        wandb_run.log(charts, step=row["step"])


def draw_and_log(rows: list[dict], run_dir: Path, window: int, wandb_run=None) -> list[Path]:
    """Draw ``layers.png`` and ``synthetic.png`` into ``run_dir`` from ``rows``; log them to wandb as images."""
    drawn = [path for path, draw in ((run_dir / LAYERS_FILE, plot_layers),
                                     (run_dir / SYNTHETIC_FILE, lambda r, p: plot_synthetic(r, p, window)))
             if draw(rows, path)]
    if wandb_run is not None and drawn:
        import wandb

        step = max((r["step"] for r in rows), default=0)
        wandb_run.log({f"dashboards/{p.stem}": wandb.Image(str(p)) for p in drawn}, step=step)
    return drawn
