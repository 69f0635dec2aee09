"""What ``parallel.local.spawn(fn, 1, ...)`` runs, in the test's own process: the multi-process tests' one-process
references. A spawned process pays 3-4 s of start-up (the interpreter and the imports of torch, DeepSpeed, datasets
and Hydra) that this process has already paid; the group of one it joins is the one test_routing and
test_trainer_reference make here, made once and kept."""
import torch

from parallel.local import spawn
from train.processes import distributed


def run_here(fn, *args) -> None:
    """``fn(0, *args)`` as rank 0 of a world of one, on one thread as a spawned worker runs, with the random state
    of this process left as it was."""
    distributed.init(torch.device("cpu"))
    assert distributed.world_size() == 1, "run_here needs this process's group to be a world of one"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            fn(0, *args)
    finally:
        torch.set_num_threads(threads)


def run_processes(fn, nprocs: int, *args) -> None:
    """``spawn(fn, nprocs, *args)``, the world of one here (``run_here``)."""
    if nprocs == 1:
        run_here(fn, *args)
    else:
        spawn(fn, nprocs, *args)
