"""What a user sees when the input is wrong: unknown keys refused with the nearest valid names, and every error
of ``python -m train`` as one line ``error: <what> — <what to do>`` on stderr, exit status 2, no traceback (unless
HYDRA_FULL_ERROR=1), and no run directory left behind."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model.cli import UnknownKeyError, compose_checked, error_line

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides, message", [
    (["train.max_step=5"], r"unknown config key train.max_step — did you mean train.max_steps\?"),
    (["+train.max_step=5"], r"unknown config key train.max_step — did you mean train.max_steps\?"),  # Hydra's hint
    (["++train.eval.evry=5"], r"train.eval.evry — did you mean train.eval.every\?"),
    (["layout=all_full", "layout.decoder.reindex_evry=2"], r"did you mean layout.decoder.reindex_every\?"),
    (["trian.lr=1"], r"did you mean train.lr\b"),
    (["-m", "train.max_steps=1,2", "train.lrr=1,2"], r"train.lrr — did you mean train.lr\b"),
])
def test_unknown_keys_are_refused_with_the_nearest_names(overrides, message):
    overrides = [o for o in overrides if o != "-m"]
    with pytest.raises(UnknownKeyError, match=message):
        compose_checked(overrides)


def test_known_keys_sweeps_and_forced_overrides_pass():
    cfg = compose_checked(["layout=all_full,v41", "train.max_steps=3,4", "++train.lr=0.5", "hydra.run.dir=x"])
    assert cfg.layout.name == "all_full" and cfg.train.max_steps == 3 and cfg.train.lr == 0.5


def test_hydra_errors_become_one_line():
    from hydra.errors import MissingConfigException, OverrideParseException

    with pytest.raises(MissingConfigException) as missing:
        compose_checked(["layout=nope"])
    line = error_line(missing.value)
    assert line.startswith("error: there is no layout config named 'nope' — use one of: all_full,") and "\n" not in line
    with pytest.raises(OverrideParseException) as parse:
        compose_checked(["train.max_steps"])
    assert error_line(parse.value).startswith("error: cannot parse the override 'train.max_steps' (missing EQUAL")
    assert error_line(ValueError("a\n  b")) == "error: a; b — fix the setting or input named above and run again"


def _train(tmp_path, *overrides, env=None):
    run_dir = tmp_path / "run"
    launcher_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HYDRA_FULL_ERROR"}
    environment = {k: v for k, v in os.environ.items() if k not in launcher_vars} | (env or {})
    done = subprocess.run([sys.executable, "-m", "train", *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, cwd=REPO, env=environment, timeout=300)
    return done, run_dir


@pytest.mark.parametrize("overrides, message", [
    (["+train.max_step=5"], "error: unknown config key train.max_step — did you mean train.max_steps?"),
    (["data=hf", f"data.path={REPO / 'no_such_notes.txt'}"],
     "error: data.path '{}' does not exist — give an existing file or directory".format(REPO / "no_such_notes.txt")),
])
def test_train_errors_are_one_line_with_status_2_and_leave_no_run_dir(tmp_path, overrides, message):
    done, run_dir = _train(tmp_path, *overrides)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not run_dir.exists()


def test_hydra_full_error_shows_the_traceback(tmp_path):
    done, run_dir = _train(tmp_path, "data=hf", f"data.path={tmp_path / 'missing.txt'}", env={"HYDRA_FULL_ERROR": "1"})
    assert done.returncode != 0 and "Traceback" in done.stderr and "FileNotFoundError" in done.stderr
    assert not run_dir.exists()
