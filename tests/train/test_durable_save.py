"""Checkpoints that survive a crash mid-save, written in the background exactly as in the foreground.

- ``kill -9`` of a one-process job in the middle of its second save, at two points (half-way through a weight file;
  after the new tag directory is published but before ``latest`` names it): the first checkpoint stays intact,
  ``train.resume=auto`` takes it, and the resumed job logs every number of the steps it recomputes as the killed
  job logged them.
  Planted bugs it catches: ``latest`` replaced before the tag directory is complete (the resume takes a torn
  checkpoint or none), writing into the tag directory in place instead of ``.partial``.
- ``kill -9`` of rank 1 of 2 (torchrun, one restart) in the middle of its file of the second save: the group
  restarts from the first checkpoint and recomputes the steps after it as the killed attempt did. Planted bug it
  catches: rank 0 publishing the tag without waiting for every rank's files (the restart resumes a torn step 4).
- Durability order: every file of a published checkpoint (``latest`` too) was fsync'd under its temporary name
  before its rename, and the directory holding each rename was fsync'd before the next step of the publication.
  Planted bugs: no ``os.fsync`` of a file; no fsync of the directory after a rename.
- Background saves (``train.checkpoint_async=true``) with a slow disk write files byte for byte equal to
  synchronous saves. Planted bug: ``stage`` keeping views of the live tensors instead of copies (the background
  write then holds a later step's weights)."""
import os
import signal
import subprocess
import sys
import threading
import time


from tests.support.interrupt import REPO, _env
from tests.support.train_run import SMALL, _exact_rows, _run
from train.formats import checkpoint, durable

STEPS = ["train.max_steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=0"]

# Runs ``python -m train`` with a SIGKILL planted at one point of the save of step 4 (argv[1]); argv[2:]: overrides.
# Mid-file: in rank 1's optimizer state (of a torchrun job's first attempt only, the rows logged until then kept in
# <run dir>/at_kill/); or just before ``latest`` names step 4.
KILLER = """
import os, pathlib, runpy, shutil, signal, sys
from train.formats import durable

point, sys.argv = sys.argv[1], ["train", *sys.argv[2:]]
real_write, real_text = durable._Hashing.write, durable.write_text
victim = {"rank 1 mid-file": ".optimizer_stage00_dp01.pt"}.get(point)
run_dir = pathlib.Path(next(arg.split("=", 1)[1] for arg in sys.argv if arg.startswith("hydra.run.dir=")))

def write(self, data):
    written = real_write(self, data)
    if (victim and f".step00000004.partial/{victim}" in self.file.name
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        (run_dir / "at_kill").mkdir(exist_ok=True)
        shutil.copy(run_dir / "metrics.jsonl", run_dir / "at_kill" / "metrics.jsonl")
        os.kill(os.getpid(), signal.SIGKILL)  # the file's first bytes are out, the rest never comes
    return written

def write_text(path, text, sync=True):
    if point == "before latest" and path.name == "latest" and text == "step00000004":
        os.kill(os.getpid(), signal.SIGKILL)  # step00000004/ is published, latest still names step00000002
    return real_text(path, text, sync)

durable._Hashing.write, durable.write_text = write, write_text
runpy.run_module("train", run_name="__main__")
"""


def _train(run_dir, *extra, killer_point=None):
    head = [sys.executable, "-c", KILLER, killer_point] if killer_point else [sys.executable, "-m", "train"]
    return subprocess.run([*head, *SMALL, *STEPS, f"hydra.run.dir={run_dir}", *extra], cwd=REPO,
                          env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)


