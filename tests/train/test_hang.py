"""A rank stopped with SIGSTOP mid-run (2 gloo processes under torchrun): within ``train.collective_timeout_s`` the
other rank ends the job with one line naming the step, itself, the collective and the stopped rank, instead of silence.

Planted bugs it catches: the timeouts not shortened after the first step (the start-up timeout, 1800 s, keeps the job
silent past the test's limit); a heartbeat that does not stop with its process's main thread (the stopped rank not
named)."""
import signal
import subprocess
import time

import psutil

from tests.support.interrupt import REPO, _env, _wait_for
from tests.support.train_run import SMALL, _train_rows


def test_a_stopped_rank_ends_in_a_named_timeout(tmp_path):
    job = subprocess.Popen(["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "train", *SMALL,
                            "train.max_steps=1000", "train.checkpoint_every=0", "train.collective_timeout_s=5",
                            f"hydra.run.dir={tmp_path}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**_env(), "OMP_NUM_THREADS": "1"})
    try:
        _wait_for(lambda: len(_train_rows(tmp_path)) >= 3 or job.poll() is not None, 120, "three training steps")
        workers = [p for p in psutil.Process(job.pid).children(recursive=True) if "train" in " ".join(p.cmdline())]
        victim = next(p for p in workers if p.environ().get("RANK") == "1")
        waiter = next(p for p in workers if p.environ().get("RANK") == "0")
        victim.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        waiter.wait(timeout=90)  # rank 0 gives up on its collective
        waited = time.monotonic() - stopped
        victim.kill()
        out, err = job.communicate(timeout=60)
    finally:
        job.kill()
    line = next((l for l in err.splitlines() if "waited more than 5 s in a collective" in l), None)
    assert line is not None, err[-3000:]
    assert line.startswith("error: step ") and "rank 0 of 2" in line, line
    assert "rank 1 silent for " in line, line  # the rank that stopped, by its heartbeat
    assert waited < 30, waited  # the 5 s limit and the line, not the 1800 s of start-up
