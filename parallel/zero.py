"""ZeRO stage 1 on the pipeline engine: a stage's optimizer state is partitioned over its data-parallel replicas.

The parameters of a stage, in model order, are read as one sequence of rows (a row is a slice along dim 0) and cut
into one contiguous run per data-parallel rank, of nearly equal element counts (``plan_shards``). Each rank keeps
the AdamW state of its run only, steps it and broadcasts it to the stage's other replicas. Gradients are still
all-reduced in full by DeepSpeed and clipped by our engine before the step, so an update is bitwise the one without
ZeRO: AdamW is elementwise, and rows of a parameter stepped with the same rows of its gradient give the same numbers.
Muon (``parallel/muon.py``) works on whole matrices, so its parameters are cut only between matrices (``units``).
A parameter inside a run is handed to the optimizer as itself; one cut by a run boundary as a view of its rows.
Communication per step is that of DeepSpeed's own stage 1 under its default (``use_multi_rank_bucket_allreduce``):
all-reduce the gradients, then send the updated weights once (here a broadcast per owner, not an all-gather).

Why not DeepSpeed's ``DeepSpeedZeroOptimizer`` (0.19.8, ``zero_optimization.stage=1``): it does run on gloo with
fp32 parameters on the pipeline engine, but it flattens the parameters into per-group buffers, keeps its own fp32
copy of each partition and reduces gradients into element partitions that cut parameters anywhere. Our two-group
clipping would have to scale those partitions through its private bookkeeping, with norms summed from fragments (no
longer bitwise the unpartitioned norm); the by-name optimizer state (checkpoints portable across stage counts) would
go through per-parameter collectives and its lazily created state; and under it the engine does not clear gradients
of parameters outside the optimizer, so shadow-replica gradients accumulated across steps (the owner's indexer keys
drifted from step 2 on in our test run).
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """Rows ``start:stop`` (dim 0) of parameter ``name``, stepped by data-parallel rank ``owner``."""
    name: str
    start: int
    stop: int
    owner: int


def plan_shards(shapes: list[tuple[str, torch.Size]], parts: int, units: dict[str, int] | None = None) -> list[Shard]:
    """Cut the parameters (in this order) into ``parts`` contiguous runs of nearly equal element counts.

    Run ``k`` starts at the row boundary nearest to element ``k * total / parts``, so runs differ by at most about
    one row of the tensor a boundary falls in; that keeps every shard a plain row slice of one parameter. ``units``:
    a parameter's rows are cut only at multiples of its unit (Muon's matrices stay whole: ``parallel/muon.py``), so
    there the runs differ by up to a unit."""
    units = units or {}
    total = sum(math.prod(shape) for _, shape in shapes)
    bounds = [k * total // parts for k in range(1, parts)]  # first element of run k+1
    shards, owner, offset = [], 0, 0
    for name, shape in shapes:
        rows, numel = shape[0], math.prod(shape)
        start = 0
        while owner < parts - 1 and bounds[owner] < offset + numel:
            unit = units.get(name, 1)
            nearest = ((bounds[owner] - offset) * rows + numel // 2) // numel  # the nearest row boundary
            cut = max(start, (nearest + unit // 2) // unit * unit)
            if cut > start:
                shards.append(Shard(name, start, cut, owner))
            start, owner = cut, owner + 1
        if start < rows:
            shards.append(Shard(name, start, rows, owner))
        offset += numel
    idle = set(range(parts)) - {s.owner for s in shards}
    if idle:
        raise ValueError(f"ZeRO-1 over {parts} data-parallel ranks: a stage of {total} parameter elements leaves "
                         f"rank(s) {sorted(idle)} no rows to own; use fewer ranks or parallel.zero_stage=0")
    return shards


class OptimizerShards:
    """The rows of a stage's parameters that this rank's optimizer steps, and what keeps the replicas in sync.

    ``group``/``ranks``/``rank``: the replicas that hold these parameters alike (the stage's data-parallel group; for
    the routed experts under expert parallelism, the ranks holding the same experts). ``row_offsets``: a parameter
    that holds rows of a larger one (an expert-parallel rank's experts) names its rows in the larger one's terms in
    the saved state, so that it re-shards under another split. With ``partitioned`` False (ZeRO off) every rank
    owns every parameter whole: the optimizer sees the module's own parameters and nothing is broadcast. ``units``:
    rows per indivisible piece of a parameter (``plan_shards``)."""

    def __init__(self, named: dict[str, torch.nn.Parameter], group, ranks: list[int], rank: int, partitioned: bool,
                 row_offsets: dict[str, int] | None = None, units: dict[str, int] | None = None):
        self.group, self.ranks, self.row_offsets = group, list(ranks), row_offsets or {}
        # With one data-parallel rank there is nothing to partition, nor to broadcast (which would copy the stage)
        self.named, self.partitioned = named, partitioned and len(self.ranks) > 1
        self.dp_rank = rank
        self.me = self.dp_rank if self.partitioned else 0  # my run of rows
        self.shards = plan_shards([(n, p.shape) for n, p in named.items()], len(self.ranks) if self.partitioned else 1,
                                  units)
        self.tensors = {s: self._rows(s) if self._partial(s) else named[s.name]
                        for s in self.shards if s.owner == self.me}  # what the optimizer steps

    def _rows(self, shard: Shard) -> torch.Tensor:
        return self.named[shard.name].detach()[shard.start:shard.stop]

    def _partial(self, shard: Shard) -> bool:
        return shard.stop - shard.start < self.named[shard.name].shape[0]

    @property
    def writes_state(self) -> bool:
        """Whether this rank's optimizer state belongs in a checkpoint: every rank's under ZeRO-1, else only the
        first data-parallel rank's (the others hold copies of it)."""
        return self.partitioned or self.dp_rank == 0

    def param_groups(self, groups: list[dict]) -> list[dict]:
        """The optimizer's parameter groups: each group's parameters replaced by the rows of them that I own."""
        mine: dict[int, list[torch.Tensor]] = {}
        for shard, tensor in self.tensors.items():
            mine.setdefault(id(self.named[shard.name]), []).append(tensor)
        return [{**group, "params": [t for p in group["params"] for t in mine.get(id(p), [])]} for group in groups]

    @contextlib.contextmanager
    def gradients(self):
        """Within: a view of a parameter's rows has the same rows of the parameter's (reduced, clipped) gradient.
        After: those views drop them, so no gradient outlives the step through them."""
        views = [(s, t) for s, t in self.tensors.items() if self._partial(s)]
        for shard, view in views:
            grad = self.named[shard.name].grad
            view.grad = None if grad is None else grad[shard.start:shard.stop]
        try:
            yield
        finally:
            for _, view in views:
                view.grad = None

    def broadcast(self) -> None:
        """Send every owner's updated rows to the stage's other data-parallel replicas (one broadcast per owner)."""
        if not self.partitioned:
            return
        for owner, rank in enumerate(self.ranks):
            views = [self._rows(s) for s in self.shards if s.owner == owner]
            if owner == self.me:
                flat = torch.cat([v.reshape(-1) for v in views])
            else:
                flat = views[0].new_empty(sum(v.numel() for v in views))
            dist.broadcast(flat, src=rank, group=self.group)
            if owner != self.me:
                for view, part in zip(views, flat.split([v.numel() for v in views])):
                    view.copy_(part.view_as(view))

    def state_by_name(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        """My optimizer state keyed by full-model parameter name: ``{"rows": (start, stop), "state": {...}}``, rows in
        the whole parameter's terms (``row_offsets``)."""
        return {s.name: {"rows": (s.start + self._offset(s), s.stop + self._offset(s)),
                         "state": {k: v.detach().cpu() for k, v in optimizer.state[t].items()}}
                for s, t in self.tensors.items() if t in optimizer.state}

    def _offset(self, shard: Shard) -> int:
        return self.row_offsets.get(shard.name, 0)

    def load_state_by_name(self, optimizer: torch.optim.Optimizer, pieces: dict[str, list[dict]]) -> None:
        """Give every shard of mine its rows of the saved state; ``pieces`` holds, per name, what every saving rank
        wrote (``state_by_name``), under any stage split and data-parallel size. A name without pieces had no
        state yet (no gradient so far) and gets none."""
        for shard, tensor in self.tensors.items():
            if shard.name in pieces:
                offset = self._offset(shard)
                rows = Shard(shard.name, shard.start + offset, shard.stop + offset, shard.owner)
                optimizer.state[tensor] = rows_of_state(rows, pieces[shard.name], tensor.device)


def rows_of_state(shard: Shard, pieces: list[dict], device: torch.device) -> dict[str, torch.Tensor]:
    """The state of ``shard``'s rows, cut and joined from saved pieces of the same parameter, on ``device`` (the
    parameter's).

    Tensors with rows (AdamW's moments) are joined along dim 0; a scalar (AdamW's ``step``, equal in every piece)
    is taken as fp32 on the parameter's device too: where the fused AdamW that trains on a GPU reads it
    (``train/run/engine.py``), and on the CPU where the plain AdamW keeps it."""
    overlaps = sorted(((max(p["rows"][0], shard.start), min(p["rows"][1], shard.stop), p) for p in pieces
                       if max(p["rows"][0], shard.start) < min(p["rows"][1], shard.stop)), key=lambda o: o[0])
    if sum(stop - start for start, stop, _ in overlaps) != shard.stop - shard.start:
        raise ValueError(f"the saved optimizer state of {shard.name} does not cover rows {shard.start}:{shard.stop}")
    state = {}
    for key, value in overlaps[0][2]["state"].items():
        if not torch.is_tensor(value):  # a plain count (sparse Adam's step)
            state[key] = value
        elif value.dim() == 0:
            state[key] = value.to(device, torch.float32, copy=True)
        else:
            state[key] = torch.cat([p["state"][key][start - p["rows"][0]: stop - p["rows"][0]]
                                    for start, stop, p in overlaps]).to(device)
    return state
