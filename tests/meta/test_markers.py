"""tests/conftest.py marks what it should: a test whose fixture runs the pipeline harness (which spawns) and one
that spawns through a module helper are ``multiprocess`` and ``slow``, a single-process oracle test is neither.
Catches the marks going missing (``-m "not slow"`` would then run the multi-process tests) or landing everywhere.

The collections run in this process (``pytest.main``): the modules are imported once, where three ``pytest``
subprocesses each imported torch, DeepSpeed and the project again (15 s of the suite)."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class Selected:
    """A plugin that keeps the files of the tests a collection selected (after ``-m`` deselected the others)."""

    def __init__(self):
        self.files: set[str] = set()

    def pytest_collection_finish(self, session):
        self.files = {item.nodeid.split("::")[0] for item in session.items}


def collected(mark: str, *files: str) -> set[str]:
    """The files of the tests ``-m mark`` selects among ``files``."""
    selected = Selected()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), "-m", mark,
                        *(str(ROOT / f) for f in files)], plugins=[selected])
    assert code in (0, 5), code  # 5: nothing selected
    return selected.files


def test_multiprocess_tests_are_marked_and_others_are_not(monkeypatch):
    monkeypatch.chdir(ROOT)  # node ids relative to the repository root
    files = ("tests/parallel/test_pipeline.py", "tests/parallel/test_context_engine.py", "tests/model/test_hyper.py")
    for mark in ("multiprocess", "slow"):
        assert collected(mark, *files) == {"tests/parallel/test_pipeline.py", "tests/parallel/test_context_engine.py"}, mark
    assert collected("not slow", *files) == {"tests/model/test_hyper.py"}
