"""``python -m train.report [sweep dir]``: which layout? The runs of a sweep, quality against cost.

A sweep dir is what ``python -m train -m ...`` writes (``multirun/<date>/<time>/`` with one numbered dir per job),
or any dir with run dirs below it; without one, the newest ``multirun/<date>/<time>`` under the current dir.
Everything comes from the run dirs themselves, so no wandb account is needed:
- quality from ``metrics.jsonl``: the last evaluation's held-out LM loss, passkey and MQAR accuracy at each
  probed length, index recall averaged over the reading layers, and with ``data=synthetic`` each trained task's
  accuracy, its accuracy beyond the sliding window and its chance level;
- cost from the resolved ``config.yaml``: KV bytes and indexer FLOPs per token (``model.accounting``, at the
  run's ``data.seq_len``), and the median step time and tokens/s of its training steps;
- names from ``.hydra/overrides.yaml``: the layout and the overrides that differ between runs (those common to
  all runs are printed once).

Noise. A tiny model trained for minutes differs from another by little, and a table of one number per run ranks
them regardless. So the held-out LM loss carries its standard error over the evaluation batches (``lm_loss_se``,
``train/evaluation/evaluate.py``), and a run whose loss lies within ``NOISE_SIGMAS`` standard errors of the difference
from the best run's is marked "within noise"; an accuracy within ``NOISE_SIGMAS`` binomial standard errors of its chance
level (probes: ``train.eval.probe_examples`` samples; synthetic tasks: ``data.synthetic.eval_examples``) is marked
"(chance)": such differences do not tell layouts apart. With several seeds per setting (``train.seed=0,1,2`` in the
sweep) a second table gives each setting's mean and standard deviation over its seeds, and marks means within
``NOISE_SIGMAS`` standard errors of the best mean; one run per setting measures no run-to-run variation at all.
Writes ``<sweep dir>/report.md`` (the tables, also printed), ``<sweep dir>/report.json`` (each run's figures) and
``<sweep dir>/report.png``.
"""
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from model.accounting import account
from model.config import ModelArgs
from model.layout import layout_from_config
from train.observe.metrics import METRICS_FILE, read_rows

CONFIG_FILE = "config.yaml"
OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
_PROBE_KEY = re.compile(r"(passkey|mqar)_acc/len(\d+)")
NOISE_SIGMAS = 2.0
SEED_KEYS = ("train.seed",)  # overrides that only reseed a run: runs differing in them alone are one setting
_SYNTHETIC_KEY = re.compile(r"synthetic/(\w+)_(acc|acc_beyond_window|chance)")


@dataclass
class Run:
    """One run dir: its name (path below the sweep dir, e.g. the job number), resolved config, Hydra overrides
    and metrics rows."""

    name: str
    cfg: DictConfig
    overrides: list[str]
    rows: list[dict]


def find_runs(root: Path) -> list[Run]:
    """Every dir under ``root`` (or ``root`` itself) holding both a config and metrics, in job-number order."""
    if not root.is_dir():
        raise SystemExit(f"error: {root} is not a directory")
    dirs = {p.parent for p in root.rglob(METRICS_FILE) if (p.parent / CONFIG_FILE).is_file()}
    if not dirs:
        raise SystemExit(f"error: no runs under {root}: a run dir holds {CONFIG_FILE} and {METRICS_FILE} "
                         "(python -m train -m ... writes one per job into multirun/<date>/<time>/<job>/)")
    return [_load(d, d.relative_to(root)) for d in sorted(dirs, key=lambda d: _natural(d.relative_to(root)))]


