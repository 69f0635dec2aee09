"""SIGINT / SIGTERM: finish the step, write a checkpoint, exit 130 / 143 with a line that says how to resume.

Inside the step loop (``Interrupts.deferred``) the first signal only sets a flag; the loop reads it after each
optimizer step, agreed over all ranks so that every rank saves at the same step. Outside it (building the engine,
the final evaluation) there is nothing to save and the signal raises ``Interrupted`` at once. SIGUSR1 (Slurm's ``--signal``) is taken as SIGTERM. A second signal
ends the process immediately, without saving; the published checkpoints stay intact (saves are atomic).

One Ctrl-C often arrives twice: the terminal signals the whole foreground process group, and ``torchrun`` /
``deepspeed`` forward what they receive to their workers. A repeat within ``REPEAT_WINDOW_S`` of the first
signal is taken as the same interrupt. Schedulers send SIGTERM before they kill a job; under ``torchrun`` the
workers have its ``--shutdown-timeout`` (30 s by default) to save before it sends SIGKILL.
"""
import contextlib
import os
import signal
import threading
import time

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + signal number, the shell's convention
# Slurm's warning before a time limit or pre-emption (sbatch --signal=USR1@<seconds>): a SIGTERM, save then exit 143
LIKE_SIGTERM = (signal.SIGUSR1,)
REPEAT_WINDOW_S = 0.5


class Interrupted(BaseException):
    """The job stops on a signal; ``message`` is its last line. A BaseException like KeyboardInterrupt, so that
    no ``except Exception`` on the way out takes it for an error."""

    def __init__(self, signum: int, message: str | None = None):
        message = message or f"interrupted by {signal.Signals(signum).name}; nothing was saved"
        super().__init__(message)
        self.signum, self.exit_code, self.message = signum, EXIT_CODES[signum], message


class Interrupts:
    """Handlers for SIGINT and SIGTERM while the context is open (main thread only); ``announce``: this rank
    prints what the first signal does."""

    def __init__(self, announce: bool = True):
        self.announce = announce
        self.signum: int | None = None  # the first signal received
        self._at = 0.0
        self._deferring = False
        self._previous = {}

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (*EXIT_CODES, *LIKE_SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @contextlib.contextmanager
    def deferred(self):
        """Within: a first signal waits for the step loop (``requested``); a signal that came before raises now."""
        if self.signum is not None:
            raise Interrupted(self.signum)
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        signum = signal.SIGTERM if signum in LIKE_SIGTERM else signum
        if self.signum is not None:
            if now - self._at < REPEAT_WINDOW_S:
                return  # the same interrupt, delivered again by a launcher
            self._say(f"{name} again: exiting now, without a checkpoint\n")
            os._exit(EXIT_CODES[signum])
        self.signum, self._at = signum, now
        if not self._deferring:
            raise Interrupted(signum)
        self._say(f"\n{name}: finishing this step, then writing a checkpoint (again to quit at once, without it)\n")

    def _say(self, text: str) -> None:
        if self.announce:
            os.write(2, text.encode())  # not print(): a handler may run inside another write to the stream
