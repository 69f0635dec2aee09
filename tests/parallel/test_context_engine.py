"""Context parallelism through the training engine (``train.run.engine.build_engine``, gloo, fp32): two optimizer steps
with ``parallel.context_parallel=C`` equal the single-process steps (losses and their parts, the first step's
reduced gradients, the weights and buffers after the second step).

Rows of 128 tokens, two microbatches of 2 rows a step; row 0 holds documents of 37, 54 and 37 tokens (borders at odd
tokens, crossing every chunk border of C = 2 and 4: straddling m = 2 groups), row 1 documents of 32 and 96 (ending
at the border of C = 4's first chunk). Cases: ``tiny`` at C = 2 and C = 4, ``v41_mini`` on 6 layers
(``pipeline_harness.V41_SIX_LAYERS``: hyper-connections, MoE with its routing-bias update, Engram with its
row-sharded tables; the DSpark draft head off, which context parallelism refuses to train) at C = 2, and 2 pipeline
stages x C = 2 on 4 processes. The cases of a process count run one after the other in one spawn, each with its own
engine (and so do the one-process references).

fp32, so not bitwise: a chunk's GEMMs have other shapes than the row's, the gathered entries' gradients are summed
over ranks and the stage's gradients averaged over C ranks of C-times-scaled shares
(``tests/parallel/test_context_parallel.py`` checks the same model code in fp64 to 1e-10, v41_mini included). Measured
(2026-12-02), bounds 10x above:
- losses of both steps within 1.7e-7 relative; the LM part likewise, the indexer KLs of step 2 within 4.3e-5 (the
  first update moved the indexer by rounding, see below);
- first-step gradients within 5.3e-6 of each tensor's norm, but for tensors whose gradient is at rounding level
  (norm < 1e-7: v41_mini's mix parameters at init, sinks, q_norm gains; sums of many cancelling per-token terms):
  within 9e-12 absolute;
- weights, buffers and table rows after two AdamW steps: within 1.3e-5 of each tensor's norm (tiny), 3.1e-4
  (v41_mini: its mix scales and Engram projections): AdamW's per-element normalisation turns a rounding-level
  difference of a small gradient entry into up to lr (3e-3) of the weight.
v41_mini on its 6 layers (2026-12-07): losses 8.6e-8, the indexer KLs 2.0e-5, gradients 5.8e-7 (at rounding level
2.5e-13 absolute), the state 1.3e-5 (a mix projection).
"""
import os

import pytest
import torch

from tests.support.in_process import run_processes
from tests.support.pipeline_harness import V41_SIX_LAYERS

SEQ_LEN, MICRO_BATCH, MICROBATCHES, STEPS = 128, 2, 2, 2
STATE_BOUND = {"tiny": 1.5e-4, "v41_mini": 3e-3}
MODELS = {"tiny": ["model=tiny"], "v41_mini": ["model=v41_mini", *V41_SIX_LAYERS]}  # its parts on 6 layers
NOISE_GRADIENT = 1e-7  # a gradient norm at rounding level
CASES = {  # name -> (model, processes, more overrides)
    "tiny-C2": ("tiny", 2, ["parallel.context_parallel=2"]),
    "tiny-C4": ("tiny", 4, ["parallel.context_parallel=4"]),
    "v41_mini-C2": ("v41_mini", 2, ["parallel.context_parallel=2"]),
    "tiny-P2xC2": ("tiny", 4, ["parallel.pipeline_stages=2", "parallel.context_parallel=2"]),
}


def batches(vocab: int):
    g = torch.Generator().manual_seed(0)
    doc = torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.long)
    doc[0, 37:] = 1
    doc[0, 91:] = 2
    doc[1, 32:] = 1
    while True:
        x = torch.randint(0, vocab - 3, (MICRO_BATCH, SEQ_LEN), generator=g)
        labels = torch.roll(x, -1, 1).masked_fill(torch.roll(doc, -1, 1) != doc, -100)
        labels[:, -1] = -100
        yield (x, doc), labels


def _worker(rank, out, jobs):
    """Each job (name, overrides) in turn: its engine, two steps, this rank's results in ``<out>/<name>``."""
    torch.set_num_threads(1)
    for name, overrides in jobs:
        _job(rank, os.path.join(out, name), overrides)


