"""bench/save_timing.py --smoke (CPU, the tiny model): its JSON against what the disk and the checkpoint say.

One smoke run (~25 s, its own process: the timing wrappers and the process group stay out of the test process);
each test names the bug it was checked to catch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    work = tmp_path_factory.mktemp("save_timing")
    out = work / "save_timing.json"
    # overrides on both sides of an option, as bench/gpu_save.sh passes them: argparse's parse_args refused that
    done = subprocess.run([sys.executable, str(ROOT / "bench/save_timing.py"), "--smoke", "--work-dir", str(work),
                           "train.progress=false", "--out", str(out), "model=tiny"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(out.read_text())
    return res, Path(res["run_dir"]) / "checkpoints"


def on_disk(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()]


def test_bytes_written_are_the_checkpoint_on_disk(smoke):
    """The async save's bytes and files are its step directory's plus ``latest``; the resume read the step
    directory's files but the manifest. Planted: bytes counted from the weight files alone (``save_tensors``, not
    every ``durable.write``): fails."""
    res, checkpoints = smoke
    tag = checkpoints / (checkpoints / "latest").read_text().strip()
    assert tag.name == res["resume"]["tag"] == f"step{res['async']['step']:08d}"
    files = on_disk(tag) + [checkpoints / "latest"]
    assert res["async"]["bytes_written"] == sum(p.stat().st_size for p in files)
    assert res["async"]["files"] == len(files)
    assert res["resume"]["bytes_read"] == sum(p.stat().st_size for p in on_disk(tag) if p.name != "manifest.json")


def test_every_phase_is_recorded_done(smoke):
    """``phases_done`` (what a run cut by its time limit finished; the file is rewritten after each phase) names the
    three phases at the end. Planted: the resume not appended: fails."""
    res, _ = smoke
    assert res["phases_done"] == ["sync", "async", "resume"]


def test_params_are_the_checkpoints_weights(smoke):
    """``params`` (the projection's bytes per parameter) is every weight the checkpoint holds, counted here from
    its files. Planted: the parameters counted twice: fails."""
    res, checkpoints = smoke
    tag = checkpoints / res["resume"]["tag"]
    weights = {}
    for path in tag.glob("*.pt"):
        if path.name not in ("resume_state.pt",) and not path.name.startswith("optimizer_"):
            weights.update(torch.load(path, weights_only=True))
    assert res["params"] == sum(t.numel() for t in weights.values())


def test_phases_fit_inside_their_totals(smoke):
    """The step loop is blocked by the copy alone under async, less than the whole synchronous save; each part
    inside the span that holds it. Planted: the async save run with the synchronous writer (blocked = the whole
    save): fails."""
    res, _ = smoke
    sync, asynchronous = res["sync"], res["async"]
    assert asynchronous["blocked_s"] < sync["total_s"]
    assert asynchronous["blocked_s"] < asynchronous["write_staged_s"]
    for save in (sync, asynchronous):
        assert save["stage_s"] + save["write_staged_s"] <= (save.get("total_s") or save["until_published_s"])
        assert save["hash_s"] + save["fsync_s"] < save["files_s"] < save["write_staged_s"]
        assert save["serialise_and_write_s"] == pytest.approx(save["files_s"] - save["hash_s"] - save["fsync_s"])
        assert save["bytes_written"] > 0 and save["files"] > 2


def test_rates_and_projection_arithmetic(smoke):
    """GB/s are the bytes over each phase's seconds; V4.1's checkpoint is the measured bytes per parameter times 552 B
    parameters, each GPU count's share that over the GPUs, each time the share over its rate, the stall a share of
    the plan's step. Planted: GiB (2^30) for GB in the rates: fails."""
    res, _ = smoke
    a, r, p = res["async"], res["resume"], res["projection_v41"]
    assert a["gb_per_s"]["stage"] == pytest.approx(a["bytes_written"] / 1e9 / a["stage_s"])
    assert r["verify_gb_per_s"] == pytest.approx(r["bytes_read"] / 1e9 / r["verify_s"])
    assert p["bytes_per_param_measured"] == pytest.approx(a["bytes_written"] / res["params"])
    assert p["checkpoint_tb"] == pytest.approx(a["bytes_written"] / res["params"] * 552e9 / 1e12)
    for gpus, plan in p["per_gpu_count"].items():
        assert plan["share_gb_per_gpu"] * int(gpus) == pytest.approx(p["checkpoint_tb"] * 1e3)
        write_rate = a["bytes_written"] / 1e9 / a["write_staged_s"]
        assert plan["write_s"] == pytest.approx(plan["share_gb_per_gpu"] / write_rate)
        assert plan["stall_share_of_a_step"] == pytest.approx(plan["stage_s"] / plan["step_s"])
        assert plan["stage_s"] == pytest.approx(plan["share_gb_per_gpu"] / a["gb_per_s"]["stage"])


def test_a_cpu_run_pins_nothing(smoke):
    """The async save reports the staging area's page-locked bytes: none on the CPU, where no tensor goes through it
    (on a GPU: the staged bytes). Planted: the field left out of the report: fails."""
    res, _ = smoke
    assert res["async"]["staging_area_bytes"] == 0
