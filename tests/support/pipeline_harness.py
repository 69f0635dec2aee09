"""Runs a few pipelined training steps in N gloo processes and saves what the tests compare.

Each process writes ``rank<r>.pt``: per-step losses, its stage's parameters (full-model names), its shadow
replicas, the ledger's findings and the backward-traversal counter."""
import os

import torch

from parallel.recompute import recomputation
from tests.support.in_process import run_processes

SEQ_LEN, MICRO_BATCH, MICROBATCHES, STEPS = 64, 2, 4, 2
# v41_mini's stack cut from 10 layers to 6, one of each layer mode (a window layer, an encoder Full and Reuse, a
# decoder Full -- the candidate source -- Reuse and Reindex; Engram before layers 1 and 3, the draft head reading the
# streams entering 3, 4 and 5): every layer holds the same parts, so the tests of how experts and tables are split,
# exchanged and resumed see as much on 60% of the work.
V41_SIX_LAYERS = ["layout.window_layers=1", "layout.encoder.layers=2", "layout.decoder.layers=3",
                  "model.engram.layers=[1,3]", "model.dspark.target_layers=[3,4,5]"]


def batches(vocab: int, seed: int = 0):
    """Deterministic microbatches: two packed documents per row, next-token labels (``seed``: one stream per
    data-parallel rank, say)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN), generator=g)
        doc = torch.zeros_like(x)
        doc[:, 40:] = 1
        yield (x, doc), torch.roll(x, -1, 1)


def interleaved(vocab: int, replicas: int, skip_steps: int = 0):
    """The ``replicas`` ranks' streams of ``batches`` in rank order, step after step (after ``skip_steps``): the
    microbatches one process accumulates to equal a data-parallel step."""
    streams = [batches(vocab, seed=r) for r in range(replicas)]
    for _ in range(skip_steps):
        for s in streams:
            next(s)
    while True:
        for s in streams:
            yield next(s)


def job_of(overrides: list[str], device: str = "cpu"):
    """The job ``overrides`` describe on this process's world (its process group's size), planned as
    ``python -m train``'s preflight plans it."""
    from model.cli import compose, resolved
    from parallel.job import plan
    from train.processes import distributed

    return plan(resolved(compose(overrides)), distributed.world_size(), torch.device(device))


def recompute_overrides(recompute: str) -> list[str]:
    """``none``, ``layer`` or ``block:N`` (the first N layers of every stage) as config overrides."""
    mode, _, count = recompute.partition(":")
    return [f"parallel.recompute={mode}"] + ([f"parallel.recompute_layers={count}"] if count else [])


def _worker(rank, world, out, cuts, index_k, recompute, precision, p2p, overrides):
    from train.run.engine import build_engine

    torch.set_num_threads(1)  # up to 4 processes share CI's 2 cores: more threads each only contend
    job = job_of([f"parallel.pipeline_stages={world}", f"parallel.cuts={cuts or 'null'}",
                  f"parallel.index_k={index_k}", f"parallel.p2p={p2p}", *recompute_overrides(recompute),
                  f"data.seq_len={SEQ_LEN}", f"data.micro_batch_size={MICRO_BATCH}",
                  f"train.grad_accum_steps={MICROBATCHES}", "train.warmup_steps=1", f"train.precision={precision}",
                  *overrides])
    engine = build_engine(job)
    stage = engine.module.stage
    first_grads = {}
    clip = engine._clip_gradients

    def snapshot_then_clip():  # the reduced gradients of the first step, before clipping and the update
        if not first_grads:  # a table's sparse gradient as its dense form, for comparisons
            first_grads.update({n: p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
                                for n, p in stage.model.named_parameters() if p.grad is not None})
        clip()
    engine._clip_gradients = snapshot_then_clip
    wrap, schedules = engine.wrap_schedule, []

    def recorded(schedule):  # the schedule each train_batch ran: rewritten by EagerSends under overlapped transfers
        wrapped = wrap(schedule)
        schedules.append(type(wrapped).__name__)
        return wrapped
    engine.wrap_schedule = recorded
    data = batches(job.args.vocab_size)
    losses, live_after = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data).item())
        live_after.append(stage.ledger.live())
    torch.save({"losses": losses, "parts": {k: v.item() for k, v in engine.get_additional_losses().items()},
                "params": {n: p.detach().clone() for n, p in stage.model.named_parameters()},
                "state": {n: t.detach().clone() for n, t in stage.model.state_dict().items()},  # routing biases too
                "first_grads": first_grads,
                "shadows": {n: p.detach().clone() for n, p in stage.shadows.named_parameters()},
                "recomputed": [int(i) for i, block in stage.model.layers.items() if recomputation(block)],
                "kept": [int(i) for i, block in stage.model.layers.items()
                         if recomputation(block) and recomputation(block).keep_attention],
                "live_after": live_after, "peak_microbatches": stage.ledger.peak_microbatches,
                "backward_traversals": stage.backward_traversals, "stage": engine.stage_id,
                "p2p": "overlap" if engine.links is not None else "deepspeed", "schedules": schedules},
               f"{out}/rank{rank}.pt")


def merged(ranks: list[dict], key: str) -> dict:
    """One dict of what the ranks of a run each reported under ``key`` (a stage's parameters, say)."""
    out = {}
    for r in ranks:
        out.update(r[key])
    return out


def run(out: str, stages: int, cuts=None, index_k: str = "shadow", recompute: str = "none", p2p: str = "overlap",
        precision: str = "fp32", overrides: tuple[str, ...] = ()):
    """Run the job in ``stages`` processes, or here for one stage (``precision``: fp32, or bf16 autocast;
    ``overrides``: more config, e.g. another model); returns the per-rank results."""
    return run_all(out, stages, {"job": dict(cuts=cuts, index_k=index_k, recompute=recompute, p2p=p2p,
                                             precision=precision, overrides=overrides)})["job"]


def run_all(out: str, stages: int, jobs: dict[str, dict]) -> dict[str, list]:
    """Several jobs (name -> ``run``'s keyword arguments) on the same ``stages`` processes, one after the other, each
    with its own engine: one start of the processes for all. Each job's per-rank results."""
    arguments = []
    for i, options in enumerate(jobs.values()):
        os.makedirs(f"{out}/job{i}", exist_ok=True)
        arguments.append((f"{out}/job{i}", options.get("cuts"), options.get("index_k", "shadow"),
                          options.get("recompute", "none"), options.get("precision", "fp32"),
                          options.get("p2p", "overlap"), tuple(options.get("overrides", ()))))
    run_processes(_jobs, stages, stages, tuple(arguments))
    return {name: [torch.load(f"{out}/job{i}/rank{r}.pt", weights_only=True) for r in range(stages)]
            for i, name in enumerate(jobs)}


def _jobs(rank, world, arguments):
    for args in arguments:
        _worker(rank, world, *args)
