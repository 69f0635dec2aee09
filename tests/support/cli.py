"""``python -m <module> args`` in the test's own process (``runpy``, as the interpreter runs a module), for the tests
of the command-line tools: a subprocess would import torch, Hydra and the project again, 2-4 s a command. The
launcher's variables that a world of one made earlier in this process left in the environment are hidden, as a fresh
shell has none (``parallel.plan`` plans for ``WORLD_SIZE`` processes)."""
import contextlib
import io
import os
import runpy
import subprocess
import sys
import warnings

from tests.support.interrupt import LAUNCHER_VARS


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """The command's status, stdout and stderr as ``subprocess.run`` gives them: a ``SystemExit`` with a message
    prints it to stderr with status 1, as the interpreter does. Any other exception is raised (a traceback)."""
    from hydra.core.global_hydra import GlobalHydra

    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_env = sys.argv, dict(os.environ)
    sys.argv = [module, *args]
    for key in LAUNCHER_VARS:
        os.environ.pop(key, None)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            _fresh_interpreter_warnings()
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as stop:
                if isinstance(stop.code, str):
                    print(stop.code, file=sys.stderr)
                    code = 1
                else:
                    code = stop.code or 0
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        GlobalHydra.instance().clear()
    return subprocess.CompletedProcess([sys.executable, "-m", module, *args], code, out.getvalue(), err.getvalue())


def _fresh_interpreter_warnings() -> None:
    """Warnings as a fresh interpreter shows them, on stderr (pytest records them instead), so that a command's
    stderr holds what a shell would see: the interpreter's default filters, and not runpy's warning that the module
    was imported already (by this process, not by the command)."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
        warnings.formatwarning(message, category, filename, lineno, line))
