"""Context extension on CPU with the tiny model: trained at one ``data.seq_len``, continued at 4x it from its weights.

    python bench/context_extension.py --out bench/results/finetune/context_extension.json

Four ``python -m train`` jobs (the commands are in the JSON): (1) ``--steps`` steps at ``--short-len``; (2) its
weights evaluated at 4x the length (``train.init_from``, one step at ``train.lr=0``: the evaluation of the weights as
they are); (3) ``--extend-steps`` steps at 4x from its weights; (4) the same steps at 4x from scratch, for
comparison. Each job's final held-out LM loss is read from its ``metrics.jsonl``. Nothing in the model changes with
the length: positions are doc-relative RoPE (YaRN on compressed layers), so the weights load as they are.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from result_meta import result_meta

COMMON = ["train.eval.probe_examples=0", "logger.mode=disabled", "train.progress=false", "train.eval.batches=16"]


def job(run_dir: Path, *overrides: str) -> dict:
    command = [sys.executable, "-m", "train", *COMMON, f"hydra.run.dir={run_dir}", *overrides]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if r.get("split") == "eval"][-1]
    trained = [r for r in rows if r.get("split") != "eval"]
    return {"command": " ".join(["python -m train", *COMMON, *overrides]), "seconds": round(seconds, 1),
            "steps": trained[-1]["step"], "heldout_lm_loss": final["lm_loss"], "last_train_loss": trained[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--extend-steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("bench/results/finetune/context_extension.json"))
    args = parser.parse_args()
    short, long = args.short_len, 4 * args.short_len
    rows_per_step = 4  # micro-batches of data.seq_len rows: the same tokens per step at both lengths
    at_short = [f"data.seq_len={short}", f"data.micro_batch_size={rows_per_step}"]
    at_long = [f"data.seq_len={long}", f"data.micro_batch_size={rows_per_step * short // long}"]
    extend = [f"train.max_steps={args.extend_steps}", "train.warmup_steps=10", "train.lr=1e-3"]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        weights = f"train.init_from={base / 'short' / 'checkpoints'}"
        results = {
            "short": job(base / "short", *at_short, f"train.max_steps={args.steps}"),
            "short_weights_at_4x": job(base / "as_is", *at_long, weights, "train.lr=0", "train.max_steps=1"),
            "extended": job(base / "extended", *at_long, weights, *extend),
            "scratch_at_4x": job(base / "scratch", *at_long, *extend),
        }
    report = {"what": "tiny model, v41_scaled, stdlib corpus: final held-out LM loss of each job at its own "
                      "data.seq_len (the three jobs at long_len evaluate the same held-out batches; the short job's "
                      "are other ones)",
              **result_meta(), "cpu_cores": os.cpu_count(), "short_len": short, "long_len": long, "jobs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, row in results.items():
        print(f"{name:<22} {row['steps']:>4} steps  held-out LM loss {row['heldout_lm_loss']:.4f}  "
              f"({row['seconds']} s)")


if __name__ == "__main__":
    main()
