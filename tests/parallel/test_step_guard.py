"""A non-finite gradient with a finite loss skips the step on every rank (``parallel/step_guard.py``) and is never
saved: one rank's gradient entry set to inf before the reductions, under 2 pipeline stages (the bad gradient on the
first stage, the loss on the second) and under expert parallelism (a routed expert's gradient, which only its own
expert-parallel group reduces); and a whole run of ``python -m train``'s loop, whose checkpoints skip that step.

Planted bug each catches: a guard that tests only the loss (the step is applied and the weights turn NaN: clipping
makes the inf entries 0 * inf)."""
import json
import math

import pytest
import torch
from deepspeed.runtime.pipe import schedule

from parallel.engine import CSA2PipelineEngine
from parallel.local import spawn
from tests.support import pipeline_harness as harness
from tests.support.train_run import _run, _train_rows

BAD_STEP = 2  # the optimizer has state by then: a skip must leave it as it was
GEOMETRY = [f"data.seq_len={harness.SEQ_LEN}", f"data.micro_batch_size={harness.MICRO_BATCH}",
            "train.warmup_steps=1"]
CASES = {  # name: (overrides, the rank whose gradient goes bad, whether the victim is a routed expert)
    "pipeline": (["parallel.pipeline_stages=2", "parallel.cuts=null", "train.grad_accum_steps=2"], 0, False),
    "experts": (["model=v41_mini", "parallel.expert_parallel=2", "train.grad_accum_steps=1"], 1, True),
}


def plant_inf(engine, victim: str, at_step: int) -> None:
    """Before the gradient reductions of optimizer step ``at_step`` (1-based), set one entry of ``victim``'s
    gradient to inf on this rank."""
    reduce = CSA2PipelineEngine._INSTRUCTION_MAP[schedule.ReduceGrads]

    def planted(self, *args, **kwargs):
        if self.global_steps + 1 == at_step:
            grad = dict(self.module.stage.model.named_parameters())[victim].grad
            grad.view(-1)[0] = math.inf
        return reduce(self, *args, **kwargs)
    engine._INSTRUCTION_MAP = {**CSA2PipelineEngine._INSTRUCTION_MAP, schedule.ReduceGrads: planted}


def _params(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.stage.model.named_parameters()}


def _state(engine) -> dict:
    """A copy of the engine's optimizer state by parameter name and key (tensors and step counts)."""
    return {f"{name}/{key}": value.clone() if torch.is_tensor(value) else torch.tensor(value)
            for name, piece in engine.checkpoint.optimizer_state_by_name().items() for key, value in piece["state"].items()}


def _worker(rank, out):
    from train.run.engine import build_engine

    torch.set_num_threads(1)
    results = {}
    for name, (overrides, bad_rank, expert) in CASES.items():
        job = harness.job_of([*GEOMETRY, *overrides])
        engine = build_engine(job)
        if rank == bad_rank:
            shards = engine.module.expert_shards
            plant_inf(engine, next(n for n in engine.module.optimized_named_parameters() if (n in shards) == expert),
                      BAD_STEP)
        data = harness.batches(job.args.vocab_size, seed=engine.grid.data_parallel_id)
        steps = []
        for _ in range(BAD_STEP + 1):
            before = (_params(engine), _state(engine))
            loss = engine.train_batch(data).item()
            after = (_params(engine), _state(engine))
            steps.append({"loss": loss, "skipped": engine.last_step_skipped, "cause": engine.guard.cause,
                          "params_same": all(torch.equal(after[0][n], t) for n, t in before[0].items()),
                          "state_same": before[1].keys() == after[1].keys() and all(
                              torch.equal(after[1][k], v) for k, v in before[1].items()),
                          "finite": all(bool(torch.isfinite(t).all()) for t in after[0].values())})
        results[name] = steps
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("guard")
    spawn(_worker, 2, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_an_inf_gradient_skips_the_step_on_every_rank(ranks, case):
    for rank in ranks:
        steps = rank[case]
        bad = steps[BAD_STEP - 1]
        assert math.isfinite(bad["loss"])  # only the gradient is bad
        assert bad["skipped"] and bad["cause"] == "gradient norm"
        assert bad["params_same"] and bad["state_same"] and bad["finite"]
        for good in steps[:BAD_STEP - 1] + steps[BAD_STEP:]:  # the steps around it train
            assert not good["skipped"] and not good["params_same"] and good["finite"]


def test_a_run_never_saves_the_skipped_step(tmp_path, monkeypatch):
    """Step 3's gradient has an inf entry: it is logged as skipped, no checkpoint is written at it (every other step
    is saved), and the weights of the next checkpoint are finite, as the next steps' losses are."""
    real = CSA2PipelineEngine._INSTRUCTION_MAP[schedule.ReduceGrads]

    def planted(engine, *args, **kwargs):
        if engine.global_steps + 1 == 3:
            next(p for p in engine.module.owned_parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
        return real(engine, *args, **kwargs)
    monkeypatch.setitem(CSA2PipelineEngine._INSTRUCTION_MAP, schedule.ReduceGrads, planted)
    _run(tmp_path, "train.max_steps=5", "train.checkpoint_every=1", "train.keep_checkpoints=0")
    rows = _train_rows(tmp_path)
    assert [r["skipped"] for r in rows] == [False, False, True, False, False]
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in rows)
    ckpt = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step00000001", "step00000002", "step00000004",
                                                           "step00000005"]
    assert json.loads((ckpt / "step00000004" / "trainer_state.json").read_text())["skipped"] == 1
    for path in (ckpt / "step00000004").glob("layer_*.pt"):
        assert all(torch.isfinite(t).all() for t in torch.load(path, weights_only=True).values())
