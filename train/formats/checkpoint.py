"""Atomic checkpoints with everything an exact resume needs.

Layout of ``<checkpoint_dir>``::

    latest                 # tag of the newest complete checkpoint, replaced atomically
    step00000100/          # one tag directory per save
        layer_000.pt ...   # the weights, one file per transformer layer (plus embed.pt, head.pt)
        experts_layer_000_<first>.pt ...  # the routed experts of a layer (of the head's: experts_head_...), one
                                          # file per range of experts an expert-parallel rank held
        rows_<name>_<first row>.pt  # a row-sharded table's rows, one file per data-parallel rank holding some
        trainer_state.json # step, bad-step counters, wandb run id, the resolved run config
        resume_state.pt    # RNG states, loader position, LR schedule and step counters
        optimizer_stage00_dp00.pt  # per rank whose optimizer state is its own (every data-parallel rank under
                                   # ZeRO-1, else the first): its rows of each parameter's state, by name
        manifest.json      # the format version, every other file's size and SHA-256, written last
(train/formats/manifest.py)

A save first copies this rank's state into CPU memory (``stage``; the GPU's tensors into one page-locked buffer of
exactly their size, ``train/formats/staging.py``), then writes it (``write_staged``, in a background thread under
``train.checkpoint_async``) into ``.step00000100.partial``, every file fsync'd under a temporary name and
renamed (``train/formats/durable.py``). Once every rank has written its files, rank 0 writes the manifest from their
digests, renames the directory into place and only then replaces ``latest``, fsyncing each rename. A crash or a power
cut mid-save leaves a ``.partial`` directory that nothing reads and the previous ``latest`` intact. What a resume reads
is JSON or ``torch.load(weights_only=True)``.

Damage after the fact (a truncated, deleted or corrupted file) is caught by the manifest before anything loads:
``train.resume=auto`` starts from ``latest`` if it is intact, else from the newest intact checkpoint, warning about
each one it skips; pruning keeps the newest ``keep`` intact checkpoints up to the current step, so it never
deletes the newest intact one to keep a damaged one.

Every rank is seeded alike and the loader's position is global (``train/data/loader.py``), so rank 0's RNG and loader
state is every rank's: one file serves any number of ranks on resume. The weights are stored per transformer
layer under the full model's names and the optimizer state per parameter name and row range
(``parallel/stage_checkpoint.py``), so a checkpoint resumes under another ``parallel.pipeline_stages``, data-parallel
size or ``parallel.zero_stage``: one path for every case. DeepSpeed's own checkpoint files are not written: they
would repeat the first data-parallel rank's optimizer state (twice the weights' size again) in a form keyed by
stage, which a resume under another split could not use.
"""
import json
import logging
import os
import pickle
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from model.config import JobConfig, plain
from train.formats import durable, manifest
from train.formats.staging import StagingArea
from train.processes.errors import ReportedError

log = logging.getLogger(__name__)

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
RESUME_STATE = "resume_state.pt"
OPTIMIZER_STATE = "optimizer_stage{stage:02d}_dp{dp:02d}.pt"
OPTIMIZER_STATES = "optimizer_stage*_dp*.pt"
WEIGHT_FILES = ("embed.pt", "layer_*.pt", "head.pt", "experts_*.pt")  # as StageCheckpoint.weight_files names them
# Config keys that change how the same weights are computed, not what they are: they may differ on resume.
RUNTIME_ONLY_KEYS = ("model.kernel_backend",)


class CheckpointError(ReportedError):
    """A checkpoint that cannot be resumed here; the message says which one, why, and what to do."""


class NoCheckpoint(CheckpointError):
    """A path that holds no checkpoint at all (as opposed to a damaged one)."""


@dataclass(frozen=True)
class CheckpointRef:
    directory: Path  # the checkpoint dir (holds ``latest``)
    tag: str

    @property
    def path(self) -> Path:
        return self.directory / self.tag


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag_dir: Path) -> int:
    return int(tag_dir.name.removeprefix("step"))


