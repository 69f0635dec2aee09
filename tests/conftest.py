"""What the whole suite shares: the ``one_thread`` fixture and the markers of pyproject.toml, applied here so that
no test file has to remember them (a test added later gets its marks too).

- ``multiprocess``: the test, a fixture it uses or a helper of the test modules they call (the pipeline harness's
  ``run``, say) starts processes through ``parallel.local.spawn``.
- ``slow``: multi-process, or a whole training job through ``train.run.app.run``. ``-m "not slow"`` keeps the quick
  unit and oracle tests.
- ``gpu``: needs a CUDA device; skipped without one.

Every test also starts from the environment variables the suite started with (``pytest_runtest_protocol``). Under
``-n N`` (pytest-xdist) each worker takes its share of the cores (``pytest_configure``).
"""
import os
import sys
from types import ModuleType

import pytest
import torch

from parallel.local import spawn
from train.run.app import run as run_job


PROJECT = ("parallel", "train", "tests")  # the packages whose attributes a test may reach a process spawner through


@pytest.fixture
def one_thread():
    """Tiny tensors on a shared CPU: intra-op threads only add contention (a 10x slower gradcheck on a loaded
    2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    """An xdist worker computes on its share of the cores, it and the processes it starts (``OMP_NUM_THREADS``, unless
    set): two workers of torch's default of a thread a core on a 2-core machine made a test that took 10 s alone take
    57 s (tests/train/test_training_health.py)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        torch.set_num_threads(int(threads))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A job run in this process sets RANK, WORLD_SIZE, MASTER_PORT, ... (``train.processes.distributed``), as a
    launcher would: put back the environment the suite started with after each test, its module- and
    session-scoped fixtures' setup included, so that no test sees another's launch (``python -m parallel.plan``
    took a leaked WORLD_SIZE=1 for the processes launched, and failed only when the tests ran in another order)."""
    saved = dict(os.environ)
    try:
        return (yield)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _named(func) -> list:
    """The objects ``func``'s code names: its globals, the modules it imports from inside, and their attributes it
    reads."""
    code, namespace = getattr(func, "__code__", None), getattr(func, "__globals__", {})
    if code is None:
        return []
    holders = [namespace.get(name, sys.modules.get(name)) for name in code.co_names]
    modules = [obj for obj in holders if isinstance(obj, ModuleType) and obj.__name__.startswith(PROJECT)]
    return holders + [getattr(module, name, None) for module in modules for name in code.co_names]


def _called(item) -> set[int]:
    """Ids of what the test function and every fixture it uses name, following the test modules' own helpers."""
    todo = [item.function] + [defs[-1].func for defs in item._fixtureinfo.name2fixturedefs.values()]
    seen: set[int] = set()
    while todo:
        func = todo.pop()
        for obj in _named(func):
            if id(obj) not in seen:
                seen.add(id(obj))
                if callable(obj) and (getattr(obj, "__module__", None) or "").startswith(("test_", "tests.")):
                    todo.append(obj)
    return seen


def pytest_collection_modifyitems(config, items):
    for item in items:
        called = _called(item)
        spawns = id(spawn) in called
        if spawns:
            item.add_marker(pytest.mark.multiprocess)
        if spawns or id(run_job) in called:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
