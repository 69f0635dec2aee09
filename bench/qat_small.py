"""Quantisation-aware training at small scale (issue 36): does ``model.qat=true`` make the served model better?

    python bench/qat_small.py --out bench/results/finetune/qat_small.json [--steps 200] [--device cuda] [overrides...]

Two runs of ``python -m train`` from the same seed and data, one plain and one with ``model.qat=true``; then each
trained model is evaluated on the same held-out batches twice, as it trains (no rounding) and as DeepSeek serves it
(the attention activations rounded: ``model/qat.py``). Reported per run: the held-out loss both ways, the KL of the
served model's next-token distribution from the unrounded one and the mean |logit difference| (how far serving
moves the model), and the training losses' last values. What QAT should show: a served loss closer to (or below)
the plain run's served loss, with a smaller served-vs-unrounded distance. Defaults: ``model=tiny`` on the CPU.
"""
import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model import Transformer  # noqa: E402
from model.cli import compose  # noqa: E402
from result_meta import result_meta  # noqa: E402
from train.data.loader import build_loader  # noqa: E402
from train.generate import load  # noqa: E402
from train.loss import IGNORE_INDEX  # noqa: E402


def train(run_dir: Path, steps: int, qat: bool, overrides: list[str]) -> float:
    """One training run; its wall seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "train", *overrides, f"train.max_steps={steps}",
                    f"model.qat={str(qat).lower()}", "logger.mode=disabled", f"hydra.run.dir={run_dir}"],
                   cwd=ROOT, check=True)
    return time.perf_counter() - start


@torch.no_grad()
def evaluate(run_dir: Path, overrides: list[str], batches: int, device: torch.device) -> dict:
    """The held-out loss unrounded and served, and the served model's distance from the unrounded one (fp32)."""
    model, _ = load(str(run_dir / "checkpoints"), device)
    models = {served: Transformer(dataclasses.replace(model.args, qat=served), model.layout, init=False)
              for served in (False, True)}
    for m in models.values():
        m.load_state_dict(model.state_dict())
        m.to(device).eval()
    loader = build_loader(compose(overrides).data, heldout=True, vocab_size=model.args.vocab_size)
    sums = {"loss_unrounded": 0.0, "loss_served": 0.0, "kl_served_from_unrounded": 0.0, "mean_abs_logit_diff": 0.0}
    tokens = 0
    for _ in range(batches):
        batch = {k: v.to(device) for k, v in next(loader).items()}
        labels = batch["labels"]
        kept = labels != IGNORE_INDEX
        logits = {served: m(batch["input_ids"], batch["doc_ids"]).logits.float()[kept] for served, m in models.items()}
        for served, name in ((False, "loss_unrounded"), (True, "loss_served")):
            sums[name] += F.cross_entropy(logits[served], labels[kept], reduction="sum").item()
        log_p, log_q = logits[True].log_softmax(-1), logits[False].log_softmax(-1)
        sums["kl_served_from_unrounded"] += F.kl_div(log_q, log_p, log_target=True, reduction="sum").item()
        sums["mean_abs_logit_diff"] += (logits[True] - logits[False]).abs().mean(-1).sum().item()
        tokens += int(kept.sum())
    return {k: v / tokens for k, v in sums.items()} | {"tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--work", default="/tmp/qat_small", help="run directories")
    parser.add_argument("--device", default="cpu", help="where the evaluation runs (the runs: train.device=...)")
    parser.add_argument("overrides", nargs="*", default=["model=tiny"])
    a = parser.parse_args()
    res = {**result_meta(), "steps": a.steps, "overrides": a.overrides, "runs": {}}
    for qat in (False, True):
        name = "qat" if qat else "plain"
        run_dir = Path(a.work) / name
        seconds = train(run_dir, a.steps, qat, a.overrides)
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        last = [m["loss"] for m in metrics if "loss" in m][-10:]
        res["runs"][name] = {"train_seconds": seconds, "train_loss_last10_mean": sum(last) / len(last),
                             **evaluate(run_dir, a.overrides, a.eval_batches, torch.device(a.device))}
        Path(a.out).write_text(json.dumps(res, indent=1))
        print(name, json.dumps(res["runs"][name]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
