"""Expert parallelism on the real engine (issue 35), CPU gloo, ``model=v41_mini`` with its draft head trained (8
routed experts a layer, 4 in the draft head's MoE).

In one spawn of 4 processes: one stage x 4 data-parallel replicas with ``parallel.expert_parallel`` 1 and 2 (each
replica its own microbatch stream), two steps each; the E = 2 run saves after step 1 and an E = 4 engine resumes it for
step 2 (the shared expert after the exchange, ``parallel.expert_overlap=false``; the others overlap it); then 2 stages x
2 replicas with E = 2. In the test's own process (a world of one): the 2 x 2 run's microbatches accumulated in one step,
and the E = 2 checkpoint resumed with the 4 replicas' step-2 microbatches. Everything equal to fp32 reduction order
(``NEAR_*``): the losses, every reduced gradient of step 1 (an expert's under its global id, from whichever rank holds
it) and the whole state after step 2, routing biases included; the biases bitwise equal across replicas.
"""
from pathlib import Path

import pytest
import torch

from parallel.local import spawn
from tests.support import pipeline_harness as harness
from tests.support.in_process import run_here
from train.observe import routing

WORLD, MICRO = 4, 2
# v41_mini on 6 layers (harness.V41_SIX_LAYERS); the 2-stage cut [4] keeps both Engram tables on the first stage
# and the last two layers on the second, as [8] of 10 did.
OVERRIDES = ["model=v41_mini", *harness.V41_SIX_LAYERS, "train.dspark_loss_coef=1.0",
             f"data.seq_len={harness.SEQ_LEN}", f"data.micro_batch_size={MICRO}", "train.warmup_steps=1"]
# Gradients (step 1) measured between E = 1, 2 and 4: at most 2.6e-7 of a tensor's norm (the same sums in another
# order; 1.8e-7 on the 6 layers). The state after step 2 also goes through Adam's division by the root of the second
# moment, which magnifies that rounding where an entry's gradient is tiny: at most 5.7e-5 (a draft-head expert's w2;
# 4.3e-5 a hyper-connection scale; on the 6 layers 6.5e-5, a hyper-connection scale, and 1.1e-4 between the 2 x 2
# run and one process). Experts the optimizer does not step are 0.96 away, halved expert gradients 1e-1.
NEAR_GRAD, NEAR_STATE = 1e-5, 1e-3


def _engine(stages: int, replicas: int, experts: int, microbatches: int = 1, overlap: bool = True):
    from train.run.engine import build_engine

    job = harness.job_of([*OVERRIDES, f"parallel.pipeline_stages={stages}", f"parallel.expert_parallel={experts}",
                          f"parallel.expert_overlap={str(overlap).lower()}", f"train.grad_accum_steps={microbatches}",
                          "parallel.cuts=[4]" if stages == 2 else "parallel.cuts=null"])
    return build_engine(job), job.args.vocab_size


def _global(engine, tensors: dict) -> dict:
    """``tensors`` (this rank's, by parameter name) under global names: an expert-parallel rank's stacked experts
    as the reference's per-expert names by global id, an Engram table's shard under ``<name>@<first row>``."""
    from model.moe import ROUTED_WEIGHTS

    module, out = engine.module, {}
    stacked = {f"{name}.experts.{w}": moe.experts.expert_ids.start
               for name, moe in module.stage.model.experts().items() for w in ROUTED_WEIGHTS}
    for name, t in tensors.items():
        t = (t.to_dense() if t.is_sparse else t).detach().clone()
        if name in stacked:
            prefix, matrix = name.rsplit(".", 1)
            out.update({f"{prefix}.{stacked[name] + i}.{matrix}.weight": e for i, e in enumerate(t)})
        elif name in module.row_shards:
            out[f"{name}@{module.row_shards[name][0]}"] = t
        else:
            out[name] = t
    return out


def _train(engine, data, steps: int, checkpoint_dir: Path | None = None) -> dict:
    """``steps`` steps; each step's reduced gradients (before clipping) and the state after the last."""
    from train.formats import checkpoint

    grads = []
    clip = engine._clip_gradients

    def snapshot_then_clip():
        named = engine.module.stage.model.named_parameters()
        grads.append(_global(engine, {n: p.grad for n, p in named if p.grad is not None}))
        clip()
    engine._clip_gradients = snapshot_then_clip
    losses = []
    for step in range(1, steps + 1):
        losses.append(engine.train_batch(data).item())
        if step == 1 and checkpoint_dir is not None:
            checkpoint.save(engine, checkpoint_dir, step, {"step": step}, {}, keep=0)
    state = {n: t for n, t in engine.module.stage.model.state_dict().items() if n not in engine.module.row_shards}
    tables = {n: p for n, p in engine.module.stage.model.named_parameters() if n in engine.module.row_shards}
    received = {key: torch.tensor(pair) for key, pair in routing.received_rows(engine).items()}
    loads = {routing.layer_key(name): load.float().cpu() for name, load in engine.expert_loads.items()}
    return {"losses": losses, "grads": grads, "state": {**_global(engine, state), **_global(engine, tables)},
            "received": received, "loads": loads}


