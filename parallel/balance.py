"""The stage split a job runs: balanced on measured per-layer times when given, and memory-aware.

``parallel/partition.py`` counts a layer's forward FLOPs; a CSA2 layer's time is not in its FLOPs alone (the
sparse-attention and indexer kernels run far below the matmul rate, elementwise work counts none), so a split that
evens FLOPs can leave one stage slower than the other. ``bench/multigpu.py`` measures the forward and backward
time (and the retained and backward memory) of every layer mode at one geometry and writes them as JSON
(``LayerTimes``); ``parallel.layer_times=<that file>`` balances the stages on those times. Without it the FLOP model
stays.

Memory: under 1F1B stage s holds min(M, P - s) microbatches in flight, so the first stage holds the most. The split
minimises the slowest stage; among the splits within ``TIME_SLACK`` of it (measurement noise) it takes the one with
the smallest largest stage peak (``parallel/memory.py``), and it keeps every stage under the device's memory when
some split does.
"""
import json
from dataclasses import asdict, dataclass, field

import torch

from model.config import LoRA, ModelArgs, ParallelConfig
from model.layout import Layout, LayerPlan, Mode
from parallel.memory import MemoryModel, estimate, kept_per_stage, recomputed_layers
from parallel.partition import StagePlan, layer_costs, partition

TIME_SLACK = 0.01
DIMS = ("vocab_size", "dim", "n_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window_size",
        "index_n_heads", "index_head_dim", "index_topk", "inter_dim", "attention")


def mode_key(plan: LayerPlan) -> str:
    """The name under which a layer's mode is timed: window, full_m<ratio>, reindex, reuse, plus ``_cand`` for a
    selection restricted to candidate blocks and ``_candsrc`` for the layer that makes them."""
    key = plan.mode.value + (f"_m{plan.ratio}" if plan.mode is Mode.FULL else "")
    if plan.candidate_source is not None:
        key += "_cand"
    if plan.makes_candidates:
        key += "_candsrc"
    return key


@dataclass(frozen=True)
class ModeTimes:
    fwd_ms: float
    bwd_ms: float  # from the layer's output gradient to its input gradient (with recompute: its forward again)
    retained_bytes: float | None = None  # kept from its forward to its backward, per microbatch
    backward_bytes: float | None = None  # peak above the start of its backward, while it runs


