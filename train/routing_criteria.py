"""The routing criteria of issue 54 for any MoE run, from its ``metrics.jsonl`` (train/observe/routing.py's series):

    python -m train.routing_criteria RUN_DIR [--dense DENSE_RUN_DIR] [--window 100]

- ``init``: at step 1 (the loads of the first forward, before any update; every run logs step 1, whatever
  ``train.log_every``) every layer's ``load_max_over_mean`` is <= ``INIT_MAX``;
- ``end``: over the last ``window`` steps, each layer's ``load_max_over_mean`` averaged over the logged rows is <=
  ``END_MEAN_MAX``, and no logged row has an idle expert in any layer (``idle_experts``; a run that predates that
  series cannot pass);
- ``persistent`` (reported, not part of ``healthy``; when the run directory has ``experts.jsonl``): over the same
  window, each layer's expert loads summed over the logged steps, then max/mean. An expert that is busy step after
  step shows here, and the balance bias is what corrects it (a rate too slow for the run leaves it); what the per-step
  mean adds on top is the rows' own spread (a step's tokens route by their text), which no bias removes;
- ``loss`` (reported, not part of ``healthy``): the run's LM loss against a dense-FFN run's at the same step (the
  last held-out evaluation both have at one step, else the training LM loss averaged over the last ``window``
  steps both logged), with the tokens a step of each; the issue asks for the MoE below the dense model, or a
  reason why not.
``healthy``: ``init`` and ``end`` hold. Prints one JSON object; exit status 0 when healthy, 1 when not.
"""
import json
import statistics
import sys
from pathlib import Path

from train.observe.metrics import METRICS_FILE, read_rows
from train.observe.routing import EXPERTS_FILE, PREFIX

INIT_MAX = 2.0
END_MEAN_MAX = 1.3
WINDOW = 100


def layer_series(row: dict, stat: str) -> dict[str, float]:
    """``{layer: value}`` of one row's ``moe/<layer>/<stat>``."""
    return {key[len(PREFIX):-len(stat) - 1]: value for key, value in row.items()
            if key.startswith(PREFIX) and key.endswith("/" + stat) and value is not None}


def training_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("split") != "eval"]


def init_criterion(train: list[dict]) -> dict:
    first = next((r for r in train if layer_series(r, "load_max_over_mean")), None)
    if first is None or first["step"] != 1:
        return {"holds": False, "why": "no routing series at step 1 (a run from before step 1 was always logged: use "
                                       "train.log_every=1)"}
    loads = layer_series(first, "load_max_over_mean")
    over = {layer: v for layer, v in loads.items() if v > INIT_MAX}
    return {"holds": not over, "limit": INIT_MAX, "worst_layer": max(loads, key=loads.get),
            "worst": max(loads.values()), "layers_over": dict(sorted(over.items()))}


def end_criterion(train: list[dict], window: int) -> dict:
    logged = [r for r in train if layer_series(r, "load_max_over_mean")]
    if not logged or logged[-1]["step"] < window:
        return {"holds": False, "why": f"the run logged routing for {logged[-1]['step'] if logged else 0} steps, "
                                       f"fewer than the window of {window}"}
    last = [r for r in logged if r["step"] > logged[-1]["step"] - window]
    means = {layer: statistics.fmean(layer_series(r, "load_max_over_mean")[layer] for r in last)
             for layer in layer_series(last[-1], "load_max_over_mean")}
    if any(not layer_series(r, "idle_experts") for r in last):
        idle, why = None, "rows without moe/<layer>/idle_experts: idle experts not logged"
    else:
        idle, why = {f"{layer}@{r['step']}": int(n) for r in last for layer, n in layer_series(r, "idle_experts").items()
                     if n > 0}, None
    over = {layer: v for layer, v in means.items() if v > END_MEAN_MAX}
    result = {"holds": not over and idle == {}, "steps": [last[0]["step"], last[-1]["step"]], "rows": len(last),
              "limit": END_MEAN_MAX, "mean_max_over_mean": dict(sorted(means.items())),
              "layers_over": dict(sorted(over.items())), "idle": idle}
    return {**result, "why": why} if why else result


def persistent_imbalance(loads: list[dict], window: int) -> dict:
    """Per layer, max/mean of the expert loads (``experts.jsonl`` rows) summed over the last ``window`` steps."""
    last = [r for r in loads if r["step"] > loads[-1]["step"] - window]
    summed = {}
    for layer in last[-1]["loads"]:
        totals = [sum(column) for column in zip(*(r["loads"][layer] for r in last if layer in r["loads"]))]
        summed[layer] = max(totals) / statistics.fmean(totals)
    return {"steps": [last[0]["step"], last[-1]["step"]], "rows": len(last),
            "summed_max_over_mean": dict(sorted(summed.items()))}


def comparable_loss(rows: list[dict], dense: list[dict], window: int) -> dict:
    """The LM losses of the two runs at the same steps: held-out at the last common evaluation step, else the
    training LM loss over the last ``window`` steps both logged."""
    def evals(run):
        return {r["step"]: r["lm_loss"] for r in run if r.get("split") == "eval" and r.get("lm_loss") is not None}

    def trains(run):
        return {r["step"]: r["lm_loss"] for r in training_rows(run) if r.get("lm_loss") is not None}

    def per_step(run):
        return next((r["tokens_per_step"] for r in run if "tokens_per_step" in r), None)

    tokens = {"tokens_per_step": per_step(rows), "dense_tokens_per_step": per_step(dense)}
    common = sorted(set(evals(rows)) & set(evals(dense)))
    if common:
        step = common[-1]
        moe, base = evals(rows)[step], evals(dense)[step]
        return {"below_dense": moe < base, "heldout_lm_loss": moe, "dense_heldout_lm_loss": base, "step": step,
                **tokens}
    steps = sorted(set(trains(rows)) & set(trains(dense)))
    if not steps:
        return {"below_dense": None, "why": "the runs share no logged step", **tokens}
    steps = [s for s in steps if s > steps[-1] - window]
    moe, base = (statistics.fmean(trains(run)[s] for s in steps) for run in (rows, dense))
    return {"below_dense": moe < base, "train_lm_loss": moe, "dense_train_lm_loss": base,
            "steps": [steps[0], steps[-1]], **tokens}


def criteria(rows: list[dict], dense: list[dict] | None = None, window: int = WINDOW,
             loads: list[dict] | None = None) -> dict:
    train = training_rows(rows)
    result = {"init": init_criterion(train), "end": end_criterion(train, window)}
    if loads:
        result["persistent"] = persistent_imbalance(loads, window)
    if dense is not None:
        result["loss"] = comparable_loss(rows, dense, window)
    result["healthy"] = result["init"]["holds"] and result["end"]["holds"]
    return result


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m train.routing_criteria", description=__doc__.split("\n")[0])
    parser.add_argument("run")
    parser.add_argument("--dense", default=None, help="a dense-FFN run of the same tokens a step, to compare loss")
    parser.add_argument("--window", type=int, default=WINDOW, help="the last steps the end criterion averages")
    a = parser.parse_args(argv)
    rows = read_rows(Path(a.run) / METRICS_FILE)
    if not rows:
        print(f"{a.run}: no {METRICS_FILE} there: pass a run directory", file=sys.stderr)
        return 2
    dense = read_rows(Path(a.dense) / METRICS_FILE) if a.dense else None
    loads = read_rows(Path(a.run) / EXPERTS_FILE)
    result = {"run": a.run, **criteria(rows, dense, a.window, loads)}
    print(json.dumps(result))
    return 0 if result["healthy"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
