"""How ``python -m train`` ends when it cannot go on: one line on stderr from rank 0, and an exit status.

- bad input (config, override, layout, batch, data, checkpoint): ``error: <what> — <what to do>``, status 2;
- a run that cannot continue (diverged, out of GPU memory): the same one line, status 1;
- SIGINT / SIGTERM (``train/interrupt.py``): the line that says what was saved and how to resume, 130 / 143;
- anything else is a bug: Python's traceback, status 1.
With ``HYDRA_FULL_ERROR=1`` every error shows its traceback. Rank 0 reports at once; another rank first waits
``OTHER_RANKS_WAIT_S``: when rank 0 failed too (the same input), the launcher ends the job in that time and the line
appears once; when the failure is this rank's own, it reports it, prefixed with its rank.

``reported`` wraps both the command line (before Hydra) and the job inside Hydra's task function: a job's error
must not reach Hydra, which would print its own "Error executing job" line first.
"""
import contextlib
import os
import sys
import time

from model.cli import USAGE_ERROR, error_line
from train.interrupt import Interrupted


OTHER_RANKS_WAIT_S = 5.0
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
        _report(_out_of_memory_line(error) if code == 1 and not isinstance(error, ReportedError) else error_line(error))
        raise SystemExit(code) from None


def _exit_code(error: Exception) -> int | None:
    """2 for bad input, 1 for a run that cannot go on, None for a bug (traceback)."""
    import torch

    if isinstance(error, ReportedError):
        return error.exit_code
    if isinstance(error, torch.OutOfMemoryError):
        return 1
    if isinstance(error, _usage_errors()):
        return USAGE_ERROR
    return None


def _out_of_memory_line(error: Exception) -> str:
    what = str(error).splitlines()[0].rstrip(".")
    return (f"error: {what} — lower data.micro_batch_size or data.seq_len, set parallel.recompute=layer, or split "
            "the model over more parallel.pipeline_stages")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _report(line: str) -> None:
    if _rank() > 0:
        time.sleep(OTHER_RANKS_WAIT_S)  # a launcher that saw rank 0 fail ends this process meanwhile
        line = f"rank {_rank()}: {line}"
    print(line, file=sys.stderr, flush=True)
