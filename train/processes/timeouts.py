"""A hang named: a collective of a step that waits past ``train.collective_timeout_s`` becomes one line.

The process groups' timeouts are set by ``train.processes.distributed`` (``init``: the start-up one; ``set_timeout``:
the shorter one after the first step); the backend then raises on the ranks that wait. Its error is a long C++ message,
raised from deep inside DeepSpeed's schedule: here it becomes a ``ReportedError`` naming the step, the rank that waited
and the limit, with the backend's own first words (gloo: "Timed out waiting 5000ms for recv operation"), and the ranks
whose heartbeat stopped or lags (``train/processes/heartbeat.py``): the ones it waited for.
"""
import contextlib

from train.processes import distributed
from train.processes.errors import ReportedError
from train.processes.heartbeat import Heartbeat


class CollectiveTimeout(ReportedError):
    """A collective of a step waited longer than ``train.collective_timeout_s``: a rank stopped or hangs."""

    exit_code = 1


@contextlib.contextmanager
def collective_timeout(step: int, seconds: float, heartbeat: Heartbeat):
    """A timed-out collective inside the step as one line: the step, this rank, the limit, the backend's words and
    the ranks ``heartbeat`` finds stopped or behind. The heartbeat reports ``step`` from here on."""
    heartbeat.step = step
    try:
        yield
    except RuntimeError as error:
        text = str(error)
        if "timed out" not in text.lower() and "timeout" not in text.lower():
            raise
        first = next((line.strip() for line in text.splitlines() if "time" in line.lower()), text.strip())
        others = heartbeat.others()
        cause = others or "every other rank beats at this step: one of them hangs inside it"
        check = "the host and GPU of each rank named" if others else "the ranks' hosts and GPUs"
        raise CollectiveTimeout(
            f"step {step}: rank {distributed.rank()} of {distributed.world_size()} waited more than {seconds:g} s in a "
            f"collective ({first[:300]}); {cause} — check {check}; train.collective_timeout_s sets the limit"
        ) from error
