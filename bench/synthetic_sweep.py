"""The README's CPU layout sweep on the synthetic tasks, timed, with its report kept as a result file.

    python bench/synthetic_sweep.py [--out bench/results/synthetic_sweep] [--layouts v41_scaled,window_only_scaled]
                                    [extra overrides ...]

Runs ``python -m train -m layout=<layouts> data=synthetic [overrides]`` exactly as a user would (in a scratch
directory, so Hydra's default ``multirun/<date>/<time>`` is used), then ``python -m train.report`` on the sweep,
and writes into ``--out``: ``report.md``, ``report.json`` and ``report.png`` (the report's own files) and
``sweep.json``: this script's command, machine and date (``result_meta``), the sweep's own command, its wall time,
the CPU, its cores and the 1-minute load average before, during (sampled every 5 s) and after the sweep (the
machine may be shared: a load above the core count means the sweep had less than the whole CPU), the git commit,
each layout's synthetic accuracies, and the issue's acceptance checks (sweep within 10 minutes; MQAR beyond the
window >= 0.8 for the sharing layout and within 0.05 of chance for window-only); it exits non-zero, its files
written, when a check fails.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from result_meta import result_meta

ROOT = Path(__file__).resolve().parent.parent
FILES = ("report.md", "report.json", "report.png")


def cpu_model() -> str:
    """The CPU's name with its family and model numbers: one name ("Intel(R) Xeon(R) Processor") covers CPUs of
    different generations, whose kernels and rounding may differ."""
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return platform.processor() or "unknown"
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first_cpu)}
    vendor, family, model = (fields.get(key, "?") for key in ("vendor_id", "cpu family", "model"))
    return f"{fields.get('model name', 'unknown')} ({vendor} family {family} model {model})"


def torch_threads(env: dict) -> int:
    """The intra-op thread count a job started with ``env`` gets (torch's default: the physical cores)."""
    probe = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    return int(subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout)


def git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return result.stdout.strip() + (" (uncommitted changes)" if dirty else "")


def checks(records: list[dict], wall_s: float) -> dict:
    """The acceptance checks of issue 15 on the sweep's report records (by layout name)."""
    by_layout = {r["layout"]: r["synthetic"].get("mqar", {}) for r in records}
    result = {"sweep_within_10_minutes": wall_s <= 600}
    sharing = by_layout.get("v41_scaled")
    window = by_layout.get("window_only_scaled")
    if sharing:
        result["v41_scaled_mqar_beyond_window_at_least_0.8"] = (sharing.get("acc_beyond_window") or 0) >= 0.8
    if window:
        gap = abs((window.get("acc_beyond_window") or 0) - window["chance"])
        result["window_only_scaled_mqar_beyond_window_within_0.05_of_chance"] = gap <= 0.05
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "synthetic_sweep"))
    parser.add_argument("--layouts", default="v41_scaled,window_only_scaled")
    args, overrides = parser.parse_known_args()
    command = [sys.executable, "-m", "train", "-m", f"layout={args.layouts}", "data=synthetic", *overrides]
    shown = " ".join(["python", "-m", "train", "-m", f"layout={args.layouts}", "data=synthetic", *overrides])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    commit = git_commit()  # before the result files land in the tree
    with tempfile.TemporaryDirectory() as scratch:
        load_before = os.getloadavg()
        start = time.perf_counter()
        sweep, load_during = subprocess.Popen(command, cwd=scratch, env=env), []
        while sweep.poll() is None:
            time.sleep(5)
            load_during.append(os.getloadavg()[0])
        wall_s = time.perf_counter() - start
        load_after = os.getloadavg()
        if sweep.returncode:
            raise SystemExit(f"the sweep failed (exit code {sweep.returncode}): {shown}")
        (sweep_dir,) = Path(scratch, "multirun").glob("*/*")
        subprocess.run([sys.executable, "-m", "train.report", str(sweep_dir)], cwd=scratch, env=env, check=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copy(sweep_dir / name, out / name)
    records = json.loads((out / "report.json").read_text())
    summary = {
        **result_meta(),
        "sweep_command": shown,
        "report_command": "python -m train.report multirun/<date>/<time>",
        "wall_s": round(wall_s, 1),
        "cpu": {"model": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),  # 1 on a shared box: 2 threads on a busy core stall
                "torch_threads": torch_threads(env),  # what each job computes with: rounding depends on it
                "load_1min_before": round(load_before[0], 2), "load_1min_after": round(load_after[0], 2),
                "load_1min_during_mean": round(sum(load_during) / max(1, len(load_during)), 2),
                "load_1min_during_max": round(max(load_during, default=load_before[0]), 2)},
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "synthetic": {r["layout"]: r["synthetic"] for r in records},
        "checks": checks(records, wall_s),
    }
    (out / "sweep.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    failed = [name for name, passed in summary["checks"].items() if not passed]
    if failed:
        raise SystemExit(f"checks failed: {', '.join(failed)} (results kept in {out})")


if __name__ == "__main__":
    main()