def _job(rank, out, overrides):
    from tests.support.pipeline_harness import job_of
    from train.run.engine import build_engine

    job = job_of([f"data.seq_len={SEQ_LEN}", f"data.micro_batch_size={MICRO_BATCH}",
                  f"train.grad_accum_steps={MICROBATCHES}", "train.warmup_steps=1", "train.dspark_loss_coef=0",
                  *overrides])
    engine = build_engine(job)
    model = engine.module.stage.model
    first_grads, clip = {}, engine._clip_gradients

    def snapshot_then_clip():  # the reduced gradients of the first step, before clipping and the update
        if not first_grads:  # a row-sharded table's: this rank's rows, as a dense tensor
            first_grads.update({n: p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
                                for n, p in model.named_parameters() if p.grad is not None})
        clip()
    engine._clip_gradients = snapshot_then_clip
    data = batches(job.args.vocab_size)
    losses = [engine.train_batch(data).item() for _ in range(STEPS)]
    named, tables = dict(model.named_parameters()), model.row_shards()  # a row-sharded Engram table: my rows
    shards = {n: (start, named[n].detach().clone(), first_grads.pop(n, None)) for n, (start, _) in tables.items()}
    os.makedirs(out, exist_ok=True)
    torch.save({"losses": losses, "parts": {k: v.item() for k, v in engine.get_additional_losses().items()},
                "state": {n: t.detach().clone() for n, t in model.state_dict().items() if n not in tables},
                "shards": shards, "first_grads": first_grads, "last": engine.is_last_stage()},
               os.path.join(out, f"rank{rank}.pt"))


def run(out, processes, jobs: dict) -> dict:
    """The jobs (name -> overrides) one after the other in one spawn of ``processes``; each job's per-rank results."""
    run_processes(_worker, processes, out, tuple((name, tuple(overrides)) for name, overrides in jobs.items()))
    return {name: [torch.load(os.path.join(out, name, f"rank{r}.pt"), weights_only=True) for r in range(processes)]
            for name in jobs}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each model's one-process run, one after the other in this process."""
    models = sorted({model for model, _, _ in CASES.values()})
    runs = run(str(tmp_path_factory.mktemp("ref")), 1, {model: MODELS[model] for model in models})
    return {model: ranks[0] for model, ranks in runs.items()}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Every case's per-rank results, the cases of a process count in one spawn (each builds its own engine)."""
    out, runs = str(tmp_path_factory.mktemp("cp")), {}
    for processes in sorted({processes for _, processes, _ in CASES.values()}):
        runs |= run(out, processes, {name: [*MODELS[model], *overrides]
                                     for name, (model, p, overrides) in CASES.items() if p == processes})
    return runs


def _close(got, want, rel):
    return (got.double() - want.double()).norm() <= rel * want.double().norm() + 1e-30


def _merged(ranks, key):
    merged = {}
    for r in ranks:
        for name, value in r[key].items():
            if name in merged:  # the C x D ranks of a stage agree after the reduction and the step
                assert torch.equal(merged[name], value), name
            merged[name] = value
    return merged


@pytest.mark.parametrize("case", list(CASES))
def test_steps_equal_one_process(references, cases, case):
    name, ranks = CASES[case][0], cases[case]
    want = references[name]
    last = [r for r in ranks if r["last"]]
    for r in last:
        assert r["losses"] == pytest.approx(want["losses"], rel=3e-6), name
        for part, value in want["parts"].items():
            assert r["parts"][part] == pytest.approx(value, rel=3e-6 if "indexer" not in part else 5e-4), part
    grads = _merged(ranks, "first_grads")
    assert grads.keys() == want["first_grads"].keys()
    bad = [n for n, g in want["first_grads"].items()
           if not (_close(grads[n], g, 5e-5) if g.norm() >= NOISE_GRADIENT else (grads[n] - g).norm() <= 1e-10)]
    assert not bad, bad
    state, bound = _merged(ranks, "state"), STATE_BOUND[name]
    assert state.keys() == want["state"].keys()
    bad = [n for n, t in want["state"].items() if not _close(state[n], t, bound)]
    assert not bad, bad
    for r in ranks:  # a row-sharded table: each rank's rows of the whole table's weights and first gradient
        for table, (start, rows, grad) in r["shards"].items():
            _, whole, whole_grad = want["shards"][table]
            stop = min(start + rows.shape[0], whole.shape[0])
            assert _close(rows[:stop - start], whole[start:stop], bound), table
            assert _close(grad[:stop - start], whole_grad[start:stop], 5e-5), table
