"""The slow rank named (``parallel/gradient_clock.py``, ``train/observe/rank_times.py``): 2 gloo data-parallel ranks,
rank 1 slowed by a sleep before each forward pass. Both ranks' step times come out equal (rank 0 waits in the
reduction), but rank 1's time to its gradients is longer by the sleeps, and it is the rank the series and the warning
name.

Planted bugs it catches: a clock that measures the whole step (both ranks equal: no slow rank), the times gathered
out of rank order (rank 0 named)."""
import json
import time

import pytest
import torch
from deepspeed.runtime.pipe import schedule

from parallel.deepspeed_private import instructions, use_instructions
from parallel.gradient_clock import GradientClock
from parallel.local import spawn
from tests.support import pipeline_harness as harness
from train.observe import rank_times

SLEEP, STEPS = 0.15, 2
OVERRIDES = [f"data.seq_len={harness.SEQ_LEN}", f"data.micro_batch_size={harness.MICRO_BATCH}",
             "train.grad_accum_steps=2"]


def slow_forwards(engine, seconds: float) -> None:
    """Sleep ``seconds`` before each of this rank's forward passes."""
    table = instructions(engine)
    forward = table[schedule.ForwardPass]

    def slow(engine, **kwargs):
        time.sleep(seconds)
        return forward(engine, **kwargs)
    table[schedule.ForwardPass] = slow
    use_instructions(engine, table)


def _worker(rank, out):
    from train.run.engine import build_engine

    torch.set_num_threads(1)
    job = harness.job_of(OVERRIDES)
    engine = build_engine(job)
    clock = GradientClock(engine)
    if rank == 1:
        slow_forwards(engine, SLEEP)
    data = harness.batches(job.args.vocab_size, seed=rank)
    steps = []
    for step in range(1, STEPS + 1):
        start = time.perf_counter()
        clock.start()
        engine.train_batch(data)
        wall = time.perf_counter() - start
        times = rank_times.gather(clock.seconds, torch.device("cpu"))
        steps.append({"wall": wall, "times": times, "series": rank_times.series(times),
                      "line": rank_times.slow_ranks_line(step, times)})
    (out / f"rank{rank}.json").write_text(json.dumps(steps))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank_times")
    spawn(_worker, 2, out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_slowed_rank_is_named_though_every_step_time_is_the_same(ranks):
    slept = SLEEP * 2  # two micro-batches: two forward passes a step
    for mine, theirs in zip(*ranks):
        assert abs(mine["wall"] - theirs["wall"]) < slept / 2  # the step's wall time does not tell them apart
        assert mine["times"] == theirs["times"]  # the same gathered list on every rank
        fast, slow = mine["times"]
        assert slow - fast > 0.8 * slept, mine["times"]
        assert mine["series"]["rank_time/slowest_rank"] == 1 and mine["series"]["rank_time/max_s"] == slow
        assert mine["line"].startswith(f"step {ranks[0].index(mine) + 1}: slow ranks, by the time to their "
                                       "gradients: rank 1 "), mine["line"]


def test_no_rank_is_named_when_they_are_even():
    assert rank_times.slow_ranks_line(3, [1.0, 1.1, 0.95, 1.2]) is None
    assert rank_times.series([1.0, 1.1, 0.95, 1.2]) == {"rank_time/median_s": 1.0, "rank_time/max_s": 1.2,
                                                         "rank_time/slowest_rank": 3}
    line = rank_times.slow_ranks_line(3, [1.0, 2.5, 0.95, 1.3, 1.0])
    assert line == ("step 3: slow ranks, by the time to their gradients: rank 1 2.50 s, rank 3 1.30 s (median "
                    "1.00 s of 5 ranks); the others wait for them in the reductions")
