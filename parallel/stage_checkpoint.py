"""What one rank of a pipeline stage writes of a checkpoint, and loads from one, in the whole model's terms.

DeepSpeed keys its checkpoint files by stage and rank, which only a run with the same split could read. Here the
weights are stored per transformer layer under the full model's names (``layer_<id>.pt``, ``embed.pt``,
``head.pt``), a row-sharded Engram table per range of rows (``rows_<name>_<first row>.pt``), the routed experts per
range of experts (``experts_<layer file>_<first expert>.pt``), and the optimizer state per parameter name and row
range (``parallel/zero.py``, ``parallel/tables.py``). Each rank then reads what it holds under its own split:
a checkpoint loads under any ``parallel.pipeline_stages``, data-parallel, expert-parallel size and ZeRO stage.
``train/formats/checkpoint.py`` writes and publishes the files (atomically) and reads them back.
"""
import glob
import os

import torch

from parallel.stage import PipelineStage
from parallel.tables import TableOptimizer
from parallel.zero import OptimizerShards


class StageCheckpoint:
    """The checkpoint files of one rank of a stage. ``stage``: the rank's ``PipelineStage``; ``row_shards``: its
    table shards' ``{name: (first row, the table's rows)}``; ``expert_shards``: its expert stacks' (expert
    parallelism); ``first_replica`` / ``first_expert_replica``: whether this rank is the first of the ranks that
    hold the same dense weights / experts (the one of them that writes them); ``shards``, ``tables``, ``optimizer``:
    what holds its optimizer state (``OptimizerShards`` per group of replicas, the tables' sparse Adam or None)."""

    def __init__(self, stage: PipelineStage, row_shards: dict[str, tuple[int, int]], expert_shards: dict,
                 first_replica: bool, first_expert_replica: bool, shards: list[OptimizerShards],
                 tables: TableOptimizer | None, optimizer: torch.optim.Optimizer):
        self.stage, self.row_shards, self.expert_shards = stage, row_shards, expert_shards
        self.first_replica, self.first_expert_replica = first_replica, first_expert_replica
        self.shards, self.tables, self.optimizer = shards, tables, optimizer

    def weight_files(self) -> dict[str, dict]:
        """What this rank writes of a checkpoint's weights, file name: contents (views of the live tensors; the
        writer copies them). One file per transformer layer (plus embedding and head), named by the full model's
        layer ids, from the first data-parallel rank of each stage (the others hold the same weights); a row-sharded
        table's rows from every rank that holds some, one file per rank (``rows_file``); each range of experts from
        the first of the ranks that hold it."""
        files = {}
        state = self.stage.owned_state_dict()
        for name, (start, rows) in self.row_shards.items():
            if name not in state:  # a frozen table under LoRA: not checkpointed
                continue
            stop = min(start + state[name].shape[0], rows)  # the last shard's padding is not part of the table
            if stop > start:
                files[rows_file(name, start)] = {"name": name, "rows": (start, stop),
                                                 "values": state[name][:stop - start]}
        experts = {k: v for k, v in state.items() if is_expert(k)}
        if experts and self.first_expert_replica:  # one copy of each range of experts
            for part, tensors in split_by_layer(experts).items():
                first = min(int(k.split(".experts.")[1].split(".")[0]) for k in tensors)
                files[experts_file(part, first)] = tensors
        if self.first_replica:
            dense = {k: v for k, v in state.items() if k not in self.row_shards and not is_expert(k)}
            files.update(split_by_layer(dense))
        return files

    def load_weights(self, load_dir: str) -> None:
        """This stage's layers from the per-layer files of ``weight_files``, whatever split wrote them, and the rows
        of its table shards from the row files of whatever data-parallel size wrote them."""
        own = self.stage.owned_state_dict()
        wanted = split_by_layer({k: v for k, v in own.items() if k not in self.row_shards and not is_expert(k)})
        state = {}
        for part in wanted:
            path = os.path.join(load_dir, part)
            if not os.path.exists(path):
                raise FileNotFoundError(f"checkpoint {load_dir} has no {part}: it was written by another model")
            state.update(torch.load(path, map_location="cpu", weights_only=True))
        for part, names in split_by_layer({k: v for k, v in own.items() if is_expert(k)}).items():
            found = {}
            for path in sorted(glob.glob(os.path.join(load_dir, experts_file(part, "*")))):
                saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                found.update({k: saved[k].clone() for k in names if k in saved})
            missing = sorted(set(names) - set(found))
            if missing:
                raise FileNotFoundError(f"checkpoint {load_dir} does not hold every expert of this model: "
                                        f"{len(missing)} missing, e.g. {missing[0]} — it was written for another "
                                        "model (the expert counts differ), or an experts_*.pt file is missing")
            state.update(found)
        pieces = saved_rows(load_dir)
        for name, (start, rows) in self.row_shards.items():
            if name not in own:  # a frozen table under LoRA: not checkpointed
                continue
            shard = own[name].detach().clone()
            stop = min(start + shard.shape[0], rows)
            shard[:stop - start] = join_rows(name, start, stop, pieces.get(name, []))
            state[name] = shard
        self.stage.load_owned_state_dict(state)

    @property
    def writes_optimizer_state(self) -> bool:
        """Whether this rank's optimizer state belongs in a checkpoint: rows it owns of the dense or the expert
        parameters (``OptimizerShards``), or of a table shard, which only this rank holds."""
        return any(shards.writes_state for shards in self.shards) or self.tables is not None

    def optimizer_state_by_name(self, saving: bool = False) -> dict[str, dict]:
        """This rank's optimizer state keyed by full-model parameter name and row range (experts and table rows in
        the whole tensor's terms), so that it can be loaded under another stage split, data-parallel and
        expert-parallel size (DeepSpeed's own files are keyed by stage and rank). ``saving``: only what this rank
        writes (a replica's copy of state that another rank writes is left out)."""
        state = {}
        for shards in self.shards:
            if shards.writes_state or not saving:
                state.update(shards.state_by_name(self.optimizer))
        if self.tables is not None:
            state.update(self.tables.state_by_name())
        return state

    def load_optimizer_state_by_name(self, pieces: dict[str, list[dict]]) -> None:
        """Load my rows of the state that every saving rank wrote (``optimizer_state_by_name``), grouped by name."""
        for shards in self.shards:
            shards.load_state_by_name(self.optimizer, pieces)
        if self.tables is not None:
            self.tables.load_state_by_name(pieces)


