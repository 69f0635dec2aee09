"""The floor plan holds: ``lint-imports`` keeps every contract of pyproject.toml (floors kernels < model <
parallel < train < bench, no import circles, the moved names staying put). Catches an upward import (a model
module importing parallel/) and a circle closed again (model/lora importing the transformer)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    pytest.importorskip("importlinter", reason="import-linter is not installed: pip install -e '.[dev]'")
    command = shutil.which("lint-imports")
    assert command is not None, "import-linter is installed but its lint-imports command is not on PATH"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([command, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