def _spread(rank, out):
    torch.set_num_threads(1)
    runs = {}
    for experts in (1, 2):
        engine, vocab = _engine(1, WORLD, experts)
        data = harness.batches(vocab, seed=engine.grid.data_parallel_id)
        runs[f"E{experts}"] = _train(engine, data, 2, Path(out) / "checkpoints" if experts == 2 else None)
    from train.formats import checkpoint

    resumed, vocab = _engine(1, WORLD, 4, overlap=False)
    assert not resumed.module.expert_groups.dispatch.overlap
    checkpoint.load(resumed, checkpoint.find("auto", Path(out) / "checkpoints"), 1)
    data = harness.batches(vocab, seed=resumed.grid.data_parallel_id)
    next(data)
    runs["E2_into_E4"] = _train(resumed, data, 1)
    engine, vocab = _engine(2, 2, 2, microbatches=2)  # 1F1B: at least a microbatch per stage
    runs["P2xE2"] = _train(engine, harness.batches(vocab, seed=engine.grid.data_parallel_id), 2)
    torch.save(runs, f"{out}/rank{rank}.pt")


def _whole(rank, out):
    from train.formats import checkpoint

    runs = {}
    resumed, vocab = _engine(1, 1, 1, microbatches=WORLD)
    checkpoint.load(resumed, checkpoint.find("auto", Path(out) / "checkpoints"), 1)
    runs["E2_into_one"] = _train(resumed, harness.interleaved(vocab, WORLD, skip_steps=1), 1)
    engine, vocab = _engine(1, 1, 1, microbatches=4)  # the 2 x 2 run's microbatches of a step
    runs["two_replicas_in_one"] = _train(engine, harness.interleaved(vocab, 2), 2)
    saved = checkpoint.find("auto", Path(out) / "checkpoints").path
    runs["missing_expert_error"] = _missing_expert_error(engine, saved)
    torch.save(runs, f"{out}/whole.pt")


def _missing_expert_error(engine, saved: Path) -> str:
    """The error of loading the E = 2 checkpoint with the second half of layer 0's experts gone."""
    import shutil

    damaged = saved.parent / "missing_expert"
    shutil.copytree(saved, damaged)
    (second,) = [p for p in damaged.rglob("experts_layer_000_*.pt") if not p.name.endswith("_00000.pt")]
    second.unlink()
    try:
        engine.checkpoint.load_weights(str(second.parent))
    except FileNotFoundError as err:
        return str(err)
    return "loaded"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("experts")
    spawn(_spread, WORLD, str(out))
    run_here(_whole, str(out))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return ranks, torch.load(out / "whole.pt", weights_only=True)


def _merged(ranks: list[dict], key: str, what: str, step: int | None = None) -> dict:
    """A run's gradients (of ``step``) or state over all its ranks: the experts and table rows each rank holds, the
    rest from any replica; the tables joined from their shards."""
    merged, shards = {}, {}
    for r in ranks:
        part = r[key][what] if step is None else r[key][what][step]
        for name, t in part.items():
            table, _, first = name.partition("@")
            if first:
                shards.setdefault(table, {})[int(first)] = t
            else:
                merged[name] = t
    for table, pieces in shards.items():
        merged[table] = torch.cat([pieces[first] for first in sorted(pieces)])[:_rows(table, ranks, key)]
    return merged


def _rows(table: str, ranks, key) -> int:
    """A table's rows: the sum of its shards but the last one's padding (the unpadded shard sizes, ceil(rows/world))."""
    from model.cli import compose
    from model.config import ModelArgs
    from model.engram_layout import table_rows

    args = ModelArgs.from_config(compose(OVERRIDES).model)
    return dict(zip((f"layers.{layer}.engram.embed.weight" for layer in args.engram.layers),
                    table_rows(args.engram)))[table]


def _near(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want))[:5])
    near = NEAR_GRAD if what.endswith("grads") else NEAR_STATE
    for name, value in want.items():
        assert (got[name] - value).norm() <= near * value.norm() + 1e-7, (what, name)


def test_expert_parallel_equals_every_expert_on_every_replica(runs):
    """E = 2 and E = 4 against E = 1 on the same 4 replicas: the losses, both steps' reduced gradients of every
    parameter (each expert under its global id, from the rank holding it) and the state after step 2. The E = 4
    engine is the one that resumed E = 2's checkpoint after step 1 (``test_a_checkpoint_moves...``): its step 2."""
    ranks, _ = runs
    want = ranks[0]["E1"]
    assert ranks[0]["E2"]["losses"] == pytest.approx(want["losses"], rel=1e-5)
    for step in (0, 1):
        _near(_merged(ranks, "E2", "grads", step), _merged(ranks, "E1", "grads", step), f"E2 step {step} grads")
    _near(_merged(ranks, "E2", "state"), _merged(ranks, "E1", "state"), "E2 state")
    assert ranks[0]["E2_into_E4"]["losses"][0] == pytest.approx(want["losses"][1], rel=1e-5)
    _near(_merged(ranks, "E2_into_E4", "grads", 0), _merged(ranks, "E1", "grads", 1), "E4 step 1 grads")
    _near(_merged(ranks, "E2_into_E4", "state"), _merged(ranks, "E1", "state"), "E4 state")


