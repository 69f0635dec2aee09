"""What a job actually builds and writes, read back from the built objects (issue 38), not from the helpers that
compute them: every setting a user can pass, the diagnostic series as they land in ``metrics.jsonl``, every file
of a checkpoint against its manifest, and the exported ``config.json``.

One job (``train.run.app``'s preflight, ``_trainer`` and ``Trainer.train``: the objects ``python -m train`` builds),
``model=v41_mini`` with every part on and nearly every setting off its default (and off its preset), so that a
setting lost between the config and the object falls back to a value the test tells apart. List-valued settings
have entries that differ (``train.betas``, ``model.engram.layers``, ``model.dspark.target_layers``,
``train.eval.probe_lens``). It trains 3 steps, logging every 2nd, evaluating at step 2 and saving after every
step into ``train.checkpoint_dir``; the step's microbatches, the weights at its start, every gradient before
clipping and every block's attention, FFN and block outputs are recorded, so each series is checked against a
value computed here from the module or parameter that must feed it (by name).

``SETTINGS`` maps every setting (every leaf of the composed config, of ``ModelArgs`` and of the data group) to
the test that reads it back: one here, or a named test elsewhere that reads it from the object it builds; a new
setting without one fails ``test_every_setting_is_read_back_somewhere``.
"""
import ast
import json
import math
import re
import shutil
import sysconfig
from dataclasses import asdict, fields, is_dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model import ModelArgs, layout_from_config
from model.cli import compose, resolved
from model.config import DSparkArgs, EngramArgs, MoEArgs
from model.deepseek_config import NOT_EXPORTED, model_and_layout, reference_config
from model.engram_layout import table_rows
from model.layout import Layout, Mode
from model.transformer import Transformer
from tests.support.pipeline_harness import job_of
from train.data.loader import DataConfig
from train.data.synthetic import SyntheticConfig
from train.export import export
from train.formats import checkpoint, manifest
from train.formats.checkpoint import CheckpointError
from train.observe.metrics import MetricsLogger, read_rows
from train.observe.routing import EXPERTS_FILE
from train.processes import distributed
from train.processes.interrupt import Interrupts
from train.run import app
from train.run.engine import engram_token_map

REPO = Path(__file__).resolve().parents[2]
EMAIL = f"{sysconfig.get_paths()['stdlib']}/email"
SEQ_LEN, MICRO_BATCH, MICROBATCHES, STOP = 64, 2, 2, 3

MODEL = {  # v41_mini with every value moved off its default and off the preset
    "vocab_size": 300, "dim": 80, "n_heads": 4, "head_dim": 40, "rope_head_dim": 12, "q_lora_rank": 56,
    "o_groups": 2, "o_lora_rank": 24, "window_size": 8, "index_n_heads": 3, "index_head_dim": 20, "index_topk": 6,
    "inter_dim": 72, "norm_eps": 1e-6, "rope_theta": 5000.0, "compress_rope_theta": 90000.0, "rope_factor": 8.0,
    "original_seq_len": 512, "beta_fast": 16.0, "beta_slow": 2.0, "init_std": 0.03, "embed_init_std": 0.5,
    "head_init_std": 0.02, "kernel_backend": "torch", "hc_mult": 2, "hc_sinkhorn_iters": 7, "hc_eps": 1e-5,
}
MOE = {"n_routed_experts": 6, "n_activated_experts": 3, "n_shared_experts": 1, "inter_dim": 40, "score_func": "sigmoid",
       "gate_temp": 0.8, "norm_topk_prob": False, "route_scale": 2.0, "swiglu_limit": 5.0, "bias_update_rate": 0.01}
ENGRAM = {"layers": [1, 6], "vocab_size": 500, "n_heads": 3, "head_dim": 8, "max_ngram_size": 3, "pad_id": 256,
          "compressed_vocab_size": 230}
DSPARK = {"blocks": 2, "block_size": 3, "target_layers": [6, 8, 9], "markov_rank": 12, "noise_token_id": 257,
          "n_routed_experts": 3, "n_activated_experts": 1}
TRAIN = {"seed": 7, "max_steps": 40, "stop_at": STOP, "grad_accum_steps": MICROBATCHES, "lr": 2e-3,
         "min_lr_ratio": 0.25, "warmup_steps": 3, "weight_decay": 0.05, "betas": [0.8, 0.97], "eps": 1e-7,
         "grad_clip": 0.005, "indexer_loss_coef": 0.3, "dspark_loss_coef": 0.4, "log_every": 2, "checkpoint_every": 1,
         "keep_checkpoints": 3, "progress": False, "device": "cpu", "precision": "fp32", "startup_timeout_s": 1234,
         "collective_timeout_s": 987}
EVAL = {"every": 2, "batches": 2, "probe_examples": 2, "probe_lens": [192, 224], "probe_seed": 5, "mqar_pairs": 3,
        "mqar_queries": 2}
DATA = {"seq_len": SEQ_LEN, "micro_batch_size": MICRO_BATCH, "path": EMAIL, "shuffle_seed": 3, "heldout_fraction": 0.2,
        "pack_buffer": 8, "pack_carry": 2}
LAYOUT = {"encoder.ratio": 4, "candidate_topk_blocks": 4, "candidate_block_size": 2}
PARALLEL = {"recompute": "block", "recompute_layers": 2, "keep_attention_layers": 1, "recompute_offload": True}
LOGGER = {"mode": "offline", "project": "readback", "name": "job-readback", "group": "readback-group",
          "tags": ["one", "two"]}
# The layout built from the knobs above: window, window, then m = 4 Full/Reuse pairs, then the m = 1 decoder (Full,
# Reuse, Reindex, Reuse), the candidate blocks made by the decoder's Full layer.
MODES = ["window", "window", "full", "reuse", "full", "reuse", "full", "reuse", "reindex", "reuse"]
RATIOS = [0, 0, 4, 4, 4, 4, 1, 1, 1, 1]


def _value(v) -> str:
    return "[" + ",".join(map(str, v)) + "]" if isinstance(v, list) else str(v)


def overrides(run_dir: Path) -> list[str]:
    groups = {"model": MODEL, "model.moe": MOE, "model.engram": ENGRAM, "model.dspark": DSPARK, "train": TRAIN,
              "train.eval": EVAL, "data": DATA, "layout": LAYOUT, "parallel": PARALLEL, "logger": LOGGER}
    return ["model=v41_mini", f"train.checkpoint_dir={run_dir / 'ck'}", *(
        f"{group}.{key}={_value(value)}" for group, values in groups.items() for key, value in values.items())]


def expected_args() -> ModelArgs:
    """The model the overrides describe, written out here (not through ``ModelArgs.from_config``)."""
    engram = EngramArgs(**{**ENGRAM, "layers": tuple(ENGRAM["layers"])})
    dspark = DSparkArgs(**{**DSPARK, "target_layers": tuple(DSPARK["target_layers"])})
    return ModelArgs(**MODEL, ffn="moe", moe=MoEArgs(**MOE), engram=engram, dspark=dspark)