def find(resume: str | None, checkpoint_dir: Path, problem=manifest.problem) -> CheckpointRef | None:
    """The intact checkpoint ``train.resume`` points at: None (fresh run), ``auto`` or a path.

    ``auto`` and a checkpoint directory give ``latest`` if it is intact, else the newest intact checkpoint there
    (a warning names each one skipped and why); ``auto`` with no checkpoint at all is a fresh start. A tag
    directory gives itself. A path that is none of these, or a choice with no intact checkpoint, is an error
    naming the damaged file, never a silent fresh start. Every file is checked against the manifest before anything
    loads: ``problem(tag dir)`` says why one is damaged (default: sizes and SHA-256 in this process; ``agree``:
    shared by the ranks)."""
    if resume is None:
        return None
    if resume == "auto":
        if not _tags(checkpoint_dir):
            log.info("train.resume=auto: no checkpoint in %s, starting fresh", checkpoint_dir)
            return None
        return _newest_intact(checkpoint_dir, problem)
    return locate(resume, "train.resume", problem)


def locate(path: str, setting: str, problem=manifest.problem) -> CheckpointRef:
    """The intact checkpoint at ``path``, which the setting ``setting`` names (for the messages): a checkpoint
    directory gives ``latest`` if intact, else its newest intact checkpoint; a tag directory gives itself."""
    location = Path(path).expanduser().resolve()
    if _tags(location):
        return _newest_intact(location, problem)
    if (location / TRAINER_STATE).is_file() or (location / manifest.MANIFEST).is_file():
        _readable_format(location)
        damage = problem(location)
        if damage is None:
            return CheckpointRef(location.parent, location.name)
        intact = [tag for tag in reversed(_tags(location.parent)) if tag != location and problem(tag) is None]
        verb = "resume from" if setting == "train.resume" else "use"
        hint = (f"{verb} the newest intact one: {setting}={intact[0]}" if intact else
                "no other intact checkpoint is there" + ("; start fresh with train.resume=null"
                                                         if setting == "train.resume" else ""))
        raise CheckpointError(f"checkpoint {location} is damaged: {damage} — {hint}")
    raise NoCheckpoint(f"{setting}={path}: no checkpoint there ({location} is neither a checkpoint directory nor a "
                       "checkpoint tag directory) — point it at <run dir>/checkpoints or one step directory")


def _tags(directory: Path) -> list[Path]:
    """Published checkpoints of ``directory`` (``step<N>``; not ``.partial``), oldest first."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.glob("step*") if p.is_dir() and p.name[4:].isdigit()), key=step_of)


def _newest_intact(directory: Path, problem=manifest.problem) -> CheckpointRef:
    """``latest`` if intact, else the newest intact tag; warns about every one skipped on the way."""
    latest_file = directory / LATEST
    latest = directory / latest_file.read_text().strip() if latest_file.is_file() else None
    order = ([latest] if latest is not None and latest.is_dir() else []) + \
        [tag for tag in reversed(_tags(directory)) if tag != latest]
    skipped = [] if latest is None or latest.is_dir() else [(latest.name, f"{LATEST} names it but it is missing")]
    for tag in order:
        _readable_format(tag)
        damage = problem(tag)
        if damage is None:
            for name, why in skipped:
                log.warning("skipping checkpoint %s: %s", name, why)
            return CheckpointRef(directory, tag.name)
        skipped.append((tag.name, damage))
    raise CheckpointError(f"no intact checkpoint in {directory}: " + "; ".join(f"{n}: {w}" for n, w in skipped)
                          + " — move the damaged ones away and start fresh (train.resume=null)")


def _readable_format(tag: Path) -> None:
    """Refuse a checkpoint of a newer format than this code reads (``manifest.FORMAT``): skipping it as damaged would
    quietly resume an older one, and reading it could misread it."""
    found = manifest.format_of(tag)
    if found is not None and found > manifest.FORMAT:
        raise CheckpointError(f"{tag / manifest.MANIFEST}: checkpoint format {found}, newer than this code reads "
                              f"(format {manifest.FORMAT} and older) — resume it with the version of the code that "
                              "wrote it, or start fresh (train.resume=null)")


def agree(resume: str | None, checkpoint_dir: Path) -> CheckpointRef | None:
    """``find`` for all ranks at once (collective, once the process group exists): rank 0 picks the checkpoint in its
    ``checkpoint_dir``, each candidate's files hashed once between the ranks (rank r the r-th of every world-size
    files: a resume reads the checkpoint once, not once per rank), and broadcasts its choice; every rank asserts that
    it sees the same checkpoint (its manifest's SHA-256), so that no rank loads another one. Rank 0's errors are
    every rank's."""
    if dist.get_world_size() == 1:
        return find(resume, checkpoint_dir)
    if dist.get_rank() == 0:
        try:
            ref = find(resume, checkpoint_dir, problem=_verify_shared)
        except Exception as error:
            _from_rank0(("error", f"rank 0: {error}"))
            raise
        _from_rank0(("chosen", ref and str(ref.path)))
    else:
        while (message := _from_rank0(None))[0] == "verify":
            _verify_share(Path(message[1]))
        if message[0] == "error":
            raise CheckpointError(message[1])
        ref = message[1] and CheckpointRef(Path(message[1]).parent, Path(message[1]).name)
    if ref is None:
        return None
    mine = ref.path / manifest.MANIFEST
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, manifest.sha256(mine) if mine.is_file() else "no manifest")
    others = [r for r, d in enumerate(seen) if d != seen[0]]
    if others:
        raise CheckpointError(f"ranks {others} do not see rank 0's checkpoint {ref.path} (its {manifest.MANIFEST} "
                              "differs or is missing there) — put train.checkpoint_dir on a filesystem every node "
                              "shares, and pin the run directory (hydra.run.dir)")
    return ref


