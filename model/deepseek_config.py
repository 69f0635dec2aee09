"""Our model settings <-> DeepSeek's ``config.json``: the reference format's (the inference code's flat one, our
field names), the released one (the inference code's flat one with ``dtype: fp8``, or Hugging Face's
``text_config``) and the ``model.*`` / ``layout.*`` settings they stand for. Plain config conversion, no weights:
the weights are read and written by ``train/formats/reference_format.py`` and ``released_format.py``.

The reference config uses the reference's field names, which are also ours (``ModelArgs``, ``Layout``), plus
``n_layers``, ``dtype`` and the FFN: our dense SwiGLU FFN is the reference's dense MLP (``ffn.w1/w2/w3``, width
``inter_dim``) on every layer, i.e. ``n_dense_layers = n_layers``; a MoE FFN is the reference's MoE
(``n_routed_experts``, ``moe_inter_dim``, ...). The other V4.1 parts, where on, under the reference's flat names
(``hc_mult``, ``engram_layer_ids``, ``n_mtp_layers`` and ``dspark_*``). No candidate source is ``-1``, as there.
DeepSeek's released config becomes this reference config (``reference_fields``) and from there ``ModelArgs`` and
``Layout``; a field or value this framework does not build is a one-line error naming it.
"""
import json
import logging
from dataclasses import asdict, fields
from pathlib import Path

from model.config import JobConfig, ModelArgs, apply
from model.engram_layout import table_rows
from model.layout import Layout

log = logging.getLogger(__name__)

# A directory of either format: its config and its weights (one file, or shards listed by the index).
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

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
        config.update({ours: json_value(flat["engram"][field]) for field, ours in ENGRAM_FIELDS.items()})
        config["engram_num_embeddings"] = list(table_rows(args.engram))
    if args.dspark.blocks:
        config.update({ours: json_value(flat["dspark"][field]) for field, ours in DSPARK_FIELDS.items()})
    return config


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


# ------------------------------------------------------------------------------------------- DeepSeek's release

# Our reference config's names -> Hugging Face text_config's, where they differ (the same name elsewhere).
HF_NAMES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "moe_inter_dim": "moe_intermediate_size", "n_activated_experts": "num_experts_per_tok",
            "score_func": "scoring_func", "route_scale": "routed_scaling_factor", "rope_head_dim": "qk_rope_head_dim",
            "norm_eps": "rms_norm_eps", "window_size": "sliding_window", "n_mtp_layers": "num_nextn_predict_layers",
            "engram_pad_id": "engram_pad_token_id", "dspark_n_activated_experts": "dspark_num_experts_per_tok",
            "n_dense_layers": "first_k_dense_replace"}
# DeepSeek's names -> ours: HF's, and the inference code's flat config.json (its lists without the _id(s)).
RENAMED = {**{theirs: ours for ours, theirs in HF_NAMES.items()}, "kv_source_layers": "kv_source_layer_ids",
           "index_source_layers": "index_source_layer_ids", "candidate_source_layer": "candidate_source_layer_id"}
ROPE_SCALING = {"factor": "rope_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
                "original_max_position_embeddings": "original_seq_len"}
# Fields that describe the files, the serving runtime or the multimodal model, not the text model's weights; the
# ones with a value are checked: another value would be another model.
REQUIRED = {"num_key_value_heads": 1, "hidden_act": "silu", "topk_method": "noaux_tc", "attention_bias": False,
            "tie_word_embeddings": False, "expert_dtype": "fp4", "scale_fmt": "ue8m0"}
IGNORED = ("architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "bos_token_id",
           "eos_token_id", "pad_token_id", "image_token_id", "vision_config", "max_position_embeddings",
           "max_batch_size", "max_seq_len", "temperature", "auto_map", "use_cache", "initializer_range",
           "attention_dropout", "quantization_config", "rope_scaling")
QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
QUANT_IGNORED = ("activation_scheme", "fmt")


def is_released(directory: Path) -> bool:
    """A directory of DeepSeek's format: a ``config.json`` with ``text_config`` or a quantisation (an HF config),
    or the inference code's ``dtype: fp8``, beside safetensors weights."""
    path = directory / CONFIG
    if not path.is_file() or not ((directory / INDEX).is_file() or (directory / WEIGHTS).is_file()):
        return False
    config = json.loads(path.read_text())
    return "text_config" in config or "quantization_config" in config or config.get("dtype") == "fp8"


