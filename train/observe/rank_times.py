"""The slow ranks named: each rank's time to its gradients (``parallel/gradient_clock.py``) gathered on the logged
steps, as series and, when one rank is well behind the median, a warning naming it."""
import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SLOW = 1.25  # a rank this many times the median's time to its gradients is named


def gather(seconds: float, device: torch.device) -> list[float]:
    """Every rank's seconds, in rank order (collective: every rank calls it at the same step)."""
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.item() for t in every]


def series(times: list[float]) -> dict[str, float]:
    """The row's ``rank_time/*`` series: the median and the slowest rank's time to the gradients, and which rank."""
    slowest = max(range(len(times)), key=times.__getitem__)
    return {"rank_time/median_s": float(torch.tensor(times).median()), "rank_time/max_s": times[slowest],
            "rank_time/slowest_rank": slowest}


def slow_ranks_line(step: int, times: list[float]) -> str | None:
    """One line naming the ranks at least ``SLOW`` times the median (slowest first), or None."""
    median = float(torch.tensor(times).median())
    slow = sorted((r for r, t in enumerate(times) if t >= SLOW * median), key=lambda r: -times[r])
    if not slow or median <= 0:
        return None
    named = ", ".join(f"rank {r} {times[r]:.2f} s" for r in slow[:8]) + (f" and {len(slow) - 8} more" if len(slow) > 8 else "")
    return (f"step {step}: slow ranks, by the time to their gradients: {named} (median {median:.2f} s of "
            f"{len(times)} ranks); the others wait for them in the reductions")
