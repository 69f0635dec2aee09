"""Weights in the reference format: what DeepSeek's inference code and the tools around it read.

A directory holds ``config.json`` and the weights as safetensors: ``model.safetensors``, or, above
``MAX_SHARD_BYTES``, shards ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` mapping
each tensor to its shard (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).

Tensor names are our parameter names, which are the reference's (``embed.weight``,
``layers.N.attn_norm.weight``, ``layers.N.attn.wq_a.weight``, ..., ``norm.weight``, ``head.weight``; SPEC §1.1).
``config.json`` uses the reference config's field names, which are also ours (``ModelArgs``, ``Layout``), plus
``n_layers``, ``dtype`` and the FFN: our dense SwiGLU FFN is the reference's dense MLP (``ffn.w1/w2/w3``, width
``inter_dim``) on every layer, i.e. ``n_dense_layers = n_layers``; a MoE FFN is the reference's MoE
(``n_routed_experts``, ``moe_inter_dim``, ...). The other V4.1 parts, where on, under the reference's flat names
(``hc_mult``, ``engram_layer_ids``, ``n_mtp_layers`` and ``dspark_*``). No candidate source is ``-1``, as there.
"""
import json
import os
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.config import ModelArgs
from model.engram_layout import table_rows
from model.layout import Layout

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = "model-{index:05d}-of-{count:05d}.safetensors"
MAX_SHARD_BYTES = 5 * 10**9
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LAYOUT_FIELDS = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                  "candidate_topk_blocks", "candidate_block_size")
# How we initialise, compute or run a baseline, not what the weights are: not in config.json.
NOT_EXPORTED = ("init_std", "embed_init_std", "head_init_std", "kernel_backend", "qat", "attention",
                "dense_head_dim")
PARTS = ("ffn", "inter_dim", "moe", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram", "dspark")  # below
# The V4.1 parts' settings under the reference config's flat names, written only where the part is on; the
# training-only ones (the balance rate, frozen tables) are not part of the weights' description.
MOE_FIELDS = {"n_routed_experts": "n_routed_experts", "n_activated_experts": "n_activated_experts",
              "n_shared_experts": "n_shared_experts", "inter_dim": "moe_inter_dim", "score_func": "score_func",
              "gate_temp": "gate_temp", "norm_topk_prob": "norm_topk_prob", "route_scale": "route_scale",
              "swiglu_limit": "swiglu_limit"}
HC_FIELDS = {"hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps"}
ENGRAM_FIELDS = {"layers": "engram_layer_ids", "num_embeddings": "engram_num_embeddings",
                 "max_ngram_size": "engram_max_ngram_size", "vocab_size": "engram_vocab_size",
                 "n_heads": "engram_n_heads", "head_dim": "engram_head_dim", "pad_id": "engram_pad_id",
                 "compressed_vocab_size": "engram_compressed_vocab_size"}
DSPARK_FIELDS = {"blocks": "n_mtp_layers", "block_size": "dspark_block_size", "target_layers": "dspark_target_layer_ids",
                 "markov_rank": "dspark_markov_rank", "noise_token_id": "dspark_noise_token_id",
                 "n_routed_experts": "dspark_n_routed_experts", "n_activated_experts": "dspark_n_activated_experts"}
NESTED = {"moe": MOE_FIELDS, "engram": ENGRAM_FIELDS, "dspark": DSPARK_FIELDS}


def reference_config(args: ModelArgs, layout: Layout, dtype: str) -> dict:
    """``config.json`` of a model: the reference's field names; our dense FFN as its dense MLP (``n_dense_layers
    = n_layers``), a MoE FFN as its MoE (``n_dense_layers = 0``); hyper-connections, Engram (with its tables'
    row counts) and the draft head where they are on."""
    flat = asdict(args)
    config = {k: v for k, v in flat.items() if k not in NOT_EXPORTED and k not in PARTS}
    for name in LAYOUT_FIELDS:
        value = getattr(layout, name)
        config[name] = list(value) if isinstance(value, tuple) else value
    if layout.candidate_source_layer_id is None:
        config["candidate_source_layer_id"] = -1
    moe = args.ffn == "moe"
    config.update(n_layers=layout.n_layers, n_dense_layers=0 if moe else layout.n_layers, dtype=dtype)
    if moe:
        config.update({ours: flat["moe"][field] for field, ours in MOE_FIELDS.items()})
    else:
        config["inter_dim"] = args.inter_dim
    if args.hc_mult > 1:
        config.update({ours: flat[field] for field, ours in HC_FIELDS.items()})
    if args.engram.layers:
        config.update({ours: _plain(flat["engram"][field]) for field, ours in ENGRAM_FIELDS.items()})
        config["engram_num_embeddings"] = list(table_rows(args.engram))
    if args.dspark.blocks:
        config.update({ours: _plain(flat["dspark"][field]) for field, ours in DSPARK_FIELDS.items()})
    return config


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def model_settings(config: dict) -> dict[str, object]:
    """The ``model.*`` and ``layout.*`` settings a reference-format ``config.json`` stands for, as override keys
    (``model.dim``, ``model.moe.inter_dim``, ``layout.compress_ratios``, ...). Fields we do not have are an error
    naming them: those weights could not be loaded into this model."""
    model_keys = {f.name for f in fields(ModelArgs)} - set(NOT_EXPORTED) - set(PARTS)
    nested = {ours: f"model.{part}.{field}" for part, names in NESTED.items() for field, ours in names.items()}
    flat = {ours: f"model.{field}" for field, ours in HC_FIELDS.items()}
    known = model_keys | set(LAYOUT_FIELDS) | {"n_layers", "n_dense_layers", "dtype", "inter_dim"} | set(nested) | \
        set(flat)
    n_layers = config.get("n_layers", len(config.get("compress_ratios", ())))
    dense_layers = config.get("n_dense_layers", n_layers)
    if dense_layers not in (0, n_layers):
        raise ValueError(f"config.json: n_dense_layers={dense_layers} of n_layers={n_layers}: a stack that mixes "
                         "dense and MoE layers is not one this framework builds (every layer dense, or every MoE)")
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"config.json has fields this framework does not have: {unknown}")
    settings = {f"model.{k}": config[k] for k in sorted(model_keys) if k in config}
    settings["model.ffn"] = "dense" if dense_layers else "moe"
    if dense_layers and "inter_dim" in config:
        settings["model.inter_dim"] = config["inter_dim"]
    settings.update({key: config[ours] for ours, key in {**nested, **flat}.items() if ours in config})
    settings.setdefault("model.hc_mult", 1)
    settings.setdefault("model.engram.layers", [])
    settings.setdefault("model.dspark.blocks", 0)
    for key in LAYOUT_FIELDS:
        if key in config:
            value = config[key]
            settings[f"layout.{key}"] = None if key == "candidate_source_layer_id" and value == -1 else value
    return settings


def model_and_layout(config: dict) -> tuple[ModelArgs, Layout]:
    """The model and layout a reference-format ``config.json`` stands for (``model_settings``, nested back)."""
    groups: dict[str, dict] = {"model": {}, "layout": {}}
    for key, value in model_settings(config).items():
        group, *path = key.split(".")
        node = groups[group]
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return ModelArgs.from_config(groups["model"]), Layout(**groups["layout"])


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
