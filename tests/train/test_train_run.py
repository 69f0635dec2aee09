"""End-to-end runs of ``train.run.app.run`` on a small config: files, exact resume, checkpoint errors, bad steps."""
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model import layout_from_config
from model.cli import compose
from tests.support.train_run import SMALL, _exact_rows, _run, _train_rows
from train.formats import checkpoint, manifest
from train.formats.checkpoint import CheckpointError
from train.loss import Loss, compute_loss
from train.observe.metrics import read_rows
from train.run import engine as engine_module
from train.run.app import Trainer, TrainingDiverged, run

TRAIN_KEYS = {"step", "loss", "lm_loss", "indexer_loss", "lr", "grad_norm", "tokens_per_s", "padding_fraction",
              "memory_mb", "skipped"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """20 steps with the wandb logger offline and the probes on: the run the file checks look at."""
    run_dir = tmp_path_factory.mktemp("run")
    final = _run(run_dir, "train.max_steps=20", "train.checkpoint_every=5", "logger.mode=offline",
                 "logger.plots=true", "train.eval.every=10", "train.eval.probe_examples=2", "train.eval.probe_lens=[192]",
                 "train.eval.mqar_pairs=2", "train.eval.mqar_queries=1")
    return run_dir, final


def test_loss_falls_and_files_are_written(trained):
    run_dir, final = trained
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(TRAIN_KEYS <= set(r) for r in rows)
    assert any(k.startswith("indexer_loss/layer") for k in rows[0])
    first, last = (sum(r["loss"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last < first - 0.5, (first, last)
    evals = [r for r in read_rows(run_dir / "metrics.jsonl") if r.get("split") == "eval"]
    assert [r["step"] for r in evals] == [10, 20]
    assert {"lm_loss", "passkey_acc", "mqar_acc"} <= set(evals[-1]) and evals[-1] == {**final, "split": "eval"}
    assert any(k.startswith("index_recall/layer") for k in evals[-1])
    assert (run_dir / "loss_curve.png").stat().st_size > 0
    assert (run_dir / "health.png").stat().st_size > 0
    assert (run_dir / "config.yaml").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*"))
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text() == "step00000020"
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step00000015", "step00000020"]  # keep_checkpoints=2


def test_health_diagnostics_in_every_row(trained):
    """Per-group gradient norms split the clipping norms exactly (a group left out or counted twice breaks the
    sum); per-layer activation RMS for every layer and the logits."""
    rows = _train_rows(trained[0])
    n_layers = layout_from_config(compose(SMALL).layout).n_layers
    for row in rows:
        groups = {k.removeprefix("grad_norm/"): v for k, v in row.items() if k.startswith("grad_norm/")}
        assert {"embedding", "attn_q", "attn_kv", "indexer", "attn_out", "ffn", "norms_sinks", "head"} == set(groups)
        trunk = sum(v * v for g, v in groups.items() if g != "indexer") ** 0.5
        assert trunk == pytest.approx(row["grad_norm"], rel=1e-5)
        for site in ("attn", "ffn", "resid"):
            assert all(row[f"act_rms/{site}/layer{i}"] > 0 for i in range(n_layers))
        assert row["act_rms/logits"] > 0


def test_resume_is_bitwise_exact(tmp_path, monkeypatch):
    """Stopped at step 3 and resumed == straight through: every logged number, and the RNG streams at each step
    (Python, NumPy, torch: a resume that re-seeds instead of restoring them would replay step 1's draws)."""
    draws = []
    real_step = Trainer.step

    def step_with_draws(self, step):
        draws.append((step, random.random(), np.random.rand(), torch.rand(1).item()))
        return real_step(self, step)
    monkeypatch.setattr(Trainer, "step", step_with_draws)
    straight, split = tmp_path / "straight", tmp_path / "split"
    final_straight = _run(straight, "train.max_steps=6")
    straight_draws, draws[:] = list(draws), []
    _run(split, "train.max_steps=6", "train.stop_at=3")
    assert (split / "checkpoints" / "latest").read_text() == "step00000003"
    final_split = _run(split, "train.max_steps=6", "train.resume=auto")
    assert draws == straight_draws
    exact = [_exact_rows(d) for d in (split, straight)]
    assert exact[0] == exact[1]  # every loss part, grad norm and lr, bit for bit
    assert final_split == final_straight


def test_resume_paths(trained, tmp_path):
    ckpt = trained[0] / "checkpoints"
    assert checkpoint.find(str(ckpt), tmp_path) == checkpoint.CheckpointRef(ckpt, "step00000020")
    assert checkpoint.find(str(ckpt / "step00000015"), tmp_path) == checkpoint.CheckpointRef(ckpt, "step00000015")
    assert checkpoint.find("auto", tmp_path) is None  # nothing to resume: a fresh start
    assert checkpoint.find(None, ckpt) is None
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        checkpoint.find(str(tmp_path / "missing"), tmp_path)


def _as_the_previous_format(tag):
    """``tag`` rewritten as the code before the format version wrote it: each tensor file saved by path, and a
    manifest with no format, hashed after the fact."""
    for path in tag.glob("*.pt"):
        torch.save(torch.load(path, weights_only=True), path)
    entries = {p.name: {"bytes": p.stat().st_size, "sha256": manifest.sha256(p)} for p in sorted(tag.iterdir())
               if p.name != manifest.MANIFEST}
    (tag / manifest.MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def test_a_checkpoint_of_the_previous_format_resumes_as_today_s(trained, tmp_path):
    """Planted bugs it catches: a manifest without a format read as unreadable or newer (no resume); a file
    layout the loader no longer reads."""
    rows = {}
    for kind in ("today", "previous"):
        tag = tmp_path / kind / "checkpoints" / "step00000020"
        shutil.copytree(trained[0] / "checkpoints" / tag.name, tag)
        if kind == "previous":
            _as_the_previous_format(tag)
            assert "format" not in json.loads((tag / manifest.MANIFEST).read_text())
        _run(tmp_path / kind, "train.max_steps=21", "train.resume=auto", "train.checkpoint_every=0")
        rows[kind] = _exact_rows(tmp_path / kind)
    assert [r["step"] for r in rows["today"]] == [21]
    assert rows["previous"] == rows["today"]


def test_missing_checkpoint_path_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="train.resume="):
        _run(tmp_path, "train.max_steps=2", f"train.resume={tmp_path / 'nowhere'}")


def test_checkpoint_of_another_layout_names_the_difference(trained, tmp_path):
    with pytest.raises(CheckpointError, match=r"layout\.name: checkpoint 'v41_scaled', this run 'all_full'"):
        _run(tmp_path, "train.max_steps=40", "layout=all_full", f"train.resume={trained[0] / 'checkpoints'}")
    with pytest.raises(CheckpointError, match=r"model\.dim: checkpoint 128, this run 64"):
        _run(tmp_path, "train.max_steps=40", "model.dim=64", f"train.resume={trained[0] / 'checkpoints'}")


def test_resume_skips_a_damaged_checkpoint_and_continues_the_wandb_run(trained, tmp_path, caplog):
    """The newest checkpoint (step 20) has a truncated weight file: ``resume=auto`` warns and resumes from step 15,
    saves step 20 again over the damaged one, and the wandb run is the first job's, continued."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained[0], run_dir, ignore=shutil.ignore_patterns("*.png"))
    victim = run_dir / "checkpoints" / "step00000020" / "layer_003.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    with caplog.at_level("WARNING", logger="train.formats.checkpoint"):
        _run(run_dir, "train.max_steps=20", "train.checkpoint_every=5", "logger.mode=offline", "train.resume=auto")
    assert "skipping checkpoint step00000020: layer_003.pt is 100 bytes" in caplog.text
    assert [r["step"] for r in _train_rows(run_dir)] == list(range(1, 21))  # 16..20 trained again
    ckpt = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step00000015", "step00000020"]
    assert checkpoint.find("auto", ckpt).tag == "step00000020"  # intact again
    first_id = json.loads((trained[0] / "checkpoints" / "step00000020" / "trainer_state.json").read_text())["wandb_id"]
    assert first_id and json.loads((ckpt / "step00000020" / "trainer_state.json").read_text())["wandb_id"] == first_id
    assert {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")} == {first_id}


def test_probe_longer_than_its_context_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="too short for the passkey probe.*train.eval.probe_lens"):
        _run(tmp_path, "train.max_steps=2", "train.eval.probe_examples=2", "train.eval.probe_lens=[64]")
    assert not (tmp_path / "metrics.jsonl").exists()


def _nan_from_call(monkeypatch, first_bad: int):
    """Make every loss from the ``first_bad``-th training forward on NaN."""
    calls = {"n": 0}

    def loss_fn(*args):
        loss = compute_loss(*args)
        calls["n"] += 1
        if calls["n"] >= first_bad:
            return Loss(loss.total * float("nan"), loss.lm, loss.indexer, loss.tokens)
        return loss

    monkeypatch.setattr(engine_module, "compute_loss", loss_fn)


def test_nan_steps_are_skipped_then_the_run_stops(tmp_path, monkeypatch):
    _nan_from_call(monkeypatch, first_bad=3)
    with pytest.raises(TrainingDiverged, match=r"steps 3\.\.5 .*Last good checkpoint: step 2"):
        _run(tmp_path, "train.max_steps=10", "train.checkpoint_every=2", "train.max_bad_steps=3")
    rows = _train_rows(tmp_path)
    assert [r["skipped"] for r in rows] == [False, False, True, True, True]
    assert rows[-1]["skipped_total"] == 3
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step00000002"  # steps 4 (bad) saved nothing
    monkeypatch.undo()
    _run(tmp_path, "train.max_steps=3", "train.resume=auto")  # the last good checkpoint resumes
    assert json.loads((tmp_path / "checkpoints" / "step00000003" / "trainer_state.json").read_text())["step"] == 3
    assert not list(tmp_path.glob("*.png"))  # logger.plots=false (SMALL): metrics.jsonl only


@pytest.mark.parametrize("writer", ["false", "true"])
def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, writer):
    """A write that fails (disk full) in the second save: the job fails with it, synchronous or in the background
    (raised at the next step or at the end, not lost), and the first checkpoint stays the one to resume."""
    real_write, calls = checkpoint.durable.write, {"n": 0}

    def failing_write(path, fill):
        if path.name == checkpoint.RESUME_STATE:
            calls["n"] += 1
            if calls["n"] == 2:  # the second checkpoint dies after the weight and optimizer files
                raise OSError("disk full")
        return real_write(path, fill)

    monkeypatch.setattr(checkpoint.durable, "write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        _run(tmp_path, "train.max_steps=3", "train.checkpoint_every=1", f"train.checkpoint_async={writer}")
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "latest").read_text() == "step00000001"
    assert (ckpt / ".step00000002.partial").is_dir() and not (ckpt / "step00000002").exists()
    assert not (ckpt / "step00000003").exists()  # the failure stopped the job before its next save
    assert checkpoint.find("auto", ckpt) == checkpoint.CheckpointRef(ckpt, "step00000001")


def test_command_line_entry_point(tmp_path):
    """``python -m train`` as a launcher starts it: Hydra app, ``--local_rank`` accepted, run dir filled."""
    command = [sys.executable, "-m", "train", "--local_rank=0", *SMALL, "train.max_steps=2",
               f"hydra.run.dir={tmp_path}"]
    launcher_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}  # this process's own group
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parents[2], env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("starting: the overrides are valid; loading torch")  # the first line, in a second
    assert "evaluating: " in done.stdout.split("evaluation after 2 steps")[0]  # the silent part at the end announced
    assert "done: steps 1-2 in " in done.stdout and f"256 tokens trained; run dir {tmp_path}" in done.stdout
    assert (tmp_path / ".hydra" / "config.yaml").is_file() and (tmp_path / "config.yaml").is_file()
    assert [r["step"] for r in _train_rows(tmp_path)] == [1, 2]


def test_a_cpu_group_builds_no_deepspeed_op():
    """DeepSpeed's CPU comm backend would JIT-compile its shared-memory op with g++ (minutes, silent: issue 57);
    ``distributed.init`` on CPU leaves it unbuilt (planting the removal of ``skip_shm_comm_build`` loads or builds
    it, and the backend holds it)."""
    code = ("import torch; from train.processes import distributed; distributed.init(torch.device('cpu')); "
            "from deepspeed.comm import comm; print('shm op:', comm.cdb.shm_comm_op)")
    launcher_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars} | {"DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "shm op: None", done.stdout[-2000:]
