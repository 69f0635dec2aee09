"""``train.init_from``: a run that starts from trained weights instead of the seeded initialisation.

The source is a checkpoint of ours (a checkpoint directory or one tag directory, written under any stage count,
data-parallel size or ZeRO stage: the weights are stored per layer under the full model's names), a directory
in the reference format (``python -m train.export``), or DeepSeek's released directory
(``train/formats/released_format.py``: its ``config.json`` then sets the model,
``model.deepseek_config.adopt_released_config``, and its FP8 / FP4 tensors are dequantised on load). Weights only:
the optimizer, the schedule and the data position start fresh. ``train.resume`` wins: a run that finds a
checkpoint to resume never reads ``init_from``.

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

from model import ModelArgs, Transformer
from model.deepseek_config import json_value, model_settings, reference_config
from model.layout import Layout
from model.quantized_base import stored_slots
from parallel.job import Job
from train.formats.reference_format import write_json
from train.formats.released_format import ReleasedWeights
from train.formats.sources import InitError, open_weights

log = logging.getLogger(__name__)

REPORT = "init_from.json"


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

    def __init__(self, path: str, strict: bool, args: ModelArgs, layout: Layout, quantized_base: bool = False):
        """``path``: ``train.init_from``; ``strict``: ``train.init_strict``; ``args``, ``layout``: this run's model;
        ``quantized_base``: ``train.lora.quantized_base`` (a released source's FP8/FP4 matrices kept so)."""
        self.path, self.strict, self.args, self.quantized_base = path, strict, args, quantized_base
        self.source = open_weights(self.path)
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
        model = engine.module.stage.model
        if self.quantized_base:  # the stage was built holding its base quantised (model/quantized_build.py)
            held = fill_stored(model, self.source, set(self.match.loaded))
            log.info("train.lora.quantized_base: %d frozen tensors of this stage hold the bytes the release stores",
                     held)
        load_stage(model, self.source, set(self.match.loaded))
        engine.sync_shadows()

    def describe_ranks(self, stages: tuple[range, ...], replicas: int, expert_parallel: int) -> list[str]:
        """What each rank will read of the source, before anything is read: one line per stage and expert rank
        (the replicas of a stage with the same experts read the same, but for their own rows of the Engram
        tables), from the source's headers."""
        if not isinstance(self.source, ReleasedWeights):
            return []
        args = self.args
        loaded = set(self.match.loaded)
        lines = []
        for stage, layers in enumerate(stages):
            for expert_rank in range(expert_parallel):
                share = rank_share(self.source.shapes(), args, layers, stage == 0, stage == len(stages) - 1,
                                   expert_rank, expert_parallel, expert_rank, replicas)
                share = {n: r for n, r in share.items() if n in loaded}
                stored = sum(self.source.stored_bytes(n, r) for n, r in share.items())
                values = sum(_numel(self.source.shapes()[n], r) for n, r in share.items()) * 4
                experts = f", experts {expert_rank + 1}/{expert_parallel} of each MoE" if expert_parallel > 1 else ""
                tables = f", 1/{replicas} of the Engram rows" if args.engram.layers and replicas > 1 else ""
                kept = "the frozen base held as stored, the rest dequantised" if self.quantized_base else \
                    f"{values / 1e9:.3g} GB dequantised (fp32 masters, one layer at a time)"
                lines.append(f"stage {stage} (layers {layers.start}-{layers.stop - 1}){experts}{tables}: "
                             f"{len(share)} tensors, {stored / 1e9:.3g} GB read, {kept}")
        for line in lines:
            log.info("train.init_from: %s", line)
        return lines

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
            for key in sorted(set(theirs) | set(ours)) if json_value(theirs.get(key)) != json_value(ours.get(key))]


def load_stage(model, source, loaded: set[str]) -> None:
    """Load ``loaded`` tensors of the source into ``model`` (a stage's slice): its own layers, only its experts
    (expert parallelism) and only its rows of the Engram tables, one layer at a time (a dequantised released
    layer is the most that is held at once besides the model), read onto the model's device (where a released
    source decodes its FP8 / FP4 bytes). Tensors the model holds quantised (``fill_stored``'s) are not in its state
    dict under these names and are left to ``fill_stored``."""
    state = model.state_dict()
    device = next(model.parameters()).device
    shards = model.row_shards()
    for names in by_part([name for name in state if name in loaded]):
        rows = {n: (shards[n][0], max(shards[n][0], min(shards[n][0] + state[n].shape[0], shards[n][1])))
                for n in names if n in shards}
        tensors = source.load(names, rows=rows, device=device)
        for name, (start, stop) in rows.items():  # the last shard's padding rows keep their values
            full = state[name].detach().clone()
            full[:stop - start] = tensors[name]
            tensors[name] = full
        model.load_state_dict(tensors, strict=False)


