"""Fine-tuning jobs (issue 14): ``train.init_from`` from our checkpoints and exported directories, strict and
non-strict matching, layout conversion, export to the reference format, context extension, SFT from weights.

The weights a run started from are read back from its first checkpoint, written after one step at ``train.lr=0``
(AdamW then changes nothing: ``p * (1 - 0 * wd) + 0 * update``), and compared with the source's files loaded with
plain ``torch.load`` / ``safetensors``, not through the code under test."""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from model import ModelArgs, Transformer, layout_from_config
from model.cli import compose, resolved
from model.config import plain
from model.deepseek_config import INDEX, WEIGHTS
from parallel.local import spawn
from tests.support import pipeline_harness as harness
from tests.support.train_run import SMALL, _run, _train_rows
from train.export import export, parse_size
from train.formats.init_from import InitFrom, from_job
from train.formats.sources import InitError

FROZEN = ["train.lr=0", "train.max_steps=1"]  # one step that leaves the loaded weights as they are
SKIP = ("optimizer_", "resume_state")


def weights_of(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every weight of a run's newest checkpoint, read with torch.load."""
    checkpoints = run_dir / "checkpoints"
    tag = checkpoints / (checkpoints / "latest").read_text()
    state = {}
    for path in sorted(tag.glob("*.pt")):
        if not path.name.startswith(SKIP):
            state.update(torch.load(path, weights_only=True))
    return state


def model_with(state: dict[str, torch.Tensor], *overrides) -> Transformer:
    cfg = compose(list(overrides))
    model = Transformer(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout))
    model.load_state_dict(state)
    return model


def logits(model: Transformer) -> torch.Tensor:
    ids = torch.randint(0, 259, (2, 96), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    """6 steps of the default layout (v41_scaled) at data.seq_len=64."""
    run_dir = tmp_path_factory.mktemp("v41")
    _run(run_dir, "train.max_steps=6")
    return run_dir


@pytest.fixture(scope="module")
def all_full(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("all_full")
    _run(run_dir, "train.max_steps=1", "layout=all_full_scaled")
    return run_dir


# ------------------------------------------------------------------------------------------- export

ISSUE_FIELDS = {"dim", "n_layers", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                "window_size", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                "candidate_source_layer_id", "index_n_heads", "index_head_dim", "index_topk", "candidate_topk_blocks",
                "candidate_block_size", "rope_theta", "compress_rope_theta", "rope_factor", "original_seq_len",
                "beta_fast", "beta_slow", "norm_eps", "vocab_size"}


def test_export_writes_reference_names_and_config(v41, tmp_path):
    files = export(str(v41 / "checkpoints"), tmp_path / "out", "fp32")
    assert files == [WEIGHTS, "config.json"]
    tensors = load_file(tmp_path / "out" / WEIGHTS)
    source = weights_of(v41)
    assert tensors.keys() == source.keys() and all(torch.equal(tensors[n], t) for n, t in source.items())
    for name in ("embed.weight", "layers.0.attn_norm.weight", "layers.0.attn.wq_a.weight", "layers.0.attn.attn_sink",
                 "layers.2.attn.compressor.wgate.weight", "layers.6.attn.indexer.wk.weight",
                 "layers.8.attn.indexer.weights_proj.weight", "layers.9.ffn.w2.weight", "norm.weight", "head.weight"):
        assert name in tensors, name
    assert "layers.6.attn.compressor.wgate.weight" not in tensors  # m = 1: no gate, as in the reference
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert ISSUE_FIELDS | {"inter_dim", "n_dense_layers", "dtype"} == set(config)
    assert {k: config[k] for k in ("dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "index_topk",
                                   "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size",
                                   "original_seq_len", "inter_dim", "n_dense_layers", "dtype")} == {
        "dim": 128, "n_layers": 10, "n_heads": 4, "head_dim": 64, "q_lora_rank": 64, "index_topk": 16,
        "candidate_source_layer_id": 6, "candidate_topk_blocks": 8, "candidate_block_size": 4,
        "original_seq_len": 65536, "inter_dim": 384, "n_dense_layers": 10, "dtype": "fp32"}
    assert config["compress_ratios"] == [0, 0, 2, 2, 2, 2, 1, 1, 1, 1]
    assert config["kv_source_layer_ids"] == [2, 4, 6] and config["index_source_layer_ids"] == [2, 4, 6, 8]


def test_export_in_bf16_and_sharded(v41, tmp_path):
    files = export(str(v41 / "checkpoints"), tmp_path / "out", "bf16", max_shard_bytes=parse_size("1MB"))
    source = weights_of(v41)
    total = sum(t.numel() * 2 for t in source.values())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) == math.ceil(total / 1e6) or len(shards) == math.ceil(total / 1e6) + 1
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert index["metadata"]["total_size"] == total and set(index["weight_map"]) == set(source)
    for shard in shards:
        with safe_open(str(tmp_path / "out" / shard), framework="pt") as handle:
            for name in handle.keys():
                assert index["weight_map"][name] == shard
                tensor = handle.get_tensor(name)
                assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, source[name].to(torch.bfloat16))
    assert not (tmp_path / "out" / WEIGHTS).exists()
    assert (tmp_path / "out" / shards[0]).stat().st_mode & 0o044  # readable by others, like any written file
    damaged = tmp_path / "out" / shards[1]
    damaged.write_bytes(damaged.read_bytes()[:50])
    with pytest.raises(ValueError, match=f"{shards[1]} is not a readable safetensors file"):
        _match(f"train.init_from={tmp_path / 'out'}")


