"""Checkpoints that survive a crash mid-save, written in the background exactly as in the foreground.

- ``kill -9`` of a one-process job in the middle of its second save, at two points (half-way through a weight file;
  after the new tag directory is published but before ``latest`` names it): the first checkpoint stays intact,
  ``train.resume=auto`` takes it, and the resumed job logs every number as the job that was never killed.
  Planted bugs it catches: ``latest`` replaced before the tag directory is complete (the resume takes a torn
  checkpoint or none), writing into the tag directory in place instead of ``.partial``.
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

import pytest

from tests.test_interrupt import REPO, _env
from tests.test_train_run import SMALL, _exact_rows, _run
from train import checkpoint, durable

STEPS = ["train.max_steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=0"]

# Runs ``python -m train`` with a SIGKILL planted at one point of the save of step 4 (argv[1]); argv[2:]: overrides.
KILLER = """
import os, runpy, signal, sys
from train import durable

point, sys.argv = sys.argv[1], ["train", *sys.argv[2:]]
real_write, real_text = durable._Hashing.write, durable.write_text

def write(self, data):
    written = real_write(self, data)
    if point == "mid-file" and ".step00000004.partial/.layer_001.pt" in self.file.name:
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


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    done = _train(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return _exact_rows(run_dir)


@pytest.mark.parametrize("point", ["mid-file", "before latest"])
def test_kill_9_mid_save_keeps_the_previous_checkpoint_and_resume_takes_it(tmp_path, straight, point):
    killed = _train(tmp_path, killer_point=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "latest").read_text() == "step00000002"
    if point == "mid-file":
        assert (ckpt / ".step00000004.partial").is_dir() and not (ckpt / "step00000004").exists()
    assert checkpoint.find("auto", ckpt) == checkpoint.CheckpointRef(ckpt, "step00000002")
    resumed = _train(tmp_path, "train.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt / 'step00000002'} at step 2" in resumed.stdout + resumed.stderr
    assert _exact_rows(tmp_path) == straight
    assert (ckpt / "latest").read_text() == "step00000006"


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
