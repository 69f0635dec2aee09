"""The row exchange of the Engram tables over a process group (``model.engram.EngramTable``'s ``exchange``).

A table's rows are split into contiguous ranges, one per rank of the group (the data-parallel ranks of a pipeline
stage, each with its own batch). A lookup sends every id a rank needs to the rank that owns its row, once per
distinct id, and the owners send the rows back: ``all_to_all_single`` of the counts, then of the ids, then of the
rows. Backward runs the same route the other way: each rank sums the gradients of its duplicate ids, sends them to
the owners, and an owner's gradient is the sparse (COO, coalesced) sum over every rank of the rows it lent.

Both directions are collectives: every rank of the group must call each lookup, and its backward, in the same
order (a rank that needs no row sends nothing, but takes part). Works with gloo (CPU) and NCCL.

A table's shards are saved the same way they are held, one file per rank of its rows
(``parallel/stage_checkpoint.py``), so a checkpoint loads under another number of ranks.
"""
import torch
import torch.distributed as dist


class RowExchange:
    """``lookup(weight, ids)``: the rows of ``ids`` (row numbers of the whole table) from the ranks of ``group``,
    each holding ``weight``, the range of ``weight.shape[0]`` rows from ``rank * weight.shape[0]``."""

    def __init__(self, group=None, ranks: list[int] | None = None):
        """``ranks``: the group's global ranks, in group-rank order (default: the whole world's)."""
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.ranks = list(range(self.world)) if ranks is None else list(ranks)

    def lookup(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return _Lookup.apply(weight, ids, self)

    def all_to_all(self, values: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """``send[r]`` leading rows of ``values`` (in rank order) to rank r; ``receive[r]`` rows from rank r."""
        out = values.new_empty((sum(receive), *values.shape[1:]))
        dist.all_to_all_single(out, values.contiguous(), receive, send, group=self.group)
        return out


class _Lookup(torch.autograd.Function):
    """The rows of ``ids`` from their owners; backward: each owner's sparse gradient of ``weight``. An id beyond the
    table is a ValueError on its rank (the others then wait in the collective until the group's timeout)."""

    @staticmethod
    def forward(ctx, weight, ids, exchange: RowExchange):
        part_rows, world = weight.shape[0], exchange.world
        wanted, inverse = torch.unique(ids.flatten(), return_inverse=True)  # sorted, so grouped by owner
        counts = torch.bincount(wanted // part_rows, minlength=world)  # ids per owner
        if counts.numel() > world:
            raise ValueError(f"Engram row {wanted[-1].item()} is beyond the table's {world} x {part_rows} rows")
        send, receive = counts.tolist(), exchange.all_to_all(counts, [1] * world, [1] * world).tolist()
        lent = exchange.all_to_all(wanted, send, receive) - exchange.rank * part_rows  # my rows the others want
        rows = exchange.all_to_all(weight[lent], receive, send)
        ctx.save_for_backward(lent, inverse)
        ctx.exchange, ctx.counts, ctx.weight_shape = exchange, (send, receive), weight.shape
        return rows[inverse].view(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad_rows):
        lent, inverse = ctx.saved_tensors
        send, receive = ctx.counts
        grad_rows = grad_rows.reshape(-1, grad_rows.shape[-1])
        per_wanted = grad_rows.new_zeros(sum(send), grad_rows.shape[1]).index_add_(0, inverse, grad_rows)
        grad_lent = ctx.exchange.all_to_all(per_wanted, send, receive)
        grad_weight = torch.sparse_coo_tensor(lent.unsqueeze(0), grad_lent, ctx.weight_shape,
                                              check_invariants=False).coalesce()
        return grad_weight, None, None
