"""``python -m train`` with pipeline stages under a real launcher (torchrun, 2 CPU processes, gloo):
exact resume at P stages, and resume under a different stage count."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.train_run import SMALL, _exact_rows

REPO = Path(__file__).resolve().parents[2]
PIPELINE = ["parallel.cuts=[8]", "train.grad_accum_steps=2", "train.checkpoint_every=2"]


def train(run_dir, stages: int, *overrides):
    launcher_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}",
               "-m", "train", *SMALL, f"parallel.pipeline_stages={stages}", f"hydra.run.dir={run_dir}",
               *(PIPELINE if stages > 1 else ["train.grad_accum_steps=2", "train.checkpoint_every=2"]), *overrides]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    stdout = train(run_dir, 2, "train.max_steps=4")
    return run_dir, stdout


@pytest.fixture(scope="module")
def stopped(straight, tmp_path_factory):
    """The straight run as a crash after step 4, before its save, leaves it: its step-2 checkpoint the newest (a
    launch fewer than a run stopped at step 2, whose checkpoint is the same; ``train.stop_at``'s own stop and
    resume: tests/train/test_train_run.py). Each resume below continues a copy of it from step 2."""
    run_dir = tmp_path_factory.mktemp("stopped")
    shutil.copytree(straight[0], run_dir, dirs_exist_ok=True)
    shutil.rmtree(run_dir / "checkpoints" / "step00000004")
    (run_dir / "checkpoints" / "latest").write_text("step00000002")
    return run_dir


def test_plan_is_printed_before_training(straight):
    _, stdout = straight
    assert "pipeline: 2 stage(s)" in stdout and "boundary 0->1" in stdout and "shadow indexers" in stdout


def test_resume_at_the_same_stage_count_is_exact(straight, stopped, tmp_path):
    shutil.copytree(stopped, tmp_path, dirs_exist_ok=True)
    out = train(tmp_path, 2, "train.max_steps=4", "train.resume=auto")
    assert f"resumed from {tmp_path / 'checkpoints' / 'step00000002'} at step 2" in out, out[-3000:]
    assert _exact_rows(tmp_path) == _exact_rows(straight[0])


def test_resume_under_another_stage_count(straight, stopped, tmp_path):
    """Two steps on 2 stages, then the same checkpoint continues on 1 stage: the step after the resume sees
    bitwise the same weights (same loss); later steps may differ by the shadow indexers' reduction order."""
    shutil.copytree(stopped, tmp_path, dirs_exist_ok=True)
    out = train(tmp_path, 1, "train.max_steps=4", "train.resume=auto")
    assert f"resumed from {tmp_path / 'checkpoints' / 'step00000002'} at step 2" in out, out[-3000:]
    got, want = _exact_rows(tmp_path), _exact_rows(straight[0])
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert got[2]["loss"] == want[2]["loss"] and got[2]["lm_loss"] == want[2]["lm_loss"]
    assert got[3]["loss"] == pytest.approx(want[3]["loss"], rel=1e-6)
    assert got[3]["lr"] == want[3]["lr"]