# ------------------------------------------------------------------------------------------- init_from

def test_export_then_init_from_gives_bitwise_the_same_logits(v41, tmp_path):
    export(str(v41 / "checkpoints"), tmp_path / "out", "fp32")
    run_dir = tmp_path / "run"
    _run(run_dir, *FROZEN, f"train.init_from={tmp_path / 'out'}", "train.resume=auto")  # nothing to resume: init
    assert torch.equal(logits(model_with(weights_of(run_dir))), logits(model_with(weights_of(v41))))
    report = json.loads((run_dir / "init_from.json").read_text())
    assert len(report["loaded"]) == len(weights_of(v41)) and not report["newly_initialised"] and not report["ignored"]
    assert report["settings_differences"] == []


def _match(*overrides):
    config = resolved(compose(SMALL + list(overrides)))
    return InitFrom(config.train.init_from, config.train.init_strict, config.model.args,
                    layout_from_config(config.layout)).match


def _layer_names(layers, *parts):
    return {f"layers.{i}.attn.{p}.weight" for i in layers for p in parts}


# all_full_scaled -> v41_scaled: Reuse layers 3, 5, 7, 9 drop compressor and indexer (m = 2 layers 3, 5 a gate too);
# the Reindex layer 8 keeps its indexer's query side and drops the rest.
DROPPED = (_layer_names([3, 5, 7, 9], "compressor.wkv", "compressor.norm", "indexer.wq_b", "indexer.weights_proj",
                        "indexer.wk", "indexer.k_norm")
           | _layer_names([3, 5], "compressor.wgate") | _layer_names([8], "compressor.wkv", "compressor.norm",
                                                                     "indexer.wk", "indexer.k_norm"))


def test_strict_init_names_what_does_not_match(v41, all_full, tmp_path):
    with pytest.raises(InitError, match=r"(?s)train.init_strict=false.*not in this model \(30\):.*"
                                        r"attn\.compressor\.wgate\.weight +layers 3, 5\n.*"
                                        r"attn\.indexer\.weights_proj\.weight +layers 3, 5, 7, 9"):
        _match(f"train.init_from={all_full / 'checkpoints'}")
    with pytest.raises(InitError, match=r"(?s)missing from the source \(30\):.*attn\.compressor\.wkv\.weight"):
        _match("layout=all_full_scaled", f"train.init_from={v41 / 'checkpoints'}")
    with pytest.raises(InitError, match=r"embed\.weight: source \[259, 128\], this model \[259, 64\]"):
        _match("model.dim=64", "train.init_strict=false", f"train.init_from={v41 / 'checkpoints'}")
    with pytest.raises(InitError, match="no weights there.*neither an exported directory"):
        _match(f"train.init_from={tmp_path / 'nowhere'}")


