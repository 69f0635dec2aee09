"""``python -m train.export <checkpoint> <out dir> [--format ours|deepseek] [--dtype bf16|fp32]
[--max-shard-size 5GB] [--source <released dir>]``.

Writes a checkpoint's weights in the reference format (``train/formats/reference_format.py``): ``model.safetensors``
(sharded above ``--max-shard-size``, with ``model.safetensors.index.json``) under the reference tensor names, and
``config.json`` with the reference config's field names. ``<checkpoint>`` is a checkpoint directory (its
``latest``) or one tag directory, written under any pipeline split; a LoRA run's is written merged into its base
(``train/formats/lora.py``). ``train.init_from=<out dir>`` reads it back.
The tokenizer file the run trained with, if any, is copied beside them as ``tokenizer.json``, with a
``tokenizer_config.json`` holding its chat template and the run's special tokens.

``--format deepseek`` writes DeepSeek's released format instead (``train/formats/released_format.py``: FP8 / FP4 with
e8m0 block scales, its shards, index and ``config.json``), byte for byte as the release for every tensor not trained,
with ``quantization_report.json`` for the rest; ``--source <released dir>`` (default: the run's
``train.init_from``, when it is one) gives the shards, dtypes, scales and the vision tensors to keep.
"""
import argparse
import json
import logging
import re
import shutil
import sys
from pathlib import Path

from model import ModelArgs, layout_from_config
from model.deepseek_config import CONFIG, deepseek_config, is_released, reference_config
from train.data.tokenizer import TOKENIZER_CONFIG
from train.formats import checkpoint
from train.formats.sources import checkpoint_weights
from train.formats.reference_format import DTYPES, MAX_SHARD_BYTES, write_json, write_weights
from train.formats.released_format import ReleasedWeights, quantisation_table, write_released

log = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``1e9`` -> bytes (decimal units, as the safetensors sharding convention)."""
    found = re.fullmatch(r"\s*([0-9.e+]+)\s*([KMGT]?B?)\s*", text.upper())
    if not found or float(found.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GB, 500MB)")
    return int(float(found.group(1)) * _UNITS[found.group(2)])


def checkpoint_model(checkpoint_path: str):
    """(ref, saved config, ModelArgs, Layout) of the checkpoint to export; a non-CSA2 baseline is refused."""
    ref = checkpoint.locate(checkpoint_path, "checkpoint")
    config = checkpoint.read_trainer_state(ref)["config"]
    args, layout = ModelArgs.from_config(config["model"]), layout_from_config(config["layout"])
    if args.attention != "csa2":
        raise ValueError(f"{ref.path} is a model.attention={args.attention} baseline, not a CSA2 model that the "
                         "reference code runs: nothing to export")
    return ref, config, args, layout


def export(checkpoint_path: str, out_dir: Path, dtype: str = "bf16",
           max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write the checkpoint at ``checkpoint_path`` into ``out_dir``; returns the files written."""
    ref, config, args, layout = checkpoint_model(checkpoint_path)
    weights = {name: tensor.to(DTYPES[dtype]) for name, tensor in checkpoint_weights(ref).items()}
    files = write_weights(weights, out_dir, max_shard_bytes)
    write_json(out_dir / CONFIG, reference_config(args, layout, dtype))
    files.append(CONFIG)
    data = config.get("data", {})
    if data.get("tokenizer"):
        files += _copy_tokenizer(data, out_dir)
    return files


REPORT = "quantization_report.json"
BESIDE = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")  # a source's files copied along


def export_deepseek(checkpoint_path: str, out_dir: Path, source: str | None = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> tuple[list[str], dict]:
    """``python -m train.export <checkpoint> <dir> --format deepseek``: the checkpoint's weights in the released
    format, DeepSeek's ``config.json`` and ``quantization_report.json`` (per quantised tensor: exact, or its
    error). ``source``: the released directory to take shards, dtypes, scales, vision tensors and the config's
    other fields from (default: the run's ``train.init_from`` when it is one); without one the layout is
    ``storage``'s and the shards are by size. Returns (files written, the report)."""
    ref, config, args, layout = checkpoint_model(checkpoint_path)
    source = source or (config.get("train") or {}).get("init_from")
    released = None
    if source and is_released(Path(source).expanduser().resolve()):
        released = ReleasedWeights(Path(source).expanduser().resolve())
    elif source and source != (config.get("train") or {}).get("init_from"):
        raise ValueError(f"--source {source} is not a released directory (config.json and safetensors of DeepSeek's "
                         "format)")
    files, report = write_released(checkpoint_weights(ref), out_dir, released, max_shard_bytes)
    write_json(out_dir / CONFIG, deepseek_config(args, layout, released.source_config if released else None))
    write_json(out_dir / REPORT, report)
    files += [CONFIG, REPORT]
    for name in BESIDE if released is not None else ():
        if (released.directory / name).is_file():
            shutil.copyfile(released.directory / name, out_dir / name)
            files.append(name)
    return files, report


def _copy_tokenizer(data: dict, out_dir: Path) -> list[str]:
    """The run's tokenizer file as ``tokenizer.json`` and, when the run had one or named special tokens, a
    ``tokenizer_config.json`` (Hugging Face's layout: the chat template, and the special tokens, the run's
    ``data.*_token`` over its file's), so ``data.tokenizer=<out dir>/tokenizer.json`` tokenizes as the run did."""
    tokenizer = Path(data["tokenizer"])
    if not tokenizer.is_file():
        log.warning("the run's tokenizer %s is not on this machine: not copied", tokenizer)
        return []
    shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    beside = tokenizer.with_name(TOKENIZER_CONFIG)
    settings = json.loads(beside.read_text(encoding="utf-8")) if beside.is_file() else {}
    settings.update({f"{role}_token": data[f"{role}_token"] for role in ("bos", "eos", "pad")
                     if data.get(f"{role}_token") is not None})
    if not settings:
        (out_dir / TOKENIZER_CONFIG).unlink(missing_ok=True)  # an earlier export's, which this tokenizer lacks
        return ["tokenizer.json"]
    write_json(out_dir / TOKENIZER_CONFIG, settings)
    return ["tokenizer.json", TOKENIZER_CONFIG]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n\n")[1])
    parser.add_argument("checkpoint", help="a checkpoint directory (its latest) or one tag directory")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--max-shard-size", type=parse_size, default=MAX_SHARD_BYTES,
                        help="shard the weights above this size (default 5GB)")
    parser.add_argument("--format", choices=("ours", "deepseek"), default="ours",
                        help="ours: the reference format in --dtype; deepseek: the released FP8/FP4 format")
    parser.add_argument("--source", help="--format deepseek: the released directory to follow (default: the run's "
                        "train.init_from, when it is one)")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if options.format == "deepseek":
            files, report = export_deepseek(options.checkpoint, options.out_dir, options.source,
                                            options.max_shard_size)
            print(quantisation_table(report))
        else:
            files = export(options.checkpoint, options.out_dir, options.dtype, options.max_shard_size)
    except (checkpoint.CheckpointError, ValueError, OSError) as error:
        sys.exit(f"error: {error}")
    print(f"exported {options.checkpoint} ({options.format if options.format == 'deepseek' else options.dtype}) to "
          f"{options.out_dir}: {', '.join(files)}")


if __name__ == "__main__":
    main(sys.argv[1:])
