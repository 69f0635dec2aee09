"""ZeRO stage 1 on CPU (gloo): 4 processes = 2 pipeline stages x 2 data-parallel ranks, each rank its own data.

ZeRO-1 partitions the optimizer state, not the arithmetic: every loss, norm and weight must be bitwise the run with
ZeRO off (``parallel/zero.py``: the gradients are the same all-reduced and clipped tensors, and AdamW on a parameter's
rows computes the same numbers as on the whole parameter). Clipping binds on both groups (``CLIP`` is below both
norms at every step). In the same 4 processes (one spawn keeps the file fast), after the run with ZeRO off, the ZeRO
run saves a checkpoint after step ``SAVE_AT``, skips a step with a NaN loss, and the checkpoint is resumed in a
fresh engine of the same layout (step ``SAVE_AT + 1`` again) and in one of 1 stage x 4 data-parallel ranks.
"""
import math
from pathlib import Path

import pytest
import torch

from parallel.local import spawn
from parallel.zero import Shard, plan_shards, rows_of_state
from tests.support import pipeline_harness as harness

WORLD, STAGES, MICROBATCHES, STEPS, SAVE_AT = 4, 2, 2, 3, 2
CLIP = 5e-5  # below the trunk's and the indexer's gradient norms at every step: both groups are scaled


def _engine(stages: int, zero_stage: int):
    from train.run.engine import build_engine

    job = harness.job_of([f"parallel.pipeline_stages={stages}", "parallel.cuts=[8]" if stages == 2 else
                          "parallel.cuts=null", f"parallel.zero_stage={zero_stage}", f"data.seq_len={harness.SEQ_LEN}",
                          f"data.micro_batch_size={harness.MICRO_BATCH}", f"train.grad_accum_steps={MICROBATCHES}",
                          "train.warmup_steps=1", f"train.grad_clip={CLIP}"])
    return build_engine(job), job.args.vocab_size


def _data(engine, vocab: int, skip_steps: int = 0):
    """This data-parallel rank's stream, from step ``skip_steps + 1`` on."""
    data = harness.batches(vocab, seed=engine.grid.data_parallel_id)
    for _ in range(skip_steps * MICROBATCHES):
        next(data)
    return data


def _state(engine) -> dict:
    """A copy of the engine's optimizer state by name (on CPU the engine's view aliases the live tensors)."""
    return {name: {"rows": piece["rows"], "state": {k: v.clone() for k, v in piece["state"].items()}}
            for name, piece in engine.checkpoint.optimizer_state_by_name().items()}


def _snapshot(engine, loss: float) -> dict:
    stage = engine.module.stage
    return {"loss": loss, "grad_norm": engine.grad_norm.item(), "indexer_grad_norm": engine.indexer_grad_norm.item(),
            "params": {n: p.detach().clone() for n, p in stage.model.named_parameters()},
            "shadows": {n: p.detach().clone() for n, p in stage.shadows.named_parameters()},
            "state": _state(engine), "lr": engine.get_lr()[0]}


def _skip_nonfinite(engine, data) -> dict:
    """A step whose loss is NaN: True for each thing it must leave untouched."""
    before = _snapshot(engine, math.nan)
    steps = engine.global_steps
    engine.module.loss_fn.coef = math.nan  # the indexer term makes the total NaN
    engine.train_batch(data)
    after = _snapshot(engine, math.nan)
    same = {key: all(torch.equal(after[key][n], t) for n, t in before[key].items()) for key in ("params", "shadows")}
    same["state"] = all(torch.equal(after["state"][n]["state"][k], v) for n, piece in before["state"].items()
                        for k, v in piece["state"].items())
    return {**same, "skipped": engine.last_step_skipped, "lr": after["lr"] == before["lr"],
            "counted": engine.global_steps == steps + 1}


def _train(zero_stage: int, checkpoint_dir: Path | None = None) -> dict:
    """``STEPS`` steps on 2 x 2 (saving after ``SAVE_AT`` into ``checkpoint_dir``, if any), then a NaN step."""
    from train.formats import checkpoint

    engine, vocab = _engine(STAGES, zero_stage)
    data = _data(engine, vocab)
    record = {"stage": engine.stage_id, "dp": engine.grid.data_parallel_id, "steps": []}
    for step in range(1, STEPS + 1):
        record["steps"].append(_snapshot(engine, engine.train_batch(data).item()))
        if step == SAVE_AT and checkpoint_dir:
            checkpoint.save(engine, checkpoint_dir, step, {"step": step}, {}, keep=0)
    record["skip"] = _skip_nonfinite(engine, data)
    return record


def _resume(stages: int, checkpoint_dir: Path) -> tuple[object, int]:
    from train.formats import checkpoint

    engine, vocab = _engine(stages, 1)
    checkpoint.load(engine, checkpoint.find("auto", checkpoint_dir), STAGES)
    return engine, vocab


