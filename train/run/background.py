"""One job at a time in a background thread: a checkpoint written while the next steps run.

``submit`` waits for the previous job, then starts the new one (or runs it at once when background work is off). A
job's failure is never lost: ``check`` (after every step) raises it once the job has ended, and ``wait`` (before the
next save, at the end of training, on the way out after a signal or an error) waits for the job and raises it."""
import threading
from collections.abc import Callable


class BackgroundJob:
    def __init__(self, enabled: bool, name: str):
        self.enabled, self.name = enabled, name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], object]) -> None:
        self.wait()
        if not self.enabled:
            job()
            return
        # a daemon: a process that dies of another error must not hang in a job waiting on a rank that is gone
        self._thread = threading.Thread(target=self._run, args=(job,), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], object]) -> None:
        try:
            job()
        except BaseException as error:  # raised in the training thread by check() or wait()
            self._error = error

    def check(self) -> None:
        """Raise the failure of a job that has ended; never waits."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the job in flight, if any; raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