@dataclass(frozen=True)
class LayerTimes:
    """Measured time per layer mode at one geometry (``bench/multigpu.py`` writes it)."""
    seq_len: int
    micro_batch: int
    recompute: str
    precision: str
    dims: dict
    modes: dict[str, ModeTimes]
    head_ms: float = 0.0  # final norm, LM head and loss, forward + backward
    meta: dict = field(default_factory=dict)  # command, machine, date

    @classmethod
    def load(cls, path: str) -> "LayerTimes":
        try:
            with open(path) as f:
                raw = json.load(f)
            return cls(**{**raw, "modes": {k: ModeTimes(**v) for k, v in raw["modes"].items()}})
        except FileNotFoundError:
            raise FileNotFoundError(f"parallel.layer_times={path}: no such file (bench/multigpu.py writes one, "
                                    "e.g. bench/results/multigpu/layer_times_small_65536.json)") from None
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"parallel.layer_times={path} is not a layer-times file: {err}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    def check(self, args: ModelArgs, layout: Layout, seq_len: int, micro_batch: int, recompute: str) -> None:
        """The times hold for this job: same model dimensions, geometry and recompute, and every mode timed."""
        wrong = {k: (self.dims.get(k), getattr(args, k)) for k in DIMS if self.dims.get(k) != getattr(args, k)}
        if (self.seq_len, self.micro_batch, self.recompute) != (seq_len, micro_batch, recompute):
            wrong["seq_len, micro_batch, recompute"] = ((self.seq_len, self.micro_batch, self.recompute),
                                                        (seq_len, micro_batch, recompute))
        if wrong:
            raise ValueError("parallel.layer_times was measured on another job (file vs this job): "
                             + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in wrong.items()))
        missing = sorted({mode_key(p) for p in layout.plan} - set(self.modes))
        if missing:
            raise ValueError(f"parallel.layer_times has no time for layer mode(s) {missing} of this layout "
                             f"(it has {sorted(self.modes)})")

    def layer_costs(self, layout: Layout) -> list[float]:
        """Forward + backward milliseconds of every layer, the head's charged to the last layer."""
        costs = [self.modes[mode_key(p)].fwd_ms + self.modes[mode_key(p)].bwd_ms for p in layout.plan]
        costs[-1] += self.head_ms
        return costs

    def backward_peaks_valid(self) -> bool:
        """False for a file whose backward figures are not peaks: a peak above the start of a backward is never
        negative, but the layer probe before its fix (``bench/layer_probe.py``, files up to 2026-11-30) read every
        layer's peak after the next layer's backward had reset the counter, i.e. the net change (minus what the
        layer retained), and only the first layer's true peak; per-mode means of those mix the two."""
        return all(t.backward_bytes is None or t.backward_bytes >= 0 for t in self.modes.values())

    def memory(self, layout: Layout, retained: list[float], transient: list[float]):
        """The analytic per-layer memory with each measured figure in place of its estimate (the backward
        figures only when they are peaks)."""
        retained, transient = list(retained), list(transient)
        peaks_valid = self.backward_peaks_valid()
        for i, p in enumerate(layout.plan):
            times = self.modes.get(mode_key(p))
            if times is not None and times.retained_bytes is not None:
                retained[i] = times.retained_bytes
            if times is not None and times.backward_bytes is not None and peaks_valid:
                transient[i] = times.backward_bytes
        return retained, transient


@dataclass(frozen=True)
class Split:
    plan: StagePlan
    costs: list[float]  # per layer, in ``unit``
    unit: str  # "FLOPs" or "measured ms"
    peaks: list[float]  # estimated peak memory per stage, bytes
    fits: bool  # every stage under the capacity the split was given (True without one)
    memory: MemoryModel  # the per-layer figures the peaks come from


def split_stages(args: ModelArgs, layout: Layout, parallel: ParallelConfig, seq_len: int, micro_batch: int,
                 dtype: torch.dtype, microbatches: int, data_parallel: int, capacity: float | None = None,
                 cuda: bool = False, lora: LoRA | None = None, muon: bool = False) -> Split:
    """The split of a job (its model, layout, ``parallel`` settings, row geometry, LoRA and optimizer: ``muon``)
    running ``microbatches`` per step on ``data_parallel`` replicas of ``parallel.context_parallel`` ranks each
    (``parallel/batch.py``), under ``capacity`` bytes."""
    par, stages = parallel, parallel.pipeline_stages
    times = None
    if par.layer_times:
        times = LayerTimes.load(par.layer_times)
        times.check(args, layout, seq_len, micro_batch, par.recompute)
    costs = times.layer_costs(layout) if times else layer_costs(args, layout, seq_len)
    memory = estimate(args, layout, micro_batch, seq_len, dtype, recomputed_layers(par, layout.n_layers),
                      data_parallel, par.zero_stage, cuda, par.index_k, measured=times,
                      expert_parallel=par.expert_parallel, context_parallel=par.context_parallel, lora=lora,
                      offload_inputs=par.recompute_offload, head_chunk=par.head_chunk, muon=muon)

    keep = kept_per_stage(par.keep_attention_layers, stages)

    def stage_peak(stage: int, layers: range) -> float:
        return memory.stage_peak(stage, layers, stages, microbatches, keep[stage])

    plan = partition(args, layout, seq_len, stages, par.cuts, costs=costs, stage_memory=stage_peak,
                     capacity=capacity, slack=TIME_SLACK)
    peaks = memory.peaks(plan.stages, microbatches, keep)
    return Split(plan, costs, "measured ms" if times else "FLOPs", peaks,
                 capacity is None or max(peaks) <= capacity, memory)