def _from_rank0(message):
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _verify_shared(tag: Path) -> str | None:
    """Rank 0's ``problem`` under ``agree``: asks every rank to check its share of ``tag``'s files."""
    _from_rank0(("verify", str(tag)))
    return _verify_share(tag)


def _verify_share(tag: Path) -> str | None:
    """This rank's share of ``tag``'s files checked against the manifest; the first problem of any rank."""
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, manifest.problem(tag, share=(dist.get_rank(), dist.get_world_size())))
    return next((p for p in found if p is not None), None)


def read_trainer_state(ref: CheckpointRef) -> dict:
    return json.loads((ref.path / TRAINER_STATE).read_text())


def _flatten(node, prefix: str) -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: node}


def check_compatible(ref: CheckpointRef, config: JobConfig) -> dict:
    """The checkpoint's trainer state, after checking it was trained with this run's model and layout.

    Compared before any weight is loaded, so a mismatch reads as the config keys that differ instead of a
    tensor-shape error from deep inside ``load_state_dict``.
    """
    state = read_trainer_state(ref)
    saved, current = {}, {}
    for group in ("model", "layout"):
        saved.update(_flatten(state["config"][group], group))
        current.update(_flatten(plain(getattr(config, group)), group))
    differences = [f"{key}: checkpoint {saved.get(key, '<missing>')!r}, this run {current.get(key, '<missing>')!r}"
                   for key in sorted(set(saved) | set(current))
                   if key not in RUNTIME_ONLY_KEYS and saved.get(key) != current.get(key)]
    if differences:
        raise CheckpointError(f"checkpoint {ref.path} was trained with another model/layout: "
                              + "; ".join(differences) + " — run with the checkpoint's settings, or start fresh "
                              "(train.resume=null)")
    return state


def rng_state() -> dict:
    """Python, NumPy and torch RNG states as tensors and plain containers (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                     gauss),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, checkpoint_dir: Path, step: int, trainer_state: dict, resume_state: dict, keep: int,
         group=None) -> CheckpointRef:
    """Save on every rank (collective): ``stage`` then ``write_staged``, in the caller's thread, through a staging
    area of this save's own."""
    area = StagingArea()
    try:
        return write_staged(checkpoint_dir, step, stage(engine, trainer_state, resume_state, area), keep, group)
    finally:
        area.release()


