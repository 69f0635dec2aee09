"""Does the CPU sweep's run depend on the thread count? (issue 42: "deterministic across thread counts where torch
allows, and say which").

    python bench/thread_determinism.py --steps 40 --out bench/results/synthetic_sweep/thread_determinism.json

Runs the README's ablation job (``data=synthetic layout=v41_scaled``) for ``--steps`` steps at 1 and at 2 threads, each
in its own process, once with torch's defaults and once with the settings that pin the CPU kernels' code paths
(``MKL_CBWR=AVX2,STRICT``: MKL's conditional numerical reproducibility, strict; ``ATEN_CPU_CAPABILITY=avx2``: ATen's
vectorised kernels at AVX2 whatever the CPU has), and records, per setting, the first step at which any logged
series (losses, gradient norms, activation RMS) differs between the two thread counts, and which series.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_meta import result_meta  # noqa: E402

SETTINGS = {"defaults": {}, "pinned": {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2"}}
SKIP = ("time", "per_s", "mfu", "rss", "mem", "lr", "tokens")  # wall-clock and bookkeeping series


def run(steps: int, threads: int, env: dict, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "train", "data=synthetic", "layout=v41_scaled", f"train.max_steps={steps}",
           "train.progress=false", "train.eval.every=0", "logger.mode=disabled", f"hydra.run.dir={out}"]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **env, "OMP_NUM_THREADS": str(threads)})
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"step"' in line]


def first_difference(a: list[dict], b: list[dict]) -> dict:
    for x, y in zip(a, b):
        differ = sorted(k for k, v in x.items() if isinstance(v, float) and k in y and v != y[k]
                        and not any(s in k for s in SKIP))
        if differ:
            return {"step": x["step"], "series": differ[:10], "of": len(differ)}
    return {"step": None, "series": [], "of": 0}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    res = {**result_meta(), "cpu": cpu_model(), "steps": a.steps, "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in SETTINGS.items():
            runs = {t: run(a.steps, t, env, Path(tmp) / f"{name}_{t}") for t in (1, 2)}
            res["settings"][name] = {"env": env, "first_difference_1_vs_2_threads": first_difference(runs[1], runs[2]),
                                     "final_loss": {t: r[-1].get("loss") for t, r in runs.items()}}
            print(name, json.dumps(res["settings"][name]), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
