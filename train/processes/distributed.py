"""Process-group helpers: join or create the group, and the few collectives the loop needs.

Every job has a process group, even a bare ``python -m train`` (a world of one on a free local port), so
the code never branches on "distributed or not".
"""
import os
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist

from parallel.local import free_port, skip_shm_comm_build
from train.observe.quiet import prints_to_debug


def flight_recorder(run_dir) -> dict[str, str]:
    """NCCL's flight recorder (torch's): the last collectives of every rank kept in a ring buffer and, when a
    collective times out, dumped to ``<run dir>/nccl_trace_rank_<r>`` (``torch.distributed.flight_recorder``'s
    analyser reads them and says which rank did not join which collective). Variables already set win."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": os.path.join(str(run_dir), "nccl_trace_rank_")}


def init(device: torch.device, timeout_s: float = 1800, run_dir=None) -> None:
    """Join the group the launcher (``torchrun``/``deepspeed``) describes, or create a world of one.

    gloo on CPU, NCCL on GPU (with its flight recorder dumping into ``run_dir``); ``timeout_s``: how long a collective
    may wait (``set_timeout`` changes it). A second call in the same process (tests) is a no-op.
    """
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if os.environ["WORLD_SIZE"] == "1" and "TORCHELASTIC_RUN_ID" not in os.environ:
        # A world of one that creates its own store (each job of a multirun too) takes a port free right now, not
        # one inherited from a parent process that may still hold it. Under torchrun the worker joins the store
        # its agent serves on MASTER_PORT, which must be kept.
        os.environ["MASTER_PORT"] = str(free_port())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        for key, value in flight_recorder(run_dir or os.getcwd()).items():
            os.environ.setdefault(key, value)
    else:
        skip_shm_comm_build()
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        _init_attempt(backend, timeout)
    with prints_to_debug():  # DeepSpeed announces its CPU comm op (and joins a group already made as it is)
        deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)


def set_timeout(seconds: float) -> None:
    """Every process group's timeout (the main one, DeepSpeed's and the project's own), e.g. shortened once the
    first step is done: a collective that waits longer fails on the ranks that wait."""
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        _set_pg_timeout(timedelta(seconds=seconds), group)


def _init_attempt(backend: str, timeout: timedelta) -> None:
    """The group of one torchrun attempt, its keys apart from earlier attempts'. After a restart (``--max-restarts``)
    the workers join the same store, where a dead attempt's ranks left their addresses under the same keys: a new
    rank read one before its peer overwrote it and gloo tried to connect to a dead port ("Connection refused", every
    restart failing). Prefixing the keys with the attempt (``TORCHELASTIC_RESTART_COUNT``) keeps the attempts apart."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store)
    attempt = dist.PrefixStore(f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store)
    dist.init_process_group(backend, store=attempt, rank=rank, world_size=world, timeout=timeout)


def close() -> None:
    """Leave the group at the end of a job. A group still alive at interpreter exit is torn down by C++ static
    destructors while its gloo threads may still run: once in the CPU suite (2 processes, a loaded box) a finished
    run's rank 1 aborted there ("terminate called without an active exception"), failing the job after its last
    step. PyTorch asks for this call too (its exit warning)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def side_group():
    """A gloo group of every rank for collectives run in another thread beside the training's (the background
    checkpoint writer): one group's collectives must come in the same order on every rank, which two threads on one
    group could not promise. Collective: every rank creates it at the same point."""
    return dist.new_group(backend="gloo")


def rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Per-key sum over ranks; every rank passes the same keys."""
    if dist.get_world_size() == 1:
        return values
    packed = torch.tensor(list(values.values()), dtype=torch.float64)
    if dist.get_backend() == "nccl":
        packed = packed.cuda()
    dist.all_reduce(packed)
    return dict(zip(values, packed.tolist()))


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Per-key mean over ranks, so logged numbers do not depend on the world size."""
    return {k: v / dist.get_world_size() for k, v in sum_over_ranks(values).items()}


def from_rank0(value):
    """Rank 0's ``value`` on every rank (e.g. its run directory: Hydra's timestamp differs across ranks)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
