"""Every check a job can make without the engine, run first so that bad input fails in seconds, before the
process group, the engine or the run directory exist. The composed config is resolved here, once, into the job
(``planned``: every value against its range, then ``parallel.job.Job``); nothing below reads the config itself. The
checks: config values, layout (and that it pairs with the model), tokenizer, device and precision, the batch against
the stages and launched processes, the stage split and its memory (every stage's estimated peak against the GPU's
memory, or the host's RAM: ``parallel/plan.py``), the probes, the data (path, format, text field, every row's type,
both parts non-empty, the chat template), the checkpoint to resume (its manifest's sizes; the SHA-256
digests once the process group exists, each file hashed by one rank: ``checkpoint.agree``) or else the weights
of ``train.init_from`` (matched tensor by tensor against the model; a released directory first sets the model from
its config.json, so the memory verdict is the released model's, and what each rank will read of it is printed).

What the checks build (documents, probes, the checkpoint) is kept for the job, so nothing is read twice.
"""
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from omegaconf import DictConfig

from model import LayoutError
from model.cli import resolved
from model.config import JobConfig, TrainConfig
from model.deepseek_config import adopt_released_config
from model.layout import CandidateCapacityError, layout_from_config
from parallel.job import Job, plan, resolve_device
from parallel.plan import check_memory, device_memory, split_capacity
from train.data import sft
from train.data.loader import SetSize, build_documents, set_size, synthetic_tasks
from train.evaluation.evaluate import build_probes, data_tokenizer
from train.formats import checkpoint, init_from, lora as lora_runs, manifest
from train.run.engine import engram_token_map


@dataclass
class Checked:
    """What the checks found and built, for the job to use."""

    job: Job  # the settings, model, layout, device, precision, batch and stage split
    memory_line: str  # the memory verdict of the split (it fits: else preflight fails)
    train_documents: object  # train.data.loader.MapDocuments | StreamingDocuments; None: data.synthetic_fraction=1
    heldout_documents: object
    data_line: str  # the sizes of the training and held-out sets, for the run's header
    probes: dict
    resume: checkpoint.CheckpointRef | None
    saved: dict  # the checkpoint's trainer state ({} for a fresh run)
    warm_start: init_from.InitFrom | None  # train.init_from, matched against the model (None when resuming, but for
    # a LoRA run: its frozen base)


def check_config(job: Job) -> None:
    """Fail before any work on settings that cannot run together (each value's own range was checked when the
    config was resolved, the model and parallel settings when the job was planned); each message names the
    setting."""
    config, data = job.config, job.config.data
    if data.source == "hf" and data.path is None:
        raise ValueError("data.source=hf needs data.path — set data.path=<a file, a directory of files, or a dataset "
                         "name>")
    tokenizer = data_tokenizer(data)
    if tokenizer.vocab_size > job.args.vocab_size:
        raise ValueError(f"the tokenizer ({data.tokenizer or 'byte-level'}) has {tokenizer.vocab_size} tokens but "
                         f"model.vocab_size={job.args.vocab_size} — set model.vocab_size>={tokenizer.vocab_size}")
    synthetic_tasks(data, tokenizer)  # data=synthetic: its symbols, and that every task fits
    train = config.train
    if train.stop_at is not None and train.stop_at > train.max_steps:
        raise ValueError(f"train.stop_at={train.stop_at} is outside 1..train.max_steps={train.max_steps} — set a step "
                         "in that range, or null")
    lora_runs.check_run(train, job.lora)


def pairing_error(config: JobConfig, error: CandidateCapacityError) -> LayoutError:
    """A layout whose candidate blocks cannot hold the model's ``index_topk``, said as the pairing it usually is: a
    model preset without its layout (``model=v41_flash`` on the default ``v41_scaled``), with the layout presets
    whose candidate blocks do hold it (more blocks or a smaller top-k would only hide the cause)."""
    index_topk = config.model.index_topk
    suited = [name for name in layout_presets() if _holds(name, index_topk)]
    fix = f"layout={' or layout='.join(suited)}, or a preset without candidate blocks" if suited else \
        "a layout without candidate blocks (layout.candidates=false)"
    return LayoutError(f"model={config.model.name} (index_topk={index_topk}) is paired with layout="
                       f"{config.layout.name}, whose candidate blocks hold too few entries: {error} — pair the model "
                       f"with a layout whose candidate blocks hold its top-k: {fix}; or change the blocks or the top-k "
                       "as said")


def layout_presets() -> list[str]:
    from model.cli import CONF_DIR

    return sorted(path.stem for path in (CONF_DIR / "layout").glob("*.yaml"))


