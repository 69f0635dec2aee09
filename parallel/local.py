"""Local multi-process runs on one machine (gloo on CPU): the tests' and the CPU benchmark's launcher.

``spawn(fn, n, *args)`` starts ``n`` processes with the environment a launcher would give them (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), initialises torch.distributed through DeepSpeed, calls
``fn(rank, *args)`` in each and then destroys the process group, as a training job does
(``train/processes/distributed.py``): left to the interpreter's exit, gloo's threads can abort a process that has
finished its work ("terminate called without an active exception", test_expert_dispatch's only_local case on an Intel
Xeon, 2026-12-04). Real jobs use ``torchrun`` or ``deepspeed`` (see launch/)."""
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skip_shm_comm_build() -> None:
    """Keep DeepSpeed's CPU communication backend from JIT-compiling its shared-memory op with g++.

    On the CPU accelerator DeepSpeed's comm backend builds ``deepspeed_shm_comm`` on first use: minutes of silent
    compilation on a small machine (issue 57), rebuilt whenever the compile flags differ (a one-process run and a
    torchrun run alternated between two). The op serves only ``inference_all_reduce`` (AutoTP inference); training
    reduces through torch.distributed's gloo group either way. DeepSpeed builds it only where its table of
    compatible ops (``deepspeed.ops.__compatible_ops__``, probed once and kept, so that an edit holds) says it can,
    so the op is marked incompatible there. Called before ``init_distributed`` by CPU jobs and by every process
    ``spawn`` starts."""
    import deepspeed
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def _entry(rank: int, fn, world: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed

    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    fn(rank, *args)
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn, nprocs: int, *args) -> None:
    mp.spawn(_entry, args=(fn, nprocs, free_port(), args), nprocs=nprocs)
