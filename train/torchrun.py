"""``python -m train.torchrun [torchrun's arguments]``: ``torchrun``, ending a failed job with its workers' own exit
status and one line instead of the launcher's traceback (``launch/torchrun.sh`` runs it).

When a worker exits non-zero, torchrun's ``main`` (decorated with ``@record``) prints a ``ChildFailedError``
traceback and a failure table, some 38 lines after the worker's one ``error:`` line, and exits 1 whatever the
workers' status: a bad setting, documented as status 2, read as status 1 (issue 57). torch offers no switch for
either, so this runs torchrun's own ``parse_args`` and ``run`` (the same launch, rendezvous and restarts) and catches
the ``ChildFailedError`` that ``main`` would have printed: the job ends with the first failed worker's status (1 for
a worker killed by a signal), after one line naming each failed worker's status. A worker's own output (a Python
traceback included) goes to the terminal as under torchrun.
"""
import logging
import signal
import sys

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher import api as launcher_api
from torch.distributed.run import parse_args, run

FINAL_STATUSES = {2, 130, 143}  # a restart would meet the same bad input, or undo a stop on purpose


class FinalStatusAgent(LocalElasticAgent):
    """torchrun's agent, restarting a failed worker group only when some failed worker's status is not final."""

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and all(f.exitcode in FINAL_STATUSES for f in result.failures.values()):
            self._remaining_restarts = 0  # the agent's own count: with none left it stops the group and returns
        return result


def failure_line(failed: ChildFailedError) -> str:
    """One line: each failed worker's global rank and exit status (or signal)."""
    statuses = ", ".join(f"rank {rank}: {status_text(failure.exitcode)}"
                         for rank, failure in sorted(failed.failures.items()))
    return f"torchrun: {failed.name} failed ({statuses})"


def status_text(exitcode: int) -> str:
    return f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"status {exitcode}"


class RestartLines(logging.Filter):
    """One line per restart of the worker group. The worker processes' records are kept, not printed: the first failed
    worker's exit code and local rank (at the end ``failure_line`` says it), the SIGTERM sent to the others. The
    agent's INFO record of a restart prints the failure with the restarts left; its warnings pass as under torchrun."""

    failed = "a worker failed"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.endswith("multiprocessing.api"):
            if record.msg.startswith("failed (exitcode"):
                exitcode, local_rank = record.args[:2]
                self.failed = f"local rank {local_rank} failed ({status_text(int(exitcode))})"
            return False
        if "attempts left; will restart worker group" in record.msg:
            left, most = record.args[2:4]
            print(f"torchrun: {self.failed}; restarting the group ({left} of {most} restarts left)", file=sys.stderr,
                  flush=True)
            return False
        return record.levelno >= logging.WARNING


def main(argv: list[str]) -> None:
    lines = RestartLines()
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(lines)
        logging.getLogger(name).setLevel(logging.INFO)
    launcher_api.LocalElasticAgent = FinalStatusAgent
    try:
        run(parse_args(argv))
    except ChildFailedError as failed:
        print(failure_line(failed), file=sys.stderr, flush=True)
        _, first = failed.get_first_failure()
        raise SystemExit(first.exitcode if first.exitcode > 0 else 1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
