"""Damaged checkpoints: the manifest names the damaged file, ``train.resume=auto`` takes the newest intact
checkpoint, and pruning never deletes the newest intact one (no engine: checkpoints made of plain files)."""
import json
import logging
import re

import pytest

from train.formats import checkpoint, manifest
from train.formats.checkpoint import CheckpointError, CheckpointRef
from tests.support.checkpoint_recovery import damage, make_checkpoint


PROBLEMS = {"truncate": r"layer_000\.pt is 100 bytes, the manifest says 10,240",
            "delete": r"layer_000\.pt is missing",
            "flip": r"layer_000\.pt does not match its SHA-256",
            "no manifest": r"it has no manifest\.json"}


@pytest.mark.parametrize("how", list(PROBLEMS))
def test_a_damaged_checkpoint_names_the_file_and_the_intact_one(tmp_path, how):
    older = make_checkpoint(tmp_path, 100)
    newest = make_checkpoint(tmp_path, 200)
    assert manifest.problem(newest) is None
    damage(newest, how)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(newest))} is damaged: {PROBLEMS[how]}.* — resume from "
                                              rf"the newest intact one: train.resume={re.escape(str(older))}$"):
        checkpoint.find(str(newest), tmp_path)


@pytest.mark.parametrize("how", list(PROBLEMS))
def test_resume_auto_takes_the_newest_intact_checkpoint(tmp_path, caplog, how):
    make_checkpoint(tmp_path, 100)
    make_checkpoint(tmp_path, 150)
    damage(make_checkpoint(tmp_path, 200), how)
    with caplog.at_level(logging.WARNING, logger="train.formats.checkpoint"):
        assert checkpoint.find("auto", tmp_path) == CheckpointRef(tmp_path, "step00000150")
        assert checkpoint.find(str(tmp_path), tmp_path / "elsewhere") == CheckpointRef(tmp_path, "step00000150")
    assert "skipping checkpoint step00000200: " in caplog.text and PROBLEMS[how].split(r"\.")[0] in caplog.text


def test_latest_first_then_newest_step(tmp_path):
    """``latest`` is the run's own newest; a checkpoint at a later step left by an abandoned run is not taken."""
    make_checkpoint(tmp_path, 300)
    make_checkpoint(tmp_path, 100)  # a run resumed from an older checkpoint wrote this one last
    assert checkpoint.find("auto", tmp_path).tag == "step00000100"
    (tmp_path / checkpoint.LATEST).write_text("step00000400")  # names a checkpoint that is gone
    assert checkpoint.find("auto", tmp_path).tag == "step00000300"


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    damage(make_checkpoint(tmp_path, 100), "truncate")
    damage(make_checkpoint(tmp_path, 200), "delete")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .*step00000200: layer_000\.pt is missing; "
                                              r"step00000100: layer_000\.pt is 100 bytes"):
        checkpoint.find("auto", tmp_path)
    assert checkpoint.find("auto", tmp_path / "empty") is None  # nothing at all: a fresh start


def test_pruning_keeps_the_newest_intact_checkpoints(tmp_path):
    """The issue's case: the newest checkpoint (200) is damaged, the run resumed from 100 and saves 150. Pruning
    with keep=2 keeps 100 and 150 (intact) and leaves 200 to be replaced when the run gets there."""
    make_checkpoint(tmp_path, 100)
    damage(make_checkpoint(tmp_path, 200), "truncate")
    make_checkpoint(tmp_path, 150)
    checkpoint.prune(tmp_path, keep=2, step=150)
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step00000100", "step00000150", "step00000200"]
    # damaged and older intact checkpoints up to the current step go; the newest intact ones stay
    damage(make_checkpoint(tmp_path, 50, latest=False), "delete")
    make_checkpoint(tmp_path, 175)
    checkpoint.prune(tmp_path, keep=2, step=175)
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step00000150", "step00000175", "step00000200"]
    # keep=1 with a damaged checkpoint at the current step: the newest intact one (175) survives
    checkpoint.prune(tmp_path, keep=1, step=200)
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step00000175"]


def _set_format(tag, version):
    """``tag``'s manifest recording format ``version`` (None: none, as before the format was recorded)."""
    path = tag / manifest.MANIFEST
    written = json.loads(path.read_text())
    written.pop("format")
    path.write_text(json.dumps(written if version is None else {"format": version, **written}))


def test_a_newer_format_is_refused_in_one_line_not_skipped(tmp_path):
    """Skipping it as damaged would resume the older checkpoint behind the user's back. Planted bug it catches: no
    format check (the newer checkpoint is read as if it were of this format)."""
    make_checkpoint(tmp_path, 100)
    newer = make_checkpoint(tmp_path, 200)
    _set_format(newer, manifest.FORMAT + 1)
    for resume in ("auto", str(newer)):
        with pytest.raises(CheckpointError) as refused:
            checkpoint.find(resume, tmp_path)
        assert str(refused.value) == (
            f"{newer / manifest.MANIFEST}: checkpoint format {manifest.FORMAT + 1}, newer than this code reads "
            f"(format {manifest.FORMAT} and older) — resume it with the version of the code that wrote it, or start "
            "fresh (train.resume=null)")
        assert refused.value.exit_code == 2


def test_a_manifest_without_a_format_is_format_1(tmp_path):
    """Checkpoints written before the format was recorded. Planted bug it catches: a missing format read as
    unreadable (the checkpoint skipped) or as 0."""
    tag = make_checkpoint(tmp_path, 100)
    assert manifest.format_of(tag) == manifest.FORMAT == 1
    _set_format(tag, None)
    assert manifest.format_of(tag) == 1
    assert checkpoint.find("auto", tmp_path) == CheckpointRef(tmp_path, "step00000100")