def stage(engine, trainer_state: dict, resume_state: dict, area: StagingArea) -> dict[str, object]:
    """This rank's files of a checkpoint (name: what goes in it), every tensor copied into CPU memory of its own
    (the GPU's into ``area``, page-locked), so that training may go on changing its tensors while they are written.
    The copies staged in ``area`` before are overwritten: write them first.

    Rank 0 adds ``trainer_state`` (JSON) and ``resume_state`` (RNG and loader position) with the schedule and
    engine counters."""
    files = dict(engine.checkpoint.weight_files())
    if engine.checkpoint.writes_optimizer_state:
        files[OPTIMIZER_STATE.format(stage=engine.stage_id, dp=engine.grid.data_parallel_id)] = \
            engine.checkpoint.optimizer_state_by_name(saving=True)
    if dist.get_rank() == 0:
        files[RESUME_STATE] = {**resume_state, **_engine_state(engine)}
        files[TRAINER_STATE] = json.dumps(trainer_state, indent=1)
    staged = host_copies(files, area)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the copies into the area were queued asynchronously
    return staged


def host_copies(files: dict[str, object], area: StagingArea,
                into_area: Callable[[torch.Tensor], bool] = lambda tensor: tensor.is_cuda) -> dict[str, object]:
    """``files`` nested as they are, each tensor replaced by a copy in CPU memory: those ``into_area`` picks (the
    GPU's; a test picks CPU tensors) copied into ``area``, the others cloned."""
    leaves, nesting = tree_flatten(files)
    picked = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and into_area(leaf)}
    staged = dict(zip(picked, area.copy(list(picked.values()))))
    return tree_unflatten([staged[i] if i in staged else leaf.detach().clone() if isinstance(leaf, torch.Tensor)
                           else leaf for i, leaf in enumerate(leaves)], nesting)


def write_staged(checkpoint_dir: Path, step: int, files: dict[str, object], keep: int, group=None) -> CheckpointRef:
    """Write every rank's ``stage``d files and publish the tag once all of them are on disk (collective over
    ``group``, default the world; a background writer passes a group of its own). Keeps the newest ``keep``
    complete checkpoints (0 = all).

    Each file goes to disk under a temporary name, is fsync'd and renamed (``train/formats/durable.py``), hashed on its
way
    out; rank 0 gathers the sizes and digests into the manifest, renames the directory into place and only then
    replaces ``latest``, each rename made durable before the next step of the publication."""
    rank = dist.get_rank()
    ref = CheckpointRef(checkpoint_dir, tag_for(step))
    partial = checkpoint_dir / f".{ref.tag}.partial"
    if rank == 0:
        if not checkpoint_dir.is_dir():
            checkpoint_dir.mkdir(parents=True)
            durable.sync_dir(checkpoint_dir.parent)
        shutil.rmtree(partial, ignore_errors=True)  # debris of a crashed save
    dist.barrier(group)
    partial.mkdir(parents=True, exist_ok=True)
    written = {name: durable.write_text(partial / name, content, sync=False) if isinstance(content, str) else
               durable.save_tensors(content, partial / name) for name, content in files.items()}
    durable.sync_dir(partial)
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(written, gathered, dst=0, group=group)
    if rank == 0:
        manifest.write(partial, known={name: entry for entries in gathered for name, entry in entries.items()})
        _publish(partial, ref)
        prune(checkpoint_dir, keep, step)
    dist.barrier(group)
    return ref


def _publish(partial: Path, ref: CheckpointRef) -> None:
    """Rename the written ``partial`` directory to the tag's, then point ``latest`` at it."""
    replaced = ref.directory / f".{ref.tag}.old"
    if ref.path.exists():  # a rerun in the same directory reached this step again
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(ref.path, replaced)
    durable.replace_dir(partial, ref.path)
    durable.write_text(ref.directory / LATEST, ref.tag)
    shutil.rmtree(replaced, ignore_errors=True)


def prune(checkpoint_dir: Path, keep: int, step: int) -> None:
    """Keep the newest ``keep`` intact checkpoints up to ``step`` (0: keep all); delete the others up to ``step``.

    Damaged checkpoints never count as kept (sizes checked; the one just written is intact by construction), so
    the newest intact one always stays. Checkpoints after ``step`` (left by a run resumed from an older one) are
    left alone: a save at their step replaces them."""
    if keep <= 0:
        return
    tags = [tag for tag in _tags(checkpoint_dir) if step_of(tag) <= step]
    intact = [tag for tag in tags if manifest.problem(tag, digests=False) is None]
    kept = set(intact[-keep:])
    for tag in tags:
        if tag not in kept:
            shutil.rmtree(tag)


