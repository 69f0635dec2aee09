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
    """torchrun's agent, restarting a failed worker group only when some failed worker's status is not final, and
    saying each restart in one line (torchrun logs it at INFO only, so it would pass unseen)."""

    failed = None  # the failure that ends the group's current attempt, in words

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.is_failed():
            first = min(result.failures.values(), key=lambda f: f.timestamp)
            self.failed = f"local rank {first.local_rank} failed ({status_text(first.exitcode)})"
            if all(f.exitcode in FINAL_STATUSES for f in result.failures.values()):
                self._remaining_restarts = 0  # the agent's own count: with none left it stops the group and returns
        return result

    def _restart_workers(self, worker_group):
        if self.failed is not None:  # not a membership change: the agent counted this restart already
            print(f"torchrun: {self.failed}; restarting the group ({self._remaining_restarts + 1} of "
                  f"{worker_group.spec.max_restarts} restarts left)", file=sys.stderr, flush=True)
            self.failed = None
        super()._restart_workers(worker_group)


def failure_line(failed: ChildFailedError) -> str:
    """One line: each failed worker's global rank and exit status (or signal)."""
    statuses = ", ".join(f"rank {rank}: {status_text(failure.exitcode)}"
                         for rank, failure in sorted(failed.failures.items()))
    return f"torchrun: {failed.name} failed ({statuses})"


def status_text(exitcode: int) -> str:
    return f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"status {exitcode}"


def main(argv: list[str]) -> None:
    # The worker processes' ERROR record of the first failure repeats failure_line or the restart line; their
    # warnings (the SIGTERM sent to the other workers) add nothing a user acts on.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    launcher_api.LocalElasticAgent = FinalStatusAgent
    try:
        run(parse_args(argv))
    except ChildFailedError as failed:
        print(failure_line(failed), file=sys.stderr, flush=True)
        _, first = failed.get_first_failure()
        raise SystemExit(first.exitcode if first.exitcode > 0 else 1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
