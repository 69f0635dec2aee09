"""Config composition, the generated DeepSpeed config, launcher arguments and config errors (no training)."""
import os

import pytest
import torch
from hydra.errors import HydraException

from model.cli import compose, compose_checked, job_config
from parallel.job import resolve_precision
from train.__main__ import strip_launcher_args
from train.run.engine import deepspeed_config, warmup_cosine
from train.run.preflight import planned


def test_defaults_and_overrides_compose():
    cfg = compose(["train.max_steps=7", "layout=all_full", "data.seq_len=512", "logger.mode=disabled",
                   "parallel.pipeline_stages=2", "parallel.cuts=[4]", "train.resume=auto"])
    assert (cfg.model.name, cfg.layout.name) == ("tiny", "all_full")
    assert cfg.train.max_steps == 7 and cfg.train.resume == "auto" and cfg.data.seq_len == 512
    assert cfg.logger.mode == "disabled" and cfg.parallel.pipeline_stages == 2 and cfg.parallel.cuts == [4]
    job, _ = planned(cfg, world_size=2)
    assert job.split.plan.cuts == [4] and job.batch.stages == 2 and job.layout.n_layers == 40


def test_deepspeed_config_follows_the_settings():
    train = job_config(["train.grad_clip=0.5", "train.lr=1e-3"]).train
    ds = deepspeed_config(train, micro_batch=3, microbatches=2, zero_stage=1)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 2
    assert ds["gradient_clipping"] == 0.5 and "bf16" not in ds  # bf16 is autocast over fp32 master weights
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["optimizer"]["params"]["lr"] == 1e-3 and "fused" not in ds["optimizer"]["params"]
    assert deepspeed_config(train, 3, 2, 1, fused_adam=True)["optimizer"]["params"]["fused"] is True
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"


def test_warmup_cosine_schedule():
    ratio = warmup_cosine(warmup_steps=4, total_steps=20, min_ratio=0.1)
    assert [ratio(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert ratio(4) == 1.0 and ratio(20) == pytest.approx(0.1) and ratio(100) == pytest.approx(0.1)
    assert all(ratio(s) >= ratio(s + 1) for s in range(4, 30))


@pytest.mark.parametrize("override", ["train.no_such_key=1", "layout=no_such_layout", "train.max_steps"])
def test_invalid_override_is_a_hydra_error(override):
    with pytest.raises(HydraException):
        compose([override])


@pytest.mark.parametrize("overrides, message", [
    (["model.vocab_size=200"], "model.vocab_size"),
    (["logger.mode=cloudy"], "logger.mode"),
    (["train.max_steps=0"], "train.max_steps"),
    (["train.max_steps=many"], "train.max_steps"),
    (["train.stop_at=50", "train.max_steps=10"], "train.stop_at"),
    (["layout.kv_source_layer_ids=[3]"], "layer"),
    (["parallel.recompute=all"], "parallel.recompute"),
    (["parallel.recompute=block"], "parallel.recompute_layers"),
    (["parallel.keep_attention_layers=2"], "parallel.keep_attention_layers"),
    (["parallel.recompute=layer", "parallel.keep_attention_layers=-1"], "parallel.keep_attention_layers"),
    (["parallel.recompute=layer", "parallel.pipeline_stages=2", "parallel.keep_attention_layers=[0,2,1]"],
     "3 entries for parallel.pipeline_stages=2"),
    (["parallel.recompute=layer", "parallel.keep_attention_layers=[-1]"], "parallel.keep_attention_layers"),
    (["parallel.keep_attention_layers=[3]"], "parallel.recompute=none"),
    (["parallel.index_k=wire"], "parallel.index_k"),
    (["parallel.zero_stage=2"], "parallel.zero_stage"),
    (["data=hf"], "data.source=hf needs data.path — set data.path="),
])
def test_bad_settings_fail_before_training(overrides, message):
    with pytest.raises(ValueError, match=message):
        planned(compose_checked(overrides), world_size=1)


def test_launcher_local_rank_moves_to_env(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_launcher_args(["--local_rank=3", "train.max_steps=2"]) == ["train.max_steps=2"]
    assert os.environ["LOCAL_RANK"] == "3"
    assert strip_launcher_args(["train.lr=1", "--local-rank", "1"]) == ["train.lr=1"]
    assert os.environ["LOCAL_RANK"] == "1"


@pytest.mark.parametrize("device,gpu,accelerator", [("cpu", True, "cpu"), ("auto", True, "cuda"), ("auto", False, "cpu"),
                                                    ("cuda", True, "cuda")])
def test_deepspeed_accelerator_follows_train_device(device, gpu, accelerator, monkeypatch):
    """DeepSpeed moves the model to its accelerator: train.device=cpu on a GPU machine must name the CPU."""
    from train.observe.quiet import name_the_accelerator

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    name_the_accelerator(device)
    assert os.environ["DS_ACCELERATOR"] == accelerator