def reference_fields(config: dict) -> tuple[dict, list[str]]:
    """DeepSeek's ``config.json`` -> (our reference config, the fields ignored). Raises a one-line ValueError for a
    field this framework does not know or a value it does not build."""
    text = dict(config.get("text_config", config))
    quant = config.get("quantization_config") or text.pop("quantization_config", None)
    ignored = sorted(k for k in config if k != "text_config" and k in IGNORED or k.startswith("vision_"))
    if quant:
        _check_quantization(quant)
    flat, unknown = {}, []
    for key, value in text.items():
        if key in REQUIRED:
            if value not in (REQUIRED[key], None):
                raise ValueError(f"config.json: {key}={value!r} is not a model this framework builds (it builds "
                                 f"{key}={REQUIRED[key]!r})")
        elif key == "rope_scaling":
            flat.update(_rope_scaling(value))
        elif key.startswith("vision_") or key in IGNORED:
            ignored.append(key)
        else:
            flat[RENAMED.get(key, key)] = value
    n_layers, n_mtp = flat.get("n_layers"), flat.get("n_mtp_layers", 0)
    ratios = flat.get("compress_ratios")
    if n_layers is not None and ratios is not None and len(ratios) == n_layers + n_mtp:
        if any(ratios[n_layers:]):
            raise ValueError(f"config.json: compress_ratios gives the draft layers ratios {ratios[n_layers:]}: this "
                             "framework's draft head attends to a window only (ratio 0)")
        flat["compress_ratios"] = ratios[:n_layers]
    if not flat.get("dspark_block_size"):  # the reference builds no draft head without a block size
        flat = {k: v for k, v in flat.items() if not k.startswith("dspark_")} | {"n_mtp_layers": 0}
    if "n_dense_layers" in flat and flat["n_dense_layers"] not in (0, n_layers):
        raise ValueError(f"config.json: first_k_dense_replace={flat['n_dense_layers']}: a stack that mixes dense and "
                         "MoE layers is not one this framework builds")
    flat.setdefault("n_dense_layers", 0 if "n_routed_experts" in flat else n_layers)
    if flat.get("candidate_source_layer_id") is None:
        flat["candidate_source_layer_id"] = -1
    try:
        model_settings(flat)
    except ValueError as error:
        unknown = str(error)
    if unknown:
        raise ValueError(unknown.replace("config.json has fields", "DeepSeek's config.json has fields") +
                         " — a released model with parts this framework does not build")
    return flat, sorted(set(ignored))


def _check_quantization(quant: dict) -> None:
    for key, value in quant.items():
        if key in QUANT_IGNORED:
            continue
        if key not in QUANTIZATION:
            raise ValueError(f"config.json: quantization_config.{key}={value!r} is not a format this framework reads")
        if value != QUANTIZATION[key] and not (key == "expert_dtype" and value is None):
            raise ValueError(f"config.json: quantization_config.{key}={value!r}; this framework reads "
                             f"{key}={QUANTIZATION[key]!r} (SPEC §6)")


def _rope_scaling(value: dict | None) -> dict:
    if not value:
        return {"original_seq_len": 0}
    kind = value.get("rope_type", value.get("type"))
    if kind != "yarn":
        raise ValueError(f"config.json: rope_scaling type {kind!r}: this framework builds YaRN only")
    return {ours: value[theirs] for theirs, ours in ROPE_SCALING.items() if theirs in value}


def released_model(config: dict) -> tuple[ModelArgs, Layout]:
    return model_and_layout(reference_fields(config)[0])


def released_settings(config: dict) -> dict[str, object]:
    """The ``model.*`` / ``layout.*`` settings DeepSeek's ``config.json`` stands for (override keys)."""
    return model_settings(reference_fields(config)[0])


def deepseek_config(args: ModelArgs, layout: Layout, source: dict | None = None) -> dict:
    """DeepSeek's ``config.json`` for a model, in HF's layout (``text_config`` with its names, ``rope_scaling``,
    ``quantization_config``). Over ``source`` (the released config) when given: its fields stay as written (the
    vision model's, the token ids, ``16`` not ``16.0``) unless this model's value differs, and a field the source
    leaves to the reference's default is added only when this model's value is not that default."""
    ours = reference_config(args, layout, "bf16")
    rope = {theirs: ours.pop(mine) for theirs, mine in ROPE_SCALING.items()}
    ours.pop("dtype")
    text = {HF_NAMES.get(k, k): v for k, v in ours.items()}
    text["rope_scaling"] = {"rope_type": "yarn", **rope} if rope["original_max_position_embeddings"] else None
    if args.dspark.blocks:  # the release lists the draft layers' ratios (0: window only) after the backbone's
        text["compress_ratios"] = [*text["compress_ratios"], *[0] * args.dspark.blocks]
    if source is None or "text_config" not in source:  # none, or the inference code's flat one: HF's afresh
        return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                "quantization_config": dict(QUANTIZATION), "text_config": text}
    theirs = dict(source.get("text_config", source))
    implied = deepseek_config(*released_model(source))["text_config"]  # what the source means, defaults included
    for key, value in text.items():
        if key in theirs and json_value(theirs[key]) != json_value(value) or \
                key not in theirs and value != implied[key]:
            theirs[key] = value
    return {**source, "text_config": theirs}


def json_value(value):
    """``value`` as JSON gives it back: lists and tuples compare alike (JSON has no tuples), in dicts too."""
    if isinstance(value, dict):
        return {k: json_value(v) for k, v in value.items()}
    return list(value) if isinstance(value, (list, tuple)) else value


def released_changes(config: JobConfig) -> dict[str, object]:
    """With ``train.init_from`` a released directory, the settings its ``config.json`` sets that differ from
    ``config``'s: every ``model.*`` / ``layout.*`` setting it describes (the training-only ones, such as the balance
    rate or frozen tables, stay the run's). Empty for any other source."""
    path = config.train.init_from
    if not path or not is_released(Path(path).expanduser().resolve()):
        return {}
    settings = released_settings(json.loads((Path(path).expanduser().resolve() / CONFIG).read_text()))
    return {key: value for key, value in settings.items() if json_value(_setting(config, key)) != json_value(value)}


def adopt_released_config(config: JobConfig) -> JobConfig:
    """``config`` with the model of a released ``train.init_from`` (``released_changes``), what changed logged as
    ``key: run's -> released``."""
    changes = released_changes(config)
    if changes:
        log.info("train.init_from=%s is DeepSeek's released model: its config.json sets\n  %s",
                 config.train.init_from,
                 "\n  ".join(f"{key}: {_setting(config, key)!r} -> {value!r}" for key, value in changes.items()))
    return apply(config, changes)


def _setting(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config
