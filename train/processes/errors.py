"""How ``python -m train`` ends when it cannot go on: one line on stderr from rank 0, and an exit status.

- bad input (config, override, layout, batch, data, checkpoint): ``error: <what> — <what to do>``, status 2;
- a run that cannot continue (diverged, out of GPU memory, a rank's experts overloaded): the same one line, status 1;
- SIGINT / SIGTERM (``train/processes/interrupt.py``): the line that says what was saved and how to resume, 130 / 143;
- anything else is a bug: Python's traceback, status 1.
With ``HYDRA_FULL_ERROR=1`` every error shows its traceback.

Under a launcher every process meets the same bad input, so each would print the line, and the first to exit would
have the launcher kill the others (status -15 in its summary). Under ``torchrun`` the failing processes meet on the
launcher's own store (``TORCHELASTIC_USE_AGENT_STORE``: a TCP store the workers reach before any process group
exists): each posts its line and waits up to ``ALL_RANKS_WAIT_S`` for the others. When every rank failed, rank 0
prints its line (and any other rank's that differs, prefixed with the rank) and all exit with their status
together, so the launcher reports each worker's status; when only some failed, each of them prints its own line,
prefixed with its rank, and exits. Without that store (the ``deepspeed`` launcher) rank 0 reports at once and
another rank first waits ``OTHER_RANKS_WAIT_S``: when rank 0 failed too, the launcher ends the job in that time
and the line appears once; when the failure is this rank's own, it reports it, prefixed with its rank.

``reported`` wraps both the command line (before Hydra) and the job inside Hydra's task function: a job's error
must not reach Hydra, which would print its own "Error executing job" line first.
"""
import contextlib
import os
import signal
import sys
import time
from datetime import timedelta

from model.cli import USAGE_ERROR, error_line
from train.processes.interrupt import Interrupted


OTHER_RANKS_WAIT_S = 5.0
ALL_RANKS_WAIT_S = 10.0  # ranks meet the same check within seconds of each other (imports, data read in parallel)
SHOW_TRACEBACK = bool(os.environ.get("HYDRA_FULL_ERROR"))  # the user's setting, before ``reported`` changes it


class ReportedError(Exception):
    """An error whose message says everything the user needs; ``exit_code`` 2 (their input) unless a subclass
    says otherwise."""

    exit_code = USAGE_ERROR


def _usage_errors() -> tuple[type, ...]:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return ValueError, OSError, HydraException, OmegaConfBaseException


@contextlib.contextmanager
def reported():
    """Runs the job; turns the exceptions above into their line and exit status.

    Sets ``HYDRA_FULL_ERROR=1`` for Hydra itself, so that it hands its own errors (composition) here instead of
    printing a trimmed traceback; the user's setting (``SHOW_TRACEBACK``) decides whether a traceback is shown."""
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except Interrupted as stop:
        if _rank() == 0:
            print(stop.message, file=sys.stderr, flush=True)
        raise SystemExit(stop.exit_code) from None
    except KeyboardInterrupt:  # before the signal handlers exist
        if _rank() == 0:
            print("interrupted before training started; nothing to save", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except Exception as error:
        code = _exit_code(error)
        if SHOW_TRACEBACK or code is None:
            raise
        _report(_out_of_memory_line(error) if _out_of_memory(error) else error_line(error))
        raise SystemExit(code) from None


def _exit_code(error: Exception) -> int | None:
    """2 for bad input, 1 for a run that cannot go on, None for a bug (traceback)."""
    import torch

    from parallel.experts import ExpertOverload

    if isinstance(error, ReportedError):
        return error.exit_code
    if isinstance(error, (torch.OutOfMemoryError, ExpertOverload)):
        return 1
    if isinstance(error, _usage_errors()):
        return USAGE_ERROR
    return None


def _out_of_memory(error: Exception) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError)


def _out_of_memory_line(error: Exception) -> str:
    what = str(error).splitlines()[0].rstrip(".")
    return (f"error: {what} — lower data.micro_batch_size or data.seq_len, set parallel.recompute=layer, or split "
            "the model over more parallel.pipeline_stages")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _report(line: str) -> None:
    """Print ``line`` once for the job (module docstring); returns when this process should exit."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    store = _launcher_store() if world > 1 else None
    if store is not None:
        lines = _meet(store, world, line)
        if lines is not None:  # every rank failed: rank 0 speaks for all, then all exit together
            if _rank() == 0:
                print("\n".join([line, *(f"rank {r}: {other}" for r, other in enumerate(lines) if other != line)]),
                      file=sys.stderr, flush=True)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a launcher's stop must not replace the exit status
            return
    elif _rank() > 0:
        time.sleep(OTHER_RANKS_WAIT_S)  # a launcher that saw rank 0 fail ends this process meanwhile
    print(f"rank {_rank()}: {line}" if _rank() > 0 else line, file=sys.stderr, flush=True)


def _launcher_store():
    """The store torchrun's agent serves to its workers (None under other launchers, or when unreachable)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import TCPStore

    try:
        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                        timeout=timedelta(seconds=ALL_RANKS_WAIT_S))
    except (KeyError, ValueError, RuntimeError):
        return None


def _meet(store, world: int, line: str) -> list[str] | None:
    """Post this rank's line; every rank's line once all ranks posted theirs within ``ALL_RANKS_WAIT_S``, else
    None."""
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    prefix = f"csa2/failed/{attempt}/"
    keys = [f"{prefix}{r}" for r in range(world)]
    try:
        store.set(keys[_rank()], line)
        store.wait(keys, timedelta(seconds=ALL_RANKS_WAIT_S))
        return [store.get(key).decode() for key in keys]
    except RuntimeError:  # a timeout (DistStoreError is one): some rank did not fail
        return None
