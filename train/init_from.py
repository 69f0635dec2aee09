"""``train.init_from``: a run that starts from trained weights instead of the seeded initialisation.

The source is a checkpoint of ours (a checkpoint directory or one tag directory, written under any stage count,
data-parallel size or ZeRO stage: the weights are stored per layer under the full model's names) or a directory
in the reference format (``python -m train.export``). Weights only: the optimizer, the schedule and the data
position start fresh. ``train.resume`` wins: a run that finds a checkpoint to resume never reads ``init_from``.

The match is by tensor name against the whole model of this run (built on the meta device), before the engine is
built, so a bad source fails in seconds. Strict (the default) refuses any tensor missing from the source, any
source tensor this model does not have, and any shape that differs, naming them. ``train.init_strict=false`` keeps
the seeded initial value of what the source lacks and ignores what this model lacks: how a model moves to another
layout (an ``all_full`` run into ``v41``: its Reuse layers keep their own query, window, output and sink weights and
drop the compressor and indexer; a Reindex layer keeps its indexer's query side) and how it keeps its weights when
only lengths change (context extension: nothing is missing or dropped). A shape that differs is always an error:
it means other dimensions, not another layout. What was loaded, newly initialised and ignored is printed and
written to ``<run dir>/init_from.json``. Settings that change what the weights compute without changing a shape
(``norm_eps``, the RoPE and YaRN fields, window and top-k sizes) are listed as a warning when they differ.
"""
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from model import ModelArgs, Transformer, layout_from_config
from train import checkpoint
from train.lora import checkpoint_weights
from train.reference_format import ExportedWeights, is_exported, model_settings, reference_config, write_json

log = logging.getLogger(__name__)

REPORT = "init_from.json"


class InitError(ValueError):
    """Weights that cannot initialise this model; the message names the tensors and what to do."""


class CheckpointWeights:
    """The weights of one of our checkpoints, memory-mapped, with the config it was trained with."""

    def __init__(self, ref: checkpoint.CheckpointRef):
        self.description = f"checkpoint {ref.path}"
        self._tensors = checkpoint_weights(ref)  # a LoRA run's: merged into its base
        saved = checkpoint.read_trainer_state(ref).get("config", {})
        try:
            self.config = reference_config(ModelArgs.from_config(saved["model"]), layout_from_config(saved["layout"]),
                                           "fp32")
        except (KeyError, ValueError) as error:
            log.warning("%s: its model/layout config cannot be read (%s); settings are not compared",
                        self.description, error)
            self.config = None

    def shapes(self) -> dict[str, torch.Size]:
        return {name: tensor.shape for name, tensor in self._tensors.items()}

    def load(self, names) -> dict[str, torch.Tensor]:
        return {name: self._tensors[name] for name in names}


def open_weights(path: str) -> CheckpointWeights | ExportedWeights:
    """The weights at ``path``: an exported directory, else a checkpoint (directory with ``latest``, or a tag)."""
    location = Path(path).expanduser().resolve()
    if is_exported(location):
        return ExportedWeights(location)
    try:
        return CheckpointWeights(checkpoint.locate(path, "train.init_from"))
    except checkpoint.NoCheckpoint:
        raise InitError(f"train.init_from={path}: no weights there ({location} is neither an exported directory "
                        "with config.json and model.safetensors, nor a checkpoint directory or one step directory)"
                        ) from None


@dataclass
class Match:
    """Tensor names of this model against a source's: what loads, what is new, what is left over."""
    loaded: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)  # in this model, not in the source: keep the seeded init
    ignored: list[str] = field(default_factory=list)  # in the source, not in this model
    mismatched: list[str] = field(default_factory=list)  # in both, shapes differ (with the shapes)

    @classmethod
    def of(cls, expected: dict[str, torch.Size], source: dict[str, torch.Size]) -> "Match":
        match = cls(ignored=[n for n in source if n not in expected])
        for name, shape in expected.items():
            if name not in source:
                match.new.append(name)
            elif source[name] != shape:
                match.mismatched.append(f"{name}: source {list(source[name])}, this model {list(shape)}")
            else:
                match.loaded.append(name)
        return match

    def summary(self) -> str:
        lines = [f"{len(self.loaded)} tensors loaded, {len(self.new)} newly initialised, {len(self.ignored)} ignored"]
        for title, names in (("loaded", self.loaded), ("newly initialised (not in the source)", self.new),
                             ("ignored (not in this model)", self.ignored)):
            if names:
                lines += [f"  {title}:", *(f"    {line}" for line in grouped(names))]
        return "\n".join(lines)


