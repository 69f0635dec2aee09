"""Bad input under torchrun (2 CPU processes, through ``python -m train.torchrun``, which ``launch/torchrun.sh``
runs): the job's one line is printed once, then one line of the launcher naming each worker's status, and the
launch exits with the workers' status 2 (plain torchrun prints a 38-line traceback and exits 1: planting a re-raise
of the ``ChildFailedError`` fails here); every worker exits 2 (none is stopped by the launcher), and neither rank
leaves a run directory, Hydra's timestamped ones included. With ``--max-restarts`` (as ``launch/torchrun.sh`` passes it)
bad input is not restarted: planting torchrun's own agent back prints the line once per attempt. And a CPU that other jobs share is named in the run's
header, with the thread setting that helps."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_config_error_under_torchrun_is_one_line_status_2_everywhere_and_no_run_dir(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "HYDRA_FULL_ERROR"}} | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    missing = tmp_path / "notes.txt"
    done = subprocess.run([sys.executable, "-m", "train.torchrun", "--standalone", "--nproc-per-node=2",
                           "--max-restarts=3", "-m", "train", "data=hf", f"data.path={missing}", "logger.mode=disabled"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    line = f"error: data.path '{missing}' does not exist — give an existing file or directory, or a dataset name"
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [line, "torchrun: train failed (rank 0: status 2, rank 1: status 2)"], \
        done.stderr[-3000:]
    assert "Traceback" not in done.stdout
    assert list(tmp_path.glob("outputs/*/*")) == [], "a run directory was left behind"


def test_a_shared_cpu_is_named_with_the_fix(monkeypatch):
    import torch

    from train.run.app import shared_cpu_warning

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.3, 4.0, 3.0))
    assert shared_cpu_warning(torch.device("cpu")).startswith("the CPU is shared (load average 5.3 on 2 cores) and "
                                                              "torch runs 2 threads")
    assert "OMP_NUM_THREADS=1" in shared_cpu_warning(torch.device("cpu"))
    assert shared_cpu_warning(torch.device("cuda")) is None
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 4.0, 3.0))
    assert shared_cpu_warning(torch.device("cpu")) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.3, 4.0, 3.0))
    assert shared_cpu_warning(torch.device("cpu")) is None
