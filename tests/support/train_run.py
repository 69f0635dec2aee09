"""What test_train_run.py shares with other tests (SMALL, _exact_rows, _run, _train_rows), here so that no test module
imports another."""
import sysconfig

from model.cli import compose
from train.observe.metrics import read_rows
from train.run.app import run


# Short rows of a small corpus (the stdlib's email package) keep a step well under a second on CPU.
SMALL = ["data.seq_len=64", "data.micro_batch_size=2", f"data.path={sysconfig.get_paths()['stdlib']}/email",
         "data.heldout_fraction=0.2", "train.progress=false", "logger.mode=disabled", "train.warmup_steps=2",
         "train.eval.batches=1", "train.eval.probe_examples=0",
         "logger.plots=false"]  # ~2 s of matplotlib a job; the run of tests/train/test_train_run.py draws them


def _run(run_dir, *overrides):
    return run(compose(SMALL + list(overrides)), run_dir)


def _train_rows(run_dir):
    return [r for r in read_rows(run_dir / "metrics.jsonl") if r.get("split") != "eval"]


TIMING = {"tokens_per_s", "memory_mb", "rank_time/median_s", "rank_time/max_s", "rank_time/slowest_rank"}


def _exact_rows(run_dir):
    """The training rows without the values that depend on timing: two runs of the same job give the same ones."""
    return [{k: v for k, v in row.items() if k not in TIMING} for row in _train_rows(run_dir)]
