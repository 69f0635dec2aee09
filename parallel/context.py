"""Context parallelism (SPEC §7): each row split over the C ranks of a context group, one contiguous chunk each.

``ContextShard`` is the ``context`` a forward takes (``model/context.py``): its three exchanges are autograd
functions over ``torch.distributed``, collectives of the group, so every rank of a group must run every layer
forward and backward in the same order (the pipeline schedule gives every replica of a stage the same order; a
rank with nothing to send still takes part).
- ``gather``: all-gather along dim 1; backward a reduce-scatter (the sum of every rank's gradient of my part). On
  gloo, which has no reduce-scatter, an all-reduce of the whole gradient and my slice of it.
- ``halo``: the previous rank's last rows, as an all-gather of every rank's tail (window - 1 rows of window KV, a
  few hundred KB a layer at V4.1 width: not worth point-to-point ordering against the pipeline's own transfers);
  backward: the next rank's gradient of my tail, the same way.
- ``total``: an all-reduce sum without gradient.

Grid. World = P x C x D (pipeline stages x context x data). DeepSpeed's topology sees P x (C x D): its data-parallel
axis of a stage is the C x D ranks ``stage * C * D + replica * C + chunk`` (a context group is C consecutive ranks),
so gradients are averaged over all of them and ZeRO-1 partitions over all of them. Each rank's loss is C times its
chunk's share of the row's loss (``context_scale``), so that average is the data-parallel mean of whole-row
gradients, as without context parallelism. Parameters do not depend on C: a checkpoint resumes under any C.
"""
import torch
import torch.distributed as dist


class ContextShard:
    """Chunk ``rank`` of a row of ``seq_len`` tokens over the context group ``group`` (global ``ranks``)."""

    def __init__(self, group, ranks: list[int], seq_len: int):
        self.group, self.ranks = group, list(ranks)
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        length = seq_len // self.size
        self.start, self.stop = self.rank * length, (self.rank + 1) * length

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(x, self)

    def halo(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        return _Halo.apply(x, rows, self)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def _all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard: ContextShard):
        ctx.shard = shard
        return torch.cat(shard._all_gather(x), dim=1)

    @staticmethod
    def backward(ctx, grad):
        shard = ctx.shard
        parts = [p.contiguous() for p in grad.chunk(shard.size, dim=1)]
        if dist.get_backend(shard.group) == "gloo":
            summed = torch.cat(parts, dim=1)
            dist.all_reduce(summed, group=shard.group)
            return summed.chunk(shard.size, dim=1)[shard.rank], None
        mine = torch.empty_like(parts[shard.rank])
        dist.reduce_scatter(mine, parts, group=shard.group)
        return mine, None


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows: int, shard: ContextShard):
        ctx.shard, ctx.rows, ctx.shape = shard, rows, x.shape
        tails = shard._all_gather(x[:, x.shape[1] - rows:])
        return tails[shard.rank - 1] if shard.rank > 0 else torch.zeros_like(tails[0])

    @staticmethod
    def backward(ctx, grad):
        shard, rows = ctx.shard, ctx.rows
        grads = shard._all_gather(grad)
        grad_x = grad.new_zeros(ctx.shape)
        if shard.rank + 1 < shard.size:
            grad_x[:, ctx.shape[1] - rows:] = grads[shard.rank + 1]
        return grad_x, None, None


def context_shard(stages: int, replicas: int, context: int, seq_len: int) -> ContextShard | None:
    """This rank's ``ContextShard`` (None for C = 1): ``replicas`` are the C x D data-parallel ranks of a stage,
    cut into context groups of C consecutive ranks. Every rank makes every group, in the same order."""
    if context == 1:
        return None
    mine = None
    for stage in range(stages):
        for first in range(stage * replicas, (stage + 1) * replicas, context):
            ranks = list(range(first, first + context))
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = ContextShard(group, ranks, seq_len)
    return mine


def chunk_length(context, seq_len: int, window: int, ratios, block_size: int) -> int:
    """The tokens of a chunk, after checking that ``parallel.context_parallel`` splits the row into chunks of whole
    compression groups and candidate blocks, no shorter than the window. One line each, naming the fix."""
    _check_count(context)
    if context == 1:
        return seq_len
    unit = max([m * block_size for m in ratios if m > 0], default=1)
    if seq_len % (context * unit):
        raise ValueError(f"data.seq_len={seq_len} is not divisible into parallel.context_parallel={context} chunks of "
                         f"whole compression groups and candidate blocks (a multiple of {unit} tokens each): use a "
                         f"seq_len that is a multiple of {context * unit}")
    length = seq_len // context
    if length < window:
        raise ValueError(f"parallel.context_parallel={context} makes chunks of {length} tokens, shorter than the "
                         f"sliding window ({window}): use at most {seq_len // window} chunks, or a longer data.seq_len")
    return length


def check_context_world(context: int, stages: int, world: int) -> int:
    """The data-parallel replicas D of world = P x C x D, after checking that C divides world / P."""
    _check_count(context)
    if (world // stages) % context:
        raise ValueError(f"parallel.context_parallel={context} does not divide the {world // stages} process(es) of a "
                         f"pipeline stage (world {world} / parallel.pipeline_stages={stages}): launch a multiple of "
                         f"{stages * context} processes")
    return world // stages // context


def _check_count(context) -> None:
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise ValueError(f"parallel.context_parallel={context!r}: use an integer >= 1 (1: no context parallelism)")
