"""Every check a job can make without the engine, run first so that bad input fails in seconds, before the
process group, the engine or the run directory exist: config values, layout (and that it pairs with the model),
tokenizer, device and precision, the batch against the stages and launched processes, the stage split and its
memory (every stage's estimated peak against the GPU's memory, or the host's RAM: ``parallel/plan.py``), the
probes, the data (path, format, text field, every row's type, both parts non-empty, the chat template), the
checkpoint to resume (manifest: sizes and SHA-256) or else the weights of ``train.init_from`` (matched tensor by
tensor against the model; a released directory first sets the model from its config.json, so the memory verdict
is the released model's, and what each rank will read of it is printed).

What the checks build (documents, probes, the checkpoint) is kept for the job, so nothing is read twice.
"""
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from model import LayoutError, ModelArgs, layout_from_config
from parallel.balance import Split, split_stages
from parallel.batch import BatchPlan, batch_plan
from parallel.plan import check_memory, device_memory
from train import checkpoint, init_from, lora as lora_runs, sft
from train.data import SetSize, build_documents, data_config, set_size, synthetic_tasks
from train.engine import (check_experts, check_parallel, engram_token_map, lora_settings, resolve_device,
                          resolve_precision)
from train.evaluate import build_probes, data_tokenizer

LOGGER_MODES = ("offline", "online", "disabled")


@dataclass
class Checked:
    """What the checks found and built, for the job to use."""

    device: torch.device
    precision: str  # bf16 | fp32
    batch: BatchPlan
    split: Split  # the stages, their costs and estimated peaks
    memory_line: str  # the memory verdict of the split (it fits: else preflight fails)
    train_documents: object  # train.data.MapDocuments | StreamingDocuments; None: data.synthetic_fraction=1
    heldout_documents: object
    data_line: str  # the sizes of the training and held-out sets, for the run's header
    probes: dict
    resume: checkpoint.CheckpointRef | None
    saved: dict  # the checkpoint's trainer state ({} for a fresh run)
    warm_start: init_from.InitFrom | None  # train.init_from, matched against the model (None when resuming, but for
    # a LoRA run: its frozen base)


def check_config(cfg: DictConfig) -> None:
    """Fail before any work on settings that cannot run; each message names the setting."""
    check_pairing(cfg)
    ModelArgs.from_config(cfg.model).check_stack(layout_from_config(cfg.layout).n_layers)
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
    lora_runs.check_run(cfg, lora_settings(cfg))
    if cfg.logger.mode not in LOGGER_MODES:
        raise ValueError(f"logger.mode={cfg.logger.mode!r} — use one of {', '.join(LOGGER_MODES)}")


def check_pairing(cfg: DictConfig) -> None:
    """The layout's candidate blocks hold a selection of the model's ``index_topk``. When they do not, the message
    first says which model and layout were paired and names the layout presets with candidate blocks that do hold
    it: a model preset without its layout (``model=v41_flash`` on the default ``v41_scaled``) is the usual cause,
    and more blocks or a smaller top-k would only hide it."""
    index_topk = ModelArgs.from_config(cfg.model).index_topk
    try:
        layout_from_config(cfg.layout).check_candidate_capacity(index_topk)
    except LayoutError as error:
        suited = [name for name in layout_presets() if _holds(name, index_topk)]
        fix = f"layout={' or layout='.join(suited)}, or a preset without candidate blocks" if suited else \
            "a layout without candidate blocks (layout.candidates=false)"
        raise LayoutError(f"model={cfg.model.name} (index_topk={index_topk}) is paired with layout={cfg.layout.name}, "
                          f"whose candidate blocks hold too few entries: {error} — pair the model with a layout whose "
                          f"candidate blocks hold its top-k: {fix}; or change the blocks or the top-k as said"
                          ) from None


def layout_presets() -> list[str]:
    from model.cli import CONF_DIR

    return sorted(path.stem for path in (CONF_DIR / "layout").glob("*.yaml"))


def _holds(preset: str, index_topk: int) -> bool:
    """Whether layout preset ``preset`` (as Hydra composes it) restricts selections to candidate blocks that
    hold ``index_topk`` entries."""
    layout = layout_from_config(_compose([f"layout={preset}"]).layout)
    try:
        layout.check_candidate_capacity(index_topk)
    except LayoutError:
        return False
    return any(p.candidate_source is not None for p in layout.plan)


