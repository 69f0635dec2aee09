"""LoRA fine-tuning (issue 36, ``model/lora.py``, ``train/formats/lora.py``), CPU, ``model=v41_mini`` (8 routed experts
and a shared one per layer) and ``model=tiny`` (dense FFN).

The references are the tests' own: the merged weights ``W + (alpha/r) B A`` computed here in fp64 from the adapter
tensors read by name, loaded into a plain model without adapters; the base's files read with ``torch.load``."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model import ModelArgs, Transformer, layout_from_config
from model.cli import compose
from model.deepseek_config import WEIGHTS
from model.lora import LoRA, attach
from parallel.local import spawn
from tests.support import pipeline_harness as harness
from tests.support.in_process import run_here
from tests.support.train_run import _exact_rows, _run
from train.export import export

EVERY_MOE = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts", "experts")
RANK, ALPHA = 4, 8.0
LORA = [f"train.lora.rank={RANK}", f"train.lora.alpha={ALPHA}", f"train.lora.targets=[{','.join(EVERY_MOE)}]"]
MINI = ["model=v41_mini", *harness.V41_SIX_LAYERS, "train.dspark_loss_coef=1.0"]  # every part, on 6 layers


def _model(overrides, lora: LoRA | None = None) -> Transformer:
    cfg = compose(overrides)
    model = Transformer(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout), seed=3)
    if lora is not None:
        attach(model, lora, seed=3)
    return model.double()


def _merged_by_hand(base: dict, adapters: dict, scale: float) -> dict:
    """``W + scale · B A`` in fp64 for every ``X.lora.A`` / ``X.lora.B`` pair (adapting ``X.weight``)."""
    merged = dict(base)
    for name, a in adapters.items():
        if name.endswith(".lora.A"):
            stem = name.removesuffix(".lora.A")
            merged[f"{stem}.weight"] = base[f"{stem}.weight"].double() + scale * adapters[f"{stem}.lora.B"].double() @ a.double()
    return merged


@pytest.mark.parametrize("overrides, targets", [(["model=v41_mini"], EVERY_MOE),
                                                (["model=tiny"], ("wq_a", "wkv", "wo_a", "dense_ffn"))])
def test_adapted_model_equals_the_merged_full_weight_model(overrides, targets):
    """Adapters with random B (the update visible in the logits) against a model without adapters whose weights are
    W + (alpha/r) B A: the same logits to fp64 rounding. Every targeted matrix is merged and compared, so an adapter
    read with another scale, on the wrong half of the stacked wq_a|wkv GEMM, or with wo_a's groups cut otherwise,
    fails."""
    lora = LoRA(RANK, ALPHA, targets)
    adapted = _model(overrides, lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if name.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    state = adapted.state_dict()
    adapters = {k: v for k, v in state.items() if ".lora." in k}
    assert len({k.rsplit(".lora.", 1)[0] for k in adapters}) == len(adapters) // 2
    plain = _model(overrides)
    base = plain.state_dict()
    assert {k: v for k, v in state.items() if ".lora." not in k}.keys() == base.keys()
    plain.load_state_dict(_merged_by_hand(base, adapters, ALPHA / RANK))
    ids = torch.randint(0, 259, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = adapted(ids).logits, plain(ids).logits
        before = _model(overrides)(ids).logits
    assert (want - before).abs().max() > 0.1 * before.abs().max()  # the update matters
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_grouped_experts_with_adapters_equal_the_loop():
    """The routed experts' grouped GEMM path (CUDA's; here bf16 on CPU, forward) with adapters against the loop over
    the experts, in fp32 from the same bf16 operands."""
    from model.moe import RoutedExperts

    args = ModelArgs.from_config(compose(["model=v41_mini"]).model).moe
    experts = RoutedExperts(128, args)
    torch.nn.init.normal_(experts.w1, std=0.05), torch.nn.init.normal_(experts.w2, std=0.05)
    torch.nn.init.normal_(experts.w3, std=0.05)
    model = torch.nn.Module()  # attach looks for layers: give it one block whose FFN holds these experts
    block = torch.nn.Module()
    block.ffn = torch.nn.Module()
    block.ffn.experts = experts
    model.layers, model.args = torch.nn.ModuleDict({"0": block}), ModelArgs.from_config(compose(["model=v41_mini"]).model)
    attach(model, LoRA(8, 16.0, ("experts",)), seed=0)
    with torch.no_grad():
        for w in ("w1", "w2", "w3"):
            experts.lora[w].B.normal_(std=0.1)
    counts = torch.tensor([5, 0, 3, 8, 1, 7, 2, 6])
    x = torch.randn(int(counts.sum()), 128)
    weights = torch.rand(int(counts.sum()))
    experts.to(torch.bfloat16)
    grouped = experts(x.bfloat16(), counts, weights, grouped=True).float()
    experts.float()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(p.bfloat16().float())
    loop = experts(x.bfloat16().float(), counts, weights, grouped=False)
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------- the engine

def _engine(overrides, precision="fp32"):
    from train.run.engine import build_engine

    job = harness.job_of([*MINI, f"data.seq_len={harness.SEQ_LEN}", f"data.micro_batch_size={harness.MICRO_BATCH}",
                          "train.warmup_steps=1", f"train.precision={precision}", *overrides])
    return build_engine(job), job.args.vocab_size


def _one_process(rank, out):
    torch.set_num_threads(1)
    results = {}
    for precision in ("fp32", "bf16"):
        full, vocab = _engine([], precision)
        adapted, _ = _engine(LORA, precision)
        results[f"base_loss_{precision}"] = full.train_batch(harness.batches(vocab)).item()
        results[f"lora_loss_{precision}"] = adapted.train_batch(harness.batches(vocab)).item()
        results[f"dtypes_{precision}"] = {n: str(p.dtype) for n, p in adapted.module.stage.model.named_parameters()}
    engine, vocab = _engine(LORA)
    stage = engine.module.stage
    before = {n: t.clone() for n, t in stage.model.state_dict().items()}
    grads = []
    clip = engine._clip_gradients

    def snapshot_then_clip():
        grads.append({n for n, p in stage.model.named_parameters() if p.grad is not None})
        clip()
    engine._clip_gradients = snapshot_then_clip
    data = harness.batches(vocab)
    for _ in range(3):
        engine.train_batch(data)
    after = stage.model.state_dict()
    results.update(before=before, after=after, grads=grads,
                   optimizer=sorted(engine.checkpoint.optimizer_state_by_name()),
                   stepped=sum(len(g["params"]) for g in engine.optimizer.param_groups),
                   adapters=sum(1 for n, _ in stage.model.named_parameters() if ".lora." in n))
    torch.save(results, f"{out}/one.pt")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_one")
    run_here(_one_process, str(out))
    return torch.load(out / "one.pt", weights_only=True)


def test_step_zero_is_the_base(one):
    """B = 0: the first loss of a LoRA run is the base model's, bit for bit, in fp32 and under bf16 autocast, where
    the frozen matrices are kept in bf16 (what autocast would round them to) and the rest in fp32."""
    for precision in ("fp32", "bf16"):
        assert one[f"lora_loss_{precision}"] == one[f"base_loss_{precision}"], precision
    dtypes = one["dtypes_bf16"]
    assert dtypes["layers.0.attn.wq_a.weight"] == dtypes["layers.3.ffn.experts.w2"] == "torch.bfloat16"
    assert dtypes["head.weight"] == dtypes["layers.3.ffn.shared_experts.w1.weight"] == "torch.bfloat16"
    for name in ("embed.weight", "layers.3.ffn.gate.weight", "layers.3.attn_norm.weight", "layers.1.attn.compressor.wkv.weight",
                 "layers.0.attn.wq_a.lora.A", "layers.3.ffn.experts.lora.w1.B"):
        assert dtypes[name] == "torch.float32", name
    assert set(one["dtypes_fp32"].values()) == {"torch.float32"}


def test_only_adapters_train(one):
    """Three steps: only adapter parameters have gradients and optimizer state; the base (its routing biases and
    buffers included) is bitwise unchanged; every B moved off zero."""
    before, after = one["before"], one["after"]
    assert before.keys() == after.keys()
    base = [n for n in before if ".lora." not in n]
    assert any(n.endswith("gate.bias") for n in base)
    for name in base:
        assert torch.equal(before[name], after[name]), name
    assert all(after[n].abs().sum() > 0 for n in after if n.endswith(".lora.B"))
    for step in one["grads"]:
        assert step and all(".lora." in n for n in step), sorted(n for n in step if ".lora." not in n)[:3]
    assert one["optimizer"] and all(".lora." in n for n in one["optimizer"])
    assert one["stepped"] == one["adapters"]


# ------------------------------------------------------------------------------------------- pipeline, experts

def _global_adapters(engine) -> dict:
    """This rank's adapters under their state-dict names (an expert's under its global id)."""
    return {n: t.clone() for n, t in engine.module.stage.owned_state_dict().items()}


def _train(engine, data, steps):
    return [engine.train_batch(data).item() for _ in range(steps)], _global_adapters(engine)


def _spread(rank, out):
    torch.set_num_threads(1)
    from train.formats import checkpoint

    runs = {}
    engine, vocab = _engine([*LORA, "parallel.pipeline_stages=2", "parallel.cuts=[3]", "train.grad_accum_steps=2"])
    runs["P2"] = _train(engine, harness.batches(vocab), 2)
    engine, vocab = _engine([*LORA, "parallel.expert_parallel=2"])
    runs["E2"] = _train(engine, harness.batches(vocab, seed=engine.grid.data_parallel_id), 2)
    checkpoint.save(engine, Path(out) / "checkpoints", 2, {"step": 2}, {}, keep=0)
    torch.save(runs, f"{out}/rank{rank}.pt")


def _whole(rank, out):
    torch.set_num_threads(1)
    from train.formats import checkpoint

    runs = {}
    engine, vocab = _engine([*LORA, "train.grad_accum_steps=2"])
    runs["P2"] = _train(engine, harness.batches(vocab), 2)
    engine, vocab = _engine([*LORA, "train.grad_accum_steps=2"])
    runs["E2"] = _train(engine, harness.interleaved(vocab, 2), 2)
    resumed, _ = _engine(LORA)
    checkpoint.load(resumed, checkpoint.find("auto", Path(out) / "checkpoints"), 1)
    runs["E2_loaded"] = _global_adapters(resumed)
    runs["files"] = sorted(p.name for p in (Path(out) / "checkpoints" / "step00000002").iterdir())
    runs["saved"] = {k for p in (Path(out) / "checkpoints" / "step00000002").glob("*layer_*.pt")
                     for k in torch.load(p, weights_only=True)}
    torch.save(runs, f"{out}/whole.pt")


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_parallel")
    spawn(_spread, 2, str(out))
    run_here(_whole, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)], torch.load(out / "whole.pt",
                                                                                             weights_only=True)


def _joined(ranks, key):
    joined = {}
    for r in ranks:
        joined.update(r[key][1])
    return joined


def _near(got: dict, want: dict):
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:4]
    for name, value in want.items():
        assert (got[name] - value).norm() <= 1e-4 * value.norm() + 1e-7, name


def test_pipeline_and_expert_parallel_lora_equal_one_process(parallel_runs):
    """Two pipeline stages, and two replicas splitting the routed experts (E = 2, each its own microbatches), against
    one process with the same microbatches: the losses, and every adapter after two steps (the experts' from the
    rank holding them, under their global ids) to fp32 reduction order. The E = 2 checkpoint holds adapters only
    (the experts' in one file per expert range), and one process loads them back exactly."""
    ranks, whole = parallel_runs
    for run in ("P2", "E2"):
        assert ranks[-1][run][0] == pytest.approx(whole[run][0], rel=1e-5), run
        _near(_joined(ranks, run), whole[run][1])
    joined = _joined(ranks, "E2")
    assert whole["E2_loaded"].keys() == joined.keys()
    assert all(torch.equal(whole["E2_loaded"][n], joined[n]) for n in joined)
    assert {f for f in whole["files"] if f.startswith("experts_layer_000")} == {"experts_layer_000_00000.pt",
                                                                                  "experts_layer_000_00004.pt"}
    assert whole["saved"] and all(".lora." in n for n in whole["saved"])
    assert not [f for f in whole["files"] if f.startswith("rows_")]  # the frozen Engram tables are not saved


# ------------------------------------------------------------------------------------------- runs, resume, export

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("base")
    _run(run_dir, *MINI, "train.max_steps=2")
    return run_dir


def test_adapter_checkpoint_resumes_like_an_uninterrupted_run(base, tmp_path):
    """A LoRA run on the base stopped at step 2 and resumed to 4 equals 4 steps straight (every logged number); its
    checkpoint holds adapters and their optimizer state only and names its base; the export is the base with every
    adapted matrix W + (alpha/r) B A (computed here in fp64 from the checkpoint's files), the rest bitwise the
    base's."""
    init = [*MINI, *LORA, f"train.init_from={base / 'checkpoints'}", "train.max_steps=4", "train.checkpoint_every=2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    _run(straight, *init)
    _run(split, *init, "train.stop_at=2")
    _run(split, *init, "train.resume=auto")
    rows = [_exact_rows(d) for d in (split, straight)]
    assert rows[0] == rows[1] and len(rows[0]) == 4
    adapters = weights_of(straight)
    assert adapters and all(".lora." in n for n in adapters)
    latest = straight / "checkpoints" / (straight / "checkpoints" / "latest").read_text()
    optimizer = {k for p in latest.glob("optimizer_*.pt") for k in torch.load(p, weights_only=True)}
    assert optimizer == {n for n, _ in _lora_parameters()}
    saved = json.loads((latest / "trainer_state.json").read_text())["config"]["train"]
    assert saved["init_from"] == str(base / "checkpoints") and saved["lora"]["rank"] == RANK

    export(str(straight / "checkpoints"), tmp_path / "out", "fp32")
    exported, source = load_file(tmp_path / "out" / WEIGHTS), weights_of(base)
    assert exported.keys() == source.keys()
    want = _merged_by_hand(source, adapters, ALPHA / RANK)
    adapted = {n.removesuffix(".lora.A") + ".weight" for n in adapters if n.endswith(".lora.A")}
    for name, tensor in exported.items():
        if name in adapted:
            torch.testing.assert_close(tensor.double(), want[name], rtol=1e-6, atol=1e-6)
            assert not torch.equal(tensor, source[name]), name
        else:
            assert torch.equal(tensor, source[name]), name


def weights_of(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every weight of a run's newest checkpoint, read with torch.load (a one-process run's table: one rows file)."""
    tag = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    state = {}
    for path in sorted(tag.glob("*.pt")):
        if path.name.startswith("rows_"):
            rows = torch.load(path, weights_only=True)
            state[rows["name"]] = rows["values"]
        elif not path.name.startswith(("optimizer_", "resume_state")):
            state.update(torch.load(path, weights_only=True))
    return state


def _lora_parameters():
    """The parameters a LoRA checkpoint's optimizer state should cover (named_parameters names)."""
    model = _model(MINI, LoRA.from_config(compose([*MINI, *LORA]).train.lora))
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("overrides, message", [
    (["train.lora.rank=-1"], r"train.lora.rank=-1 is out of range — set a whole number >= 0"),
    (["train.lora.rank=4", "train.lora.targets=[wq_a,q_proj]"], r"train.lora.targets=\['wq_a', 'q_proj'\]: use .*'q_proj' unknown"),
    (["train.lora.rank=4", "train.lora.targets=[]"], r"train.lora.targets=\[\]: use a non-empty list"),
    (["train.lora.rank=4", "train.lora.alpha=0"], r"train.lora.alpha=0 is out of range — set a number > 0"),
    (["train.lora.rank=4", "train.lora.targets=[dense_ffn]", "model=v41_mini"], r"has no dense_ffn — leave it out"),
    (["train.lora.rank=4", "train.lora.targets=[experts]"], r"model.ffn=dense.* has no experts"),
    (["train.lora.rank=4"], r"train.lora.rank=4 trains adapters on a frozen base: set train.init_from="),
    (["train.lora.rank=4", "train.optimizer=muon"], r"train.optimizer=muon trains whole matrices.*use "
                                                    r"train.optimizer=adamw for LoRA"),
    (["train.lora.rank=4", "train.lora.quantized_base=true", "train.init_from=/nowhere"],
     r"train.lora.quantized_base=true keeps the base as DeepSeek's release stores it: set train.init_from to a "
     r"released directory \(it is /nowhere\)"),
])
def test_bad_settings_fail_in_one_line(overrides, message, tmp_path):
    from train.run.preflight import planned

    with pytest.raises(ValueError, match=message) as error:
        planned(compose(["data.seq_len=64"] + overrides), world_size=1)
    assert "\n" not in str(error.value)


def test_resume_on_another_base_or_settings_is_refused(base, tmp_path):
    from train.formats.checkpoint import CheckpointError

    init = [*MINI, *LORA, f"train.init_from={base / 'checkpoints'}", "train.max_steps=1"]
    run_dir = tmp_path / "run"
    _run(run_dir, *init)
    with pytest.raises(CheckpointError, match="trained with train.lora=rank 4.*this run has rank 8"):
        _run(run_dir, *init, "train.lora.rank=8", "train.max_steps=2", "train.resume=auto")
    with pytest.raises(CheckpointError, match="holds adapters of the base train.init_from="):
        _run(run_dir, *init, f"train.init_from={run_dir / 'checkpoints'}", "train.max_steps=2", "train.resume=auto")
