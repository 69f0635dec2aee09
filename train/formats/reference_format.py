"""Weights in the reference format: what DeepSeek's inference code and the tools around it read.

A directory holds ``config.json`` and the weights as safetensors: ``model.safetensors``, or, above
``MAX_SHARD_BYTES``, shards ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` mapping
each tensor to its shard (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).

Tensor names are our parameter names, which are the reference's (``embed.weight``,
``layers.N.attn_norm.weight``, ``layers.N.attn.wq_a.weight``, ..., ``norm.weight``, ``head.weight``; SPEC §1.1).
``config.json`` is the reference config of ``model/deepseek_config.py`` (``reference_config``: the reference's
field names, which are also ours).
"""
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.deepseek_config import CONFIG, INDEX, WEIGHTS

SHARD = "model-{index:05d}-of-{count:05d}.safetensors"
MAX_SHARD_BYTES = 5 * 10**9
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def write_weights(state: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write ``state`` (in its order) as safetensors into ``out_dir``; returns the file names written.

    Shards are filled in order up to ``max_shard_bytes`` (a tensor larger than that gets a shard of its own).
    Every file is written under a temporary name and renamed, the index last; weight files of an earlier export
    that this one does not write are removed, so the directory never mixes two exports' shards."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    count = len(shards)
    names = [WEIGHTS] if count == 1 else [SHARD.format(index=i + 1, count=count) for i in range(count)]
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("model-*-of-*.safetensors"), out_dir / WEIGHTS, out_dir / INDEX]:
        if stale.name not in names and stale.exists():
            stale.unlink()
    mode = _file_mode()
    for file, tensors in zip(names, shards):
        tmp = out_dir / f".{file}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, mode)  # safetensors creates its files private (0600); these are for other tools to read
        os.replace(tmp, out_dir / file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {name: file for file, tensors in zip(names, shards) for name in tensors}}
        write_json(out_dir / INDEX, index)
        names.append(INDEX)
    return names


def _file_mode() -> int:
    """What a plain ``open(..., "w")`` would give a new file under this process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def is_exported(path: Path) -> bool:
    return (path / CONFIG).is_file() and ((path / WEIGHTS).is_file() or (path / INDEX).is_file())


class ExportedWeights:
    """The tensors of a reference-format directory, read lazily: shapes from the headers, a tensor when asked."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.description = f"exported weights {directory}"
        self.config = json.loads((directory / CONFIG).read_text())
        if (directory / INDEX).is_file():
            files = json.loads((directory / INDEX).read_text())["weight_map"]
        else:
            files = None
        self._files: dict[str, str] = {}
        self._shapes: dict[str, torch.Size] = {}
        for file in sorted(set(files.values())) if files else [WEIGHTS]:
            try:
                with safe_open(str(directory / file), framework="pt") as handle:
                    for name in handle.keys():
                        self._files[name] = file
                        self._shapes[name] = torch.Size(handle.get_slice(name).get_shape())
            except Exception as error:  # safetensors raises its own error type for a damaged header
                raise ValueError(f"{directory / file} is not a readable safetensors file ({error})") from error
        if files is not None and set(files) != set(self._files):
            raise ValueError(f"{directory / INDEX} does not match its shards: tensors "
                             f"{sorted(set(files) ^ set(self._files))[:5]} are in one and not the other")

    def shapes(self) -> dict[str, torch.Size]:
        return dict(self._shapes)

    def load(self, names, rows: dict[str, tuple[int, int]] | None = None,
             device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """``names``; ``rows[name] = (start, stop)`` reads only those rows of it (a rank's Engram table shard),
        moved to ``device`` (default: left on the host)."""
        rows = rows or {}
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self._files[name], []).append(name)
        tensors = {}
        for file, wanted in by_file.items():
            with safe_open(str(self.directory / file), framework="pt") as handle:
                tensors.update({name: (handle.get_slice(name)[slice(*rows[name])] if name in rows else
                                       handle.get_tensor(name)).to(device) for name in wanted})
        return tensors
