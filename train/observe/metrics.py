"""Where the numbers go: ``metrics.jsonl`` (the record scripts read), wandb, and PNGs.

Only rank 0 writes. ``metrics.jsonl`` holds one JSON object per logged training step and one per evaluation
(``"split": "eval"``); a resumed run first drops the rows past its checkpoint, so the file reads as one run.
A non-finite number (the loss of a skipped step) is written as ``null``, so that the file stays strict JSON.
The PNGs are drawn from that file, for people without a wandb account: ``loss_curve.png`` here, the per-layer and
synthetic-task dashboards in ``train/observe/dashboards.py`` (also logged to wandb, with the layout as a Table). A MoE
model's expert loads go to ``experts.jsonl`` beside it, drawn as ``experts.png``, and its routing scalars as
``routing.png`` (``train/observe/routing.py``).

What the layout costs (``model.accounting`` at ``data.seq_len``) and the tokens of one optimizer step are logged
once per run: in the first training row of the file, and in the wandb config next to the resolved config and the
layout's plan, with the layout as the wandb group and its name as a tag, so that a sweep's runs group and compare
in a dashboard.
"""
import json
import math
from pathlib import Path

from model.accounting import account
from model.config import plain
from model.layout import Layout
from parallel.job import Job
from train.observe import dashboards, routing
from train.observe.health import plot_health
from train.observe.metric_rows import read_rows, series_of

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss_curve.png"
HEALTH_PLOT_FILE = "health.png"  # gradient norms per group, activation RMS per layer (train/observe/health.py)


