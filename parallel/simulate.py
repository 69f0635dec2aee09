"""A simulator of the pipeline's 1F1B schedule: step time, tokens/s, bubble and peak memory per stage.

It replays, per stage, the instruction sequence the engine runs (DeepSpeed's ``TrainSchedule``, or ``EagerSends``
of it with ``parallel.p2p=overlap``) with given durations:
- a forward or backward pass takes its stage's time (``StageWork``: per-layer times summed over the stage);
- overlapped transfers (``p2p="overlap"``): a send starts when its pass has ended and its link (one per boundary
  and direction) is free, takes latency + bytes / bandwidth, and does not hold up the sender; a receive holds up
  its stage until the data has arrived;
- DeepSpeed's blocking transfers (``p2p="deepspeed"``): the k-th send and the k-th receive of a link meet; both
  stages wait for the later of the two and go on when the bytes have crossed;
- after the last pass the stages all-reduce gradients over their data-parallel replicas and meet in the global
  gradient norm, then step the optimizer (``StageWork.optimizer_s``).

``stage_work`` turns per-layer times, payload bytes and parameter counts into each stage's work on a ``Cluster``
(link bandwidths; stages laid out in order over the nodes, data-parallel replicas within or across nodes). Under
expert parallelism (E > 1) every MoE layer's all-to-alls are a cost inside its passes: per microbatch two exchanges
forward (dispatch, combine), two backward (their gradients) and two more when the layer is recomputed, each moving
(E - 1) / E of the rank's routed rows (uniform routing) over NVLink or, for the part that leaves the node when the
expert group spans nodes, over the inter-node links; optionally (``overlap``) hidden behind the shared expert's
compute of the same pass, up to that compute's time.

Under context parallelism (C ranks a row, ``parallel/context.py``) a rank's pass computes its chunk: the layers'
row times divided by C, except the part that grows with a query's position (``Layers.growing_fwd_s``: the indexer
scoring every visible entry), of which the last chunk, whose queries see the most, does (2C - 1) / C^2 and every rank
waits for it at the layer's collectives; each layer's all-gathers (a Full layer's latent, every layer's halo) and, in
the backward, their reduce-scatter (and the recomputation's all-gathers again) are a cost inside the passes, over
NVLink while the group is in a node (a ring: each rank receives over its own link), else between nodes. The
all-to-alls carry the chunk's rows, and the gradients are reduced over all C x D ranks of a stage.

Assumptions (what the simulator does not model): a pass takes the same time whatever runs beside it (no slowdown
from a transfer's kernels or from the host), every microbatch of a stage takes the same time, a link moves one
transfer at a time at its full bandwidth, and the data-parallel all-reduce does not overlap the passes (DeepSpeed
reduces after the last backward).
"""
from dataclasses import dataclass

from deepspeed.runtime.pipe import schedule

from parallel.p2p import EagerSends


@dataclass(frozen=True)
class StageWork:
    fwd_s: float  # one microbatch's forward through the stage
    bwd_s: float  # its backward (with recompute: the forward again)
    send_s: float = 0.0  # activations to the next stage, per microbatch (0 for the last)
    grad_s: float = 0.0  # their gradient back from the next stage
    reduce_s: float = 0.0  # data-parallel gradient all-reduce after the last pass
    optimizer_s: float = 0.0  # gradient norm, clipping and the optimizer step
    all_to_all_s: float = 0.0  # of fwd_s + bwd_s: the expert all-to-alls' exposed time, per microbatch
    context_s: float = 0.0  # of fwd_s + bwd_s: the context group's all-gathers and reduce-scatters, per microbatch


@dataclass(frozen=True)
class Timeline:
    step_s: float  # from the first pass to the end of the optimizer step
    pipeline_s: float  # from the first pass to the last stage's last pass
    busy_s: tuple[float, ...]  # per stage: time in passes
    exposed_wait_s: tuple[float, ...]  # per stage: time held up in receives (transfers and waiting for the peer)
    passes: tuple[tuple[tuple[str, int, float, float], ...], ...] = ()  # per stage: (fwd|bwd, microbatch, start, end)

    @property
    def bubble(self) -> tuple[float, ...]:
        """Per stage: 1 - busy / pipeline time, what ``bench/multigpu.py`` measures."""
        return tuple(1 - busy / self.pipeline_s for busy in self.busy_s)


