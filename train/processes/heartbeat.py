"""Every rank's heartbeat in the process group's store, so that a hang names the rank that stopped, not only the one
that waited.

A collective that times out fails on the ranks that wait; the rank that stopped (SIGSTOP, a dead host, a wedged
driver) says nothing. So a daemon thread of each rank writes ``heartbeat/<rank>`` = ``"<step> <wall time>"`` every
``interval_s`` into the store the group was made with (torch.distributed's TCPStore, on a connection of its own):
one small write per rank per interval, no collective and nothing on the step's path. A stopped process stops
beating; a rank alive but held up before the step shows an older step. The rank that timed out reads every beat
(``others``) and names them in its line (``train/processes/timeouts.py``). Wall times are compared across hosts, so a
beat counts as silent only after ``SILENT_BEATS`` intervals: well above the clock offsets of hosts that keep time.
"""
import threading
import time
from datetime import timedelta

from torch.distributed.distributed_c10d import _get_default_store

SILENT_BEATS = 3  # intervals without a beat after which a rank is named as stopped
STORE_TIMEOUT_S = 5  # a store that does not answer (its process stopped) is given up on after this


def interval_for(timeout_s: float) -> float:
    """A tenth of the collective timeout, between 0.5 s and 10 s: a stopped rank is silent for three beats well
    before the collective times out, and a job of 1000 ranks writes at most 2000 beats a second to the store."""
    return min(max(timeout_s / 10, 0.5), 10.0)


class Heartbeat:
    """This rank's beat, written by a daemon thread until ``close``; ``step`` is the step it reports."""

    def __init__(self, rank: int, world_size: int, interval_s: float):
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self.step = 0
        self._store = _client()
        self._stopped = threading.Event()
        self._beat()  # one beat before the first step: a rank that never beats again is named from the start
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._store.set(f"heartbeat/{self.rank}", f"{self.step} {time.time()}")

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self._beat()
            except RuntimeError:  # the store is gone: the job is ending
                return

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()

    def others(self) -> str:
        """The ranks that stopped beating or are behind this one's step, in words; "" when every other rank beats
        at this step."""
        try:
            store, now = _client(), time.time()
            beats = {r: store.get(f"heartbeat/{r}").decode().split() if store.check([f"heartbeat/{r}"]) else None
                     for r in range(self.world_size) if r != self.rank}
        except RuntimeError as error:  # the store's process stopped (it is rank 0's when no launcher serves it)
            return f"the store of the ranks' heartbeats does not answer ({str(error).splitlines()[0][:120]})"
        silent, behind = [], []
        for rank, beat in beats.items():
            if beat is None:
                silent.append(f"rank {rank} never beat")
                continue
            step, seconds = int(beat[0]), now - float(beat[1])
            if seconds > SILENT_BEATS * self.interval_s:
                silent.append(f"rank {rank} silent for {seconds:.0f} s (it had reached step {step})")
            elif step < self.step:
                behind.append(f"rank {rank} alive at step {step}")
        return "; ".join(silent + behind)


def _client():
    """A connection of its own to the group's store (the main thread's collectives keep theirs), with a short
    timeout."""
    store = _get_default_store().clone()
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    return store