def grouped(names: list[str]) -> list[str]:
    """Names with their layer number factored out, one line per per-layer name: ``attn.wq_a.weight  layers 2-5, 8``."""
    layers: dict[str, list[int]] = {}
    for name in names:
        found = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        key, layer = (found.group(2), int(found.group(1))) if found else (name, None)
        layers.setdefault(key, [])
        if layer is not None:
            layers[key].append(layer)
    width = max(map(len, layers))
    return [f"{key:<{width}}  layers {_ranges(ids)}" if ids else key for key, ids in layers.items()]


def _ranges(ids: list[int]) -> str:
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class InitFrom:
    """``train.init_from`` of one run: the source opened and matched against the model before any work."""

    def __init__(self, cfg: DictConfig):
        train = cfg.train
        self.path, self.strict = str(train.init_from), bool(train.get("init_strict", True))
        self.source = open_weights(self.path)
        args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
        with torch.device("meta"):
            expected = {name: t.shape for name, t in Transformer(args, layout).state_dict().items()}
        self.match = Match.of(expected, self.source.shapes())
        self.differences = settings_differences(self.source.config, reference_config(args, layout, "fp32"))
        self._check()

    def _check(self) -> None:
        match, where = self.match, f"train.init_from={self.path} ({self.source.description})"
        if match.mismatched:
            raise InitError(f"{where}: tensor shapes differ from this model's (other model dimensions; compare "
                            "its config):\n  " + "\n  ".join(match.mismatched))
        if self.strict and (match.new or match.ignored):
            parts = [f"{where} does not match this model tensor for tensor (train.init_strict=true). Set "
                     "train.init_strict=false to initialise what the source lacks and ignore what this model lacks "
                     "(e.g. for another layout)."]
            for title, names in (("missing from the source", match.new), ("not in this model", match.ignored)):
                if names:
                    parts += [f"  {title} ({len(names)}):", *(f"    {line}" for line in grouped(names))]
            raise InitError("\n".join(parts))

    def load_into(self, engine) -> None:
        """Copy the matched weights into this rank's stage (owned parameters; shadow replicas follow their owners)."""
        stage = engine.module.stage.model
        loaded = set(self.match.loaded)
        stage.load_state_dict(self.source.load([n for n in stage.state_dict() if n in loaded]), strict=False)
        engine.sync_shadows()

    def report(self, run_dir: Path) -> None:
        """Print what was loaded, newly initialised and ignored, and write it to ``<run_dir>/init_from.json``."""
        if self.differences:
            log.warning("train.init_from: %s was trained with other settings (the weights load regardless):\n  %s",
                        self.source.description, "\n  ".join(self.differences))
        log.info("train.init_from: %s\n%s", self.source.description, self.match.summary())
        write_json(run_dir / REPORT, {
            "init_from": self.path, "source": self.source.description, "strict": self.strict,
            "loaded": self.match.loaded, "newly_initialised": self.match.new, "ignored": self.match.ignored,
            "settings_differences": self.differences})


def settings_differences(source: dict | None, this: dict) -> list[str]:
    """``model.X: source A, this run B`` for every setting of the two configs that differs."""
    if source is None:
        return []
    try:
        theirs = model_settings(source)
    except ValueError as error:
        return [str(error)]
    ours = model_settings(this)
    return [f"{key}: source {theirs.get(key, '<missing>')!r}, this run {ours.get(key, '<missing>')!r}"
            for key in sorted(set(theirs) | set(ours)) if _plain(theirs.get(key)) != _plain(ours.get(key))]


def _plain(value):
    """Lists and tuples compare alike (JSON has no tuples)."""
    return list(value) if isinstance(value, (list, tuple)) else value


def from_config(cfg: DictConfig) -> InitFrom | None:
    return InitFrom(cfg) if OmegaConf.select(cfg, "train.init_from") else None