def test_layout_conversion_keeps_and_drops_what_it_lists(all_full, tmp_path):
    """An all_full run into v41: every kept tensor is the source's, the dropped ones are exactly ``DROPPED``."""
    run_dir = tmp_path / "run"
    _run(run_dir, *FROZEN, f"train.init_from={all_full / 'checkpoints'}", "train.init_strict=false")
    report = json.loads((run_dir / "init_from.json").read_text())
    assert set(report["ignored"]) == DROPPED and report["newly_initialised"] == []
    source, started = weights_of(all_full), weights_of(run_dir)
    assert set(report["loaded"]) == set(started) == set(source) - DROPPED
    assert all(torch.equal(started[n], source[n]) for n in started)
    assert report["settings_differences"] == [
        "layout.candidate_source_layer_id: source None, this run 6",
        "layout.index_source_layer_ids: source [2, 3, 4, 5, 6, 7, 8, 9], this run [2, 4, 6, 8]",
        "layout.kv_source_layer_ids: source [2, 3, 4, 5, 6, 7, 8, 9], this run [2, 4, 6]"]


def test_what_the_source_lacks_keeps_its_seeded_initialisation(v41, tmp_path):
    run_dir = tmp_path / "run"
    _run(run_dir, *FROZEN, "layout=all_full_scaled", f"train.init_from={v41 / 'checkpoints'}",
         "train.init_strict=false")
    report = json.loads((run_dir / "init_from.json").read_text())
    assert set(report["newly_initialised"]) == DROPPED and report["ignored"] == []
    seeded = Transformer(ModelArgs.from_config(compose(["layout=all_full_scaled"]).model),
                         layout_from_config(compose(["layout=all_full_scaled"]).layout), seed=0).state_dict()
    started, source = weights_of(run_dir), weights_of(v41)
    assert all(torch.equal(started[n], seeded[n]) for n in DROPPED)
    assert all(torch.equal(started[n], source[n]) for n in report["loaded"])


def test_resume_wins_over_init_from(tmp_path):
    """The second run finds its own checkpoint: it resumes and never opens ``init_from`` (a path that does not exist
    would be an error otherwise)."""
    _run(tmp_path, "train.max_steps=2", "train.stop_at=1")
    _run(tmp_path, "train.max_steps=2", "train.resume=auto", f"train.init_from={tmp_path / 'nowhere'}")
    assert [r["step"] for r in _train_rows(tmp_path)] == [1, 2]
    assert not (tmp_path / "init_from.json").exists()


def test_context_extension_continues_at_four_times_the_length(v41, tmp_path):
    """Trained at data.seq_len=64, continued at 256 from its weights: everything loads (lengths are not weights),
    and the first step at 256 already has the trained model's loss, not an untrained one's (ln 259 = 5.56)."""
    run_dir = tmp_path / "long"
    _run(run_dir, "train.max_steps=2", "data.seq_len=256", "data.micro_batch_size=1",
         f"train.init_from={v41 / 'checkpoints'}")
    report = json.loads((run_dir / "init_from.json").read_text())
    assert not report["newly_initialised"] and not report["ignored"] and not report["settings_differences"]
    untrained, trained = _train_rows(v41)[0]["loss"], _train_rows(v41)[-1]["loss"]
    first = _train_rows(run_dir)[0]["loss"]
    assert first < untrained - 0.5 and first < trained + 0.5, (untrained, trained, first)


def test_sft_from_a_checkpoint(v41, tmp_path):
    """The README's fine-tuning path: the example conversations, from trained weights, through the whole job."""
    data = ["data=hf", f"data.path={Path(__file__).resolve().parents[2] / 'examples' / 'sft_chat.jsonl'}",
            "data.heldout_fraction=0.2", "data.seq_len=128"]
    final = _run(tmp_path, *data, "train.max_steps=2", f"train.init_from={v41 / 'checkpoints'}")
    rows = _train_rows(tmp_path)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows) and math.isfinite(final["lm_loss"])