def is_expert(name: str) -> bool:
    """A routed expert's matrix under its reference name (``layers.3.ffn.experts.17.w1.weight``)."""
    return ".ffn.experts." in name


def experts_file(part: str, first) -> str:
    """The file of a range of routed experts of weight file ``part`` (``layer_003.pt`` -> ``experts_layer_003_
    00024.pt``, from expert 24), one per range of experts a rank held; ``first="*"``: the glob of them."""
    stem = part.removesuffix(".pt")
    return f"experts_{stem}_{first}.pt" if first == "*" else f"experts_{stem}_{first:05d}.pt"


def split_by_layer(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Group a (stage) state dict into checkpoint files: ``layer_<id>.pt``, ``embed.pt``, ``head.pt``."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name.startswith("layers."):
            part = f"layer_{int(name.split('.')[1]):03d}.pt"
        else:
            part = "embed.pt" if name.startswith("embed.") else "head.pt"
        parts.setdefault(part, {})[name] = tensor
    return parts


def rows_file(name: str, start: int) -> str:
    """The file of the rows from ``start`` of row-sharded table ``name`` (``layers.1.engram.embed.weight``)."""
    return f"rows_{name}_{start:012d}.pt"


def saved_rows(load_dir: str) -> dict[str, list[dict]]:
    """Every row file of a checkpoint, grouped by table name."""
    pieces: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(load_dir, "rows_*.pt"))):
        piece = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        pieces.setdefault(piece["name"], []).append(piece)
    return pieces


def join_rows(name: str, start: int, stop: int, pieces: list[dict]) -> torch.Tensor:
    """Rows ``start:stop`` of table ``name`` joined from the saved pieces that overlap them."""
    parts = sorted((max(p["rows"][0], start), min(p["rows"][1], stop), p) for p in pieces
                   if max(p["rows"][0], start) < min(p["rows"][1], stop))
    if sum(b - a for a, b, _ in parts) != stop - start:
        raise FileNotFoundError(f"the checkpoint's row files of {name} do not cover rows {start}:{stop}: it was "
                                "written by another model, or a file is missing")
    return torch.cat([p["values"][a - p["rows"][0]:b - p["rows"][0]] for a, b, p in parts])
