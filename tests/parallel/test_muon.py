"""Muon's pieces (``parallel/muon.py``, ``model/matrices.py``) and Muon under ZeRO-1.

The optimizer's whole step against a plain per-matrix reference is ``tests/train/test_muon_reference.py``.
"""
import pytest
import torch

from parallel.local import spawn
from parallel.muon import orthogonalize
from parallel.zero import plan_shards
from tests.support import pipeline_harness as harness


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_orthogonalize_reaches_the_polar_factor(dtype):
    """Each matrix of a stack goes to ``U V^T`` of its own SVD, tall or wide, whatever its scale: the stack holds a
    matrix 1e4 times another's (a norm over the whole stack would leave the small one short of 1) and singular
    values down to 1/200 of the largest. Planted bugs: one norm for the stack, a missing transpose of tall
    matrices, the settling steps left out (singular values then spread over about 0.7 - 1.2)."""
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 40, 24), (3, 24, 40)]:
        u, _, vh = torch.linalg.svd(torch.randn(*shape, generator=g, dtype=torch.float64), full_matrices=False)
        spectrum = torch.logspace(0, -2.3, min(shape[1:]), dtype=torch.float64)
        matrices = u @ torch.diag_embed(spectrum * torch.tensor([1.0, 1e4, 1e-2])[:, None].double()) @ vh
        got = orthogonalize(matrices.to(dtype), dtype=dtype).double()
        torch.testing.assert_close(got, u @ vh, rtol=0, atol=2e-3)
        singular = torch.linalg.svdvals(got)
        assert singular.min() > 0.995 and singular.max() < 1.005, (shape, singular.aminmax())


def test_a_zero_gradient_gives_a_zero_update():
    assert torch.equal(orthogonalize(torch.zeros(2, 4, 6)), torch.zeros(2, 4, 6))


def test_shards_of_muon_parameters_keep_their_matrices_whole():
    """A wo_a of 10 groups of 3 rows, a stack of 5 experts and a 2-D matrix, cut for 3 ranks: every cut of a unit
    parameter falls on a multiple of its unit, and every row is owned once."""
    shapes = [("wo_a", torch.Size([30, 8])), ("experts", torch.Size([5, 6, 8])), ("w", torch.Size([16, 8]))]
    units = {"wo_a": 3, "w": 16}
    shards = plan_shards(shapes, 3, units)
    for name, shape in shapes:
        pieces = sorted((s.start, s.stop) for s in shards if s.name == name)
        assert pieces[0][0] == 0 and pieces[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all(start % units.get(name, 1) == 0 for start, _ in pieces), (name, pieces)
    assert len({s.owner for s in shards}) == 3
    assert any(s.name == "wo_a" and 0 < s.start for s in shards)  # the test cuts inside wo_a


STEPS = 2


def _train(rank, out):
    """Two data-parallel ranks of one stage: ``STEPS`` Muon steps with ZeRO off, then with ZeRO-1."""
    from train.run.engine import build_engine

    torch.set_num_threads(1)
    record = {}
    for zero in (0, 1):
        job = harness.job_of([f"parallel.zero_stage={zero}", f"data.seq_len={harness.SEQ_LEN}",
                              f"data.micro_batch_size={harness.MICRO_BATCH}", "train.grad_accum_steps=1",
                              "train.optimizer=muon", "train.warmup_steps=1"])
        engine = build_engine(job)
        data = harness.batches(job.args.vocab_size, seed=engine.grid.data_parallel_id)
        losses = [engine.train_batch(data).item() for _ in range(STEPS)]
        params = {n: p.detach().clone() for n, p in engine.module.stage.model.named_parameters()}
        state = engine.checkpoint.optimizer_state_by_name()
        record[zero] = {"losses": losses, "params": params, "state_names": sorted(state)}
    torch.save(record, f"{out}/rank{rank}.pt")


def test_zero1_muon_is_bitwise_zero_off(tmp_path):
    """ZeRO-1 gives each rank whole matrices (wo_a's groups, whole 2-D weights) and steps them as without it.
    Planted bug: a Muon parameter cut mid-matrix (units ignored) orthogonalises halves: the weights differ."""
    spawn(_train, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for record in ranks:
        off, zero = record[0], record[1]
        assert zero["losses"] == off["losses"]
        for name, value in off["params"].items():
            assert torch.equal(zero["params"][name], value), name
    owned = [set(r[1]["state_names"]) for r in ranks]
    assert owned[0] and owned[1] and owned[0] != owned[1]  # the state is partitioned


def test_muon_writes_a_far_smaller_shared_shift_than_adamw_where_inputs_agree():
    """The routing collapse's mechanism (``docs/TRAINING_HEALTH.md``) on one 256 x 256 matrix: 512 tokens whose
    inputs are one vector plus 1% noise, each with its own output gradient. The weight's gradient is then nearly
    rank one, and AdamW's first step (about ``lr sign(G)``) moves every token's output by about ``lr |x|_1`` in the
    same direction; Muon's moves it by about ``lr 0.18 sqrt(256) |x|_2 / 16``, some 70 times less. Measured: the RMS
    of the mean output change over the tokens after one step at the same lr (torch's AdamW against ours).
    Planted bug: an elementwise step in place of the orthogonalised one (the momentum's sign at Muon's update RMS).
    A rank-one gradient normalised as a whole is already orthogonal, so that bug is the polar-factor test's."""
    from parallel.muon import MuonWithAdamW

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, generator=g) + 0.01 * torch.randn(512, 256, generator=g)
    output_grads = torch.randn(512, 256, generator=g)
    shifts = {}
    for name in ("adamw", "muon"):
        weight = torch.nn.Parameter(torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) * 0.02)
        if name == "adamw":
            optimizer = torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.0)
        else:
            optimizer = MuonWithAdamW([{"params": [weight], "matrix": (256, 256)}], lr=1e-3, betas=(0.9, 0.95),
                                      eps=1e-8, weight_decay=0.0, momentum=0.95, update_rms=0.18)
        before = x @ weight.detach().T
        (x @ weight.T * output_grads).sum().backward()
        optimizer.step()
        shifts[name] = ((x @ weight.detach().T - before).mean(0).pow(2).mean().sqrt() / 1e-3).item()
    assert shifts["muon"] < shifts["adamw"] / 30, shifts