@dataclass(frozen=True)
class Cluster:
    """Where the stages and replicas run: bandwidths in GB/s (1e9 bytes), one direction, per GPU."""
    nodes: int = 1
    gpus_per_node: int = 8
    p2p_gbps: float = 300.0  # point to point within a node (NVLink)
    internode_gbps: float = 50.0  # between nodes (one 400 Gb/s NIC per GPU)
    allreduce_gbps: float = 300.0  # all-reduce bus bandwidth within a node
    latency_s: float = 20e-6
    pipeline_across_nodes: bool = False  # stages spread over the nodes (else replicas are)
    alltoall_gbps: float = 350.0  # expert all-to-all within a node, effective, per GPU and direction (NVLink)
    alltoall_internode_gbps: float = 40.0  # its part between nodes, effective, per GPU and direction

    def context_s(self, nbytes: float, context: int) -> float:
        """A context group's collective in which a rank receives ``nbytes`` (a ring all-gather, or the reduce-scatter
        of its gradient): C - 1 steps over the rank's link, NVLink while the C consecutive ranks are in one node,
        else the inter-node link."""
        if context <= 1 or not nbytes:
            return 0.0
        gbps = self.p2p_gbps if context <= self.gpus_per_node else self.internode_gbps
        return (context - 1) * self.latency_s + nbytes / (gbps * 1e9)

    def node_of(self, stage: int, stages: int) -> int:
        return stage * self.nodes // stages if self.pipeline_across_nodes else 0

    def all_to_all_s(self, nbytes: float, expert_parallel: int) -> float:
        """One exchange of ``nbytes`` of a rank's rows over an expert group of E consecutive ranks (DeepSpeed's
        rank order: a group fills a node's GPUs before the next node): (E - 1) / E of them leave the rank, the share
        to the other ``min(E, gpus_per_node) - 1`` ranks of its node over NVLink, the rest between nodes, the two at
        once (the slower one sets the time)."""
        E = expert_parallel
        if E <= 1 or not nbytes:
            return 0.0
        here = min(E, self.gpus_per_node)
        within, across = nbytes * (here - 1) / E, nbytes * (E - here) / E
        return self.latency_s + max(within / (self.alltoall_gbps * 1e9), across / (self.alltoall_internode_gbps * 1e9))


@dataclass(frozen=True)
class Layers:
    """Per-layer inputs of ``stage_work``: seconds, bytes and parameters."""
    fwd_s: list[float]
    bwd_s: list[float]
    boundary_bytes: list[float]  # activations sent after each layer (0 after the last)
    gradient_bytes: list[float]  # their gradient back
    params: list[int]
    optimizer_s_per_param: float = 0.0
    # expert parallelism: per layer, bytes of one exchange of its routed rows (``parallel.experts.routed_bytes``),
    # the shared expert's forward and backward seconds (what ``overlap`` hides the all-to-alls behind) and the
    # routed-expert parameters (of ``params``; reduced over the D / E ranks holding the same experts)
    routed_bytes: list[float] | None = None
    shared_fwd_s: list[float] | None = None
    shared_bwd_s: list[float] | None = None
    expert_params: list[int] | None = None
    recomputed: bool = False  # the backward runs each layer's forward again (and its all-to-alls)
    # context parallelism: of fwd_s, the seconds that grow with a query's position (the indexer's scoring of every
    # visible entry); per layer, a microbatch's row of compressed latent a Full layer all-gathers and one chunk's
    # halo rows (``parallel.memory.context_bytes``). ``boundary_bytes`` are then a rank's (its chunk's payload).
    growing_fwd_s: list[float] | None = None
    gathered_bytes: list[float] | None = None
    halo_bytes: list[float] | None = None

    def chunk_fwd_s(self, layer: int, context: int) -> float:
        """A layer's forward on the slowest rank of C: the row's time / C, but (2C - 1) / C^2 of its growing part
        (the last chunk's share of sum_t t)."""
        growing = self.growing_fwd_s[layer] if self.growing_fwd_s else 0.0
        return (self.fwd_s[layer] - growing) / context + growing * (2 * context - 1) / context ** 2

    def context_received(self, layer: int, context: int) -> float:
        """Bytes a rank receives in a layer's forward collectives: (C - 1) / C of the gathered row, C - 1 halos."""
        gathered = self.gathered_bytes[layer] if self.gathered_bytes else 0.0
        halo = self.halo_bytes[layer] if self.halo_bytes else 0.0
        return gathered * (context - 1) / context + halo * (context - 1)


