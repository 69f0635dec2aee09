"""Every check a job can make without the engine, run first so that bad input fails in seconds, before the
process group, the engine or the run directory exist: config values, layout, tokenizer, device and precision,
the batch against the stages and launched processes, the stage split, the probes, the data (path, format, text
field, both parts non-empty, the chat template), the checkpoint to resume (manifest: sizes and SHA-256) or else
the weights of ``train.init_from`` (matched tensor by tensor against the model).

What the checks build (documents, probes, the checkpoint) is kept for the job, so nothing is read twice.
"""
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from model import ModelArgs, layout_from_config
from parallel.batch import BatchPlan, batch_plan
from parallel.partition import partition
from train import checkpoint, init_from, sft
from train.data import build_documents, data_config, synthetic_tasks
from train.engine import check_parallel, engram_token_map, resolve_device, resolve_precision
from train.evaluate import build_probes, data_tokenizer

LOGGER_MODES = ("offline", "online", "disabled")


@dataclass
class Checked:
    """What the checks found and built, for the job to use."""

    device: torch.device
    precision: str  # bf16 | fp32
    batch: BatchPlan
    train_documents: object  # train.data.MapDocuments | StreamingDocuments; None: data.synthetic_fraction=1
    heldout_documents: object
    probes: dict
    resume: checkpoint.CheckpointRef | None
    saved: dict  # the checkpoint's trainer state ({} for a fresh run)
    warm_start: init_from.InitFrom | None  # train.init_from, matched against the model (None when resuming)


def check_config(cfg: DictConfig) -> None:
    """Fail before any work on settings that cannot run; each message names the setting."""
    layout, args = layout_from_config(cfg.layout), ModelArgs.from_config(cfg.model)
    layout.check_candidate_capacity(args.index_topk)
    args.check_stack(layout.n_layers)
    engram_token_map(cfg, args)  # the data tokenizer against the Engram tables
    if OmegaConf.is_missing(cfg.data, "path"):
        raise ValueError(f"data.source={cfg.data.source} needs data.path — set data.path=<a file, a directory of "
                         "files, or a dataset name>")
    tokenizer = data_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer ({cfg.data.tokenizer or 'byte-level'}) has {tokenizer.vocab_size} tokens but "
                         f"model.vocab_size={cfg.model.vocab_size} — set model.vocab_size>={tokenizer.vocab_size}")
    synthetic_tasks(data_config(cfg.data), tokenizer)  # data=synthetic: its symbols, and that every task fits
    train = cfg.train
    for key in ("max_steps", "log_every", "max_bad_steps", "eval.batches"):
        value = OmegaConf.select(train, key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"train.{key}={value!r} — set an integer >= 1")
    if not isinstance(train.checkpoint_every, int) or train.checkpoint_every < 0:
        raise ValueError(f"train.checkpoint_every={train.checkpoint_every!r} — set an integer >= 0 (0: no checkpoints)")
    if train.stop_at is not None and not 1 <= train.stop_at <= train.max_steps:
        raise ValueError(f"train.stop_at={train.stop_at} is outside 1..train.max_steps={train.max_steps} — set a step "
                         "in that range, or null")
    check_parallel(cfg.parallel)
    if cfg.logger.mode not in LOGGER_MODES:
        raise ValueError(f"logger.mode={cfg.logger.mode!r} — use one of {', '.join(LOGGER_MODES)}")


def checkpoint_dir(cfg: DictConfig, run_dir: Path) -> Path:
    return Path(cfg.train.checkpoint_dir or run_dir / "checkpoints")


def launched_world_size() -> int:
    """Processes the launcher started (``WORLD_SIZE``; 1 for a plain ``python -m train``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def preflight(cfg: DictConfig, run_dir: Path, world_size: int) -> Checked:
    check_config(cfg)
    device = resolve_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    batch = batch_plan(cfg, world_size)
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    partition(args, layout, int(cfg.data.seq_len), batch.stages, cfg.parallel.cuts)
    probes = build_probes(cfg, batch.stages)
    data = data_config(cfg.data)
    reads_text = data.synthetic_fraction < 1  # all-synthetic rows never read the text source
    train_documents = build_documents(data) if reads_text else None
    heldout_documents = build_documents(data, heldout=True) if reads_text else None
    if train_documents is not None and train_documents.format == "chat":
        sft.check_template(data_tokenizer(cfg.data))
    ref = checkpoint.find(cfg.train.resume, checkpoint_dir(cfg, run_dir))
    saved = checkpoint.check_compatible(ref, cfg) if ref else {}
    warm_start = None if ref else init_from.from_config(cfg)
    return Checked(device, precision, batch, train_documents, heldout_documents, probes, ref, saved, warm_start)