def test_pipeline_stages_with_expert_parallelism_equal_one_process(runs):
    """2 stages x 2 replicas (2 microbatches each) x E = 2 against one process with the four microbatches."""
    ranks, whole = runs
    want = whole["two_replicas_in_one"]
    assert ranks[-1]["P2xE2"]["losses"] == pytest.approx(want["losses"], rel=1e-5)
    _near(_merged(ranks, "P2xE2", "grads", 0), _merged([whole], "two_replicas_in_one", "grads", 0), "P2xE2 grads")
    _near(_merged(ranks, "P2xE2", "state"), _merged([whole], "two_replicas_in_one", "state"), "P2xE2 state")


def test_a_checkpoint_moves_between_expert_parallel_sizes(runs):
    """Saved under E = 2 after step 1, resumed under E = 4 and in one process: step 2 there equals step 2 of the
    E = 2 run (the experts re-split by their files, their Adam state by its global rows, the tables by row ranges)."""
    ranks, whole = runs
    want = _merged(ranks, "E2", "state")
    assert ranks[0]["E2_into_E4"]["losses"][0] == pytest.approx(ranks[0]["E2"]["losses"][1], rel=1e-5)
    _near(_merged(ranks, "E2_into_E4", "state"), want, "E2 -> E4 state")
    assert whole["E2_into_one"]["losses"][0] == pytest.approx(ranks[0]["E2"]["losses"][1], rel=1e-5)
    _near(_merged([whole], "E2_into_one", "state"), want, "E2 -> one process state")


def test_routing_biases_are_identical_on_every_replica(runs):
    """The balance step sums the loads over the stage's replicas before moving the biases: bitwise equal on all."""
    ranks, _ = runs
    for key in ("E2", "E2_into_E4", "P2xE2"):
        biases = [n for n in ranks[0][key]["state"] if n.endswith("gate.bias")]
        assert biases
        for name in biases:
            assert ranks[0][key]["state"][name].abs().sum() > 0
            for r in ranks:
                if name in r[key]["state"]:
                    assert torch.equal(r[key]["state"][name], ranks[0][key]["state"][name]), (key, name)


def test_each_ranks_received_rows_are_its_experts_loads(runs):
    """The rows each rank received at the last dispatch (``train.observe.routing.received_rows``, logged as
    ``moe/<layer>/received_max_over_mean``) against the step's expert loads: with E = 4 over the 4 replicas (one
    group, one microbatch a step) rank r received exactly the loads of its experts, so the busiest rank's rows are the
    largest sum of a quarter of the experts' loads, and the mean is the tokens x top-k each rank sent. Caught: the
    rows a rank sent counted instead (every rank the same: max = mean)."""
    ranks, _ = runs
    run = ranks[0]["E2_into_E4"]
    assert run["received"] and run["received"].keys() <= run["loads"].keys()
    for key, (most, mean) in run["received"].items():
        per_rank = run["loads"][key].view(4, -1).sum(1)
        assert most.item() == per_rank.max().item() and mean.item() == per_rank.mean().item(), key
        assert per_rank.max() > per_rank.mean(), key  # the test can tell received from sent
    assert ranks[0]["E1"]["received"] == {}  # no expert parallelism: nothing gathered


def test_a_checkpoint_missing_experts_is_refused(runs):
    _, whole = runs
    error = whole["missing_expert_error"]
    assert "does not hold every expert of this model: 12 missing, e.g. layers.0.ffn.experts.4.w1.weight" in error


@pytest.mark.parametrize("overrides, processes, message", [
    (["parallel.expert_parallel=3"], 4, "parallel.expert_parallel=3 does not divide the 4 data-parallel replica(s) "
     "of a stage (processes / parallel.pipeline_stages): use one of [1, 2, 4], or more processes"),
    (["parallel.expert_parallel=2", "parallel.pipeline_stages=2"], 2, "does not divide the 1 data-parallel"),
    (["parallel.expert_parallel=8", "model.dspark.n_routed_experts=6"], 8,
     "parallel.expert_parallel=8 does not divide the routed experts (8 and 6): use one of [1, 2]"),
    (["model=tiny", "parallel.expert_parallel=2"], 2, "needs routed experts: model.ffn=dense has none"),
    (["parallel.expert_parallel=0"], 2, "parallel.expert_parallel=0 is out of range — set a whole number >= 1"),
])
def test_expert_parallel_sizes_that_cannot_split_are_one_line_errors(overrides, processes, message):
    from model.cli import compose
    from train.run.preflight import planned

    with pytest.raises(ValueError) as err:
        planned(compose([*OVERRIDES, *overrides]), world_size=processes)
    assert message in str(err.value) and "\n" not in str(err.value)
