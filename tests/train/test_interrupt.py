"""SIGINT / SIGTERM with real processes and real signals: the job finishes its step, writes a checkpoint, exits
130 / 143 with a line that resumes it; a second signal ends a process at once; one signal delivered twice (a
launcher forwarding it) counts once."""
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.support.train_run import SMALL, _train_rows
from tests.support.interrupt import REPO, _env, _wait_for


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_the_step_and_says_how_to_resume(tmp_path, sig, code):
    """(SIGUSR1, Slurm's warning before pre-emption, is a SIGTERM from its handler on: the waiter test below.)"""
    run_dir = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "train", *SMALL, "train.max_steps=1000",
                            "train.checkpoint_every=1000", "parallel.cuts=null", f"hydra.run.dir={run_dir}"],
                           cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_train_rows(run_dir)) >= 2 or job.poll() is not None, 300, "two training steps")
        job.send_signal(sig)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == code, err[-3000:]
    last = _train_rows(run_dir)[-1]["step"]  # the step it finished after the signal
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"stopped by {signal.Signals(sig).name} after step {last}; newest checkpoint: step {last} "
                           "— resume with: python -m train "), line
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step{last:08d}"
    assert "Traceback" not in err
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[:3] == ["python", "-m", "train"] and "parallel.cuts=null" in command
    assert command[-2:] == [f"hydra.run.dir={run_dir}", "train.resume=auto"]
    if sig == signal.SIGINT:  # the printed command continues the run
        done = subprocess.run([sys.executable, *command[1:], f"train.stop_at={last + 1}"], cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert [r["step"] for r in _train_rows(run_dir)] == list(range(1, last + 2))


WAITER = """
import sys, time
from train.processes.interrupt import Interrupts
with Interrupts() as interrupts, interrupts.deferred():
    print("ready", flush=True)
    while True:
        time.sleep(0.02)
        if interrupts.requested:
            print("requested", interrupts.signum, flush=True)
            break
    while True:  # a step or a save that takes long
        time.sleep(0.02)
"""


@pytest.mark.parametrize("sig, taken_as, code", [(signal.SIGINT, signal.SIGINT, 130),
                                                  (signal.SIGUSR1, signal.SIGTERM, 143)])
def test_a_second_signal_exits_at_once_and_a_repeated_one_counts_once(sig, taken_as, code):
    """SIGUSR1 is taken as SIGTERM (without a handler it would kill the job unsaved): the step loop sees the signal
    the SIGTERM case of the job above sees, so a whole job of its own would check nothing more."""
    waiter = subprocess.Popen([sys.executable, "-c", WAITER], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert waiter.stdout.readline() == "ready\n"
        waiter.send_signal(sig)
        waiter.send_signal(sig)  # the same Ctrl-C, forwarded by a launcher: still one interrupt
        assert waiter.stdout.readline() == f"requested {taken_as.value}\n"
        time.sleep(1.0)
        assert waiter.poll() is None  # the first signal waits for the step to end
        waiter.send_signal(sig)
        assert waiter.wait(timeout=10) == code
        assert f"{sig.name} again: exiting now, without a checkpoint" in waiter.stderr.read()
    finally:
        waiter.kill()