@pytest.mark.parametrize("zero_ranks", [1, 2])
def test_memory_counts_one_moment_for_muons_matrices(zero_ranks):
    """``parallel/memory.py`` under ``train.optimizer=muon``: the state is 4 B less per matrix value (Muon keeps one
    fp32 moment where AdamW keeps two), divided over the ZeRO-1 ranks. The matrices are counted here from the model:
    every parameter of two or more dimensions but the embedding and the head (the `tiny` model has no Engram, no
    draft head, no hyper-connections). Planted bugs: Muon's saving forgotten, or counted on the embedding and head."""
    from model import ModelArgs, Transformer, layout_from_config
    from model.cli import compose
    from parallel.memory import estimate

    cfg = compose(["model=tiny"])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    with torch.device("meta"):
        model = Transformer(args, layout, init=False)
    matrices = sum(p.numel() for n, p in model.named_parameters()
                   if p.dim() >= 2 and n not in ("embed.weight", "head.weight"))
    adamw, muon = (estimate(args, layout, 1, 64, torch.float32, 0, data_parallel=zero_ranks, cuda=False, muon=m)
                   for m in (False, True))
    assert sum(adamw.state) - sum(muon.state) == pytest.approx(4 * matrices / zero_ranks)


def _resume_in_stages(rank, out):
    """2 pipeline stages (each its own Muon groups, one per matrix shape): 3 steps straight, then 2 steps, a save, fresh
    engines that load it, and the third step."""
    from pathlib import Path

    from train.formats import checkpoint
    from train.run.engine import build_engine

    torch.set_num_threads(1)
    overrides = ["parallel.pipeline_stages=2", "parallel.cuts=[8]", f"data.seq_len={harness.SEQ_LEN}",
                 f"data.micro_batch_size={harness.MICRO_BATCH}", "train.grad_accum_steps=2", "train.optimizer=muon",
                 "train.warmup_steps=1"]

    vocab = harness.job_of(overrides).args.vocab_size

    def steps(engine, skip, count):
        data = harness.batches(vocab)
        for _ in range(skip * 2):
            next(data)
        return [engine.train_batch(data).item() for _ in range(count)]

    straight = build_engine(harness.job_of(overrides))
    losses = steps(straight, 0, 3)
    first = build_engine(harness.job_of(overrides))
    steps(first, 0, 2)
    checkpoint.save(first, Path(out), 2, {"step": 2}, {}, keep=0)
    resumed = build_engine(harness.job_of(overrides))
    checkpoint.load(resumed, checkpoint.find("auto", Path(out)), 2)
    again = steps(resumed, 2, 1)
    same = all(torch.equal(p, q) for p, q in zip(straight.module.stage.model.parameters(),
                                                 resumed.module.stage.model.parameters()))
    torch.save({"losses": losses, "again": again, "same": same,
                "groups": len(resumed.optimizer.param_groups)}, f"{out}/rank{rank}.pt")


def test_muon_resumes_bitwise_under_pipeline_stages(tmp_path):
    """The stages hold different numbers of Muon groups, and the checkpoint's one LR schedule must fit each
    (``checkpoint.schedule_for``). Planted bug: the saved schedule loaded as it is (a stage with more groups than the
    saving rank fails to resume)."""
    spawn(_resume_in_stages, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["groups"] != ranks[1]["groups"]
    for record in ranks:
        assert record["same"]
    assert ranks[1]["again"] == ranks[1]["losses"][2:]  # the last stage computes the loss