def _natural(path: Path) -> list:
    """Sort key that puts job 10 after job 9."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _load(path: Path, name: Path) -> Run:
    overrides_path = path / OVERRIDES_FILE
    overrides = [str(o) for o in OmegaConf.load(overrides_path)] if overrides_path.is_file() else []
    return Run(str(name) if name.parts else path.name, OmegaConf.load(path / CONFIG_FILE), overrides,
               read_rows(path / METRICS_FILE))


def probe_scores(row: dict) -> dict[str, float]:
    """``{"passkey@<L>": acc, "mqar@<L>": acc}`` from the ``<kind>_acc/len<L>`` keys of an eval row."""
    scores = {}
    for key, value in row.items():
        match = _PROBE_KEY.fullmatch(key)
        if match and value is not None:
            scores[f"{match.group(1)}@{match.group(2)}"] = value
    return scores


def synthetic_scores(row: dict) -> dict[str, dict[str, float]]:
    """``{task: {"acc", "acc_beyond_window", "chance"}}`` from the ``synthetic/<task>_*`` keys of an eval row."""
    scores: dict[str, dict[str, float]] = {}
    for key, value in row.items():
        match = _SYNTHETIC_KEY.fullmatch(key)
        if match:
            scores.setdefault(match.group(1), {})[match.group(2)] = math.nan if value is None else value
    return scores


def _mean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def summarize(run: Run) -> dict:
    """The figures of one run: quality from its last evaluation, cost from its config and training rows."""
    cfg = run.cfg
    train_rows = [r for r in run.rows if r.get("split") != "eval" and r.get("tokens_per_s")]
    evals = [r for r in run.rows if r.get("split") == "eval"]
    final = evals[-1] if evals else {}
    figures = account(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout), int(cfg.data.seq_len))
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in train_rows) if train_rows else math.nan
    return {
        "layout": cfg.layout.name,
        "steps": train_rows[-1]["step"] if train_rows else 0,
        "eval_lm_loss": final.get("lm_loss", math.nan),
        "eval_lm_loss_se": _number(final.get("lm_loss_se")),
        "probes": probe_scores(final),
        "probe_chance": _probe_chance(cfg),
        "probe_examples": int(OmegaConf.select(cfg, "train.eval.probe_examples", default=0) or 0),
        "synthetic_examples": int(OmegaConf.select(cfg, "data.synthetic.eval_examples", default=0) or 0),
        "synthetic": synthetic_scores(final),
        "index_recall": _mean(v for k, v in final.items() if k.startswith("index_recall/")),
        "seq_len": int(cfg.data.seq_len),
        "kv_bytes_per_token": figures["kv_bytes_per_token"],
        "indexer_flops_per_token": figures["indexer_flops_per_token"],
        "params": figures["params_total"],
        "tokens_per_s": tokens_per_s,
        "step_time_s": _tokens_per_step(run.rows) / tokens_per_s,
    }


def _number(value) -> float:
    return math.nan if value is None else float(value)


def _probe_chance(cfg: DictConfig) -> dict[str, float]:
    """The chance level of each probe kind (``passkey``, ``mqar``) with the run's tokenizer."""
    from train.evaluation.evaluate import data_tokenizer
    from train.evaluation.probes import chance_levels

    try:
        levels = chance_levels(data_tokenizer(cfg.data))
    except (OSError, ValueError):  # the run's tokenizer file is not on this machine
        return {}
    return {kind.removesuffix("_acc"): level for kind, level in levels.items()}


def at_chance(accuracy: float | None, chance: float | None, examples: int) -> bool:
    """Whether ``accuracy`` over ``examples`` samples lies within ``NOISE_SIGMAS`` binomial standard errors of
    ``chance`` (above it, or anywhere below)."""
    if accuracy is None or chance is None or math.isnan(accuracy) or math.isnan(chance) or examples < 1:
        return False
    return accuracy <= chance + NOISE_SIGMAS * math.sqrt(chance * (1 - chance) / examples)


def loss_marks(losses: list[float], errors: list[float]) -> list[str]:
    """Each loss against the lowest: ``best``, ``+d (within noise)`` when ``d`` is within ``NOISE_SIGMAS``
    standard errors of the difference (``sqrt(se^2 + se_best^2)``), ``+d`` beyond it, ``+d (spread unknown)``
    without standard errors (one evaluation batch)."""
    finite = [i for i, loss in enumerate(losses) if math.isfinite(loss)]
    if not finite:
        return ["" for _ in losses]
    best = min(finite, key=lambda i: losses[i])
    marks = []
    for loss, error in zip(losses, errors):
        if not math.isfinite(loss):
            marks.append("")
            continue
        gap = loss - losses[best]
        noise = NOISE_SIGMAS * math.sqrt(error ** 2 + errors[best] ** 2)
        marks.append("best" if gap == 0 else f"+{gap:.4f}" + (" (spread unknown)" if math.isnan(noise) else
                                                             " (within noise)" if gap <= noise else ""))
    return marks


def _tokens_per_step(rows: list[dict]) -> float:
    """Tokens of one optimizer step over all ranks, as the run logged it once (``tokens_per_s`` counts all
    ranks too); NaN for a run that did not."""
    return next((r["tokens_per_step"] for r in rows if "tokens_per_step" in r), math.nan)


