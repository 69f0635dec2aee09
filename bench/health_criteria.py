"""The training-health criteria of docs/TRAINING_HEALTH.md for one run directory, as one JSON (issue 34: a model's
health from step 0, e.g. ``model=small_moe`` at 16K, ``bash bench/gpu_health.sh moe``).

    python bench/health_criteria.py RUN_DIR --warmup N [--out FILE.json]

From the run's ``metrics.jsonl``:
- ``init``: the gradient at initialisation (step 1's, taken before the first update): no parameter group's norm
  (``grad_norm/<group>``, model/groups.py) above the head's. A well-scaled trunk passes the head's O(1) logit error
  back without amplifying it (docs/TRAINING_HEALTH.md, "The cause").
- ``warmup``: the held-out LM loss at every evaluation inside the warm-up (step <= N) below the one before it, the
  first below step 1's training LM loss. The trainer evaluates no earlier than its first ``train.eval.every``
  steps, so step 1's loss (the model at init, on a training batch of the same corpus) stands for the held-out loss
  at init. Also the largest training LM loss inside the warm-up against step 1's (reported, not a criterion: one
  batch's loss is noisier than the held-out one).
- ``after_warmup``: ``train.observe.health.stability`` (issue 11's criteria after the warm-up), when steps ran past it.
``healthy``: ``init`` and ``warmup`` hold (and ``after_warmup`` where it was measured).
"""
import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from result_meta import result_meta  # noqa: E402
from train.observe.health import GRAD_PREFIX, stability  # noqa: E402
from train.observe.metrics import read_rows  # noqa: E402


def init_criterion(first: dict) -> dict:
    """Step 1's group gradient norms against the head's: the largest other group and its ratio to the head."""
    groups = {k.removeprefix(GRAD_PREFIX): v for k, v in first.items() if k.startswith(GRAD_PREFIX) and v is not None}
    if "head" not in groups:
        return {"holds": False, "why": f"step {first.get('step')} has no grad_norm/head"}
    head = groups.pop("head")
    worst = max(groups, key=groups.get) if groups else None
    return {"holds": bool(worst is None or groups[worst] < head), "step": first.get("step"), "head": head,
            "largest_other": worst, "largest_other_norm": groups.get(worst), "ratio_to_head":
            groups[worst] / head if worst is not None and head else None, "groups": dict(sorted(groups.items()))}


def warmup_criterion(train: list[dict], evals: list[dict], warmup_steps: int) -> dict:
    """The held-out LM losses inside the warm-up, each below the one before it (the first below step 1's)."""
    inside = [(r["step"], r["lm_loss"]) for r in evals if r["step"] <= warmup_steps and r.get("lm_loss") is not None]
    first = train[0]["lm_loss"]
    trajectory = [(train[0]["step"], first)] + inside
    rises = [(step, loss) for (_, before), (step, loss) in zip(trajectory, trajectory[1:]) if not loss < before]
    warm = [(r["lm_loss"], r["step"]) for r in train if r["step"] <= warmup_steps and r.get("lm_loss") is not None]
    worst_train = max(warm)
    return {"holds": bool(inside) and not rises, "evaluations": len(inside), "step1_lm_loss": first,
            "heldout_lm_loss": [{"step": s, "lm_loss": v} for s, v in inside], "rises": rises,
            "max_train_lm_loss_in_warmup": worst_train[0], "at_step": worst_train[1]}


def criteria(rows: list[dict], warmup_steps: int) -> dict:
    train = [r for r in rows if r.get("split") != "eval" and r.get("lm_loss") is not None]
    if not train:
        return {"healthy": False, "why": "no training rows in metrics.jsonl"}
    evals = [r for r in rows if r.get("split") == "eval"]
    result = {"steps": train[-1]["step"], "warmup_steps": warmup_steps, "init": init_criterion(train[0]),
              "warmup": warmup_criterion(train, evals, warmup_steps)}
    holds = result["init"]["holds"] and result["warmup"]["holds"]
    if train[-1]["step"] > warmup_steps:
        result["after_warmup"] = stability(rows, warmup_steps)
        holds = holds and result["after_warmup"]["healthy"]
    result["heldout_lm_loss_last"] = next((r["lm_loss"] for r in reversed(evals) if r.get("lm_loss") is not None),
                                          math.nan)
    result["healthy"] = bool(holds)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run")
    p.add_argument("--warmup", type=int, required=True, help="the run's train.warmup_steps")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    result = {**result_meta(), "run": a.run, **criteria(read_rows(Path(a.run) / "metrics.jsonl"), a.warmup)}
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    verdicts = {"init": "holds", "warmup": "holds", "after_warmup": "healthy"}
    print(json.dumps({"healthy": result["healthy"], "steps": result.get("steps"),
                      **{k: result[k][v] for k, v in verdicts.items() if k in result}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