def stage_work(layers: Layers, stages: tuple[range, ...], data_parallel: int, cluster: Cluster,
               expert_parallel: int = 1, overlap: bool = False, context_parallel: int = 1) -> list[StageWork]:
    """Each stage's work: its layers' times summed, its boundary's transfer over NVLink or between nodes, the
    ring all-reduce of its fp32 gradients and ZeRO-1's broadcast of its updated weights over its ranks
    (2 (R-1)/R and (R-1)/R times the bytes over the all-reduce bandwidth, or between nodes when the ranks
    are on other nodes; the routed experts' over their R / E ranks), and its optimizer step over its 1/R of
    the parameters (a rank steps 1/R of the dense ones and 1/(R/E) of its 1/E of the experts: 1/R of them too),
    R = C x D ranks a stage. With ``expert_parallel`` E > 1 each layer's all-to-alls (``Cluster.all_to_all_s``,
    of the rank's chunk) are added to its passes; ``overlap``: less the shared expert's time of the same pass, down
    to zero. With ``context_parallel`` C > 1 the passes are the slowest chunk's (``Layers.chunk_fwd_s``; a
    backward's time / C) plus each layer's context collectives (``Cluster.context_s``): once forward, and backward
    the reduce-scatter (and the recomputation's all-gathers)."""
    P, E, C = len(stages), expert_parallel, context_parallel
    D = data_parallel * C  # the ranks of a stage: what gradients are reduced and ZeRO-1 partitions over
    n = len(layers.params)
    routed = layers.routed_bytes or [0.0] * n
    shared_fwd, shared_bwd = layers.shared_fwd_s or [0.0] * n, layers.shared_bwd_s or [0.0] * n
    experts = layers.expert_params or [0] * n

    def exposed(seconds: float, hidden_by: float) -> float:
        return max(0.0, seconds - hidden_by) if overlap else seconds

    work = []
    for s, span in enumerate(stages):
        last = span.stop - 1
        if s + 1 < P:
            across = cluster.node_of(s, P) != cluster.node_of(s + 1, P)
            gbps = cluster.internode_gbps if across else cluster.p2p_gbps
            send = cluster.latency_s + layers.boundary_bytes[last] / (gbps * 1e9)
            grad = cluster.latency_s + layers.gradient_bytes[last] / (gbps * 1e9)
        else:
            send = grad = 0.0
        exchange = [cluster.all_to_all_s(routed[i] / C, E) for i in span]
        a2a_fwd = sum(exposed(2 * t, shared_fwd[i] / C) for t, i in zip(exchange, span))
        a2a_bwd = sum(exposed((4 if layers.recomputed else 2) * t, shared_bwd[i] / C) for t, i in zip(exchange, span))
        gathers = [cluster.context_s(layers.context_received(i, C), C) for i in span] if C > 1 else [0.0]
        context_bwd = (2 if layers.recomputed else 1) * sum(gathers)
        params = sum(layers.params[i] for i in span)
        expert = sum(experts[i] for i in span) if E > 1 else 0
        gbps = cluster.allreduce_gbps if cluster.pipeline_across_nodes or cluster.nodes == 1 else cluster.internode_gbps
        reduce = ring_reduce_s(params - expert, D, gbps) + ring_reduce_s(expert / E, D // E, gbps)
        work.append(StageWork(sum(layers.chunk_fwd_s(i, C) for i in span) + a2a_fwd + sum(gathers),
                              sum(layers.bwd_s[i] for i in span) / C + a2a_bwd + context_bwd, send, grad,
                              reduce, layers.optimizer_s_per_param * params / D, a2a_fwd + a2a_bwd,
                              sum(gathers) + context_bwd))
    return work


def ring_reduce_s(params: float, replicas: int, gbps: float) -> float:
    """The ring all-reduce of ``params`` fp32 gradients and the broadcast of the updated weights over ``replicas``:
    3 (R-1)/R x 4 B a parameter over ``gbps``."""
    return (3 * (replicas - 1) / replicas) * 4 * params / (gbps * 1e9) if replicas > 1 else 0.0


def ideal_bubble(stages: int, microbatches: int) -> float:
    """The 1F1B bubble of balanced stages with free transfers: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def instructions(stages: int, microbatches: int, stage: int, p2p: str) -> list:
    train = schedule.TrainSchedule(micro_batches=microbatches, stages=stages, stage_id=stage)
    steps = EagerSends(train).steps() if p2p == "overlap" else train.steps()
    kinds = (schedule.ForwardPass, schedule.BackwardPass, schedule.SendActivation, schedule.RecvActivation,
             schedule.SendGrad, schedule.RecvGrad)
    return [c for commands in steps for c in commands if isinstance(c, kinds)]


def simulate(work: list[StageWork], microbatches: int, p2p: str = "overlap") -> Timeline:
    P = len(work)
    programs = [instructions(P, microbatches, s, p2p) for s in range(P)]
    clock, busy, waited = [0.0] * P, [0.0] * P, [0.0] * P
    passes: list[list[tuple[str, int, float, float]]] = [[] for _ in range(P)]
    position = [0] * P
    counted = [{"fwd": 0, "bwd": 0} for _ in range(P)]  # passes of each kind so far, per stage
    # a channel is (boundary, direction); per channel: arrival times (overlap) or the posted sides (deepspeed)
    arrivals: dict[tuple[int, str], list[float]] = {}
    link_free: dict[tuple[int, str], float] = {}
    posted: dict[tuple[int, str], dict[str, list[float]]] = {}
    received: dict[tuple[int, str], int] = {}

    def channel(command, s):
        """(channel, transfer seconds, is a send) of a transfer instruction on stage s."""
        if isinstance(command, schedule.SendActivation):
            return (s, "act"), work[s].send_s, True
        if isinstance(command, schedule.RecvActivation):
            return (s - 1, "act"), work[s - 1].send_s, False
        if isinstance(command, schedule.SendGrad):
            return (s - 1, "grad"), work[s - 1].grad_s, True
        return (s, "grad"), work[s].grad_s, False

    def advance(s) -> bool:
        command = programs[s][position[s]]
        if isinstance(command, (schedule.ForwardPass, schedule.BackwardPass)):
            kind = "fwd" if isinstance(command, schedule.ForwardPass) else "bwd"
            took = work[s].fwd_s if kind == "fwd" else work[s].bwd_s
            microbatch = counted[s][kind]  # 1F1B keeps the microbatches' order in each kind
            counted[s][kind] += 1
            passes[s].append((kind, microbatch, clock[s], clock[s] + took))
            clock[s] += took
            busy[s] += took
            return True
        key, seconds, sending = channel(command, s)
        if p2p == "overlap":
            if sending:
                start = max(clock[s], link_free.get(key, 0.0))
                link_free[key] = start + seconds
                arrivals.setdefault(key, []).append(start + seconds)
                return True
            k = received.get(key, 0)
            if k >= len(arrivals.get(key, [])):
                return False
            received[key] = k + 1
            waited[s] += max(0.0, arrivals[key][k] - clock[s])
            clock[s] = max(clock[s], arrivals[key][k])
            return True
        sides = posted.setdefault(key, {"send": [], "recv": []})
        mine, theirs = ("send", "recv") if sending else ("recv", "send")
        k = received.get((key, mine), 0)
        if len(sides[mine]) <= k:
            sides[mine].append(clock[s])
        if len(sides[theirs]) <= k:
            return False  # the peer has not reached its side of this transfer yet
        done = max(sides[mine][k], sides[theirs][k]) + seconds
        received[(key, mine)] = k + 1
        waited[s] += done - clock[s]
        clock[s] = done
        return True

    while any(position[s] < len(programs[s]) for s in range(P)):
        moved = False
        for s in range(P):
            while position[s] < len(programs[s]) and advance(s):
                position[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("schedule deadlock in the simulation (a transfer nobody sends)")
    pipeline = max(clock)
    after = max(clock[s] + work[s].reduce_s for s in range(P)) + max(w.optimizer_s for w in work)
    return Timeline(after, pipeline, tuple(busy), tuple(waited), tuple(tuple(p) for p in passes))
