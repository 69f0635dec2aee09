"""Recipe exploration for the synthetic tasks: several CPU training runs side by side, each a plain
``python -m train data=synthetic <row's overrides>``, and their evaluation curves in one JSON.

    python bench/synthetic_explore.py --out FILE.json [--jobs 8] [--threads 2] [--budget 570] \
        [--seeds 0,1,2] --row "name: override override ..." [--row ...]

``--seeds`` crosses every row with those training seeds (rows ``<name>_s<seed>`` with ``train.seed=<seed>``, seed by
seed, so that a budget cut leaves every row as many seeds): a recipe has to hold for every seed, not for one. Rows
run ``--jobs`` at a time, each with ``OMP_NUM_THREADS=--threads`` and ``train.device=--device`` (cpu by default: a
machine with more cores explores several recipes in the time one takes; ``cuda`` runs the rows side by side on one
GPU). Accuracy per step depends on the CPU and the thread count
through rounding (thread_determinism.json), so a recipe is checked at the threads and on the CPUs it is meant for.
A row still running when ``--budget`` seconds are spent is stopped with SIGTERM and keeps the curve it has. The JSON
(rewritten after every row) holds this script's command, machine and date (``result_meta``), and per row: its
overrides, exit status, wall time, median training tokens/s, and the curve [step, MQAR accuracy beyond the window]
from the run's eval rows in ``metrics.jsonl``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from result_meta import result_meta
from synthetic_sweep import cpu_model

ROOT = Path(__file__).resolve().parent.parent
METRIC = "synthetic/mqar_acc_beyond_window"


def parse_row(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition(":")
    if not name.strip() or not overrides.strip():
        raise SystemExit(f"--row {text!r}: expected 'name: override override ...'")
    return name.strip(), overrides.split()


def summary(run_dir: Path) -> dict:
    """Curve, median tokens/s, last loss and the last evaluation's synthetic-task figures (every task and distance
    bucket) of a run from its metrics.jsonl (whatever it wrote so far)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    evals = [r for r in rows if r.get(METRIC) is not None]
    curve = [[r["step"], round(r[METRIC], 4)] for r in evals]
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    losses = [r["loss"] for r in rows if "tokens_per_s" in r]
    return {"curve": curve, "median_tok_s": statistics.median(speeds) if speeds else None,
            "steps": len(speeds), "last_loss": losses[-1] if losses else None,
            "last_eval": {k: v for k, v in evals[-1].items() if k.startswith("synthetic/")} if evals else {}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row", action="append", required=True, help="'name: override override ...'")
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=570.0, help="seconds for all rows")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seeds", default=None, help="comma-separated training seeds to cross every row with")
    a = p.parse_args()
    rows = [parse_row(text) for text in a.row]
    if a.seeds:
        seeds = [int(seed) for seed in a.seeds.split(",")]
        rows = [(f"{name}_s{seed}", [*overrides, f"train.seed={seed}"]) for seed in seeds for name, overrides in rows]
    scratch = Path(tempfile.mkdtemp(prefix="synthetic_explore_"))
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    result = {**result_meta(), "cpu": cpu_model(), "cpus": os.cpu_count(), "device": a.device, "jobs": a.jobs,
              "threads": a.threads, "metric": METRIC, "rows": []}
    pending, running, start = list(rows), {}, time.monotonic()

    def finish(name, overrides, proc, began, stopped=False):
        record = {"name": name, "overrides": overrides, "returncode": proc.returncode, "stopped_at_budget": stopped,
                  "wall_s": round(time.monotonic() - began, 1), **summary(scratch / name)}
        result["rows"].append(record)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(json.dumps({k: record[k] for k in ("name", "wall_s", "median_tok_s", "curve")}), flush=True)

    while pending or running:
        while pending and len(running) < a.jobs:
            name, overrides = pending.pop(0)
            command = [sys.executable, "-m", "train", "data=synthetic", *overrides, f"train.device={a.device}",
                       "train.progress=false", f"hydra.run.dir={scratch / name}"]
            with open(scratch / f"{name}.log", "w") as log:  # the child keeps its own descriptor
                proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
            running[name] = (overrides, proc, time.monotonic())
        time.sleep(2)
        out_of_time = time.monotonic() - start > a.budget
        for name, (overrides, proc, began) in list(running.items()):
            done = proc.poll() is not None
            if out_of_time and not done:
                proc.terminate()
                proc.wait()
            if done or out_of_time:
                finish(name, overrides, proc, began, stopped=not done)
                del running[name]
        if out_of_time:
            pending.clear()
    print(f"logs: {scratch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
