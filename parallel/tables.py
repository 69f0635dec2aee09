"""The optimizer of the row-sharded Engram tables, whose gradients are sparse.

Each data-parallel replica of a stage holds other rows of every table (196.6 B parameters cannot be replicated), so
the tables are in neither DeepSpeed's data-parallel reduction nor the dense optimizer. A shard's gradient already
sums every replica's lookups of its rows (the row exchange's backward, ``parallel/rows.py``); ``average`` turns it
into the mean the reduction gives every other gradient. The state is saved by parameter name and row range, in the
whole table's terms, so that it loads under another data-parallel size.
"""
import torch

from parallel.zero import Shard, rows_of_state


class TableOptimizer:
    """``torch.optim.SparseAdam`` over this rank's table shards (lazy: a row's moments move only in the steps that
    looked it up), with the dense optimizer's betas and epsilon and its learning rate at every step; no weight decay
    (the tables are embeddings). ``tables``: name -> shard; ``row_shards``: name -> (first row, the table's rows)."""

    def __init__(self, tables: dict[str, torch.nn.Parameter], row_shards: dict[str, tuple[int, int]],
                 lr: float, betas: tuple[float, float], eps: float):
        self.tables, self.row_shards = tables, row_shards
        self.optimizer = torch.optim.SparseAdam(list(tables.values()), lr=lr, betas=betas, eps=eps)

    def average(self, replicas: int) -> None:
        """Divide the shards' summed gradients by the ``replicas`` whose lookups they hold."""
        for p in self.tables.values():
            if p.grad is not None and replicas > 1:
                p.grad.mul_(1.0 / replicas)

    def step(self, lr: float) -> None:
        """One step at the dense optimizer's learning rate of this step, then the gradients dropped."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.clear()

    def clear(self) -> None:
        for p in self.tables.values():
            p.grad = None

    def _rows(self, name: str, p: torch.nn.Parameter) -> tuple[int, int]:
        """The rows of the table that shard ``name`` holds (the last shard's padding is no part of it)."""
        start, rows = self.row_shards[name]
        return start, min(start + p.shape[0], rows)

    def state_by_name(self) -> dict[str, dict]:
        """``{name: {"rows": (start, stop), "state": {...}}}`` of the shards that have state."""
        state = {}
        for name, p in self.tables.items():
            start, stop = self._rows(name, p)
            if p in self.optimizer.state and stop > start:
                state[name] = {"rows": (start, stop), "state": {
                    k: v[:stop - start].detach().cpu() if torch.is_tensor(v) and v.dim() else v
                    for k, v in self.optimizer.state[p].items()}}
        return state

    def load_state_by_name(self, pieces: dict[str, list[dict]]) -> None:
        """My rows of the state every saving rank wrote (``state_by_name``); padding rows start from zero moments."""
        for name, p in self.tables.items():
            start, stop = self._rows(name, p)
            if name in pieces and stop > start:
                state = rows_of_state(Shard(name, start, stop, 0), pieces[name], p.device)
                self.optimizer.state[p] = {k: torch.nn.functional.pad(v, (0, 0, 0, p.shape[0] - v.shape[0]))
                                           if torch.is_tensor(v) and v.dim() else v for k, v in state.items()}


def table_optimizer(tables: dict[str, torch.nn.Parameter], row_shards: dict[str, tuple[int, int]],
                    config: dict) -> TableOptimizer | None:
    """The tables' optimizer from the DeepSpeed config's (dense) optimizer parameters; None without trained tables."""
    if not tables:
        return None
    params = config["optimizer"]["params"]
    return TableOptimizer(tables, row_shards, params["lr"], tuple(params["betas"]), params["eps"])