def _compose(overrides: list[str]) -> DictConfig:
    """The config of ``overrides``, inside a running Hydra app (``python -m train``) or outside one (tests)."""
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        from hydra import compose

        return compose(config_name="config", overrides=overrides)
    from model.cli import compose

    return compose(overrides)


def local_processes(world_size: int) -> int:
    """This host's processes of the job (torchrun's ``LOCAL_WORLD_SIZE``; else all of them)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def checkpoint_dir(cfg: DictConfig, run_dir: Path) -> Path:
    return Path(cfg.train.checkpoint_dir or run_dir / "checkpoints")


def launched_world_size() -> int:
    """Processes the launcher started (``WORLD_SIZE``; 1 for a plain ``python -m train``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def preflight(cfg: DictConfig, run_dir: Path, world_size: int) -> Checked:
    init_from.adopt_released_config(cfg)  # a released train.init_from sets the model, before anything checks it
    check_config(cfg)
    device = resolve_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    batch = batch_plan(cfg, world_size)
    check_experts(cfg, batch.data_parallel)
    on_gpu, dtype = device.type == "cuda", torch.bfloat16 if precision == "bf16" else torch.float32
    memory = device_memory(on_gpu, local_processes(world_size))
    split = split_stages(cfg, dtype, batch.microbatches, batch.data_parallel, memory.capacity if on_gpu else None,
                         cuda=on_gpu)
    memory_line = check_memory(cfg, world_size, split, batch, dtype, on_gpu, memory)
    engram_token_map(cfg, ModelArgs.from_config(cfg.model))  # the data tokenizer against the Engram tables
    probes = build_probes(cfg, batch.stages)
    data = data_config(cfg.data)
    reads_text = data.synthetic_fraction < 1  # all-synthetic rows never read the text source
    train_documents = build_documents(data) if reads_text else None
    heldout_documents = build_documents(data, heldout=True) if reads_text else None
    if train_documents is not None and train_documents.format == "chat":
        sft.check_template(data_tokenizer(cfg.data))
    sizes = [set_size(d, data_tokenizer(cfg.data), data.seq_len) if d is not None else None
             for d in (train_documents, heldout_documents)]
    ref = checkpoint.find(cfg.train.resume, checkpoint_dir(cfg, run_dir))
    saved = checkpoint.check_compatible(ref, cfg) if ref else {}
    if ref:
        lora_runs.check_resume(ref, saved["config"], cfg)
    warm_start = None if ref and lora_settings(cfg) is None else init_from.from_config(cfg)
    if warm_start is not None:  # what each rank will read, printed before anything is read
        warm_start.describe_ranks(split.plan.stages, batch.data_parallel, int(cfg.parallel.expert_parallel))
    return Checked(device, precision, batch, split, memory_line, train_documents, heldout_documents,
                   data_line(cfg, batch, *sizes), probes, ref, saved, warm_start)


def data_line(cfg: DictConfig, batch: BatchPlan, train: SetSize | None, heldout: SetSize | None) -> str:
    """``data: training set <documents, tokens> (<what the run reads of it: epochs>); held-out set <...> (<what an
    evaluation reads: how many times over>)``, and the synthetic tasks when the rows are (partly) synthetic. A
    held-out set smaller than an evaluation repeats within it: its loss is then that of a few documents."""
    data, seq_len = data_config(cfg.data), int(cfg.data.seq_len)
    parts = []
    if train is not None:
        reads = int(cfg.train.max_steps) * batch.global_batch * seq_len * (1 - data.synthetic_fraction)
        part = f"training set {train.describe()}"
        if train.tokens:
            part += (f" ({cfg.train.max_steps} steps read {reads:,.0f} positions of it: "
                     f"{reads / train.tokens:.2g} epochs)")
        parts.append(part)
    tasks = synthetic_tasks(data)
    if tasks is not None:
        parts.append(f"synthetic rows ({data.synthetic_fraction:.0%}): {', '.join(tasks.tasks)}, drawn afresh every "
                     f"step, {tasks.config.eval_examples} held-out examples per task")
    if heldout is not None:
        reads = int(cfg.train.eval.batches) * int(cfg.data.micro_batch_size) * seq_len * batch.data_parallel
        part = f"held-out set {heldout.describe()} (an evaluation reads {reads:,} positions"
        if heldout.tokens and reads > heldout.tokens:
            part += (f": the set {reads / heldout.tokens:.1f} times over; its loss is that of these documents, a "
                     "larger data.heldout_fraction makes it steadier")
        parts.append(part + ")")
    return "data: " + "; ".join(parts)