class Recording:
    """Stands in for the trainer's loader: records every microbatch it hands out, forwards everything else."""

    def __init__(self, loader, batches: list):
        self._loader, self._batches = loader, batches

    def __next__(self):
        batch = next(self._loader)
        self._batches.append({k: v.clone() for k, v in batch.items()})
        return batch

    def __getattr__(self, name):
        return getattr(self._loader, name)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("job")
    cfg = compose(overrides(run_dir))
    checked = app.preflight(cfg, run_dir, 1)
    distributed.init(checked.job.device)
    app.seed_everything(cfg.train.seed)
    trainer = app._trainer(run_dir, checked)
    engine, stage = trainer.engine, trainer.engine.module.stage
    model = stage.model
    record = {"cfg": cfg, "data": resolved(cfg).data, "run_dir": run_dir, "trainer": trainer, "engine": engine,
              "model": model, "initial": {n: t.detach().clone() for n, t in model.state_dict().items()},
              "batches": {}, "start": {}, "grads": {}, "clipped": {}, "outputs": {}, "eval_batches": 0}
    step_now = {"step": 0}

    # the step: its microbatches and the weights (and routing biases) it starts from
    real_step = trainer.step

    def recorded_step(step):
        step_now["step"] = step
        record["start"][step] = {n: t.detach().clone() for n, t in model.state_dict().items()}
        record["batches"][step], record["outputs"][step] = [], {}
        trainer.loader = Recording(real_loader, record["batches"][step])
        return real_step(step)
    real_loader = trainer.loader
    trainer.step = recorded_step

    # every gradient as clipping finds it (a table's sparse gradient as its dense form)
    clip = engine._clip_gradients

    def grads():
        return {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone()
                for n, p in model.named_parameters() if p.grad is not None}

    def record_then_clip():
        record["grads"][step_now["step"]] = grads()
        clip()
        record["clipped"][step_now["step"]] = grads()
    engine._clip_gradients = record_then_clip

    # every block's attention, FFN and block outputs in the stage's forwards (a recomputation in backward runs the
    # blocks outside the stage's forward: not recorded)
    in_forward = {"on": False}
    stage.register_forward_pre_hook(lambda *_: in_forward.update(on=True))
    stage.register_forward_hook(lambda *_: in_forward.update(on=False))

    def recorder(key):
        def hook(module, inputs, output):
            if in_forward["on"] and module.training:
                out = output[0] if isinstance(output, tuple) else output
                record["outputs"][step_now["step"]].setdefault(key, []).append(out.detach().double())
        return hook
    for layer_id, block in model.layers.items():
        block.attn.register_forward_hook(recorder(f"attn/layer{layer_id}"))
        block.ffn.register_forward_hook(recorder(f"ffn/layer{layer_id}"))
        block.register_forward_hook(recorder(f"resid/layer{layer_id}"))
    model.head.register_forward_hook(recorder("logits"))
    record["moe_inputs"] = {name: [] for name in model.experts()}

    def moe_input(name):
        def hook(module, inputs):
            if in_forward["on"] and module.training and step_now["step"] == LOGGED:
                record["moe_inputs"][name].append(inputs[0].detach().reshape(-1, inputs[0].shape[-1]).clone())
        return hook
    for name, moe in model.experts().items():
        moe.register_forward_pre_hook(moe_input(name))

    # the process groups' timeout after the first step
    record["timeouts"] = []
    set_timeout = distributed.set_timeout
    distributed.set_timeout = lambda seconds: (record["timeouts"].append(seconds), set_timeout(seconds))[1]

    heldout = trainer.evaluator.loader

    class CountedHeldout(Recording):
        def __next__(self):
            record["eval_batches"] += 1
            return next(heldout)
    trainer.evaluator.loader = CountedHeldout(heldout, [])

    logger = MetricsLogger(checked.job, run_dir, 0, enabled=True)
    wandb_run = logger.wandb_run
    record["wandb"] = {"project": wandb_run.project, "name": wandb_run.name, "group": wandb_run.group,
                       "tags": list(wandb_run.tags)}
    with Interrupts(announce=False) as interrupts:
        trainer.train(logger, interrupts)
    logger.close()
    distributed.set_timeout = set_timeout
    rows = read_rows(run_dir / "metrics.jsonl")
    record["rows"] = {r["step"]: r for r in rows if r.get("split") != "eval"}
    record["evals"] = [r for r in rows if r.get("split") == "eval"]
    return record


# ----------------------------------------------------------------------------------------------- the engine

def test_optimizer_groups_schedule_and_clipping(job):
    """AdamW's groups as the engine holds them: decay on every matrix (by name: not the norms' gains, the sinks, the
    mix bases and scales), ``train.betas`` in order, eps, weight decay; the schedule's multiplier at every step and
    the lr of each logged row from warmup + cosine over ``train.max_steps`` to ``min_lr_ratio``; the clip norm."""
    engine, model = job["engine"], job["model"]
    names = {id(p): n for n, p in model.named_parameters()}
    decay, keep = engine.optimizer.param_groups[:2]
    assert {names[id(p)] for p in decay["params"]} == {n for n, p in model.named_parameters()
                                                      if p.dim() >= 2 and ".engram.embed." not in n}
    assert all(names[id(p)].endswith(("norm.weight", "attn_sink", "_base", "_scale")) for p in keep["params"])
    for group in engine.optimizer.param_groups:
        assert group["betas"] == (0.8, 0.97) and group["eps"] == 1e-7
    assert decay["weight_decay"] == 0.05 and keep["weight_decay"] == 0.0

    def lr_ratio(step):  # after ``step`` updates
        if step < TRAIN["warmup_steps"]:
            return (step + 1) / TRAIN["warmup_steps"]
        progress = (step - TRAIN["warmup_steps"]) / (TRAIN["max_steps"] - TRAIN["warmup_steps"])
        return TRAIN["min_lr_ratio"] + (1 - TRAIN["min_lr_ratio"]) * (1 + math.cos(math.pi * progress)) / 2
    schedule = engine.lr_scheduler.lr_lambdas[0]
    for step in range(TRAIN["max_steps"] + 2):
        assert schedule(step) == pytest.approx(lr_ratio(min(step, TRAIN["max_steps"])), rel=1e-12), step
    for step, row in job["rows"].items():
        assert row["lr"] == pytest.approx(TRAIN["lr"] * lr_ratio(step - 1), rel=1e-12), step
    assert engine.max_grad_norm == TRAIN["grad_clip"]
    tables = engine.table_optimizer.param_groups[0]  # the Engram tables' sparse Adam: the dense one's betas, eps
    assert tables["betas"] == (0.8, 0.97) and tables["eps"] == 1e-7


def test_batch_geometry_loss_weights_and_devices(job):
    """Microbatches of ``data.micro_batch_size`` rows of ``data.seq_len``, ``train.grad_accum_steps`` of them a
    step; the loss function's coefficients (and the draft head's parts, trained: ``dspark_loss_coef`` > 0); the
    device and the compute dtype; one pipeline stage holding every layer."""
    engine, trainer = job["engine"], job["trainer"]
    assert engine.micro_batches == MICROBATCHES and engine.train_micro_batch_size_per_gpu() == MICRO_BATCH
    for step, batches in job["batches"].items():
        assert len(batches) == MICROBATCHES, step
        assert all(b["input_ids"].shape == (MICRO_BATCH, SEQ_LEN) for b in batches)
    loss = engine.module.loss_fn
    assert loss.coef == 0.3 and loss.dspark_coef == 0.4 and loss.draft_parts == ("ce", "l1", "confidence")
    assert engine.device == torch.device("cpu") and engine.module.stage.compute_dtype == torch.float32
    assert engine.num_stages == 1 and list(job["model"].layers) == [str(i) for i in range(10)]
    assert trainer.checkpoint_dir == job["run_dir"] / "ck"


def test_recompute_and_kept_attention_per_layer(job):
    """``parallel.recompute=block``: the first ``recompute_layers`` layers of the stage run as checkpoints, and the
    first ``keep_attention_layers`` of those keep their attention outputs; with ``recompute_offload`` the recomputed
    ones (only they) keep their inputs on the host."""
    from parallel.recompute import recomputation

    wrappers = [recomputation(b) for b in job["model"].layers.values()]
    assert [w is not None for w in wrappers] == [i < 2 for i in range(10)]
    assert [w is not None and w.keep_attention for w in wrappers] == [i < 1 for i in range(10)]
    assert [w is not None and w.offload for w in wrappers] == [i < 2 for i in range(10)]