class MetricsLogger:
    """Appends rows to ``metrics.jsonl`` and mirrors them to wandb (``logger.mode``: offline|online|disabled)."""

    def __init__(self, job: Job, run_dir: Path, start_step: int, enabled: bool, run_id: str | None = None):
        """``run_id``: the wandb run to continue (a resumed job's, from its checkpoint); None starts a new one."""
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self.plot_path = run_dir / PLOT_FILE
        self.experts_path = run_dir / routing.EXPERTS_FILE
        self.window = job.args.window_size
        self.plots = job.config.logger.plots
        self.wandb_run = None
        self.once = {}
        if not enabled:
            return
        for path in (self.path, self.experts_path):
            kept = [row for row in read_rows(path) if row["step"] <= start_step]
            path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        constants = run_constants(job)
        self.once = constants if start_step == 0 else {}  # a resumed run kept its first row
        if job.config.logger.mode != "disabled":
            self.wandb_run = _start_wandb(job, run_dir, constants, run_id)
            if start_step == 0 and self.wandb_run is not None:
                dashboards.log_layout_table(self.wandb_run, job.layout)

    @property
    def run_id(self) -> str | None:
        """The wandb run's id (kept in checkpoints, so that a resumed job continues the same run)."""
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, row: dict) -> None:
        """A training row (``step`` and scalars); the first one of a run also carries ``run_constants``."""
        self._write(row, prefix="train", file_only=self.once)
        self.once = {}

    def log_experts(self, step: int, loads: dict[str, list[float]]) -> None:
        """The normalised expert loads of a logged step, per MoE layer, into ``experts.jsonl``."""
        if self.enabled:
            routing.append(self.experts_path, step, loads)

    def log_eval(self, row: dict) -> None:
        """An evaluation row; marked ``"split": "eval"`` in the file and logged under ``eval/`` in wandb (with its
        synthetic accuracies by distance as charts)."""
        self._write({**row, "split": "eval"}, prefix="eval")
        if self.enabled and self.wandb_run is not None:
            dashboards.log_synthetic_charts(self.wandb_run, row)

    def _write(self, row: dict, prefix: str, file_only: dict | None = None) -> None:
        """``row`` to the file and to wandb; ``file_only`` to the file alone (wandb has it in its config)."""
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _finite_or_none(v) for k, v in {**row, **(file_only or {})}.items()}) + "\n")
        if self.wandb_run is not None:
            scalars = {f"{prefix}/{k}": v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
            self.wandb_run.log(scalars, step=row["step"])

    def summarize(self, summary: dict) -> None:
        if self.wandb_run is not None:
            self.wandb_run.summary.update(summary)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.plots:
            self._draw()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def _draw(self) -> None:
        """The PNGs of the run (and wandb's copies of the dashboards), from metrics.jsonl and experts.jsonl."""
        rows = read_rows(self.path)
        plot_losses(rows, self.plot_path)
        plot_health(rows, self.path.parent / HEALTH_PLOT_FILE)
        dashboards.draw_and_log(rows, self.path.parent, self.window, self.wandb_run)
        experts_plot, routing_plot = (self.path.parent / name for name in (routing.EXPERTS_PLOT, routing.ROUTING_PLOT))
        drawn = {name: path for name, path, done in (
            ("experts", experts_plot, routing.plot_experts(self.experts_path, experts_plot)),
            ("routing", routing_plot, routing.plot_routing(rows, routing_plot))) if done}
        if drawn and self.wandb_run is not None:
            import wandb

            self.wandb_run.log({f"dashboards/{name}": wandb.Image(str(path)) for name, path in drawn.items()},
                               step=max((r["step"] for r in rows), default=0))


def _finite_or_none(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def run_constants(job: Job) -> dict:
    """KV-cache bytes and indexer FLOPs per token of the layout (at ``data.seq_len``), and the tokens of one
    optimizer step over all data-parallel ranks (step time = ``tokens_per_step / tokens_per_s``)."""
    seq_len = job.config.data.seq_len
    figures = account(job.args, job.layout, seq_len)
    return {"kv_bytes_per_token": figures["kv_bytes_per_token"],
            "indexer_flops_per_token": figures["indexer_flops_per_token"],
            "tokens_per_step": job.batch.global_batch * seq_len}


def layout_group(layout_name: str) -> str:
    """The layout's name and this Hydra job's ``layout.*`` overrides (e.g. ``v41_scaled decoder.reindex_every=4``):
    the runs of one layout share a wandb group whatever else a sweep varies."""
    from hydra.core.hydra_config import HydraConfig

    task = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    return " ".join([layout_name, *(o.removeprefix("layout.") for o in task if o.startswith("layout."))])


def layout_plan(layout: Layout) -> dict:
    """The layout as the model builds it (the canonical lists the knobs generate, and the layers per mode)."""
    return {"kv_source_layer_ids": list(layout.kv_source_layer_ids),
            "index_source_layer_ids": list(layout.index_source_layer_ids),
            "candidate_source_layer_id": layout.candidate_source_layer_id,
            **{mode.value: n for mode, n in layout.counts().items()}}


def _start_wandb(job: Job, run_dir: Path, constants: dict, run_id: str | None):
    import wandb

    config = job.config
    logger, model, layout = config.logger, config.model.name, config.layout.name
    return wandb.init(
        mode=logger.mode,
        project=logger.project,
        entity=logger.entity,
        name=logger.name or f"{model}-{layout}-{run_dir.name}",
        group=logger.group or layout_group(layout),
        tags=list(dict.fromkeys([*logger.tags, layout, model])),
        config={**plain(config), "layout_plan": layout_plan(job.layout), "run_constants": constants},
        dir=str(run_dir),
        id=run_id,
        resume="allow" if run_id else None,
        settings=wandb.Settings(quiet=True),  # the closing summary is ours (train/run/app.py)
    )


def plot_losses(rows: list[dict], path: Path) -> None:
    """Training loss (total and LM), per-source indexer KL, and held-out LM loss against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("split") != "eval"]
    evals = [r for r in rows if r.get("split") == "eval"]
    fig, (lm_ax, kl_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("loss", "train loss"), ("lm_loss", "train LM loss")):
        lm_ax.plot(*series_of(train, key), label=label, lw=1)
    if evals:
        lm_ax.plot(*series_of(evals, "lm_loss"), "o-", label="held-out LM loss")
    lm_ax.set(xlabel="step", ylabel="nats/token", title="loss")
    lm_ax.legend()
    sources = sorted({k for r in train for k in r if k.startswith("indexer_loss/")},
                     key=lambda k: int(k.rsplit("layer", 1)[-1]))
    for key in sources:
        kl_ax.plot(*series_of(train, key), label=key.split("/")[-1], lw=1)
    kl_ax.set(xlabel="step", ylabel="KL", title="indexer loss per index source")
    if sources:
        kl_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