def test_kill_9_before_latest_keeps_the_previous_checkpoint_and_resume_takes_it(tmp_path):
    """Killed after every file of step 4's save is written, just before ``latest`` names it (the kill mid-file is
    the two-process test below); the resumed job recomputes steps 3 and 4 as the killed one computed them."""
    killed = _train(tmp_path, killer_point="before latest")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    before_kill = _exact_rows(tmp_path)
    assert [row["step"] for row in before_kill] == [1, 2, 3, 4]  # killed in the save after step 4
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "latest").read_text() == "step00000002"
    assert checkpoint.find("auto", ckpt) == checkpoint.CheckpointRef(ckpt, "step00000002")
    resumed = _train(tmp_path, "train.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt / 'step00000002'} at step 2" in resumed.stdout + resumed.stderr
    rows = _exact_rows(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6] and rows[:4] == before_kill
    assert (ckpt / "latest").read_text() == "step00000006"


def test_kill_9_of_one_rank_mid_save_restarts_from_the_previous_checkpoint(tmp_path):
    """2 gloo processes under torchrun (one restart): rank 1 dies in the middle of its file of step 4's save (rank 0
    writing its own or done); the restarted group resumes from step 2, never from the torn step 4, and recomputes steps
    3 and 4 as the first attempt computed them before the kill."""
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    run_dir = tmp_path / "run"
    job = subprocess.run([sys.executable, "-m", "train.torchrun", "--standalone", "--nproc-per-node", "2",
                          "--max-restarts", "1", str(killer), "rank 1 mid-file", *SMALL, "train.max_steps=4",
                          "train.checkpoint_every=2", f"hydra.run.dir={run_dir}", "train.resume=auto"],
                         cwd=REPO, env={**_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "local rank 1 failed (signal SIGKILL)" in job.stderr, job.stderr[-3000:]
    ckpt = run_dir / "checkpoints"
    assert f"resumed from {ckpt / 'step00000002'} at step 2" in job.stdout + job.stderr, job.stderr[-3000:]
    before_kill = _exact_rows(run_dir / "at_kill")
    assert [row["step"] for row in before_kill] == [1, 2, 3, 4]  # killed in the save after step 4
    assert _exact_rows(run_dir) == before_kill
    assert (ckpt / "latest").read_text() == "step00000004"


def test_every_rename_is_durable_before_the_next_step(tmp_path, monkeypatch):
    """The order of fsyncs and renames of a real (synchronous) save, recorded as the OS sees them."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(source, target):
        events.append(("replace", str(source), str(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _run(tmp_path, "train.max_steps=1", "train.checkpoint_async=false")
    ckpt = tmp_path / "checkpoints"
    tag, partial = ckpt / "step00000001", ckpt / ".step00000001.partial"

    def at(event) -> int:
        assert event in events, (event, events)
        return events.index(event)

    def durable_file(final):  # fsync'd under its temporary name, then renamed
        tmp = final.with_name(f".{final.name}.tmp")
        return at(("fsync", str(tmp))) < at(("replace", str(tmp), str(final)))

    files = sorted(p.name for p in tag.iterdir())
    assert "manifest.json" in files and "resume_state.pt" in files
    assert all(durable_file(partial / name) for name in files)
    last_file = max(at(("replace", str(partial / f".{n}.tmp"), str(partial / n))) for n in files)
    published = at(("replace", str(partial), str(tag)))
    assert last_file < events.index(("fsync", str(partial)), last_file) < published
    assert durable_file(ckpt / "latest")
    latest = at(("replace", str(ckpt / ".latest.tmp"), str(ckpt / "latest")))
    assert published < events.index(("fsync", str(ckpt)), published) < latest
    assert ("fsync", str(ckpt)) in events[latest:]


def test_background_saves_write_the_bytes_of_synchronous_ones(tmp_path, monkeypatch):
    real_save, started, threads = durable.save_tensors, set(), set()

    def slow_save(obj, path):  # a slow disk: the next step runs before the rest of the checkpoint is written
        threads.add(threading.current_thread() is threading.main_thread())
        if path.parent not in started:
            started.add(path.parent)
            time.sleep(0.5)
        return real_save(obj, path)

    monkeypatch.setattr(durable, "save_tensors", slow_save)
    runs = {mode: tmp_path / mode for mode in ("true", "false")}
    for mode, run_dir in runs.items():
        threads.clear()
        _run(run_dir, *STEPS, f"train.checkpoint_async={mode}")
        assert threads == {mode == "false"}, mode  # the setting reaches the writer: written on the main thread or not
    background, foreground = (runs[mode] / "checkpoints" for mode in ("true", "false"))
    tags = sorted(p.name for p in foreground.iterdir() if p.is_dir())
    assert tags == ["step00000002", "step00000004", "step00000006"]
    for tag in tags:
        names = sorted(p.name for p in (foreground / tag).iterdir())
        assert names == sorted(p.name for p in (background / tag).iterdir())
        for name in names:
            if name in (checkpoint.TRAINER_STATE, "manifest.json"):  # the config names the mode; below without it
                continue
            assert (foreground / tag / name).read_bytes() == (background / tag / name).read_bytes(), (tag, name)
        states = [checkpoint.read_trainer_state(checkpoint.CheckpointRef(d, tag)) for d in (foreground, background)]
        for state in states:
            del state["config"]["train"]["checkpoint_async"]
        assert states[0] == states[1]
    assert _exact_rows(runs["true"]) == _exact_rows(runs["false"])