def _engine_state(engine) -> dict:
    """What the engine itself must resume besides weights and optimizer: schedule and step counters."""
    return {"schedule": engine.lr_scheduler.state_dict(),
            "counters": {k: getattr(engine, k) for k in ("global_steps", "global_samples", "skipped_steps")}}


def schedule_for(saved: dict, groups: int) -> dict:
    """The saved LR schedule's state for an optimizer of ``groups`` param groups. Every group of every rank follows
    the one schedule, but the rank that saved it may have held another number of groups: Muon's are one per matrix
    shape (``train/run/engine.py``), so they differ between pipeline stages and ZeRO-1 ranks."""
    return {key: value[:1] * groups if isinstance(value, list) else value for key, value in saved.items()}


def load(engine, ref: CheckpointRef, saved_stages: int) -> dict:
    """Load weights, optimizer and schedule into ``engine``; return the RNG and loader state.

    Whatever split wrote it, each stage reads its layers' weight files and each rank its rows of its parameters'
    optimizer state, by name, from every saving rank's file."""
    if saved_stages != engine.num_stages:
        log.info("checkpoint %s was written by %d pipeline stage(s); re-splitting it over %d", ref.path,
                 saved_stages, engine.num_stages)
    try:
        resume = torch.load(ref.path / RESUME_STATE, weights_only=True)
        engine.checkpoint.load_weights(str(ref.path))
        pieces = optimizer_pieces(ref)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"checkpoint {ref.path} could not be read: {error} — resume from an older one "
                              "(train.resume=<its step directory>)") from error
    if not pieces:
        raise CheckpointError(f"checkpoint {ref.path} has no optimizer state ({OPTIMIZER_STATES}): it is incomplete "
                              "or was written by an older version — resume from another one, or start fresh")
    engine.sync_shadows()  # replicas are not in checkpoints: their owners' values are
    engine.checkpoint.load_optimizer_state_by_name(pieces)
    engine.lr_scheduler.load_state_dict(schedule_for(resume["schedule"], len(engine.optimizer.param_groups)))
    for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
        group["lr"] = lr
    for key, value in resume["counters"].items():
        setattr(engine, key, value)
    return resume


def read_weights(ref: CheckpointRef) -> dict[str, torch.Tensor]:
    """Every weight of the checkpoint under the full model's names, in model order, memory-mapped (a tensor is
    read from disk when used), whatever pipeline split wrote it."""
    weights = {}
    for pattern in WEIGHT_FILES:
        for path in sorted(ref.path.glob(pattern)):
            try:
                weights.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
            except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
                raise CheckpointError(f"{path} is not a readable weight file ({error})") from error
    if not weights:
        raise CheckpointError(f"checkpoint {ref.path} holds no weight files ({', '.join(WEIGHT_FILES)})")
    from parallel.stage_checkpoint import join_rows, saved_rows

    for name, pieces in saved_rows(str(ref.path)).items():  # row-sharded tables, joined whole
        weights[name] = join_rows(name, 0, max(p["rows"][1] for p in pieces), pieces)
    return weights


def optimizer_pieces(ref: CheckpointRef) -> dict[str, list[dict]]:
    """Every saved piece of optimizer state, grouped by parameter name. The files are memory-mapped, so a rank
    reads from disk only the rows it takes."""
    pieces: dict[str, list[dict]] = {}
    for path in sorted(ref.path.glob(OPTIMIZER_STATES)):
        try:
            saved = torch.load(path, weights_only=True, mmap=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
            raise CheckpointError(f"{path} is not a readable optimizer state file ({error}) — resume from an older "
                                  "checkpoint (train.resume=<its step directory>)") from error
        for name, piece in saved.items():
            pieces.setdefault(name, []).append(piece)
    return pieces
