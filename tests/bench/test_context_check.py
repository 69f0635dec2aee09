"""bench/context_check.py's verdict and its bad input, on the CPU (the check itself runs on a GPU:
bench/gpu_context.sh; ``SMOKE=1`` runs it here).

Planted bugs these catch: the threshold taken as the floor itself instead of twice it, a planted run reported as
expected when it passes, a zero floor compared exactly (bf16-free quantities would fail on rounding), a bad
--seq-len reaching the processes instead of exiting 2 with one line.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from context_check import verdict  # noqa: E402


def distances(chunks: dict) -> dict:
    floor = {"logits": 1e-3, "lm": 1e-4, "grad/w": 2e-3, "grad/zero": 0.0}
    return {"chunks": {**floor, **chunks}, "floor": floor, "seconds": {}, "peak_gib": {}}


def test_verdict_twice_the_floor():
    close = distances({"logits": 1.9e-3, "grad/w": 3.9e-3, "grad/zero": 9e-7})
    assert verdict(close, None)["passes"] and verdict(close, None)["as_expected"]
    far = verdict(distances({"grad/w": 4.1e-3}), None)
    assert not far["passes"] and not far["as_expected"] and far["over_twice_floor"] == 1
    assert not verdict(distances({"grad/zero": 2e-6}), None)["passes"]


def test_verdict_planted_bug_must_fail():
    caught = verdict(distances({"logits": 0.5}), "no_halo")
    assert not caught["passes"] and caught["as_expected"]
    missed = verdict(distances({}), "no_halo")
    assert missed["passes"] and not missed["as_expected"]


def test_bad_split_exits_2_with_one_line():
    run = subprocess.run([sys.executable, str(ROOT / "bench/context_check.py"), "--smoke", "--seq-len", "100",
                          "--chunks", "3", "--out", "/nonexistent/x.json"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "--seq-len" in lines[0] and "context_parallel=3" in lines[0], run.stderr