def _worker(rank, out):
    torch.set_num_threads(1)  # 4 processes share the cores: more threads each only contend
    checkpoint_dir = Path(out) / "checkpoints"
    replicated = _train(0)
    zero = _train(1, checkpoint_dir)
    resumed, vocab = _resume(STAGES, checkpoint_dir)
    zero["resumed"] = _snapshot(resumed, resumed.train_batch(_data(resumed, vocab, SAVE_AT)).item())
    reshaped, vocab = _resume(1, checkpoint_dir)  # 1 stage x 4 data-parallel ranks
    loaded = {"params": {n: p.detach().clone() for n, p in reshaped.module.stage.model.named_parameters()},
              "state": _state(reshaped), "lr": reshaped.get_lr()[0]}
    zero["reshaped"] = {**loaded, "loss": reshaped.train_batch(_data(reshaped, vocab, SAVE_AT)).item()}
    torch.save({"replicated": replicated, "zero": zero}, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero")
    spawn(_worker, WORLD, str(out))
    return out, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.fixture(scope="module")
def replicated(runs):
    return [r["replicated"] for r in runs[1]]


@pytest.fixture(scope="module")
def zero(runs):
    return runs[0], [r["zero"] for r in runs[1]]


def _merged(ranks: list[dict], pick) -> dict:
    """One data-parallel rank per stage, merged: the whole model under full-model names."""
    merged = {}
    for r in ranks:
        if r["dp"] == 0:
            merged.update(pick(r))
    return merged


def _full_state(ranks: list[dict], step: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's optimizer state after ``step``, joined from all ranks' pieces."""
    pieces = {}
    for r in ranks:
        for name, piece in r["steps"][step - 1]["state"].items():
            pieces.setdefault(name, []).append(piece)
    params = _merged(ranks, lambda r: r["steps"][step - 1]["params"])
    return {name: rows_of_state(Shard(name, 0, params[name].shape[0], 0), p, torch.device("cpu"))
            for name, p in pieces.items()}


def test_plan_shards_cuts_rows_into_balanced_contiguous_runs():
    shapes = [("a", torch.Size([10, 4])), ("b", torch.Size([3])), ("c", torch.Size([7, 2, 2])), ("d", torch.Size([5]))]
    for parts in (1, 2, 3, 5):
        shards = plan_shards(shapes, parts)
        assert [s.owner for s in shards] == sorted(s.owner for s in shards) and shards[-1].owner == parts - 1
        for name, shape in shapes:  # every row of every parameter exactly once, in order
            mine = [s for s in shards if s.name == name]
            assert mine[0].start == 0 and mine[-1].stop == shape[0]
            assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))
        sizes = [sum((s.stop - s.start) * math.prod(dict(shapes)[s.name][1:]) for s in shards if s.owner == k)
                 for k in range(parts)]
        assert max(sizes) - min(sizes) <= 2 * 4, (parts, sizes)  # about one row apart (rows of at most 4)
    assert plan_shards(shapes, 1) == [Shard(n, 0, s[0], 0) for n, s in shapes]
    with pytest.raises(ValueError, match="no rows to own"):
        plan_shards([("w", torch.Size([2, 8]))], 3)


def test_rows_of_state_joins_pieces_of_any_split():
    exp_avg, step = torch.arange(12.0).view(6, 2), torch.tensor(3.0)
    pieces = [{"rows": (0, 4), "state": {"exp_avg": exp_avg[:4], "step": step}},
              {"rows": (4, 6), "state": {"exp_avg": exp_avg[4:], "step": step}}]
    state = rows_of_state(Shard("w", 3, 6, 0), pieces, torch.device("cpu"))
    assert torch.equal(state["exp_avg"], exp_avg[3:]) and torch.equal(state["step"], step)
    with pytest.raises(ValueError, match="does not cover rows 3:6"):
        rows_of_state(Shard("w", 3, 6, 0), pieces[:1], torch.device("cpu"))


def test_a_fused_adamw_resumes_from_pieces_as_if_uninterrupted():
    """torch's fused AdamW (the GPU default, train/run/engine.py) reads ``step`` as an fp32 tensor on the parameter's
    device: the resumed state must give it that and step exactly as the optimizer that never stopped."""
    grads = [torch.randn(6, 2, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    w = torch.nn.Parameter(torch.randn(6, 2))
    start = w.detach().clone()

    def stepped(opt, param, gs):
        for g in gs:
            param.grad = g.clone()
            opt.step()

    whole = torch.optim.AdamW([w], lr=0.1, fused=True)
    stepped(whole, w, grads[:1])
    saved = {k: v.clone() for k, v in whole.state[w].items()}
    after_one = w.detach().clone()
    stepped(whole, w, grads[1:])
    resumed = torch.nn.Parameter(after_one)
    opt = torch.optim.AdamW([resumed], lr=0.1, fused=True)
    pieces = [{"rows": (0, 4), "state": {k: v[:4] if v.dim() else v for k, v in saved.items()}},
              {"rows": (4, 6), "state": {k: v[4:] if v.dim() else v for k, v in saved.items()}}]
    opt.state[resumed] = rows_of_state(Shard("w", 0, 6, 0), pieces, resumed.device)
    assert opt.state[resumed]["step"].dtype == torch.float32 and opt.state[resumed]["step"] is not saved["step"]
    stepped(opt, resumed, grads[1:])
    assert not torch.equal(w, start) and torch.equal(resumed, w)


def test_zero1_is_bitwise_zero_off(replicated, zero):
    _, ranks = zero
    for want, got in zip(replicated, ranks):
        for step, (a, b) in enumerate(zip(want["steps"], got["steps"]), 1):
            for key in ("loss", "grad_norm", "indexer_grad_norm", "lr"):
                assert a[key] == b[key], (step, key)
            for name, value in a["params"].items():
                assert torch.equal(b["params"][name], value), (step, name)
    for step in range(1, STEPS + 1):
        full = _full_state(ranks, step)
        for r in replicated:  # ZeRO off: every rank holds every state whole
            for name, piece in r["steps"][step - 1]["state"].items():
                assert all(torch.equal(full[name][k], v) for k, v in piece["state"].items()), (step, name)


def test_clipping_binds_on_both_groups(zero):
    _, ranks = zero
    for step in ranks[0]["steps"]:
        assert step["grad_norm"] > CLIP and step["indexer_grad_norm"] > CLIP


def _held(rank: dict) -> int:
    """Elements of optimizer state (AdamW's first moment) a rank holds after the last step."""
    return sum(piece["state"]["exp_avg"].numel() for piece in rank["steps"][-1]["state"].values())


def test_optimizer_state_is_partitioned(replicated, zero):
    """The ranks of a stage hold the state of disjoint runs of rows that tile every parameter, in halves that differ
    by at most a row; without ZeRO each rank holds the whole stage."""
    _, ranks = zero
    for stage in range(STAGES):
        of_stage = [r for r in ranks if r["stage"] == stage]
        params = of_stage[0]["steps"][-1]["params"]
        for name, p in params.items():
            rows = sorted(r["steps"][-1]["state"][name]["rows"] for r in of_stage if name in r["steps"][-1]["state"])
            assert rows[0][0] == 0 and rows[-1][1] == p.shape[0], name
            assert all(a[1] == b[0] for a, b in zip(rows, rows[1:])), name
        total = sum(p.numel() for p in params.values())
        held = [_held(r) for r in of_stage]
        assert sum(held) == total and abs(held[0] - held[1]) <= max(p[0].numel() for p in params.values()), held
        assert all(_held(r) == total for r in replicated if r["stage"] == stage)


def test_shadows_equal_owners_after_every_step(zero):
    _, ranks = zero
    for step in range(STEPS):
        params = _merged(ranks, lambda r: r["steps"][step]["params"])
        shadows = [(name, value) for r in ranks for name, value in r["steps"][step]["shadows"].items()]
        assert shadows
        for name, value in shadows:
            source, tensor = name.split(".", 1)
            assert torch.equal(value, params[f"layers.{source}.attn.indexer.{tensor}"]), (step, name)


def test_nonfinite_step_changes_nothing(replicated, zero):
    for r in replicated + zero[1]:
        assert all(r["skip"].values()), r["skip"]


def test_checkpoint_holds_one_optimizer_file_per_rank(zero):
    out, _ = zero
    tag = out / "checkpoints" / f"step{SAVE_AT:08d}"
    assert sorted(p.name for p in tag.glob("optimizer_stage*")) == [
        f"optimizer_stage{s:02d}_dp{d:02d}.pt" for s in range(STAGES) for d in range(WORLD // STAGES)]
    assert not list(tag.parent.glob(".*partial"))


def test_resume_at_the_same_layout_is_exact(zero):
    _, ranks = zero
    for r in ranks:
        want, got = r["steps"][SAVE_AT], r["resumed"]
        for key in ("loss", "grad_norm", "indexer_grad_norm", "lr"):
            assert got[key] == want[key], key
        for key in ("params", "shadows"):
            assert all(torch.equal(got[key][n], v) for n, v in want[key].items()), key
        assert got["state"].keys() == want["state"].keys()
        for name, piece in want["state"].items():
            assert got["state"][name]["rows"] == piece["rows"]
            assert all(torch.equal(got["state"][name]["state"][k], v) for k, v in piece["state"].items()), name


def test_resume_under_another_stage_count_and_data_parallel_size(zero):
    """1 stage x 4 ranks reads the checkpoint of 2 x 2: the same weights, each rank the saved state of its new
    quarter of the rows, and it trains on."""
    _, ranks = zero
    saved_params = _merged(ranks, lambda r: r["steps"][SAVE_AT - 1]["params"])
    saved_state = _full_state(ranks, SAVE_AT)
    held = 0
    for r in ranks:
        got = r["reshaped"]
        assert got["params"].keys() == saved_params.keys()
        assert all(torch.equal(got["params"][n], v) for n, v in saved_params.items())
        assert got["lr"] == ranks[0]["steps"][SAVE_AT - 1]["lr"] and math.isfinite(got["loss"])
        for name, piece in got["state"].items():
            start, stop = piece["rows"]
            for key, value in piece["state"].items():
                want = saved_state[name][key]
                assert torch.equal(value, want if want.dim() == 0 else want[start:stop]), (name, key)
            held += piece["state"]["exp_avg"].numel()
    assert held == sum(p.numel() for p in saved_params.values())
