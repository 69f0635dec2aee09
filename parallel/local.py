"""Local multi-process runs on one machine (gloo on CPU): the tests' and the CPU benchmark's launcher.

``spawn(fn, n, *args)`` starts ``n`` processes with the environment a launcher would give them (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), initialises torch.distributed through DeepSpeed and calls
``fn(rank, *args)`` in each. Real jobs use ``torchrun`` or ``deepspeed`` (see launch/)."""
import os
import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    fn(rank, *args)


def spawn(fn, nprocs: int, *args) -> None:
    mp.spawn(_entry, args=(fn, nprocs, free_port(), args), nprocs=nprocs)