def fill_stored(model, source: ReleasedWeights, loaded: set[str]) -> int:
    """Copy into ``model``'s quantised modules (``model.quantized_base.stored_slots``) the codes and scales the
    released ``source`` stores, as stored (no decoding, no full-precision copy; an Engram table's rows of this rank
    only), one layer at a time onto the model's device; returns how many tensors were filled. The base of a LoRA run
    must come from the source: one it lacks, or stores in another form, is an error."""
    slots = stored_slots(model)
    missing = sorted(set(slots) - loaded)
    if missing:
        raise InitError(f"train.lora.quantized_base: train.init_from lacks {missing[0]} ({len(missing)} such), a "
                        "frozen base tensor held as released — start from the release this model is, or set "
                        "train.lora.quantized_base=false")
    device = next(model.parameters()).device
    for names in by_part(list(slots)):
        stored = source.load_stored(names, {n: slots[n].rows for n in names if slots[n].rows}, device)
        for name in names:
            codes, scale, fmt, block = stored[name]
            slot = slots[name]
            if (fmt, block) != (slot.fmt, slot.block):
                raise InitError(f"train.init_from={source.directory}: {name} is stored "
                                f"{'plain' if fmt is None else f'{fmt} in blocks of {block}'}, not {slot.fmt} in "
                                f"blocks of {slot.block} as the release stores it — set "
                                "train.lora.quantized_base=false")
            slot.codes.copy_(codes.view(torch.uint8))
            slot.scale.copy_(scale.view(torch.uint8))
    return len(slots)


def by_part(names: list[str]) -> list[list[str]]:
    """``names`` grouped by layer (``layers.N``, ``mtp.K``) or top-level module: what is read at once."""
    parts: dict[str, list[str]] = {}
    for name in names:
        part = name.split(".")
        parts.setdefault(".".join(part[:2]) if part[0] in ("layers", "mtp") else part[0], []).append(name)
    return list(parts.values())


def rank_share(shapes: dict[str, torch.Size], args: ModelArgs, layers: range, has_embed: bool, has_head: bool,
               expert_rank: int, expert_parallel: int, table_rank: int, table_ranks: int
               ) -> dict[str, tuple[int, int] | None]:
    """The tensors of the full model's ``shapes`` that one rank holds, with the rows it holds of a row-sharded
    one (None: whole): its layers, the embedding on the first stage, the norm, head and draft head on the last,
    its range of every MoE's routed experts and its ``ceil(rows / table_ranks)`` rows of each Engram table."""
    share = {}
    for name, shape in shapes.items():
        first = name.split(".")[0]
        if first == "layers" and int(name.split(".")[1]) not in layers or first == "embed" and not has_embed or \
                first in ("norm", "head", "mtp") and not has_head:
            continue
        expert = re.search(r"\.ffn\.experts\.(\d+)\.", name)
        if expert:
            n = args.dspark.n_routed_experts if first == "mtp" else args.moe.n_routed_experts
            held = n // expert_parallel
            if not expert_rank * held <= int(expert.group(1)) < (expert_rank + 1) * held:
                continue
        rows = None
        if name.endswith("engram.embed.weight"):
            part = -(-shape[0] // table_ranks)
            rows = (min(table_rank * part, shape[0]), min((table_rank + 1) * part, shape[0]))
        share[name] = rows
    return share


def _numel(shape: torch.Size, rows: tuple[int, int] | None) -> int:
    return (rows[1] - rows[0]) * shape[1:].numel() if rows else shape.numel()


def from_job(job: Job) -> InitFrom | None:
    """The job's ``train.init_from`` opened and matched against its model (None when it has none)."""
    train = job.config.train
    quantized = job.lora is not None and job.lora.quantized_base
    return InitFrom(train.init_from, train.init_strict, job.args, job.layout, quantized) if train.init_from else None
