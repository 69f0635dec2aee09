"""A rank killed with SIGKILL mid-run under ``launch/torchrun.sh`` (2 gloo processes): torchrun restarts the group,
the pinned run directory and ``train.resume=auto`` continue from the newest checkpoint, and every logged number
equals the run that was never killed.

Planted bugs it catches: no ``--max-restarts`` (the job ends at the kill), a run directory that is not pinned or no
``train.resume=auto`` (the restart starts over: the rows before the kill are lost or replayed differently)."""
import subprocess

import psutil

from tests.support.interrupt import REPO, _env, _wait_for
from tests.support.train_run import SMALL, _exact_rows, _train_rows

STEPS = ["train.max_steps=12", "train.checkpoint_every=4"]


def _launch(run_dir):
    return subprocess.Popen(["launch/torchrun.sh", *SMALL, *STEPS], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**_env(), "NPROC": "2", "RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"})


def test_a_killed_rank_restarts_and_resumes_as_the_straight_run(tmp_path):
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    job = _launch(killed)
    try:
        _wait_for(lambda: len(_train_rows(killed)) >= 6 or job.poll() is not None, 120, "six training steps")
        workers = [p for p in psutil.Process(job.pid).children(recursive=True) if "train" in " ".join(p.cmdline())]
        victim = next(p for p in workers if p.environ().get("RANK") == "1")
        victim.kill()  # SIGKILL, mid-step: nothing of this step is saved
        out, err = job.communicate(timeout=180)
    finally:
        job.kill()
    assert job.returncode == 0, err[-3000:]
    # the kill happened, was said in one line, and the job went on
    assert "torchrun: local rank 1 failed (signal SIGKILL); restarting the group (3 of 3 restarts left)" in err, \
        err[-3000:]
    resumed = f"resumed from {killed / 'checkpoints' / 'step00000004'} at step 4"
    assert resumed in out + err, err[-3000:]  # the kill happened, and the job went on from the checkpoint before it
    reference = _launch(straight)
    out, err = reference.communicate(timeout=180)
    assert reference.returncode == 0, err[-3000:]
    assert [r["step"] for r in _exact_rows(killed)] == list(range(1, 13))
    assert _exact_rows(killed) == _exact_rows(straight)
