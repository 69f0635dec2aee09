"""Each rank's time to its gradients: what tells a slow rank from the ranks that wait for it.

In a synchronous step every rank's wall time is the same, because the gradient reductions wait for the slowest rank:
a slow GPU, host or link shows in no rank's step time. What differs is when each rank arrives at its first reduction
(``ReduceTiedGrads``, which DeepSpeed's training schedule runs once every forward and backward of the step's
micro-batches is done): the slowest rank arrives last, the others idle in the reduction. A pipeline stage's time to
its gradients also holds its waits for the neighbouring stages' activations and gradients.
"""
import time

from deepspeed.runtime.pipe import schedule

from parallel.deepspeed_private import instructions, use_instructions


class GradientClock:
    """Seconds from ``start()`` to the step's first gradient reduction on this rank (``seconds``; None before it)."""

    def __init__(self, engine):
        table = instructions(engine)
        reduce_tied = table[schedule.ReduceTiedGrads]

        def arrive(engine, **kwargs):
            self.seconds = time.perf_counter() - self.started
            return reduce_tied(engine, **kwargs)
        table[schedule.ReduceTiedGrads] = arrive
        use_instructions(engine, table)
        self.started, self.seconds = 0.0, None

    def start(self) -> None:
        self.started, self.seconds = time.perf_counter(), None
