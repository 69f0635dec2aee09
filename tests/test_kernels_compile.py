"""Every Triton kernel compiles for Hopper, checked on a machine without a GPU.

The interpreter tests (tests/test_kernels.py) run the kernels' arithmetic but never Triton's compiler; a kernel
that only the compiler rejects passed all of them and stopped every GPU training step (2026-11-30). The compile
runs in a fresh process because tests/test_kernels.py turns on ``TRITON_INTERPRET`` for this whole process.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "kernels.hopper_compile"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "kernel launches compile for sm_90a" in done.stdout