def _holds(preset: str, index_topk: int) -> bool:
    """Whether layout preset ``preset`` (as Hydra composes it) restricts selections to candidate blocks that
    hold ``index_topk`` entries."""
    layout = layout_from_config(resolved(_compose([f"layout={preset}"])).layout)
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


def checkpoint_dir(train: TrainConfig, run_dir: Path) -> Path:
    return Path(train.checkpoint_dir or run_dir / "checkpoints")


def launched_world_size() -> int:
    """Processes the launcher started (``WORLD_SIZE``; 1 for a plain ``python -m train``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def planned(cfg: DictConfig, world_size: int) -> tuple[Job, str]:
    """The job of the composed ``cfg`` on ``world_size`` processes, resolved once (``model.cli.resolved``: every
    value in its range; ``parallel.job.plan``: the model, layout, batch and split) and checked as a whole, and its
    memory verdict line: every check of the settings, before any data, weights or process group."""
    config = adopt_released_config(resolved(cfg))  # a released train.init_from sets the model first
    device = resolve_device(config.train.device)
    memory = device_memory(device.type == "cuda", local_processes(world_size))
    try:
        job = plan(config, world_size, device, split_capacity(device, memory))
    except CandidateCapacityError as error:
        raise pairing_error(config, error) from None
    check_config(job)
    return job, check_memory(job, memory)


def preflight(cfg: DictConfig, run_dir: Path, world_size: int) -> Checked:
    """The job (``planned``) and what its checks build: the probes, the documents, the checkpoint to resume or the
    weights to start from."""
    job, memory_line = planned(cfg, world_size)
    config, data, train = job.config, job.config.data, job.config.train
    engram_token_map(data, job.args)  # the data tokenizer against the Engram tables
    probes = build_probes(config, job.batch.stages)
    reads_text = data.synthetic_fraction < 1  # all-synthetic rows never read the text source
    train_documents = build_documents(data) if reads_text else None
    heldout_documents = build_documents(data, heldout=True) if reads_text else None
    if train_documents is not None and train_documents.format == "chat":
        sft.check_template(data_tokenizer(data))
    sizes = [set_size(d, data_tokenizer(data), data.seq_len) if d is not None else None
             for d in (train_documents, heldout_documents)]
    # sizes only here: the digests are checked once the ranks can share them (checkpoint.agree, in the job)
    ref = checkpoint.find(train.resume, checkpoint_dir(train, run_dir), partial(manifest.problem, digests=False))
    saved = checkpoint.check_compatible(ref, config) if ref else {}
    if ref:
        lora_runs.check_resume(ref, saved["config"], train)
    warm_start = None if ref and job.lora is None else init_from.from_job(job)
    if warm_start is not None:  # what each rank will read, printed before anything is read
        warm_start.describe_ranks(job.split.plan.stages, job.batch.data_parallel, config.parallel.expert_parallel)
    return Checked(job, memory_line, train_documents, heldout_documents, data_line(job, *sizes), probes, ref, saved,
                   warm_start)


def data_line(job: Job, train: SetSize | None, heldout: SetSize | None) -> str:
    """``data: training set <documents, tokens> (<what the run reads of it: epochs>); held-out set <...> (<what an
    evaluation reads: how many times over>)``, and the synthetic tasks when the rows are (partly) synthetic. A
    held-out set smaller than an evaluation repeats within it: its loss is then that of a few documents."""
    data, steps, batch = job.config.data, job.config.train.max_steps, job.batch
    parts = []
    if train is not None:
        reads = steps * batch.global_batch * data.seq_len * (1 - data.synthetic_fraction)
        part = f"training set {train.describe()}"
        if train.tokens:
            part += f" ({steps} steps read {reads:,.0f} positions of it: {reads / train.tokens:.2g} epochs)"
        parts.append(part)
    tasks = synthetic_tasks(data)
    if tasks is not None:
        parts.append(f"synthetic rows ({data.synthetic_fraction:.0%}): {', '.join(tasks.tasks)}, drawn afresh every "
                     f"step, {tasks.config.eval_examples} held-out examples per task")
    if heldout is not None:
        reads = job.config.train.eval.batches * data.micro_batch_size * data.seq_len * batch.data_parallel
        part = f"held-out set {heldout.describe()} (an evaluation reads {reads:,} positions"
        if heldout.tokens and reads > heldout.tokens:
            part += (f": the set {reads / heldout.tokens:.1f} times over; its loss is that of these documents, a "
                     "larger data.heldout_fraction makes it steadier")
        parts.append(part + ")")
    return "data: " + "; ".join(parts)
