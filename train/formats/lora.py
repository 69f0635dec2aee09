"""LoRA runs (``train.lora.rank > 0``, ``model/lora.py``) around their checkpoints.

A LoRA run's checkpoint holds its adapters (per layer and expert range, as any checkpoint's weights), their
optimizer state and the trainer state, whose config names the frozen base: ``train.init_from``. The base is read
from there at the start of every run of it, a resumed one included, and a checkpoint's full weights are the base's
with every adapted matrix merged, ``W + (alpha / rank) B A`` (``train/formats/sources.py``'s ``checkpoint_weights``:
what ``python -m train.export`` writes and ``train.init_from=<a LoRA checkpoint>`` starts from).

LoRA without ``train.init_from`` is an error, not a warning: adapters on a seeded random base train nothing worth
keeping, and a checkpoint of one could not name its base.
"""
from pathlib import Path

from model.config import LoRA, TrainConfig
from model.deepseek_config import is_released
from train.formats import checkpoint


def check_run(train: TrainConfig, lora: LoRA | None) -> None:
    """A LoRA run needs a base to adapt; a quantised base (``train.lora.quantized_base``) a released one."""

    if lora is not None and not train.init_from:
        raise ValueError(f"train.lora.rank={lora.rank} trains adapters on a frozen base: set train.init_from=<a "
                         "checkpoint or an exported directory> (or train.lora.rank=0 to train every weight)")
    if lora is not None and lora.quantized_base and not is_released(Path(train.init_from).expanduser().resolve()):
        raise ValueError(f"train.lora.quantized_base=true keeps the base as DeepSeek's release stores it: set "
                         f"train.init_from to a released directory (it is {train.init_from}), or "
                         "train.lora.quantized_base=false")


def check_resume(ref: checkpoint.CheckpointRef, saved_config: dict, train: TrainConfig) -> None:
    """A checkpoint resumes under the LoRA settings and the base it was trained with (or both without LoRA)."""
    saved_train = saved_config.get("train", {})
    saved, current = LoRA.from_config(saved_train.get("lora")), train.lora if train.lora.rank else None
    if saved != current:
        raise checkpoint.CheckpointError(
            f"checkpoint {ref.path} was trained with train.lora={_describe(saved)}, this run has {_describe(current)}"
            " — resume with the checkpoint's train.lora settings, or start fresh (train.resume=null)")
    if saved is not None and _where(saved_train.get("init_from")) != _where(train.init_from):
        raise checkpoint.CheckpointError(
            f"checkpoint {ref.path} holds adapters of the base train.init_from={saved_train.get('init_from')}, this "
            f"run names train.init_from={train.init_from} — resume on the checkpoint's base")


def _describe(lora: LoRA | None) -> str:
    return "off (rank 0)" if lora is None else f"rank {lora.rank}, alpha {lora.alpha}, targets {list(lora.targets)}"


def _where(path) -> Path | None:
    return Path(path).expanduser().resolve() if path else None
