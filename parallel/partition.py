"""Which layers run on which pipeline stage: explicit cuts, or a balanced split of a per-layer cost model.

The cost of a layer is its forward FLOPs at the configured sequence length, counted per mode (projections,
window + sparse attention, compressor and index keys for Full layers, index scoring for Full/Reindex layers,
the FFN: dense, or a MoE's gate and active experts; hyper-connection mixes, Engram's projection where there is
one); the LM head is charged to the last layer. Measured times can stand in for it (``parallel/balance.py``).
Stages are contiguous and minimise the largest stage cost; given a stage-memory estimate, the split with the
smallest largest stage memory among those within a slack of that cost, under a capacity where possible.
"""
from dataclasses import dataclass

from model.config import ModelArgs
from model.layout import Layout, Mode


class PartitionError(ValueError):
    """A stage split that cannot run; the message says which rule it breaks."""


@dataclass(frozen=True)
class StagePlan:
    stages: tuple[range, ...]

    def stage_of(self, layer: int) -> int:
        return next(s for s, layers in enumerate(self.stages) if layer in layers)

    @property
    def cuts(self) -> list[int]:
        return [layers.start for layers in self.stages[1:]]


def ffn_flops(args: ModelArgs, T: int) -> float:
    """Forward FLOPs of one layer's FFN on ``T`` tokens: the dense SwiGLU, or a MoE's gate plus the experts a
    token activates (top-k routed and the shared one)."""
    if args.ffn == "dense":
        return 6 * T * args.dim * args.inter_dim
    moe = args.moe
    return 2 * T * args.dim * moe.n_routed_experts + 6 * T * args.dim * moe.inter_dim * (
        moe.n_activated_experts + moe.n_shared_experts)


def layer_costs(args: ModelArgs, layout: Layout, seq_len: int) -> list[float]:
    """Forward FLOPs of every layer at ``seq_len`` tokens (one sequence)."""
    T, D, H, hd = seq_len, args.dim, args.n_heads, args.head_dim
    Hi, Di = args.index_n_heads, args.index_head_dim
    projections = 2 * T * (D * args.q_lora_rank + args.q_lora_rank * H * hd + D * hd
                           + H * hd * args.o_lora_rank + args.o_groups * args.o_lora_rank * D)
    ffn = ffn_flops(args, T)
    if args.hc_mult > 1:  # the mixes of the attention and FFN sublayers
        projections += 2 * 2 * T * args.hc_mult * D * (2 + args.hc_mult) * args.hc_mult
    engram = args.engram
    engram_cost = 2 * T * (engram.max_ngram_size - 1) * engram.n_heads * engram.head_dim * D * (args.hc_mult + 1)
    costs = []
    for p in layout.plan:
        entries = T // p.ratio if p.ratio else 0
        read = min(args.index_topk, entries)
        cost = projections + ffn + 4 * T * H * hd * (min(args.window_size, T) + read)
        if p.layer_id in engram.layers:
            cost += engram_cost
        if p.mode is Mode.FULL:
            cost += 2 * T * D * hd * (2 if p.ratio > 1 else 1) + 2 * entries * hd * Di
        if p.selects:
            scored = entries / 2  # causal: a query sees half the entries on average
            if p.candidate_source is not None:
                scored = min(scored, layout.candidate_topk_blocks * layout.candidate_block_size)
            cost += 2 * T * (args.q_lora_rank * Hi * Di + D * Hi) + 2 * T * Hi * Di * (scored + read)
        costs.append(float(cost))
    costs[-1] += 2 * T * D * args.vocab_size
    return costs


def balanced_cuts(costs: list[float], n_stages: int, stage_memory=None, capacity: float | None = None,
                  slack: float = 0.0) -> list[int]:
    """Contiguous split of ``costs`` into ``n_stages`` non-empty parts minimising the largest part (exact DP).

    ``stage_memory(stage, layers)``, if given, estimates a stage's peak memory: stages above ``capacity`` are not
    allowed (unless no split fits), and among the splits whose largest part is within ``slack`` (a fraction) of
    the smallest possible, the one with the smallest largest stage memory is taken."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(start, end):
        return prefix[end] - prefix[start]

    def fits(stage, start, end):
        return capacity is None or stage_memory(stage, range(start, end)) <= capacity

    def minmax(part, allowed):
        """The DP: stages 0..s-1 cover layers [0, end); the largest ``part`` of an ``allowed`` split."""
        best = [[float("inf")] * (n + 1) for _ in range(n_stages + 1)]
        choice = [[0] * (n + 1) for _ in range(n_stages + 1)]
        best[0][0] = 0.0
        for s in range(1, n_stages + 1):
            for end in range(s, n + 1):
                for start in range(s - 1, end):
                    if best[s - 1][start] == float("inf") or not allowed(s - 1, start, end):
                        continue
                    worst = max(best[s - 1][start], part(s - 1, start, end))
                    if worst < best[s][end]:
                        best[s][end], choice[s][end] = worst, start
        if best[n_stages][n] == float("inf"):
            return None
        cuts, end = [], n
        for s in range(n_stages, 1, -1):
            end = choice[s][end]
            cuts.append(end)
        return best[n_stages][n], sorted(cuts)

    def anything(stage, start, end):
        return True

    def span(stage, start, end):
        return cost(start, end)

    if stage_memory is None:
        return minmax(span, anything)[1]
    fastest_fitting = minmax(span, fits)
    allowed = fits if fastest_fitting is not None else anything
    fastest = (fastest_fitting or minmax(span, anything))[0]
    return minmax(lambda stage, start, end: stage_memory(stage, range(start, end)),
                  lambda stage, start, end: allowed(stage, start, end) and cost(start, end) <= fastest * (1 + slack))[1]


def partition(args: ModelArgs, layout: Layout, seq_len: int, n_stages: int, cuts=None, costs=None,
              stage_memory=None, capacity: float | None = None, slack: float = 0.0) -> StagePlan:
    """The stages at ``cuts`` (checked), or balanced on ``costs`` (default: ``layer_costs``), see
    ``balanced_cuts`` for the memory arguments."""
    n = layout.n_layers
    if n_stages < 1:
        raise PartitionError(f"parallel.pipeline_stages={n_stages}: need at least one stage")
    if n_stages > n:
        raise PartitionError(f"parallel.pipeline_stages={n_stages} is more stages than the model's {n} layers")
    if cuts is None:
        costs = layer_costs(args, layout, seq_len) if costs is None else costs
        cuts = balanced_cuts(costs, n_stages, stage_memory, capacity, slack)
    if isinstance(cuts, str) or not all(isinstance(c, int) and not isinstance(c, bool) for c in cuts):
        raise PartitionError(f"parallel.cuts={cuts!r}: give a list of layer ids where stages 2.. start, e.g. "
                             "parallel.cuts=[10,20,30], or null for the cost model")
    cuts = list(cuts)
    if len(cuts) != n_stages - 1:
        raise PartitionError(f"parallel.cuts={cuts} gives {len(cuts) + 1} stages, "
                             f"but parallel.pipeline_stages={n_stages}")
    bounds = [0, *cuts, n]
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if not 0 <= lo < hi <= n:
            raise PartitionError(f"parallel.cuts={cuts} leaves stage {s} empty or outside layers 0..{n - 1}: "
                                 "cuts must be strictly increasing layer ids in 1..n_layers-1")
    return StagePlan(tuple(range(lo, hi) for lo, hi in zip(bounds, bounds[1:])))
