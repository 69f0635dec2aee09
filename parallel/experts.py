"""Expert parallelism inside a pipeline stage (SPEC §7): the routed experts of every MoE layer split over an
expert-parallel group, the routed slots sent to their experts' ranks and back by all-to-all.

Groups. A stage's ``D`` data-parallel ranks (DeepSpeed's topology: global rank ``stage * D + replica``) form
``D / E`` expert-parallel groups of ``E`` consecutive replicas; member ``r`` of a group holds experts ``[r * E_l,
(r + 1) * E_l)`` of every MoE (``E_l = experts / E``, for the main layers and the draft head's alike). The members
with the same ``r`` across the groups hold the same experts: their expert gradients are summed over that
*expert-data-parallel* group (``D / E`` ranks), every other weight's over all ``D`` (``parallel/engine.py``).

Dispatch (``ExpertAllToAll``, ``model.moe.MoE``'s ``dispatch``). A rank routes its own tokens; its slots, sorted by
expert, are already grouped by destination. The per-expert counts go out first (``all_to_all_single``), then the
slot rows and their routing weights; a receiver puts the rows it got (source-major) into expert-major order, runs
its experts as one grouped GEMM, restores the order and sends the outputs back (``run_received``: both
permutations gathers, forward and backward). Every exchange is an autograd function whose backward is the exchange
the other way, so the experts' inputs, the routing weights (and through them the gate) and the experts' weights all
get the gradients of the whole batch. The counts are read on the host (the splits of ``all_to_all_single``): one
synchronisation per layer and direction, the MoE step's only ones.

Load. Under uniform routing a rank receives as many rows as it sends (tokens x top-k); a rank holding busier experts
receives more, up to E times as many when every token goes to its experts. Each dispatch keeps the rows it received
by MoE (``received``: the trainer logs them), and on CUDA checks them against the memory left before running the
experts: a rank that would run out stops with ``ExpertOverload``, naming the layer and its load (``received_bytes``
is the working set the check and the plan count).

Every rank of a group must run every MoE forward and backward in the same order (a rank that routes nothing to
another still sends it an empty part): the pipeline schedule gives every replica of a stage the same order.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.config import ModelArgs
from model.layout import Layout
from model.moe import inverse_permutation, reorder


class ExpertOverload(RuntimeError):
    """A rank's experts received more routed rows than its GPU's memory left can run (collapsed routing)."""


def received_bytes(dim: int, inter_dim: int, rows: int, itemsize: int) -> int:
    """The experts' working set for ``rows`` received rows: per row, in the compute dtype, the input (dim), the
    w1|w3 products (2 x inter), the clamped SwiGLU (inter) and the output (dim), and as much again for their gradients
    in the backward. The fp32 routing weights and the permutations' indices are left out (< 1% at V4.1's widths)."""
    return rows * (2 * dim + 3 * inter_dim) * itemsize * 2


class _AllToAll(torch.autograd.Function):
    """``send[r]`` leading rows of ``x`` (rank order) to rank ``r`` of ``group``, ``receive[r]`` rows from it; the
    gradient goes back the same way. With a ``pending`` list the forward's exchange is only started (its work is
    appended there): the caller waits on it before it reads the output."""

    @staticmethod
    def forward(ctx, x, send: list[int], receive: list[int], group, pending: list | None = None):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return exchange(x, send, receive, group, pending)

    @staticmethod
    def backward(ctx, grad):
        return exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None, None


def exchange(x: torch.Tensor, send: list[int], receive: list[int], group, pending: list | None = None) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), receive, send, group=group, async_op=pending is not None)
    if pending is not None:
        pending.append(work)
    return out


class ExpertAllToAll:
    """The dispatch of one expert-parallel group (``group``, its global ``ranks`` in group order): ``(experts, rows,
    counts, weights, meanwhile) -> (rows, meanwhile())`` as ``model.moe.LocalDispatch``, with this rank's
    ``experts`` holding its range. ``overlap``: ``meanwhile`` (the shared expert) runs while the slots are on their
    way to the experts' ranks (on CUDA, NCCL's stream beside the compute stream); off, after the exchange."""

    def __init__(self, group, ranks: list[int], overlap: bool = True):
        self.group, self.ranks, self.overlap = group, list(ranks), overlap
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.received: dict[torch.nn.Module, tuple[int, int]] = {}  # experts -> (rows received, rows sent), latest
        self.names: dict[torch.nn.Module, str] = {}  # experts -> their MoE's module name, for ExpertOverload

    def experts_of(self, n_experts: int) -> range:
        """The global ids of the experts this rank holds, of a MoE of ``n_experts``."""
        if n_experts % self.world:
            raise ValueError(f"{n_experts} routed experts cannot be split over parallel.expert_parallel="
                             f"{self.world} ranks: use a divisor of the expert count")
        held = n_experts // self.world
        return range(self.rank * held, (self.rank + 1) * held)

    def __call__(self, experts, rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, meanwhile=None):
        world, held = self.world, len(experts.expert_ids)
        per_expert = counts.view(world, held)  # rows for each rank's experts, by destination
        received = exchange(per_expert, [1] * world, [1] * world, self.group)  # [source, my expert]
        send, receive = per_expert.sum(1).tolist(), received.sum(1).tolist()
        self.received[experts] = sum(receive), sum(send)
        if rows.is_cuda:
            self.check_memory(experts, rows)
        pending = [] if self.overlap else None
        slots = _AllToAll.apply(rows, send, receive, self.group, pending)
        slot_weights = _AllToAll.apply(weights.unsqueeze(-1), send, receive, self.group, pending).squeeze(-1)
        during = meanwhile() if meanwhile is not None else None
        for work in pending or ():
            work.wait()
        back = run_received(experts, slots, slot_weights, received, sum(receive))
        return _AllToAll.apply(back, receive, send, self.group), during

    def check_memory(self, experts, rows: torch.Tensor) -> None:
        """Stop before running ``experts`` on more rows than this rank's memory holds: what the device has free plus
        what the caching allocator holds unused, against ``received_bytes``."""
        got, sent = self.received[experts]
        device = rows.device
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(
            device)
        check_received(self.names.get(experts, "a MoE"), self.rank, self.world, got, sent,
                       received_bytes(experts.dim, experts.inter_dim, got, rows.element_size()), free)


def check_received(name: str, rank: int, world: int, got: int, sent: int, need: float, free: float) -> None:
    """``ExpertOverload`` when the experts' working set for the ``got`` rows received (``need`` bytes) exceeds
    ``free``: one line naming the MoE, the rank and its load."""
    if need > free:
        raise ExpertOverload(
            f"{name}: expert-parallel rank {rank} of {world} received {got:,} routed rows, {got / max(sent, 1):.1f}x "
            f"the {sent:,} it sent (uniform routing: about 1x); its experts would need {need / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB is free — routing has collapsed onto this rank's experts (see "
            "moe/<layer>/load_max_over_mean and received_max_over_mean in metrics.jsonl, docs/TRAINING_HEALTH.md)")


def run_received(experts, rows: torch.Tensor, weights: torch.Tensor, received: torch.Tensor, total: int,
                 grouped: bool | None = None) -> torch.Tensor:
    """The held experts on the rows a rank received, source after source (``received`` [sources, held experts]
    rows each, ``total`` of them: known on the host), with their routing weights: the rows put expert after expert,
    through the experts (``grouped`` as ``RoutedExperts.forward`` takes it), and the outputs put back in arrival
    order. Both permutations are gathers forward and backward (``model.moe.reorder``): no atomics."""
    order = expert_major(received, total)
    inverse = inverse_permutation(order)
    out = experts(reorder(rows, order, inverse), received.sum(0), reorder(weights, order, inverse), grouped=grouped)
    return reorder(out, inverse, order)


def expert_major(counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """The permutation that takes rows laid out source after source (each source's rows by expert, ``counts``
    [sources, experts]) to expert after expert (each expert's rows by source). ``total``: the rows' count when the
    host knows it (else ``repeat_interleave`` reads it from the device)."""
    sources, experts = counts.shape
    segment = torch.arange(sources * experts, device=counts.device).view(sources, experts)
    segment_of_row = segment.flatten().repeat_interleave(counts.flatten(), output_size=total)  # source-major ids
    expert_first = segment.t().flatten()  # segments in expert-major order
    rank_of = torch.empty_like(expert_first)
    rank_of[expert_first] = torch.arange(expert_first.numel(), device=counts.device)
    return torch.argsort(rank_of[segment_of_row], stable=True)


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel dispatch and the group it reduces expert gradients over."""
    dispatch: ExpertAllToAll
    data: object  # the expert-data-parallel process group: the D / E ranks holding the same experts
    data_ranks: list[int]


def expert_groups(stages: int, replicas: int, expert_parallel: int, overlap: bool = True) -> ExpertGroups:
    """Every stage's expert-parallel and expert-data-parallel groups, made by every rank in the same order (as
    ``torch.distributed.new_group`` requires); returns this rank's (``overlap``: ``ExpertAllToAll``'s)."""
    if expert_parallel < 1 or replicas % expert_parallel:
        raise ValueError(f"parallel.expert_parallel={expert_parallel} does not divide the {replicas} data-parallel "
                         f"replicas of a stage: use one of {[e for e in range(1, replicas + 1) if replicas % e == 0]}")
    me, mine = dist.get_rank(), {}
    for stage in range(stages):
        base = stage * replicas
        for first in range(0, replicas, expert_parallel):
            ranks = [base + first + r for r in range(expert_parallel)]
            group = dist.new_group(ranks)
            if me in ranks:
                mine["dispatch"] = ExpertAllToAll(group, ranks, overlap)
        for r in range(expert_parallel):
            ranks = [base + first + r for first in range(0, replicas, expert_parallel)]
            group = dist.new_group(ranks)
            if me in ranks:
                mine["data"], mine["data_ranks"] = group, ranks
    return ExpertGroups(**mine)


def average_expert_gradients(experts: dict[str, torch.nn.Parameter], group, replicas: int) -> None:
    """After the data-parallel reduction (which leaves the experts out): each rank's experts hold the gradients the
    tokens of its expert-parallel group gave them; sum them over ``group`` (the ranks holding the same experts) and
    divide by the stage's ``replicas``, the mean every other gradient gets. A missing gradient counts as zeros."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in experts.values()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.mul_(1.0 / replicas)
    for p, part in zip(experts.values(), flat.split([g.numel() for g in grads])):
        p.grad = part.view_as(p).to(p.dtype)


def routed_bytes(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, itemsize: int,
                 dspark: bool = False) -> list[float]:
    """Bytes of one exchange of each layer's routed rows per microbatch (plans and the schedule simulator): the
    rank's routing slots (tokens x top-k) x dim in the compute dtype (``itemsize``), summed over the layer's MoEs:
    its FFN, and on the last layer the draft head's blocks when it trains (``dspark``: tokens x block_size slots of
    its top-k each). A MoE makes four exchanges a microbatch (dispatch and combine, and their gradients back) and
    two more when its layer is recomputed; of each, (E - 1) / E of the bytes leave the rank under uniform routing.
    The routing weights (4 B a row) and the counts are left out (under 0.1% at dim 5120)."""
    if args.ffn != "moe":
        return [0.0] * layout.n_layers
    tokens = micro_batch * seq_len
    rows = [float(tokens * args.moe.n_activated_experts)] * layout.n_layers
    if dspark and args.dspark.blocks:
        d = args.dspark
        rows[-1] += d.blocks * tokens * d.block_size * d.n_activated_experts
    return [r * args.dim * itemsize for r in rows]


def leaving(expert_parallel: int) -> float:
    """The share of a rank's routed rows that goes to other ranks of its group under uniform routing: (E - 1) / E."""
    return (expert_parallel - 1) / expert_parallel