def _expert_ranges(rank, out):
    """A rank's routed experts on an engine built with ``parallel.expert_parallel=2`` over 2 replicas."""
    from train.run.engine import build_engine

    torch.set_num_threads(1)
    engine = build_engine(job_of(["model=v41_mini", "parallel.expert_parallel=2", "data.seq_len=64",
                                  "data.micro_batch_size=1"]))
    groups = engine.module.expert_groups
    torch.save({"held": {name: (moe.experts.expert_ids.start, moe.experts.expert_ids.stop, moe.experts.w1.shape[0])
                         for name, moe in engine.module.stage.model.experts().items()},
                "dispatch": groups.dispatch.ranks, "data": groups.data_ranks}, f"{out}/rank{rank}.pt")


def test_expert_parallel_splits_each_moes_experts(tmp_path):
    """``parallel.expert_parallel=2`` on 2 replicas (gloo): each rank's MoEs hold their half of the routed experts,
    rank 0 the first (8 a layer, 4 in the draft head's), both ranks one dispatch group, each its own data group."""
    from parallel.local import spawn

    spawn(_expert_ranges, 2, str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["dispatch"] == [0, 1] and got["data"] == [rank], rank
        for name, held in got["held"].items():
            n = 4 if name.startswith("mtp.") else 8
            assert held == (rank * n // 2, (rank + 1) * n // 2, n // 2), (rank, name)
        assert len(got["held"]) == 10 + 1


# ------------------------------------------------------------------------------------------------ the model

def test_every_module_holds_the_model_settings(job):
    """Each module that keeps the model's settings keeps these (the ones a forward reads: window, top-k, the
    Sinkhorn iterations, eps, ...), and the MoE gates their own (the draft head's with its expert counts)."""
    want = expected_args()
    model = job["model"]
    holders = [m for m in model.modules() if isinstance(getattr(m, "args", None), ModelArgs)]
    assert len(holders) >= 10 + 2 + 1 and all(m.args == want for m in holders)
    for name, moe in model.experts().items():
        expected = replace(want.moe, n_routed_experts=3, n_activated_experts=1) if name.startswith("mtp.") else want.moe
        assert moe.args == expected and moe.gate.args == expected, name


def test_model_dimensions_from_the_parameters(job):
    """The widths and counts of the model settings, read from the shapes of the parameters they size."""
    model, m, moe, e, d = job["model"], MODEL, MOE, ENGRAM, DSPARK
    params = dict(model.named_parameters())
    assert params["embed.weight"].shape == (300, 80) and params["head.weight"].shape == (300, 80)
    attn = "layers.4.attn."
    assert params[attn + "wq_a.weight"].shape == (m["q_lora_rank"], m["dim"])
    assert params[attn + "wq_b.weight"].shape == (m["n_heads"] * m["head_dim"], m["q_lora_rank"])
    assert params[attn + "wkv.weight"].shape == (m["head_dim"], m["dim"])
    assert params[attn + "wo_a.weight"].shape == (m["o_groups"] * m["o_lora_rank"],
                                                 m["n_heads"] * m["head_dim"] // m["o_groups"])
    assert params[attn + "attn_sink"].shape == (m["n_heads"],)
    assert params[attn + "indexer.wq_b.weight"].shape == (m["index_n_heads"] * m["index_head_dim"], m["q_lora_rank"])
    assert params[attn + "indexer.wk.weight"].shape == (m["index_head_dim"], m["head_dim"])
    assert params["layers.4.ffn.gate.weight"].shape == (moe["n_routed_experts"], m["dim"])
    assert params["layers.4.ffn.experts.w1"].shape == (moe["n_routed_experts"], moe["inter_dim"], m["dim"])
    assert params["layers.4.ffn.shared_experts.w2.weight"].shape == (m["dim"], moe["inter_dim"])
    assert params["layers.4.hc_attn_fn"].shape == ((2 + m["hc_mult"]) * m["hc_mult"], m["hc_mult"] * m["dim"])
    assert not any(".ffn.w1." in n for n in params)  # model.ffn=moe: no dense FFN (model.inter_dim unused)
    engram_layers = sorted(int(n.split(".")[1]) for n in params if n.endswith("engram.wkv.weight"))
    assert engram_layers == e["layers"]
    assert params["layers.6.engram.wkv.weight"].shape == (m["dim"] * (m["hc_mult"] + 1),
                                                         (e["max_ngram_size"] - 1) * e["n_heads"] * e["head_dim"])
    assert params["layers.6.engram.embed.weight"].shape[1] == e["head_dim"]
    assert sorted({int(n.split(".")[1]) for n in params if n.startswith("mtp.")}) == list(range(d["blocks"]))
    assert params["mtp.0.main_proj.weight"].shape == (m["dim"], len(d["target_layers"]) * m["dim"])
    assert params["mtp.1.markov_head.embed.weight"].shape[1] == d["markov_rank"]
    assert params["mtp.0.ffn.gate.weight"].shape == (d["n_routed_experts"], m["dim"])
    assert [b.feeds_dspark for b in model.layers.values()] == [i in d["target_layers"] for i in range(10)]


def test_engram_tables_and_hash(job):
    """Rows of each table: the sum of its (n-gram size, head) buckets' primes, each the next prime above the last
    from ``model.engram.vocab_size`` up (written here); the pad's normalised id; the tables train."""
    def primes_above(n, count):
        found = []
        while len(found) < count:
            n += 1
            if all(n % k for k in range(2, math.isqrt(n) + 1)):
                found.append(n)
        return found
    e = ENGRAM
    per_layer = (e["max_ngram_size"] - 1) * e["n_heads"]
    primes = primes_above(e["vocab_size"], len(e["layers"]) * per_layer)
    model = job["model"]
    for k, layer in enumerate(e["layers"]):
        table = model.layers[str(layer)].engram.embed
        assert table.rows == sum(primes[k * per_layer:(k + 1) * per_layer]) == table.weight.shape[0], layer
        assert table.weight.requires_grad  # model.engram.train
    token_map, size = engram_token_map(job["data"], expected_args())
    assert size == e["compressed_vocab_size"] and model.engram_hash.pad == token_map[e["pad_id"]]
    assert model.layers["6"].engram.eps == MODEL["norm_eps"]


def test_engram_tokenizer_is_checked_against_its_vocabulary(job, tmp_path):
    """``model.engram.compressed_vocab_size`` is the normalised count of the tokenizer the tables were hashed with:
    another count is refused before any engine, naming the setting."""
    cfg = compose(overrides(tmp_path) + ["model.engram.compressed_vocab_size=99092"])
    with pytest.raises(ValueError, match=r"normalises to 230 ids .* model\.engram\.compressed_vocab_size=99092"):
        app.preflight(cfg, tmp_path, 1)


def test_rope_norms_and_kernel_backend(job):
    """Window-only layers rotate with ``rope_theta``, every other layer (and the shadow replicas) with
    ``compress_rope_theta`` under YaRN's settings; the frequencies of both written out here; every norm's eps is
    ``norm_eps``, every module's backend ``kernel_backend``."""
    m = MODEL
    dim = m["rope_head_dim"]
    plain = 1.0 / m["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    base = 1.0 / m["compress_rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def correction(rotations):
        return dim * math.log(m["original_seq_len"] / (rotations * 2 * math.pi)) / (2 * math.log(m["compress_rope_theta"]))
    low, high = max(math.floor(correction(m["beta_fast"])), 0), min(math.ceil(correction(m["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    yarn = base / m["rope_factor"] * ramp + base * (1 - ramp)
    model = job["model"]
    for i, block in model.layers.items():
        rotary = block.attn.rotary
        want = plain if MODES[int(i)] == "window" else yarn
        assert rotary.dim == dim and torch.allclose(rotary._freqs[torch.device("cpu")], want, rtol=1e-12), i
    assert torch.allclose(job["engine"].module.stage.shadow_rotary._freqs[torch.device("cpu")], yarn, rtol=1e-12)
    norms = [mod for mod in model.modules() if type(mod).__name__ == "RMSNorm"]
    assert len(norms) > 40 and all(n.eps == m["norm_eps"] for n in norms)
    backends = [mod.kernel_backend for mod in model.modules() if hasattr(mod, "kernel_backend")]
    assert len(backends) > 40 and set(backends) == {"torch"}


def _modes(model) -> list[str]:
    """Each block's mode, read from the modules it owns (compressor: Full, an indexer without one: Reindex, neither
    on a compressed layer: Reuse); a compressor's ratio is its layer's."""
    modes = []
    for block in model.layers.values():
        attn = block.attn
        has = {name for name, _ in attn.named_children()}
        modes.append("full" if "compressor" in has else "reindex" if "indexer" in has else
                     "reuse" if attn.plan.ratio else "window")
        assert "compressor" not in has or attn.compressor.ratio == attn.plan.ratio
    return modes


@pytest.mark.parametrize("overrides, modes, sources", [
    (["layout.window_layers=0", "layout.decoder.layers=6", "layout.decoder.full_every=3", "layout.encoder.ratio=4"],
     "full reuse full reuse full reuse reindex full reindex reuse",
     [(4, 0, 0), (4, 0, 0), (4, 2, 2), (4, 2, 2), (1, 4, 4), (1, 4, 4), (1, 4, 6), (1, 7, 7), (1, 7, 8), (1, 7, 8)]),
    (["layout.compress_ratios=[0,2,2,2,1,1,1,1]", "layout.kv_source_layer_ids=[1,3,4]",
      "layout.index_source_layer_ids=[1,3,4,6]", "layout.candidate_source_layer_id=4"],
     "window full reuse full full reuse reindex reuse",
     [(0, None, None), (2, 1, 1), (2, 1, 1), (2, 3, 3), (1, 4, 4), (1, 4, 4), (1, 4, 6), (1, 4, 6)]),
], ids=["full_every", "explicit lists"])
def test_layout_settings_reach_the_engines_blocks(overrides, modes, sources):
    """The layout knobs not in the job (``decoder.full_every``) and the explicit lists that replace the knobs
    (``compress_ratios``, ``kv_source_layer_ids``, ``index_source_layer_ids``, ``candidate_source_layer_id``), each
    list's entries different, through ``build_engine`` to each block: its mode from its modules, its ratio and
    the layers whose KV and selection it reads, written out here; the candidate blocks from layer 4 only in
    layer 6 of the explicit lists."""
    from train.run.engine import build_engine

    distributed.init(torch.device("cpu"))
    model = build_engine(job_of(["model=tiny", "layout=v41_scaled", "data.seq_len=64", *overrides])).module.stage.model
    assert _modes(model) == modes.split()
    assert [(b.attn.plan.ratio, b.attn.plan.kv_source, b.attn.plan.index_source) for b in model.layers.values()] \
        == sources
    restricted = [int(i) for i, b in model.layers.items() if b.attn.plan.candidate_source is not None]
    assert restricted == ([6, 7, 8] if "layout.decoder.full_every=3" in overrides else [6])


def test_layout_of_the_built_blocks(job):
    """Each block's mode and ratio read from the modules it owns (compressor: Full, indexer without one: Reindex,
    neither on a compressed layer: Reuse), the compressors' ratios, the candidate settings; a forward's window,
    selections and candidate blocks have the widths of ``window_size``, ``index_topk`` and
    ``candidate_topk_blocks``."""
    model = job["model"]
    assert _modes(model) == MODES and [b.attn.plan.ratio for b in model.layers.values()] == RATIOS
    assert all((b.attn.candidate_topk_blocks, b.attn.candidate_block_size) == (4, 2) for b in model.layers.values())
    assert model.layout.candidate_source_layer_id == 6
    produced = {}

    def keep(i):
        def hook(module, inputs, out):
            produced[i] = out[1]
        return hook
    hooks = [block.attn.register_forward_hook(keep(int(i))) for i, block in model.layers.items()]
    batch = job["batches"][1][0]
    state = model.new_state(batch["doc_ids"], batch["input_ids"])
    first_doc = int((batch["doc_ids"][0] == batch["doc_ids"][0, 0]).sum())
    t = torch.arange(first_doc)
    assert torch.equal(state.geometry.window_lo[0, :first_doc], (t - MODEL["window_size"] + 1).clamp(min=0))
    try:
        with torch.no_grad():
            model(batch["input_ids"], batch["doc_ids"])
    finally:
        for handle in hooks:
            handle.remove()
    assert produced[2]["topk"].shape == produced[8]["topk"].shape == (MICRO_BATCH, SEQ_LEN, MODEL["index_topk"])
    assert produced[6]["candidates"].shape == (MICRO_BATCH, SEQ_LEN, 4)


def test_initial_weights_follow_the_seed_and_the_init_scales(job):
    """The weights the job started from are the seeded draws of ``train.seed`` (a model built here with the same
    seed), with the standard deviations of ``embed_init_std``, ``head_init_std`` and ``init_std`` (the residual
    outputs scaled by 1/sqrt(2 n_layers))."""
    initial = job["initial"]
    cfg = job["cfg"]
    rebuilt = Transformer(expected_args(), layout_from_config(cfg.layout), seed=7,
                          token_map=engram_token_map(job["data"], expected_args()), run_dspark=True).state_dict()
    assert rebuilt.keys() == initial.keys() and all(torch.equal(rebuilt[n], t) for n, t in initial.items())
    other = Transformer(expected_args(), layout_from_config(cfg.layout), seed=8).state_dict()
    assert not torch.equal(other["layers.0.attn.wq_a.weight"], initial["layers.0.attn.wq_a.weight"])

    def std(name):
        return initial[name].double().std().item()
    assert std("embed.weight") == pytest.approx(0.5, rel=0.05)
    assert std("head.weight") == pytest.approx(0.02, rel=0.05)
    assert std("layers.3.attn.wq_b.weight") == pytest.approx(0.03, rel=0.05)
    assert std("layers.3.attn.wo_b.weight") == pytest.approx(0.03 / math.sqrt(20), rel=0.05)


# ---------------------------------------------------------------------------------------- the loop and data

def test_loop_settings_from_what_the_run_wrote(job):
    """Rows every ``log_every`` steps up to ``stop_at`` (the schedule still spans ``max_steps``) and at step 1, one
    evaluation at ``eval.every`` reading ``eval.batches`` batches, a checkpoint after every step
    (``checkpoint_every``) of which ``keep_checkpoints`` stay, in ``checkpoint_dir``; the expert loads of the logged
    steps only."""
    assert sorted(job["rows"]) == [1, 2]
    assert [r["step"] for r in job["evals"]] == [2] and job["eval_batches"] == EVAL["batches"]
    ck = job["run_dir"] / "ck"
    assert sorted(p.name for p in ck.glob("step*")) == ["step00000001", "step00000002", "step00000003"]
    experts = [json.loads(line) for line in (job["run_dir"] / EXPERTS_FILE).read_text().splitlines()]
    assert [r["step"] for r in experts] == [1, 2]
    assert set(experts[0]["loads"]) == {f"layer{i}" for i in range(10)} | {"mtp0", "mtp1"}


def test_process_group_timeouts_at_start_up_and_after_the_first_step(job, tmp_path, monkeypatch):
    """``app.run`` opens the process groups with ``startup_timeout_s`` (stopped right there by a spy), and the loop
    shortens them to ``collective_timeout_s`` once, after its first step."""
    assert job["timeouts"] == [TRAIN["collective_timeout_s"]]
    opened = []

    def spy(device, timeout_s, run_dir):
        opened.append(timeout_s)
        raise KeyboardInterrupt  # a stop the run reports, before anything is built
    monkeypatch.setattr(distributed, "init", spy)
    with pytest.raises(KeyboardInterrupt):
        app.run(job["cfg"], tmp_path / "run")
    assert opened == [TRAIN["startup_timeout_s"]]


def test_loaders_and_probes(job):
    """The training loader and the evaluator's held-out loader carry the data settings (the model's vocabulary
    bounds the ids), read disjoint documents; the probes are ``probe_examples`` passkey and MQAR samples at each of
    ``probe_lens``, drawn with ``probe_seed``, ``mqar_pairs`` and ``mqar_queries``."""
    from train.evaluation.evaluate import data_tokenizer
    from train.evaluation.probes import mqar_probes, passkey_probes

    trainer = job["trainer"]
    loaders = {"train": trainer.loader._loader if isinstance(trainer.loader, Recording) else trainer.loader,
               "heldout": trainer.evaluator.loader._loader}
    for name, loader in loaders.items():
        assert (loader.seq_len, loader.micro_batch_size, loader.shuffle_seed, loader.pack_buffer, loader.pack_carry,
                loader.vocab_size) == (SEQ_LEN, MICRO_BATCH, 3, 8, 2, 300), name
    keys = {name: set(loader.documents.texts(0, 0)) for name, loader in loaders.items()}
    assert keys["train"] and keys["heldout"] and not keys["train"] & keys["heldout"]
    share = len(keys["heldout"]) / (len(keys["train"]) + len(keys["heldout"]))
    assert 0.1 < share < 0.35, share  # heldout_fraction 0.2 of the email package's documents
    probes = trainer.evaluator.probes
    assert set(probes) == {(kind, n) for kind in ("passkey", "mqar") for n in EVAL["probe_lens"]}
    tokenizer = data_tokenizer(job["data"])
    for (kind, n), samples in probes.items():
        want = passkey_probes(tokenizer, n, 2, seed=5) if kind == "passkey" else \
            mqar_probes(tokenizer, n, 2, seed=5, n_pairs=3, n_queries=2)
        assert len(samples) == 2 and all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(samples, want))
        if kind == "mqar":  # 3 lines key=value, 2 queries key= answered by a 4-digit value
            for sample in samples:
                text = bytes(int(i) for i in sample.input_ids if i < 256).decode()
                assert text.count("=") == 3 + 2 and len(sample.answer_ids) == 4 * 2


def test_logger_settings_reach_the_wandb_run(job):
    assert job["wandb"] == {"project": "readback", "name": "job-readback", "group": "readback-group",
                            "tags": ["one", "two", "v41_scaled", "v41_mini"]}


# ------------------------------------------------------------------------------------- the series as logged

def role(name: str) -> str:
    """The gradient-norm group of a parameter, written out from the released checkpoint's names."""
    if name in ("embed.weight", "head.weight"):
        return {"embed.weight": "embedding", "head.weight": "head"}[name]
    if name == "norm.weight":
        return "norms_sinks"
    if name.startswith("mtp."):
        return "dspark"
    rest = name.split(".", 2)[2]
    for prefix, group in (("attn.indexer.", "indexer"), ("engram.", "engram"), ("hc_", "hc"),
                          ("ffn.shared_experts.", "ffn"), ("ffn.experts.", "experts")):
        if rest.startswith(prefix):
            return group
    return {"attn_norm.weight": "norms_sinks", "ffn_norm.weight": "norms_sinks", "attn.q_norm.weight": "norms_sinks",
            "attn.kv_norm.weight": "norms_sinks", "attn.compressor.norm.weight": "norms_sinks",
            "attn.attn_sink": "norms_sinks", "attn.wq_a.weight": "attn_q", "attn.wq_b.weight": "attn_q",
            "attn.wkv.weight": "attn_kv", "attn.compressor.wkv.weight": "attn_kv",
            "attn.compressor.wgate.weight": "attn_kv", "attn.wo_a.weight": "attn_out", "attn.wo_b.weight": "attn_out",
            "ffn.gate.weight": "gate"}[rest]


LOGGED = 2  # the logged step the series are checked at


def test_gradient_norm_series_are_their_parameters_norms(job):
    """``grad_norm/<group>`` of the logged row: the norm of the gradients (before clipping) of the parameters of
    that group by name, the sparse Engram tables' among the engram group's; ``grad_norm`` the trunk's (every
    group but the indexer's and the draft head's, which clip on their own). Catches a parameter counted in
    another group, a group fed by the clipped gradients, or the trunk norm taken over the wrong groups."""
    row, grads = job["rows"][LOGGED], job["grads"][LOGGED]
    squares = {}
    for name, grad in grads.items():
        squares[role(name)] = squares.get(role(name), 0.0) + grad.double().pow(2).sum().item()
    assert set(squares) == {"embedding", "attn_q", "attn_kv", "indexer", "attn_out", "ffn", "gate", "experts", "hc",
                            "engram", "norms_sinks", "head", "dspark"}
    assert {k for k in row if k.startswith("grad_norm/")} == {f"grad_norm/{g}" for g in squares}
    for group, value in squares.items():
        assert row[f"grad_norm/{group}"] == pytest.approx(value ** 0.5, rel=1e-5), group
    trunk = sum(v for g, v in squares.items() if g not in ("indexer", "dspark")) ** 0.5
    assert row["grad_norm"] == pytest.approx(trunk, rel=1e-5)
    assert any(".engram.embed." in n for n in grads)


def test_each_clipping_group_is_clipped_by_its_own_norm(job):
    """Every gradient after clipping: the one before times ``train.grad_clip`` / (the norm of its clipping group +
    1e-6), at most 1; the groups (the draft head's, the indexer's, the trunk: every other) by name. ``grad_clip`` is
    below all three norms (the indexer's is ~6e-3), so each group's scale differs. Catches a parameter clipped in
    another group, or by the norm of all of them."""
    for step, grads in job["grads"].items():
        clip_of = {n: role(n) if role(n) in ("indexer", "dspark") else "trunk" for n in grads}
        norms = {}
        for name, grad in grads.items():
            norms[clip_of[name]] = norms.get(clip_of[name], 0.0) + grad.double().pow(2).sum().item()
        scales = {g: min(1.0, TRAIN["grad_clip"] / (v ** 0.5 + 1e-6)) for g, v in norms.items()}
        assert len({round(v, 6) for v in scales.values()}) == 3, scales  # each group's own: the scales differ
        for name, clipped in job["clipped"][step].items():
            want = grads[name].double() * scales[clip_of[name]]
            assert torch.allclose(clipped.double(), want, rtol=1e-5, atol=1e-12), (step, name)


def test_activation_series_are_their_modules_outputs(job):
    """``act_rms/<site>/layer<N>``: the RMS over the step's microbatches of that block's attention output (the
    sublayer's, before any residual or mix), its FFN's output and the block's output (its residual stream, every
    hyper-connected copy); ``act_rms/logits`` the head's output. Each counted once per microbatch (the recomputed
    layers' backward runs not counted)."""
    row, outputs = job["rows"][LOGGED], job["outputs"][LOGGED]
    assert {k for k in row if k.startswith("act_rms/")} == {f"act_rms/{k}" for k in outputs}
    assert len(outputs) == 3 * 10 + 1
    for key, values in outputs.items():
        assert len(values) == MICROBATCHES, key
        rms = (sum(v.pow(2).mean() for v in values) / len(values)).sqrt().item()
        assert row[f"act_rms/{key}"] == pytest.approx(rms, rel=1e-5), key
    assert outputs["resid/layer3"][0].shape == (MICRO_BATCH, SEQ_LEN, MODEL["hc_mult"], MODEL["dim"])


def test_loss_series_are_a_plain_forwards_parts(job):
    """The loss parts of the logged row from a plain ``Transformer`` holding the weights the step started from,
    run on the step's microbatches: the LM cross-entropy written out here, each indexer source's KL under its
    layer, each draft-head part under its name, and the total with ``indexer_loss_coef`` and
    ``dspark_loss_coef``. Catches a part logged under another's name, or a coefficient lost on the way."""
    cfg, row = job["cfg"], job["rows"][LOGGED]
    model = Transformer(expected_args(), layout_from_config(cfg.layout),
                        token_map=engram_token_map(job["data"], expected_args()), run_dspark=True)
    model.load_state_dict(job["start"][LOGGED])
    parts = {}
    with torch.no_grad():
        for batch in job["batches"][LOGGED]:
            out = model(batch["input_ids"], batch["doc_ids"])
            lm = F.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            for key, value in [("lm_loss", lm), *((f"indexer_loss/layer{s}", kl) for s, kl in out.indexer_losses.items()),
                               *((f"dspark_loss/{p}", v) for p, v in out.draft_losses.items())]:
                parts[key] = parts.get(key, 0.0) + value.item() / MICROBATCHES
    assert sorted(k for k in parts if k.startswith("indexer_loss/")) == [f"indexer_loss/layer{s}" for s in (2, 4, 6, 8)]
    indexer = sum(v for k, v in parts.items() if k.startswith("indexer_loss/"))
    draft = sum(v for k, v in parts.items() if k.startswith("dspark_loss/"))
    parts.update(indexer_loss=indexer, dspark_loss=draft, loss=parts["lm_loss"] + 0.3 * indexer + 0.4 * draft)
    assert {k for k in row if k.split("/")[0] in ("loss", "lm_loss", "indexer_loss", "dspark_loss")} == set(parts)
    for key, value in parts.items():
        assert row[key] == pytest.approx(value, rel=1e-5), key


def test_routing_series_from_each_layers_own_gate(job):
    """``moe/<layer>/...`` of the logged row from loads counted here: each MoE's inputs of the step (recorded by a
    hook on that module) scored with ``model.moe.score_func`` (sigmoid) at ``gate_temp`` by the gate weight the
    step started from, top-``n_activated_experts`` of score + bias; and the bias after the step moved by
    ``bias_update_rate`` against that load (bias_min, bias_max of the row)."""
    model, row = job["model"], job["rows"][LOGGED]
    start, after = job["start"][LOGGED], job["start"][LOGGED + 1]
    seen = job["moe_inputs"]
    for name, moe in model.experts().items():
        k = 1 if name.startswith("mtp.") else MOE["n_activated_experts"]
        experts = 3 if name.startswith("mtp.") else MOE["n_routed_experts"]
        load = torch.zeros(experts, dtype=torch.float64)
        for x in seen[name]:
            scores = torch.sigmoid(F.linear(x.float(), start[f"{name}.gate.weight"].float()) / MOE["gate_temp"])
            picks = (scores + start[f"{name}.gate.bias"]).topk(k, dim=-1).indices
            load += torch.bincount(picks.flatten(), minlength=experts).double()
        bias = start[f"{name}.gate.bias"].double() + MOE["bias_update_rate"] * torch.sign(load.mean() - load)
        assert torch.allclose(after[f"{name}.gate.bias"].double(), bias, atol=1e-7), name
        key = name.replace("layers.", "layer").replace("mtp.", "mtp").removesuffix(".ffn")
        share = load / load.sum()
        assert row[f"moe/{key}/load_max_over_mean"] == pytest.approx((load.max() / load.mean()).item(), rel=1e-9)
        assert row[f"moe/{key}/load_entropy"] == pytest.approx(-(share * share.clamp_min(1e-300).log()).sum().item())
        assert (row[f"moe/{key}/bias_min"], row[f"moe/{key}/bias_max"]) == pytest.approx((bias.min().item(),
                                                                                         bias.max().item()), abs=1e-7)


# ---------------------------------------------------------------------------------------- the checkpoint

KINDS = {"embedding": r"embed\.pt", "layer": r"layer_\d{3}\.pt", "head": r"head\.pt", "table rows": r"rows_.+\.pt",
         "routed experts": r"experts_(layer_\d{3}|head)_\d{5}\.pt",
         "optimizer": r"optimizer_stage\d\d_dp\d\d\.pt", "resume state": r"resume_state\.pt",
         "trainer state": r"trainer_state\.json", "manifest": r"manifest\.json"}


def _kind(name: str) -> str:
    (kind,) = [k for k, pattern in KINDS.items() if re.fullmatch(pattern, name)]
    return kind


def _newest(job) -> Path:
    return job["run_dir"] / "ck" / f"step{STOP:08d}"


def test_the_manifest_covers_every_file_of_the_checkpoint(job):
    """Every file the save wrote (each of a known kind, every kind there: the Engram tables' row files too) is in
    the manifest with its size and SHA-256, computed here; nothing else is."""
    import hashlib

    tag = _newest(job)
    files = sorted(p.relative_to(tag).as_posix() for p in tag.rglob("*") if p.is_file())
    assert {_kind(Path(f).name) for f in files} == set(KINDS)
    entries = json.loads((tag / manifest.MANIFEST).read_text())["files"]
    assert sorted(entries) == [f for f in files if f != manifest.MANIFEST]
    for name, entry in entries.items():
        data = (tag / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


@pytest.mark.parametrize("kind", list(KINDS))
def test_damage_to_each_kind_of_file_is_caught(job, tmp_path, kind):
    """One byte of one file of each kind changed (the manifest: deleted): the checkpoint is refused naming the
    file, and ``resume=auto`` takes the one before."""
    ck = tmp_path / "ck"
    shutil.copytree(job["run_dir"] / "ck", ck)
    tag = ck / _newest(job).name
    victim = sorted(p for p in tag.iterdir() if _kind(p.name) == kind)[0]
    if kind == "manifest":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 1
        victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(victim.name)):
        checkpoint.locate(str(tag), "train.resume")
    assert checkpoint.find("auto", ck).tag == f"step{STOP - 1:08d}"


# ------------------------------------------------------------------------------------------------ exports

def _round_trip_view(args: ModelArgs) -> dict:
    """What ``config.json`` describes of a model: its fields but those not exported and those of parts that are
    off (the dense FFN's width under a MoE, the MoE's under a dense FFN, ...)."""
    view = {k: v for k, v in asdict(args).items() if k not in NOT_EXPORTED}
    view["moe"] = {k: v for k, v in view["moe"].items() if k != "bias_update_rate"} if args.ffn == "moe" else None
    view["inter_dim"] = args.inter_dim if args.ffn == "dense" else None
    view["engram"] = {**{k: v for k, v in view["engram"].items() if k != "train"},
                      "num_embeddings": table_rows(args.engram)} if args.engram.layers else None
    view["dspark"] = view["dspark"] if args.dspark.blocks else None
    if args.hc_mult == 1:
        view["hc_sinkhorn_iters"] = view["hc_eps"] = None
    return view


def test_export_of_the_job_describes_what_it_built(job, tmp_path):
    """``python -m train.export`` of this job's checkpoint: config.json stands for the model and layout the job
    built (read back through ``model_and_layout``), its table row counts are the built tables', and every tensor
    is the checkpoint's, the routed experts under their per-expert names."""
    files = export(str(job["run_dir"] / "ck"), tmp_path / "out", "fp32")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    args, layout = model_and_layout(config)
    assert _round_trip_view(args) == _round_trip_view(expected_args())
    assert layout == layout_from_config(job["cfg"].layout) == job["model"].layout
    model = job["model"]
    assert config["engram_num_embeddings"] == [model.layers[str(i)].engram.embed.rows for i in ENGRAM["layers"]]
    assert (config["n_layers"], config["n_dense_layers"], config["n_mtp_layers"]) == (10, 0, 2)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "out" / files[0])
    saved = checkpoint.read_weights(checkpoint.find("auto", job["run_dir"] / "ck"))
    assert tensors.keys() == saved.keys() and "layers.4.ffn.experts.5.w3.weight" in tensors
    assert all(torch.equal(tensors[n], t) for n, t in saved.items())


MODEL_PRESETS = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
LAYOUT_PRESETS = sorted(p.stem for p in (REPO / "conf" / "layout").glob("*.yaml"))


@pytest.mark.parametrize("model_preset", MODEL_PRESETS)
def test_exported_config_of_every_preset(model_preset):
    """config.json of every model preset on every layout preset: it reads back as the same model and layout, and
    holds exactly the fields of the parts that preset has (the dense FFN's width or the MoE's, hyper-connections,
    Engram with its tables' rows, the draft head; -1 for no candidate source)."""
    for layout_preset in LAYOUT_PRESETS:
        cfg = compose([f"model={model_preset}", f"layout={layout_preset}"])
        args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
        config = reference_config(args, layout, "bf16")
        back_args, back_layout = model_and_layout(json.loads(json.dumps(config)))
        where = (model_preset, layout_preset)
        assert back_layout == layout and _round_trip_view(back_args) == _round_trip_view(args), where
        assert config["n_layers"] == layout.n_layers == len(config["compress_ratios"]), where
        moe = args.ffn == "moe"
        assert config["n_dense_layers"] == (0 if moe else layout.n_layers), where
        assert ("inter_dim" in config) != moe and ("moe_inter_dim" in config) == moe, where
        assert ("hc_mult" in config) == (args.hc_mult > 1), where
        assert config.get("engram_num_embeddings") == (list(table_rows(args.engram)) if args.engram.layers else None)
        assert ("n_mtp_layers" in config) == (args.dspark.blocks > 0), where
        if layout.candidate_source_layer_id is None:
            assert config["candidate_source_layer_id"] == -1, where


# ----------------------------------------------------------------------------------------------- data glue

def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_data_settings_reach_the_documents_and_the_tokenizer(tmp_path):
    """The hf source's settings, from a composed config to the documents it builds: the text column, the split's
    label (a hub dataset's, with its config name: not reachable offline), streaming with its shuffle buffer, chat and prompt/response columns; the tokenizer file's special tokens
    by the names given (each a different token: swapped roles show)."""
    from tokenizers import Tokenizer as HFTokenizerModel, models, pre_tokenizers, trainers

    from train.data.loader import StreamingDocuments, build_documents
    from train.evaluation.evaluate import data_tokenizer

    rows = [{"body": f"text number {i}", "q": f"question {i}", "a": f"answer {i}",
             "conv": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"ho {i}"}]}
            for i in range(20)]
    path = _jsonl(tmp_path / "d.jsonl", rows)

    def documents(*more):
        cfg = compose(["data=hf", f"data.path={path}", "data.heldout_fraction=0", *more])
        return build_documents(resolved(cfg).data)
    texts = documents("data.text_field=body", "data.split=validation", "data.name=any")
    assert sorted(texts.texts(0, 0)) == sorted(r["body"] for r in rows)
    assert "(name=any, split=validation," in texts.description  # local files: the split's label, no config name
    streamed = documents("data.text_field=body", "data.streaming=true", "data.shuffle_buffer=3")
    assert isinstance(streamed, StreamingDocuments) and streamed.shuffle_buffer == 3
    assert sorted(streamed.texts(0, 0)) == sorted(r["body"] for r in rows)
    chats = documents("data.format=chat", "data.messages_field=conv")
    assert chats.format == "chat" and sorted(map(json.dumps, chats.texts(0, 0))) == sorted(
        json.dumps(r["conv"]) for r in rows)
    pairs = list(documents("data.format=prompt_response", "data.prompt_field=q", "data.response_field=a").texts(0, 0))
    assert sorted(json.dumps(p) for p in pairs) == sorted(json.dumps(
        [{"role": "user", "content": r["q"]}, {"role": "assistant", "content": r["a"]}]) for r in rows)

    tokenizer = HFTokenizerModel(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["plain words"] * 5, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<x>", "<y>", "<z>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(tmp_path / "tok.json"))
    cfg = compose(["data=hf", f"data.path={path}", "data.text_field=body", f"data.tokenizer={tmp_path / 'tok.json'}",
                   "data.bos_token='<y>'", "data.eos_token='<z>'", "data.pad_token='<x>'", "model.vocab_size=300"])
    from train.data.loader import build_loader

    data = resolved(cfg).data
    for built in (data_tokenizer(data), build_loader(data).tokenizer):
        assert (built.bos_id, built.eos_id, built.pad_id) == (2, 3, 1)


def _hydra(value) -> str:
    """A value in Hydra's override grammar."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(_hydra, value)) + "]"
    return f"'{value}'" if isinstance(value, str) else str(value)


def test_synthetic_settings_reach_the_loaders_tasks():
    """``data.synthetic.*`` off their defaults, from a composed config to the tasks of the loader it builds."""
    from train.data.loader import build_loader

    values = {"tasks": {"mqar": 0.5, "passkey": 0.25, "copy": 0.25}, "eval_examples": 7, "keys": "abcdefgh",
              "values": "ABCDEFGH", "digits": "0123", "filler": ".", "markers": "!?", "pairs": [3, 5],
              "spacing": [0, 1], "distance": [4, 20], "align": 1, "passkey_digits": 3, "copy_length": [3, 9],
              "loss": "all"}
    cfg = compose(["data=synthetic", "data.synthetic_fraction=1.0", *(
        f"data.synthetic.{k}={_hydra(v)}" for k, v in values.items())])
    loader = build_loader(resolved(cfg).data)
    assert loader.tasks.config == SyntheticConfig.from_mapping(values)
    assert {f.name: getattr(loader.tasks.config, f.name) for f in fields(SyntheticConfig)} == {
        k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


# ------------------------------------------------------------------------------------- every setting's test

HERE = {  # settings read back by a test of this file
    "test_every_module_holds_the_model_settings": [
        "model.window_size", "model.index_topk", "model.hc_sinkhorn_iters", "model.hc_eps", "model.moe.score_func",
        "model.moe.gate_temp", "model.moe.norm_topk_prob", "model.moe.route_scale", "model.moe.swiglu_limit",
        "model.dspark.block_size", "model.dspark.noise_token_id"],
    "test_model_dimensions_from_the_parameters": [
        "model.vocab_size", "model.dim", "model.n_heads", "model.head_dim", "model.q_lora_rank", "model.o_groups",
        "model.o_lora_rank", "model.index_n_heads", "model.index_head_dim", "model.ffn", "model.inter_dim",
        "model.moe.n_routed_experts", "model.moe.n_shared_experts", "model.moe.inter_dim", "model.hc_mult",
        "model.engram.layers", "model.engram.max_ngram_size", "model.engram.n_heads", "model.engram.head_dim",
        "model.dspark.blocks", "model.dspark.target_layers", "model.dspark.markov_rank",
        "model.dspark.n_routed_experts"],
    "test_routing_series_from_each_layers_own_gate": [
        "model.moe.n_activated_experts", "model.dspark.n_activated_experts", "model.moe.bias_update_rate"],
    "test_engram_tables_and_hash": ["model.engram.vocab_size", "model.engram.num_embeddings", "model.engram.pad_id",
                                    "model.engram.train"],
    "test_engram_tokenizer_is_checked_against_its_vocabulary": ["model.engram.compressed_vocab_size"],
    "test_rope_norms_and_kernel_backend": [
        "model.rope_head_dim", "model.rope_theta", "model.compress_rope_theta", "model.rope_factor",
        "model.original_seq_len", "model.beta_fast", "model.beta_slow", "model.norm_eps", "model.kernel_backend"],
    "test_initial_weights_follow_the_seed_and_the_init_scales": [
        "train.seed", "model.init_std", "model.embed_init_std", "model.head_init_std"],
    "test_layout_of_the_built_blocks": [
        "layout.window_layers", "layout.encoder.layers", "layout.encoder.group_size", "layout.encoder.ratio",
        "layout.decoder.layers", "layout.decoder.ratio", "layout.decoder.reindex_every", "layout.candidates",
        "layout.candidate_topk_blocks", "layout.candidate_block_size"],
    "test_layout_settings_reach_the_engines_blocks": [
        "layout.decoder.full_every", "layout.compress_ratios", "layout.kv_source_layer_ids",
        "layout.index_source_layer_ids", "layout.candidate_source_layer_id"],
    "test_optimizer_groups_schedule_and_clipping": [
        "train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.max_steps", "train.weight_decay",
        "train.betas", "train.eps", "train.grad_clip"],
    "test_batch_geometry_loss_weights_and_devices": [
        "train.grad_accum_steps", "data.micro_batch_size", "data.seq_len", "train.indexer_loss_coef",
        "train.dspark_loss_coef", "train.device", "train.precision", "train.checkpoint_dir"],
    "test_recompute_and_kept_attention_per_layer": [
        "parallel.recompute", "parallel.recompute_layers", "parallel.keep_attention_layers",
        "parallel.recompute_offload"],
    "test_expert_parallel_splits_each_moes_experts": ["parallel.expert_parallel"],
    "test_loop_settings_from_what_the_run_wrote": [
        "train.stop_at", "train.log_every", "train.checkpoint_every", "train.keep_checkpoints", "train.eval.every",
        "train.eval.batches"],
    "test_process_group_timeouts_at_start_up_and_after_the_first_step": [
        "train.startup_timeout_s", "train.collective_timeout_s"],
    "test_loaders_and_probes": [
        "data.path", "data.shuffle_seed", "data.heldout_fraction", "data.pack_buffer", "data.pack_carry",
        "train.eval.probe_examples", "train.eval.probe_lens", "train.eval.probe_seed", "train.eval.mqar_pairs",
        "train.eval.mqar_queries"],
    "test_logger_settings_reach_the_wandb_run": ["logger.mode", "logger.project", "logger.name", "logger.group",
                                                 "logger.tags", "model.name", "layout.name"],
    "test_data_settings_reach_the_documents_and_the_tokenizer": [
        "data.source", "data.name", "data.split", "data.text_field", "data.streaming", "data.shuffle_buffer",
        "data.format", "data.messages_field", "data.prompt_field", "data.response_field", "data.tokenizer",
        "data.bos_token", "data.eos_token", "data.pad_token"],
    "test_synthetic_settings_reach_the_loaders_tasks": [
        "data.synthetic_fraction", *(f"data.synthetic.{f.name}" for f in fields(SyntheticConfig))],
}
ELSEWHERE = {  # settings whose test needs another job: one that reads them from what that job builds
    "model.attention": "tests/model/test_dense_baseline.py::test_dense_attention_keeps_documents_apart",
    "model.dense_head_dim": "tests/model/test_dense_baseline.py::test_dense_attention_keeps_documents_apart",
    "data.sample_by": "tests/train/test_data.py::test_a_single_text_file_is_split_into_documents",
    "train.global_batch_size": "tests/parallel/test_batch.py::test_global_batch_fixes_the_microbatches_whatever_the_split",
    "train.max_bad_steps": "tests/train/test_train_run.py::test_nan_steps_are_skipped_then_the_run_stops",
    "logger.plots": "tests/train/test_train_run.py::test_nan_steps_are_skipped_then_the_run_stops",
    "train.resume": "tests/train/test_train_run.py::test_resume_is_bitwise_exact",
    "train.init_from": "tests/train/test_finetune.py::test_export_then_init_from_gives_bitwise_the_same_logits",
    "train.init_strict": "tests/train/test_finetune.py::test_layout_conversion_keeps_and_drops_what_it_lists",
    "parallel.pipeline_stages": "tests/parallel/test_pipeline.py::test_each_stage_holds_the_layers_its_cuts_give",
    "parallel.cuts": "tests/parallel/test_pipeline.py::test_each_stage_holds_the_layers_its_cuts_give",
    "parallel.index_k": "tests/parallel/test_pipeline.py::test_replicas_equal_owners",
    "parallel.p2p": "tests/parallel/test_pipeline.py::test_transfers_take_the_configured_path",
    "parallel.zero_stage": "tests/parallel/test_zero.py::test_optimizer_state_is_partitioned",
    "parallel.layer_times": "tests/parallel/test_pipeline_balance.py::test_split_follows_measured_times",
    "parallel.check_memory": "tests/parallel/test_memory_verdict.py::test_a_job_that_does_not_fit_names_settings_that_do",
    "parallel.keep_attention_layers (a list)": "tests/parallel/test_pipeline.py::test_kept_attention_layers_per_stage",
    "parallel.expert_overlap":
        "tests/parallel/test_expert_parallel.py::test_expert_parallel_equals_every_expert_on_every_replica",
    "parallel.context_parallel": "tests/parallel/test_context_engine.py::test_steps_equal_one_process",
    "parallel.head_chunk": "tests/parallel/test_head_chunk.py::test_a_step_with_head_chunks_equals_one_without",
    "model.qat": "tests/model/test_qat.py::test_qat_rounds_exactly_the_served_tensors",
    "train.optimizer": "tests/train/test_muon_reference.py::test_muon_steps_match_a_plain_reference",
    "train.muon.momentum": "tests/train/test_muon_reference.py::test_muon_steps_match_a_plain_reference",
    "train.muon.update_rms": "tests/train/test_muon_reference.py::test_muon_steps_match_a_plain_reference",
    "train.lora.rank": "tests/train/test_lora.py::test_adapted_model_equals_the_merged_full_weight_model",
    "train.lora.alpha": "tests/train/test_lora.py::test_adapted_model_equals_the_merged_full_weight_model",
    "train.lora.targets": "tests/train/test_lora.py::test_adapted_model_equals_the_merged_full_weight_model",
    "train.checkpoint_async": "tests/train/test_durable_save.py::test_background_saves_write_the_bytes_of_synchronous_ones",
    "train.lora.quantized_base":
        "tests/train/test_released_format.py::test_lora_training_over_the_quantised_base_equals_the_dequantised_one",
}
NOT_READ_BACK = {  # settings with nothing on a CPU to read them from, and why
    "train.peak_tflops": "the MFU's denominator, computed on GPU only (bench/results hold GPU rows with mfu)",
    "train.progress": "the tqdm bar on rank 0: display only",
    "logger.entity": "a wandb account's team: offline runs have none",
}


def all_settings() -> set[str]:
    """Every leaf of the composed config (and of data=synthetic's), of ``ModelArgs`` and of the data group."""
    def leaves(node, prefix):
        out = set()
        for key, value in node.items():
            if isinstance(value, dict) and not prefix.endswith("synthetic.") and key != "tasks":
                out |= leaves(value, f"{prefix}{key}.")
            else:
                out.add(prefix + key)
        return out
    from omegaconf import OmegaConf

    keys = set()
    for extra in ([], ["data=synthetic"]):
        keys |= leaves(OmegaConf.to_container(compose(extra)), "")
    keys |= {f"model.{k}" for k in leaves(asdict(ModelArgs()), "")}
    keys |= {f"data.{f.name}" for f in fields(DataConfig) if f.name != "synthetic"}
    keys |= {f"data.synthetic.{f.name}" for f in fields(SyntheticConfig)}
    return keys


def test_every_setting_is_read_back_somewhere():
    """Each setting is in exactly one of the three lists above, and every test named for one exists: a setting added
    without a read-back fails here."""
    here = [k for keys in HERE.values() for k in keys]
    elsewhere = [k for k in ELSEWHERE if " " not in k]
    listed = here + elsewhere + list(NOT_READ_BACK)
    assert len(listed) == len(set(listed)), [k for k in listed if listed.count(k) > 1]
    settings = all_settings()
    assert set(listed) == settings, {"without a test": sorted(settings - set(listed)),
                                     "not a setting": sorted(set(listed) - settings)}
    own = {node.name for node in ast.parse(Path(__file__).read_text()).body if isinstance(node, ast.FunctionDef)}
    assert set(HERE) <= own, set(HERE) - own
    for where in ELSEWHERE.values():
        path, name = where.split("::")
        tree = ast.parse((REPO / path).read_text())
        assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, where