# ------------------------------------------------------------------------------------------- other splits

def _engine(stages: int, zero_stage: int, init_from: Path | None = None):
    from train.run.engine import build_engine

    overrides = [f"parallel.pipeline_stages={stages}", f"parallel.cuts={'[8]' if stages == 2 else 'null'}",
                 f"parallel.zero_stage={zero_stage}", f"data.seq_len={harness.SEQ_LEN}",
                 f"data.micro_batch_size={harness.MICRO_BATCH}", "train.grad_accum_steps=2", "train.warmup_steps=1"]
    job = harness.job_of(overrides + ([f"train.init_from={init_from}"] if init_from else []))
    engine = build_engine(job)
    if init_from:
        from_job(job).load_into(engine)
    return engine, job


def _snapshot(engine) -> dict:
    stage = engine.module.stage
    return {"params": {n: p.detach().clone() for n, p in stage.model.named_parameters()},
            "shadows": {n: p.detach().clone() for n, p in stage.shadows.named_parameters()},
            "optimizer_state": sum(len(s) for s in engine.optimizer.state.values()), "lr": engine.get_lr()[0],
            "global_steps": engine.global_steps, "stage": engine.stage_id, "dp": engine.grid.data_parallel_id}


def _split_worker(rank, out):
    """A: 2 stages x 1 rank trains a step and saves. B: 1 stage x 2 ranks (ZeRO-1) starts from A, trains, saves.
    C: 2 stages (ZeRO off) starts from B."""
    from train.formats import checkpoint

    torch.set_num_threads(1)
    out = Path(out)
    record = {}
    for name, stages, zero, source in (("A", 2, 1, None), ("B", 1, 1, out / "A"), ("C", 2, 0, out / "B")):
        engine, job = _engine(stages, zero, source)
        record[name] = _snapshot(engine)
        if name != "C":
            engine.train_batch(harness.batches(job.args.vocab_size, seed=engine.grid.data_parallel_id))
            record[name + "_trained"] = _snapshot(engine)
            checkpoint.save(engine, out / name, 1, {"step": 1, "config": plain(job.config)}, {}, keep=0)
    torch.save(record, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    out = tmp_path_factory.mktemp("splits")
    spawn(_split_worker, 2, str(out))
    return out, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _whole(ranks, key) -> dict:
    """The whole model from the stages' snapshots under ``key`` (first data-parallel rank of each stage)."""
    return {n: t for r in ranks if r[key]["dp"] == 0 for n, t in r[key]["params"].items()}


def test_init_from_under_other_stage_counts_and_data_parallel_sizes(splits):
    out, ranks = splits
    assert sorted(p.name for p in (out / "B" / "step00000001").glob("optimizer_*")) == [
        "optimizer_stage00_dp00.pt", "optimizer_stage00_dp01.pt"]  # B was written by 2 ZeRO-1 ranks
    a, b = _whole(ranks, "A_trained"), _whole(ranks, "B_trained")
    assert not all(torch.equal(a[n], t) for n, t in _whole(ranks, "A").items())  # A's step changed the weights
    for r in ranks:  # B: both data-parallel ranks start from A's weights, fresh optimizer and schedule
        start = r["B"]
        assert start["params"].keys() == a.keys() and all(torch.equal(start["params"][n], a[n]) for n in a)
        assert start["optimizer_state"] == 0 and start["global_steps"] == 0 and start["lr"] == ranks[0]["A"]["lr"]
    for r in ranks:  # C: each stage holds B's weights, its shadow replica the owner's values
        start = r["C"]
        assert start["params"] and all(torch.equal(t, b[n]) for n, t in start["params"].items())
        for name, t in start["shadows"].items():
            owner = f"layers.{name.split('.')[0]}.attn.indexer.{name.split('.', 1)[1]}"
            assert torch.equal(t, b[owner]), name
    assert any(r["C"]["shadows"] for r in ranks)  # the cut at 8 puts layer 6's index keys on both stages