def run_labels(runs: list[Run]) -> tuple[list[str], list[str]]:
    """Each run's overrides that not every run shares (its layout is a column of its own), and the shared ones."""
    common = set.intersection(*(set(r.overrides) for r in runs)) if len(runs) > 1 else set()
    labels = [" ".join(o for o in r.overrides if o not in common and not o.startswith("layout=")) for r in runs]
    return labels, [o for o in runs[0].overrides if o in common]


def _fmt(value, digits: int) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def probe_columns(summaries: list[dict]) -> list[str]:
    """``passkey@L`` then ``mqar@L`` columns, each by length."""
    keys = {k for s in summaries for k in s["probes"]}
    return sorted(keys, key=lambda k: (k.split("@")[0] != "passkey", int(k.split("@")[1])))


SYNTHETIC_COLUMNS = (("acc", "acc"), ("acc_beyond_window", "beyond window"), ("chance", "chance"))


def synthetic_tasks(summaries: list[dict]) -> list[str]:
    """The synthetic tasks any run evaluated, in ``train.data.synthetic.TASKS`` order."""
    from train.data.synthetic import TASKS

    present = {task for s in summaries for task in s["synthetic"]}
    return [task for task in TASKS if task in present] + sorted(present - set(TASKS))


def markdown(runs: list[Run], summaries: list[dict]) -> str:
    labels, common = run_labels(runs)
    probes = probe_columns(summaries)
    tasks = synthetic_tasks(summaries)
    head = ["run", "layout", "overrides", "steps", "eval LM loss", "± SE", "vs best", *probes,
            *(f"{task} {title}" for task in tasks for _, title in SYNTHETIC_COLUMNS), "index recall", "KV B/token",
            "indexer MFLOP/token", "seq_len", "params M", "step s", "tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    settings = seed_groups(runs)
    seeded = any(len(members) > 1 for members in settings.values())
    marks = loss_marks([s["eval_lm_loss"] for s in summaries], [s["eval_lm_loss_se"] for s in summaries])
    for run, label, s, mark in zip(runs, labels, summaries, marks):
        cells = [run.name, s["layout"], f"`{label}`" if label else "", str(s["steps"]),
                 _fmt(s["eval_lm_loss"], 4), _fmt(s["eval_lm_loss_se"], 4), mark,
                 *(_probe_cell(s, p) for p in probes),
                 *(_synthetic_cell(s, task, key) for task in tasks for key, _ in SYNTHETIC_COLUMNS),
                 _fmt(s["index_recall"], 3), _fmt(s["kv_bytes_per_token"], 1),
                 _fmt(s["indexer_flops_per_token"] / 1e6, 3), str(s["seq_len"]), _fmt(s["params"] / 1e6, 2),
                 _fmt(s["step_time_s"], 3), _fmt(s["tokens_per_s"], 0)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = ["", "Quality from each run's last evaluation (index recall: mean over reading layers; synthetic tasks: "
             "share of answer tokens right, over all answers and over those whose source lies beyond the sliding "
             "window, and the chance level of uniform guessing); KV bytes and indexer FLOPs per token from the "
             "accounting at the run's seq_len; step time and tokens/s: median over training steps.",
             "", f"Noise: ± SE is the held-out LM loss's standard error over its evaluation batches; a run marked "
             f"'within noise' is less than {NOISE_SIGMAS:g} standard errors of the difference above the best, and "
             f"an accuracy marked (chance) is within {NOISE_SIGMAS:g} binomial standard errors of its chance level "
             "(over the examples evaluated): these do not tell the runs apart. " + _verdict(summaries, marks, probes,
                                                                                             seeded)]
    if common:
        notes.append("Common overrides: `" + " ".join(common) + "`")
    if seeded:
        notes += ["", seed_table(runs, summaries, settings, probes, tasks)]
    return "\n".join(lines + notes) + "\n"


def _probe_cell(summary: dict, column: str) -> str:
    value = summary["probes"].get(column)
    chance = summary["probe_chance"].get(column.split("@")[0])
    return _fmt(value, 3) + (" (chance)" if at_chance(value, chance, summary["probe_examples"]) else "")


def _synthetic_cell(summary: dict, task: str, key: str) -> str:
    scores = summary["synthetic"].get(task, {})
    value = scores.get(key)
    marked = key != "chance" and at_chance(value, scores.get("chance"), summary["synthetic_examples"])
    return _fmt(value, 3) + (" (chance)" if marked else "")


def _verdict(summaries: list[dict], marks: list[str], probes: list[str], seeded: bool) -> str:
    """What this evaluation can tell apart, in a sentence or two."""
    said = []
    runs = sum(1 for m in marks if m)
    tied = sum(1 for m in marks if m == "best" or "within noise" in m)
    if runs > 1 and tied == runs:
        said.append("Every run's held-out loss is within noise of the best: the loss does not rank them.")
    elif runs > 1 and any("spread unknown" in m for m in marks):
        said.append("With one evaluation batch the loss has no spread (train.eval.batches > 1 measures it).")
    if probes and all(at_chance(s["probes"].get(p), s["probe_chance"].get(p.split("@")[0]), s["probe_examples"])
                      for s in summaries for p in probes if p in s["probes"]):
        said.append("Every probe is at chance: the probes do not rank these runs (a tiny model trained for minutes "
                    "does not retrieve; data=synthetic trains retrieval).")
    if len(summaries) > 1 and not seeded:
        said.append("One run per setting measures no run-to-run variation: sweep train.seed=0,1,2 to see it.")
    return " ".join(said)


def seed_groups(runs: list[Run]) -> dict[tuple[str, ...], list[int]]:
    """The runs of each setting: runs whose overrides differ only in ``SEED_KEYS``, in order of first run."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, run in enumerate(runs):
        key = tuple(o for o in run.overrides if not o.startswith(tuple(f"{k}=" for k in SEED_KEYS)))
        groups.setdefault(key, []).append(i)
    return groups


def _spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation of the finite ``values`` (NaN where too few)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def _mean_sd(values: list[float], digits: int) -> str:
    mean, sd = _spread(values)
    return _fmt(mean, digits) + (f" ± {sd:.{digits}f}" if math.isfinite(sd) else "")


def seed_table(runs: list[Run], summaries: list[dict], settings: dict, probes: list[str], tasks: list[str]) -> str:
    """One row per setting: the mean ± standard deviation over its seeds of the held-out loss, the probes and the
    synthetic accuracies; a mean loss within ``NOISE_SIGMAS`` standard errors of the difference of the best mean is
    marked."""
    head = ["runs", "layout", "overrides", "seeds", "eval LM loss", "vs best", *probes,
            *(f"{task} {title}" for task in tasks for key, title in SYNTHETIC_COLUMNS if key != "chance"),
            "index recall"]
    lines = [f"Over seeds ({', '.join(SEED_KEYS)}): mean ± standard deviation per setting", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = list(settings.values())
    losses = [[summaries[i]["eval_lm_loss"] for i in members] for members in groups]
    means = [_spread(values)[0] for values in losses]
    errors = [_spread(values)[1] / math.sqrt(len(values)) if len(values) > 1 else math.nan for values in losses]
    labels, _ = run_labels(runs)
    for members, mark in zip(groups, loss_marks(means, errors)):
        first = summaries[members[0]]
        label = " ".join(o for o in labels[members[0]].split() if not o.startswith(tuple(f"{k}=" for k in SEED_KEYS)))
        cells = [",".join(runs[i].name for i in members), first["layout"], f"`{label}`" if label else "",
                 str(len(members)), _mean_sd([summaries[i]["eval_lm_loss"] for i in members], 4), mark,
                 *(_mean_sd([summaries[i]["probes"].get(p, math.nan) for i in members], 3) for p in probes),
                 *(_mean_sd([summaries[i]["synthetic"].get(task, {}).get(key, math.nan) for i in members], 3)
                   for task in tasks for key, _ in SYNTHETIC_COLUMNS if key != "chance"),
                 _mean_sd([summaries[i]["index_recall"] for i in members], 3)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[Run], summaries: list[dict], path: Path) -> None:
    """Quality (rows: held-out LM loss, and the probes' retrieval and the index recall where some run has them)
    against cost (columns), one colour per run; with synthetic tasks, a last row of their accuracy per run (all
    answers, and those beyond the window) against chance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, _ = run_labels(runs)
    points = [{**s, "retrieval": _mean(s["probes"].values()), "indexer_mflops": s["indexer_flops_per_token"] / 1e6}
              for s in summaries]
    qualities = [(q, label) for q, label in (("eval_lm_loss", "held-out LM loss"),
                                             ("retrieval", "retrieval accuracy\n(mean of probes)"),
                                             ("index_recall", "index recall (mean)"))
                 if q == "eval_lm_loss" or any(math.isfinite(p[q]) for p in points)]  # no empty panels
    costs = [("kv_bytes_per_token", "KV bytes / token"), ("indexer_mflops", "indexer MFLOP / token"),
             ("step_time_s", "step time (s)")]
    tasks = synthetic_tasks(summaries)[:len(costs)]
    fig, axes = plt.subplots(len(qualities) + bool(tasks), len(costs),
                             figsize=(13, 3.3 * (len(qualities) + bool(tasks))), squeeze=False)
    for run, label, s, point in zip(runs, labels, summaries, points):
        name = f"{run.name}: {s['layout']} {label}".rstrip()
        for (q, _), row in zip(qualities, axes):
            for (c, _), ax in zip(costs, row):
                ax.scatter(point[c], point[q], s=50, label=name)  # a NaN (no evaluation yet) draws nothing
                if math.isnan(point[c]) or math.isnan(point[q]):
                    continue
                ax.annotate(run.name, (point[c], point[q]), xytext=(4, 4), textcoords="offset points",
                            fontsize=8)
    for (_, q_label), row in zip(qualities, axes):
        for (_, c_label), ax in zip(costs, row):
            ax.set(xlabel=c_label, ylabel=q_label)
            ax.grid(alpha=0.3)
    if tasks:
        for ax, task in zip(axes[-1], tasks):
            _synthetic_bars(ax, task, runs, summaries)
        for ax in axes[-1][len(tasks):]:
            ax.axis("off")
    handles, names = axes[0][0].get_legend_handles_labels()
    columns = max(1, min(3, len(names), 150 // max(len(n) for n in names)))  # long override lists: fewer columns
    fig.legend(handles, names, loc="lower center", ncol=columns, fontsize=8)
    fig.tight_layout(rect=(0, 0.02 + 0.022 * math.ceil(len(names) / columns), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _synthetic_bars(ax, task: str, runs: list[Run], summaries: list[dict]) -> None:
    """Per run: the task's accuracy over all answers and beyond the window, with its chance level dashed."""
    width = 0.38
    for i, s in enumerate(summaries):
        scores = s["synthetic"].get(task, {})
        for offset, key, color in ((-width / 2, "acc", "tab:blue"), (width / 2, "acc_beyond_window", "tab:orange")):
            value = scores.get(key, math.nan)
            ax.bar(i + offset, 0 if math.isnan(value) else value, width, color=color,
                   label={"acc": "all answers", "acc_beyond_window": "beyond the window"}[key] if i == 0 else None)
        chance = scores.get("chance", math.nan)
        ax.hlines(chance, i - width, i + width, colors="k", linestyles="--", label="chance" if i == 0 else None)
    ax.set_xticks(range(len(runs)), [f"{run.name}: {s['layout']}" for run, s in zip(runs, summaries)],
                  rotation=20, ha="right", fontsize=8)
    ax.set(ylim=(0, 1.02), ylabel="accuracy", title=f"synthetic {task}")
    ax.legend(fontsize=7, loc="upper right")


def report(sweep_dir: Path) -> tuple[str, list[dict]]:
    """Write ``report.md`` and ``report.png`` into ``sweep_dir``; return the table and each run's figures."""
    runs = find_runs(sweep_dir)
    summaries = [summarize(run) for run in runs]
    table = markdown(runs, summaries)
    (sweep_dir / "report.md").write_text(table)
    records = [{"run": run.name, "overrides": run.overrides, **s} for run, s in zip(runs, summaries)]
    (sweep_dir / "report.json").write_text(json.dumps(_strict(records), indent=1) + "\n")
    plot(runs, summaries, sweep_dir / "report.png")
    return table, summaries


def _strict(value):
    """``value`` with NaN and infinities as None, so that the JSON is strict."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def newest_sweep(multirun: Path = Path("multirun")) -> Path:
    """The newest ``multirun/<date>/<time>`` (Hydra's default sweep dir, relative to where the sweep ran)."""
    sweeps = sorted(p for p in multirun.glob("*/*") if p.is_dir())
    if not sweeps:
        raise SystemExit(f"error: no sweep under {multirun.resolve()} — run `python -m train -m ...` here first, or "
                         "give the sweep dir: python -m train.report <sweep dir>")
    return sweeps[-1]


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise SystemExit("usage: python -m train.report [sweep dir]  (default: the newest multirun/<date>/<time>)")
    sweep_dir = Path(argv[0]) if argv else newest_sweep()
    table, _ = report(sweep_dir)
    print(table)
    print(f"written: {sweep_dir / 'report.md'}, {sweep_dir / 'report.json'}, {sweep_dir / 'report.png'}")


if __name__ == "__main__":
    main(sys.argv[1:])
