"""Engram tables row-sharded over a stage's data-parallel ranks (SPEC §5.3: 196.6 B parameters cannot be
replicated), on the real engine, CPU gloo.

``model=v41_mini`` on 2 processes (one stage, two data-parallel ranks, each its own microbatch) against one
process that takes the same two microbatches in one step (gradient accumulation: the same mean of the two
gradients). Each rank holds half of every table's rows; a lookup fetches rows from their owner and the gradient goes
back to the owner only (``parallel/rows.py``), divided by the replicas as the data-parallel reduction divides every
other gradient; the tables are stepped by sparse Adam (only looked-up rows move). The two-process run saves after
step ``SAVE_AT`` and the checkpoint resumes in the one process (the row files and the sparse Adam state re-sharded
from 2 shards to 1). Everything is compared to fp32 reduction-order tolerance (the two paths sum the same numbers
in another order).
"""
from pathlib import Path

import pytest
import torch

from parallel.local import spawn
from tests.support import pipeline_harness as harness
from tests.support.in_process import run_here

STEPS, SAVE_AT, REPLICAS = 3, 2, 2
OVERRIDES = ["model=v41_mini", "model.dspark.blocks=0", f"data.seq_len={harness.SEQ_LEN}",
             f"data.micro_batch_size={harness.MICRO_BATCH}", "train.warmup_steps=1"]
TABLES = ("layers.1.engram.embed.weight", "layers.5.engram.embed.weight")
# The two runs sum the same gradients in another order (over ranks, over microbatches): 1e-7 of a gradient, which
# Adam's division by the root of the second moment magnifies where an entry is tiny. Measured after 3 steps, as a
# share of a tensor's norm: at most 2.4e-5 (a hyper-connection scale; the tables 5e-6); the bound is 4x that. An
# undivided table gradient moves the tables by 1e-1 of their norm, mixed shards by far more.
NEAR = 1e-4


def _engine(microbatches: int):
    from train.run.engine import build_engine

    job = harness.job_of([*OVERRIDES, f"train.grad_accum_steps={microbatches}"])
    return build_engine(job), job.args.vocab_size


def _record(engine, loss: float) -> dict:
    model = engine.module.stage.model
    tables = {n: (model.row_shards()[n][0], p.detach().clone()) for n, p in model.named_parameters() if n in TABLES}
    return {"loss": loss, "tables": tables, "grad_norm": engine.grad_norm.item(),
            "state": {n: t.detach().clone() for n, t in model.state_dict().items() if n not in TABLES}}


def _sharded(rank, out):
    """Two data-parallel ranks, each its own stream (``harness.batches`` seeded by the rank)."""
    from train.formats import checkpoint

    torch.set_num_threads(1)
    engine, vocab = _engine(1)
    data = harness.batches(vocab, seed=engine.grid.data_parallel_id)
    steps = []
    for step in range(1, STEPS + 1):
        steps.append(_record(engine, engine.train_batch(data).item()))
        if step == SAVE_AT:
            checkpoint.save(engine, Path(out) / "checkpoints", step, {"step": step}, {}, keep=0)
    torch.save(steps, f"{out}/rank{rank}.pt")


def _whole(rank, out):
    """One process: the same steps from scratch, then a fresh engine resumed from the sharded run's checkpoint."""
    from train.formats import checkpoint

    engine, vocab = _engine(REPLICAS)
    data = harness.interleaved(vocab, REPLICAS)
    steps = [_record(engine, engine.train_batch(data).item()) for _ in range(STEPS)]
    resumed, _ = _engine(REPLICAS)
    checkpoint.load(resumed, checkpoint.find("auto", Path(out) / "checkpoints"), 1)
    loaded = {n: p.detach().clone() for n, p in resumed.module.stage.model.named_parameters() if n in TABLES}
    after = _record(resumed, resumed.train_batch(harness.interleaved(vocab, REPLICAS, SAVE_AT)).item())
    torch.save({"steps": steps, "loaded": loaded, "resumed": after}, f"{out}/whole.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("engram_dp")
    spawn(_sharded, REPLICAS, str(out))
    run_here(_whole, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(REPLICAS)], \
        torch.load(out / "whole.pt", weights_only=True)


def _joined(ranks: list, step: int, name: str, rows: int) -> torch.Tensor:
    """A table whole, from every rank's shard (the last one padded past the table)."""
    shards = sorted(r[step]["tables"][name] for r in ranks)
    return torch.cat([t for _, t in shards])[:rows]


def test_shards_hold_halves_of_the_rows(runs):
    ranks, whole = runs
    for name in TABLES:
        rows = whole["steps"][0]["tables"][name][1].shape[0]
        starts = [r[0]["tables"][name][0] for r in ranks]
        assert starts == [0, -(-rows // REPLICAS)]  # ceil(rows / 2) rows a shard, rank order


def test_sharded_training_equals_one_process(runs):
    """Losses (the mean over ranks), the trunk's gradient norm, every table's rows and every other weight and
    routing bias after each step: equal to the one-process run to fp32 reduction order. A gradient left undivided by
    the replicas (twice the table steps under clipping), rows fetched from the wrong owner, or a table left in the
    dense all-reduce (every shard's rows summed with the other's) fails it."""
    ranks, whole = runs
    for step in range(STEPS):
        want = whole["steps"][step]
        assert sum(r[step]["loss"] for r in ranks) / REPLICAS == pytest.approx(want["loss"], rel=1e-5), step
        assert ranks[0][step]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), step
        for name, value in [*((n, want["tables"][n][1]) for n in TABLES), *want["state"].items()]:
            got = _joined(ranks, step, name, value.shape[0]) if name in TABLES else ranks[0][step]["state"][name]
            assert (got - value).norm() <= NEAR * value.norm() + 1e-7, (step, name)
            if name not in TABLES:
                assert torch.equal(got, ranks[1][step]["state"][name]), (step, name)  # the replicas agree exactly


def test_tables_move_only_where_looked_up(runs):
    """Sparse Adam: a row no step looked up keeps its initial value; looked-up rows moved."""
    _, whole = runs
    for name in TABLES:
        first, last = whole["steps"][0]["tables"][name][1], whole["steps"][-1]["tables"][name][1]
        moved = (first != last).any(-1)
        assert 0 < moved.sum() < moved.numel()


def test_a_sharded_checkpoint_resumes_in_one_process(runs):
    """The row files of 2 shards load as the whole table, and the sparse Adam state follows: the resumed step
    equals the sharded run's next step (to reduction order), which a mis-joined shard or a lost moment would not."""
    ranks, whole = runs
    for name in TABLES:
        rows = whole["loaded"][name].shape[0]
        assert torch.equal(whole["loaded"][name], _joined(ranks, SAVE_AT - 1, name, rows))
    after = whole["resumed"]
    assert after["loss"] == pytest.approx(sum(r[SAVE_AT]["loss"] for r in ranks) / REPLICAS, rel=1e-5)
    for name in TABLES:
        full = after["tables"][name][1]
        assert (full - _joined(ranks, SAVE_AT, name, full.shape[0])).norm() <= NEAR * full.norm(), name
