"""The weights at a path, whatever wrote them: one of our checkpoints (a LoRA run's merged into its base), a
directory in the reference format or DeepSeek's released directory. What ``train.init_from`` reads, and what a
LoRA checkpoint's base is read from.
"""
import logging
from pathlib import Path

import torch

from model import ModelArgs, layout_from_config
from model.config import LoRA
from model.deepseek_config import is_released, reference_config
from model.lora import merge
from train.formats import checkpoint
from train.formats.reference_format import ExportedWeights, is_exported
from train.formats.released_format import ReleasedWeights

log = logging.getLogger(__name__)


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

    def load(self, names, rows: dict[str, tuple[int, int]] | None = None,
             device: torch.device | None = None) -> dict[str, torch.Tensor]:
        rows = rows or {}
        return {name: self._tensors[name][slice(*rows[name]) if name in rows else slice(None)].to(device)
                for name in names}


def open_weights(path: str) -> CheckpointWeights | ExportedWeights | ReleasedWeights:
    """The weights at ``path``: DeepSeek's released directory, an exported one, else a checkpoint (directory with
    ``latest``, or a tag)."""
    location = Path(path).expanduser().resolve()
    if is_released(location):
        return ReleasedWeights(location)
    if is_exported(location):
        return ExportedWeights(location)
    try:
        return CheckpointWeights(checkpoint.locate(path, "train.init_from"))
    except checkpoint.NoCheckpoint:
        raise InitError(f"train.init_from={path}: no weights there ({location} is neither an exported directory "
                        "with config.json and model.safetensors, nor a checkpoint directory or one step directory)"
                        ) from None


def checkpoint_weights(ref: checkpoint.CheckpointRef) -> dict[str, torch.Tensor]:
    """Every weight of the checkpoint at ``ref`` under the full model's names: its own, or for a LoRA run's, its
    base's (``train.init_from``, read whole) with the adapters merged in (fp32 at least)."""
    weights = checkpoint.read_weights(ref)
    train = checkpoint.read_trainer_state(ref).get("config", {}).get("train", {})
    lora = LoRA.from_config(train.get("lora"))
    if lora is None:
        return weights
    base = open_weights(train["init_from"])
    return merge(base.load(list(base.shapes())), weights, lora.scale)
