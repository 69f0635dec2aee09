"""What test_interrupt.py shares with other tests (REPO, _env, _wait_for), here so that no test module imports
another."""
import os
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def _env():
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
