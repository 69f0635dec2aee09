"""tests/conftest.py marks what it should: a test whose fixture runs the pipeline harness (which spawns) and one
that spawns through a module helper are ``multiprocess`` and ``slow``, a single-process oracle test is neither.
Catches the marks going missing (``-m "not slow"`` would then run the multi-process tests) or landing everywhere."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collected(mark: str, *files: str) -> set[str]:
    """The files of the tests ``-m mark`` selects among ``files``."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", mark, *files], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 5), result.stdout[-3000:] + result.stderr[-3000:]  # 5: nothing selected
    # the suite's addopts add a second -q: one "file: count" line per file
    return {line.split(":")[0] for line in result.stdout.splitlines() if re.fullmatch(r"tests/\S+\.py: \d+", line)}


def test_multiprocess_tests_are_marked_and_others_are_not():
    files = ("tests/test_pipeline.py", "tests/test_context_engine.py", "tests/test_hyper.py")
    for mark in ("multiprocess", "slow"):
        assert collected(mark, *files) == {"tests/test_pipeline.py", "tests/test_context_engine.py"}, mark
    assert collected("not slow", *files) == {"tests/test_hyper.py"}
