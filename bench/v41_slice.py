"""A V4.1-width slice as one expert-parallel rank trains it (issue 35, Measure): 4 consecutive layers of
``model=v41_flash layout=v41`` at the released shapes, forward + backward at 64K tokens of one row, on one GPU.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CSA2_CODE=<commit> python bench/v41_slice.py --out $OUT/v41_slice.json
    python bench/v41_slice.py --smoke --out /tmp/v41_slice.json   # the same code on the CPU: v41_mini widths,
                                                                  # 64 experts, 64 tokens, fp32, PyTorch kernels

What runs, and why so:
- Layers. No 4 consecutive layers of the V4.1 layout hold both a Full and a Reindex layer (the decoder's Full
  layer 20 and its first Reindex layer 24 are 4 apart), so two slices are measured, one after the other: 20-23
  (Full 20, the candidate source, whose indexer scores every entry; Reuse 21-23) and 24-27 (Reindex 24, selecting
  inside 20's candidate blocks; Reuse 25-27: the decoder's repeating group, 16 of its 20 layers). Each closes its
  selection's indexer loss. Neither holds an Engram layer (1 and 14), so there is no Engram part.
- Modules: ``model.transformer.Transformer(args, layout, layer_ids=..., init=False, experts=StandInDispatch(16))``,
  so every block's FFN is the real ``model.moe.MoE`` of rank 0 of an E = 16 expert-parallel group (the gate of
  all 384 experts, experts 0-23, the shared expert) with its dispatch; weights drawn on the device
  (``init_parameters(on_device=True)``, the real initialisation's distribution). bf16 autocast over fp32 master
  weights; the gradients are fp32 and not reduced, and no optimizer steps (a benchmark of the layers).
- Stream and shared state. The input is the stream a middle slice receives: ``x`` [1,T,4,dim] drawn normal in the
  stream's dtype (bf16 under autocast, as a pipeline boundary carries it: ``model.hyper.stream_dtype``; the files
  of c657ab4 and before drew it in fp32, which kept the slice's whole stream in fp32),
  ``pre`` [1,T,4] = 1/4 (a block's pre-mix at init), both carrying gradients, and a random gradient for each output.
  The first slice starts at a Full layer and reads nothing from before it. A later slice reads what the earlier
  ones produced (``--slices`` in order): the fields a pipeline boundary before it carries
  (``parallel.payload.boundary_fields``: for 24-27 layer 20's KV latent and candidate blocks) are kept from the
  earlier slice's forward, the differentiable ones (the latent) as leaves with a gradient; index keys of a Full
  layer outside the slice are recomputed by a shadow indexer, as a pipeline stage does (``parallel.index_k=shadow``).
- Expert parallelism. In the issue's design the E ranks of an expert group are data-parallel replicas, each with
  its own 64K-token row: a rank holding 24 of the 384 experts receives the slots routed to them from all 16 ranks,
  on average 16 x 65,536 x 6 x 24 / 384 = 393,216 rows a layer (16,384 per expert, as many as its own tokens send
  out). Splits: ``uniform`` (equal), ``skewed`` (falling as (e + 1)^-0.5 over the experts: 2.85x the mean on the
  busiest), each sender's share equal; and ``own_tokens``: 65,536 x 6 x 24 / 384 = 24,576 rows, the rank's own
  tokens alone (what ``MoE(expert_ids=range(0, 24))`` computes locally). ``StandInDispatch`` is
  ``parallel.experts.ExpertAllToAll`` step for step with the exchanges left out (measured elsewhere):
  ``AllToAllStandIn`` fills the buffer a rank would receive with rows it has, and is timed as its own part.
  Everything else an EP rank does is in: the gate on its 64K tokens, the sort of its 393,216 slots by expert, the
  gather of the send buffer, the permutation from arrival order (sender, expert) to expert order and back, the
  grouped GEMMs, the combine of every slot into its token, the shared expert.
- Recomputation: ``layer`` is ``parallel.recompute=layer`` (a non-reentrant checkpoint per layer,
  ``parallel.recompute.recompute``); ``keep_attention`` also keeps the sparse attention's outputs (its
  ``keep_attention``);
  ``none`` (only with ``--modes``) recomputes nothing (expected not to fit: the weights with their fp32 gradients
  take 33 GB, and the 4 layers' activations several times the rest of the card).
- Runs, in this order in each slice: layer x own_tokens, layer x uniform (the measurement: time is kept for them
  in every later slice), then layer x skewed and keep_attention x own_tokens when time is left (``--splits``,
  ``--modes`` choose among them). A run that would end after ``--time-limit`` (estimated from the runs before it)
  is skipped; a run that runs out of memory is recorded and the runs of the slice needing at least as much (as
  many rows, at least as much kept) are skipped.

Per run: ``--warmup`` steps, then ``--steps`` timed ones (CUDA events; forward and backward apart, the per-layer
times of ``layer_probe.LayerProbe``; peak memory allocated and reserved), then one step under
``layer_probe.PartProbe``: time per part over the 4 layers, forward, recomputation and backward apart:
``attention``; ``mhc``; ``routed`` (the held experts: grouped GEMMs, SwiGLU, the weights' casts); ``shared`` (the
shared expert); ``moe_rest`` (the rest of the MoE: FFN norm, gate, sort, gathers, permutations, combine);
``all_to_all_standin``; ``rest``. Model FLOPs as ``model/flops.py`` counts them for the slice's layers, the routed
experts at the rows the rank receives; MFU against the bf16 matmul rate of this process (8192^3); grouped-GEMM
efficiency: a dense bf16 chain of the same GEMM FLOPs (``moe_ffn.dense_chain``, this process, before the slices)
against the routed experts' forward + backward in the step (recomputation apart), and ``moe_ffn.case`` standalone
at the same rows beside it. With ``--kernel-table`` (CUDA), one more step's device time by kernel and by host op
(``train_step.kernel_table``): what the parts cannot say, e.g. which of the stream's kernels or the MoE's sorts and
gathers take the time at V4.1 width. The JSON is rewritten after each run, so a cut call keeps what ran; a short
table is printed at the end.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from layer_probe import Clock, LayerProbe, PartProbe  # noqa: E402
from model import ModelArgs, layout_from_config  # noqa: E402
from model.attention import IndexKeys  # noqa: E402
from model.cli import compose  # noqa: E402
from model.flops import model_flops, passes  # noqa: E402
from model.rope import Rotary  # noqa: E402
from model.state import FIELDS  # noqa: E402
from model.transformer import Transformer, init_parameters  # noqa: E402
from moe_ffn import Timer, case, matmul_rate, routing_counts  # noqa: E402
from parallel.balance import mode_key  # noqa: E402
from parallel.experts import ExpertAllToAll, run_received  # noqa: E402
from parallel.payload import boundary_fields  # noqa: E402
from parallel.recompute import recompute, run_plainly  # noqa: E402
from parallel.stage import owner_name, shadow_sources  # noqa: E402
from result_meta import result_meta, write_result  # noqa: E402
from train_step import kernel_table  # noqa: E402

V41 = ["model=v41_flash", "layout=v41"]
# v41_mini's widths on the 40-layer V4.1 layout, top-6 over 64 experts (the split arithmetic of 16 ranks at 4 each).
SMOKE = ["model=v41_mini", "layout=v41", "model.kernel_backend=torch", "model.moe.n_routed_experts=64",
         "model.moe.n_activated_experts=6", "model.moe.inter_dim=32"]
RANKS = 16  # the expert-parallel group: E = 16 ranks of 384 / 16 = 24 experts each
SPLITS = {"own_tokens": (1, "uniform"), "uniform": (RANKS, "uniform"), "skewed": (RANKS, "skewed")}  # senders, routing
MODES = ("layer", "keep_attention", "none")  # in order of the memory they keep
RUNS = (("layer", "own_tokens"), ("layer", "uniform"), ("layer", "skewed"), ("keep_attention", "own_tokens"),
        ("none", "own_tokens"))  # (mode, split) in the order a slice runs them
ESSENTIAL = RUNS[:2]  # time is kept for these in every later slice
MARGIN = 1.3  # a run's time estimate times this must fit before the time limit
MFU_GOAL = 0.45
PARTS = ("attention", "mhc", "routed", "shared", "moe_rest", "all_to_all_standin", "rest")


# ------------------------------------------------------------------------------------ the expert-parallel split

def rank_rows(tokens: int, topk: int, experts: int, held: int, senders: int) -> int:
    """Routing slots a rank holding ``held`` of ``experts`` experts receives on average when ``senders`` ranks of
    ``tokens`` tokens each route top-``topk``: senders x tokens x topk x held / experts (an exact count required,
    so that each split sums to it)."""
    slots = senders * tokens * topk * held
    if slots % experts:
        raise ValueError(f"{senders} x {tokens} tokens x top-{topk} x {held} / {experts} experts is not a whole number "
                         "of rows: use a token count that makes it one (e.g. a multiple of the expert count)")
    return slots // experts


def expert_split(rows: int, held: int, routing: str) -> list[int]:
    """Rows of each held expert, summing to ``rows``: ``uniform`` or ``skewed`` (``moe_ffn.routing_counts``)."""
    if rows % held:
        raise ValueError(f"{rows} rows do not split evenly over {held} experts: use a token count that does")
    return routing_counts(routing, held, rows // held)


def source_split(counts: list[int], senders: int) -> list[list[int]]:
    """Rows each sender sends to each held expert [senders][experts]: every expert's rows spread evenly over the
    senders (the first ones one more where they do not divide)."""
    return [[c // senders + (s < c % senders) for c in counts] for s in range(senders)]


# ------------------------------------------------------------------------------------------ the rank's MoE FFN

def resize_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A new tensor of ``rows`` rows: t's rows from the first, repeated from the start as often as needed."""
    whole, part = divmod(rows, t.shape[0])
    return torch.cat([t] * whole + [t[:part]])


class _Wire(torch.autograd.Function):
    """``resize_rows`` both ways: forward to ``rows`` rows, backward the gradient back to the input's rows. Not the
    true gradient of the forward: an all-to-all's backward is the reverse all-to-all, and this stands in for both."""

    @staticmethod
    def forward(ctx, x, rows: int):
        ctx.rows_in = x.shape[0]
        return resize_rows(x, rows)

    @staticmethod
    def backward(ctx, grad):
        return resize_rows(grad, ctx.rows_in), None


class AllToAllStandIn(nn.Module):
    """Where an all-to-all sits: a new buffer of ``rows`` rows (what the rank would receive), filled with rows it
    has (the values do not matter to the time). Its cost is one buffer write per direction; the exchange is left
    out. A module, so that ``PartProbe`` times it as a part."""

    def forward(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        return _Wire.apply(x, rows)


class StandInDispatch:
    """The MoE dispatch (``model.moe.MoE``'s ``dispatch``) of rank ``rank`` of an expert-parallel group of ``ranks``,
    step for step ``parallel.experts.ExpertAllToAll``'s with its three exchanges replaced by ``AllToAllStandIn``:
    the host reads of the split sizes, the send buffer (the rank's slots sorted by expert, hence by destination)
    out, the rows of the held experts in (``set_split``: how many per sender and expert, fixed instead of the other
    ranks' routing) with their routing weights, ``meanwhile`` (the shared expert, which the real exchange
    overlaps), ``parallel.experts.run_received`` (the permutation from arrival order to expert order, the held
    experts, one grouped GEMM per matrix, the inverse permutation) and the rows back, one per slot sent: ``(rows,
    meanwhile())``. ``grouped``: passed to ``RoutedExperts.forward`` (None: grouped_mm on CUDA; True forces it,
    to run the GPU's path on the CPU in bf16)."""

    experts_of = ExpertAllToAll.experts_of  # the held range: [rank * E_l, (rank + 1) * E_l)

    def __init__(self, ranks: int, rank: int = 0, grouped: bool | None = None):
        self.world, self.rank, self.grouped = ranks, rank, grouped
        self.exchange = AllToAllStandIn()
        self.received = None

    def set_split(self, counts: list[int], senders: int, device) -> None:
        """Receive ``counts[e]`` rows for held expert e, spread evenly over ``senders`` ranks."""
        self.received = torch.tensor(source_split(counts, senders), device=device)  # [sender, held expert]

    def __call__(self, experts, rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, meanwhile=None):
        if self.received is None:
            raise ValueError("StandInDispatch.set_split(counts, senders, device) first: the rows the rank receives")
        held = len(experts.expert_ids)
        send = counts.view(self.world, held).sum(1).tolist()  # the host reads all_to_all_single's splits need
        receive = self.received.sum(1).tolist()
        slots = self.exchange(rows, sum(receive))
        slot_weights = self.exchange(weights.unsqueeze(-1), sum(receive)).squeeze(-1)
        during = meanwhile() if meanwhile is not None else None  # where the real one overlaps the exchange
        back = run_received(experts, slots, slot_weights, self.received, sum(receive), self.grouped)
        return self.exchange(back, sum(send)), during


# ------------------------------------------------------------------------------------------------- the slice

def routed_flops_per_row(experts: nn.Module) -> int:
    """Forward + backward matmul FLOPs of one routed row through a stack of held experts: ``model.flops.passes``
    per value of one expert's matrices (18 x dim x inter when they train, 12 frozen), their adapters' too."""
    held = len(experts.expert_ids)
    return sum(passes(name, p) * p.numel() for name, p in experts.named_parameters() if p.dim() > 1) // held


def slice_flops(model, layout, args: ModelArgs, layers: range, T: int, rows: int) -> dict[str, int]:
    """``model_flops`` of the slice's layers, with the routed experts at ``rows`` received rows a layer instead of
    the share of its own ``T`` tokens that ``model_flops`` counts for the held experts (``T x top-k x held / E``).
    The matrices are ``model``'s parameters: a base held quantised (buffers) is not in it."""
    flops = model_flops(model, layout, args, T, 1, layers=layers)
    moes = list(model.experts().values())
    moe, held = args.moe, len(moes[0].experts.expert_ids)
    own = rank_rows(T, moe.n_activated_experts, moe.n_routed_experts, held, 1)
    per_row = sum(routed_flops_per_row(m.experts) for m in moes)
    routed = rows * per_row
    flops["matmul"] += routed - own * per_row
    flops["routed"] = routed
    flops["total"] = flops["matmul"] + flops["attention"] + flops["indexer"]
    return flops


def parse_slices(text: str, n_layers: int) -> list[range]:
    slices = []
    for item in text.split(","):
        first, _, last = item.partition("-")
        r = range(int(first), int(last or first) + 1)
        if not (0 < r.start and r.stop < n_layers and len(r)):
            raise ValueError(f"--slices {item}: use middle layers first-last inside 1..{n_layers - 2} (a middle slice "
                             "has no embedding and no head)")
        slices.append(r)
    return slices


def drawn_layers(args: ModelArgs, layout, layers: range, dispatch, seed: int) -> Transformer:
    """The slice's layers on the ambient device, every tensor drawn there (``init_parameters(on_device=True)``)."""
    model = Transformer(args, layout, layer_ids=layers, init=False, experts=dispatch)
    init_parameters(model.state_dict(keep_vars=True).items(), args, layout.n_layers, seed, on_device=True)
    return model


class Slice:
    """The slice's layers on ``device`` with the MoEs of one expert-parallel rank (``dispatch``), its shadow
    indexers, and the stream and shared state it reads. ``build(args, layout, layers, dispatch, seed)`` makes the
    layers on the ambient device (``drawn_layers``; bench/lora_slice.py: a LoRA stage's)."""

    def __init__(self, args: ModelArgs, layout, layers: range, T: int, device: torch.device, carried: dict,
                 dispatch: StandInDispatch, autocast: bool, seed: int = 0, build=drawn_layers):
        self.args, self.layout, self.layers, self.T, self.device = args, layout, layers, T, device
        self.dispatch, self.autocast = dispatch, autocast
        with torch.device(device):
            self.model = build(args, layout, layers, dispatch, seed)
            self.shadows = nn.ModuleDict({str(s): IndexKeys(args) for s in shadow_sources(layout, layers)})
            self.rotary = Rotary.for_layer(args, compressed=True)
        for s, shadow in self.shadows.items():
            init_parameters(shadow.named_parameters(), args, layout.n_layers, seed, on_device=True,
                            rename=lambda name, s=int(s): owner_name(s, name))
        self.moes = list(self.model.experts().values())
        self.reads = self._reads(carried)
        gen = torch.Generator(device).manual_seed(seed)
        stream = (1, T, args.hc_mult, args.dim)
        dtype = torch.bfloat16 if autocast else torch.float32  # the stream's (model.hyper.stream_dtype)
        self.x = torch.randn(stream, device=device, generator=gen).to(dtype).requires_grad_()
        self.pre = torch.full(stream[:-1], 1 / args.hc_mult, device=device).requires_grad_()
        self.grad_x = torch.randn(stream, device=device, generator=gen).to(dtype)
        self.grad_pre = torch.randn(stream[:-1], device=device, generator=gen)
        self.doc_ids = torch.zeros(1, T, dtype=torch.long, device=device)

    def _reads(self, carried: dict) -> dict:
        """The shared tensors a boundary before the slice carries, from ``carried`` (what earlier slices made)."""
        fields = [(f.name, f.source, f.differentiable) for f in boundary_fields(
            self.args, self.layout, self.layers.start - 1, 1, self.T, torch.bfloat16, "shadow") if f.name in FIELDS]
        missing = [f"{name} of layer {source}" for name, source, _ in fields if (name, source) not in carried]
        if missing:
            raise ValueError(f"slice {self.layers.start}-{self.layers.stop - 1} reads {', '.join(missing)}: list a slice "
                             "holding those layers before it in --slices (e.g. 20-23,24-27)")
        return {(name, source): carried[name, source].detach().clone().requires_grad_(diff)
                for name, source, diff in fields}

    def set_run(self, mode: str, counts: list[int], senders: int) -> None:
        """Recompute ``mode`` in every block; the rank receives ``counts[e]`` rows for held expert e."""
        for block in self.model.layers.values():
            if mode == "none":
                run_plainly(block)
            else:
                recompute(block, keep_attention=mode == "keep_attention")
        self.dispatch.set_split(counts, senders, self.device)

    def step(self, clock: Clock):
        """One forward + backward from fresh gradients: (state after the forward, marks at start, mid, end)."""
        self.model.zero_grad(set_to_none=True)
        for t in (self.x, self.pre, *self.reads.values()):
            t.grad = None
        start = clock.mark()
        state = self.model.new_state(self.doc_ids)
        for (name, source), t in self.reads.items():
            getattr(state, name)[source] = t
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            for source, shadow in self.shadows.items():
                source = int(source)
                entries = state.geometry.entries(self.layout.compress_ratios[source])
                state.index_k[source] = shadow(state.kv[source], self.rotary, entries)
            # views: the probes' hooks go on tensors made per step, not on the persistent leaves
            x, pre = self.model.run_layers(self.x.view_as(self.x), self.pre.view_as(self.pre), state)
        # a frozen indexer's loss (LoRA) has no gradient: nothing of it to run backward
        losses = [loss for _, loss in sorted(state.indexer_losses.items()) if loss.requires_grad]
        mid = clock.mark()
        torch.autograd.backward([x, pre, *losses], [self.grad_x, self.grad_pre, *(torch.ones_like(v) for v in losses)])
        return state, (start, mid, clock.mark())

    def produced(self, state) -> dict:
        """The shared tensors alive after the slice (what later slices may read), detached."""
        return {(name, source): t.detach() for name in FIELDS for source, t in getattr(state, name).items()}

    def probe_parts(self, clock: Clock) -> dict:
        """One step under ``PartProbe``, the MoE's routed and shared experts and the stand-in as parts of their own
        (nested in the MoE's span, so ``moe`` keeps the rest)."""
        probe = PartProbe(self.model, clock)
        for moe in self.moes:
            probe.add_part("routed", moe.experts)
            probe.add_part("shared", moe.shared_experts)
        probe.add_part("all_to_all_standin", self.dispatch.exchange)  # one module, called by every layer
        try:
            probe.begin()
            self.step(clock)
            probe.end()
        finally:
            probe.remove()
        return probe.result()


def part_summary(parts: dict, layers: int, routed_flops: int, dense_ms: float | None) -> dict:
    """The parts the issue asks for, from ``PartProbe.result()``: ms over the slice's ``layers``, all phases; the
    routed experts' rate in the step and their grouped-GEMM efficiency (``layers`` dense chains of one layer's
    routed FLOPs, ``dense_ms`` each, against the routed forward + backward, recomputation apart)."""
    p = dict(parts["parts"])
    p["moe_rest"] = p.pop("moe", {})
    out = {f"{name}_ms": p.get(name, {}).get("total_ms", 0.0) for name in PARTS}
    routed = p.get("routed", {})
    fwd_bwd = routed.get("forward_ms", 0.0) + routed.get("backward_ms", 0.0)
    out.update(routed_fwd_bwd_ms=fwd_bwd, routed_recompute_ms=routed.get("recompute_ms", 0.0),
               routed_tflops=routed_flops / fwd_bwd / 1e9 if fwd_bwd else None,
               dense_chain_ms_per_layer=dense_ms,
               grouped_gemm_efficiency=layers * dense_ms / fwd_bwd if fwd_bwd and dense_ms else None)
    return out


# -------------------------------------------------------------------------------------------------- the runs

def is_oom(err: Exception) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def free_memory(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def measure(sl: Slice, clock: Clock, a, mode: str, split: str, senders: int, counts: list[int], flops: dict,
            rate: float, dense_ms: float | None) -> tuple[dict, object]:
    """One (mode, split) run of a slice, ``counts`` rows from ``senders`` ranks a held expert, ``flops`` its model
    FLOPs (``slice_flops``): warm-up, timed steps, the probed step. Returns (result, last state)."""
    rows = sum(counts)
    sl.set_run(mode, counts, senders)
    res = {"recompute": mode, "split": split, "senders": senders, "rows_per_layer": rows, "per_expert": counts,
           "max_over_mean": max(counts) * len(counts) / rows, "flops": flops}
    for _ in range(a.warmup):
        sl.step(clock)
    clock.sync()
    if clock.cuda:
        free_memory(True)
        torch.cuda.reset_peak_memory_stats()
    layers = LayerProbe(sl.model, clock)
    times = []
    try:
        for _ in range(a.steps):
            state, (start, mid, end) = sl.step(clock)
            clock.sync()
            times.append((clock.ms(start, mid), clock.ms(mid, end)))
    finally:
        layers.remove()
    step_ms = statistics.median(f + b for f, b in times)
    res.update(step_ms=step_ms, step_ms_each=[f + b for f, b in times],
               fwd_ms=statistics.median(f for f, _ in times), bwd_ms=statistics.median(b for _, b in times),
               model_tflops=flops["total"] / step_ms / 1e9, per_layer=layers.per_layer())
    res["mfu_vs_measured_matmul"] = res["model_tflops"] / rate
    res["mfu_goal_met"] = res["mfu_vs_measured_matmul"] >= MFU_GOAL
    if clock.cuda:
        res["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    res["parts"] = sl.probe_parts(clock)
    res["parts"]["unprobed_step_ms"] = step_ms
    if a.kernel_table and clock.cuda:
        res["kernel_table"] = kernel_table(lambda: sl.step(clock), clock.sync, top=30)
    res["summary"] = s = part_summary(res["parts"], len(sl.layers), flops["routed"], dense_ms)
    res["mfu_without_standin"] = flops["total"] / (step_ms - s["all_to_all_standin_ms"]) / 1e9 / rate
    return res, state


class Budget:
    """When a run may start: its estimate (``estimate``) times ``MARGIN`` must end before ``deadline``, and the
    runs beyond a slice's first two must also leave the time of every later slice's first two (``reserve``)."""

    def __init__(self, deadline: float, runs_per_step: int):
        self.deadline, self.runs_per_step = deadline, runs_per_step  # steps a run takes: warm-up, timed, probed
        self.done: list[dict] = []  # measured runs: slice index, key, run_s, step_s, flops
        self.essential_s: float | None = None  # build + essential runs of the latest slice that ran them all

    def estimate(self, index: int, key: tuple, flops: int) -> float:
        """Seconds for run ``key`` of slice ``index``: the same run in an earlier slice (kernels compiled there
        were compiled in it), else the slowest step so far in this slice scaled by FLOPs; 0 when none ran yet."""
        earlier = [d for d in self.done if d["key"] == key and d["slice"] < index]
        if earlier:
            return earlier[-1]["run_s"]
        here = [d["step_s"] * flops / d["flops"] for d in self.done if d["slice"] == index]
        return max(here, default=0.0) * self.runs_per_step

    def allows(self, estimate_s: float, later_slices: int, essential: bool) -> bool:
        reserve = 0.0 if essential else later_slices * (self.essential_s or 0.0)
        return time.monotonic() + MARGIN * estimate_s + reserve <= self.deadline


def run_slice(res: dict, index: int, slices: list[range], args, layout, device, carried: dict, clock: Clock, a,
              save, dense: dict, dispatch: StandInDispatch, budget: Budget) -> dict:
    """Build slice ``index``, run its (mode, split) runs in order, append each to ``res["slices"]``; returns what
    the slice produced for later ones."""
    layers, T = slices[index], a.tokens
    entry = {"layers": list(layers), "modes": [mode_key(layout.plan[i]) for i in layers]}
    res["slices"].append(entry)
    t0 = time.monotonic()
    try:
        sl = Slice(args, layout, layers, T, device, carried, dispatch, a.autocast, a.seed)
    except Exception as err:  # noqa: BLE001 - e.g. reads of a slice not listed before it, or weights not fitting
        entry["error"] = f"{type(err).__name__}: {err}"[:600]
        print(f"slice {layers.start}-{layers.stop - 1}: {entry['error']}", flush=True)
    if "error" in entry:
        free_memory(clock.cuda)
        return {}
    entry.update(build_s=time.monotonic() - t0, params=sum(p.numel() for p in sl.model.parameters()),
                 reads={f"{name}[{source}]": list(t.shape) for (name, source), t in sl.reads.items()},
                 shadow_index_keys=[int(s) for s in sl.shadows], runs=[])
    moe, held = args.moe, len(sl.moes[0].experts.expert_ids)
    produced, too_big, essential_s = {}, [], entry["build_s"]
    for mode, split in [r for r in RUNS if r[0] in a.modes and r[1] in a.splits]:
        senders, routing = SPLITS[split]
        rows = rank_rows(T, moe.n_activated_experts, moe.n_routed_experts, held, senders)
        counts = expert_split(rows, held, routing)
        essential = (mode, split) in ESSENTIAL
        flops = slice_flops(sl.model, layout, args, layers, T, rows)
        estimate_s = budget.estimate(index, (mode, split), flops["total"])
        run = {"recompute": mode, "split": split, "rows_per_layer": rows, "estimate_s": estimate_s}
        blocker = next((b for b in too_big if MODES.index(mode) >= MODES.index(b[0]) and rows >= b[1]), None)
        if blocker is not None:
            run["skipped"] = f"recompute={blocker[0]} at {blocker[1]} rows a layer ran out of memory"
        elif not budget.allows(estimate_s, len(slices) - index - 1, essential):
            run["skipped"] = f"--time-limit {a.time_limit}s: ~{estimate_s:.0f}s would pass it"
        if "skipped" in run:
            entry["runs"].append(run)
            print(f"slice {layers.start}-{layers.stop - 1} {mode} {split}: skipped ({run['skipped']})", flush=True)
            save()
            continue
        start = time.monotonic()
        try:
            measured, state = measure(sl, clock, a, mode, split, senders, counts, flops,
                                      res["matmul_bf16"]["tflops"], dense.get(rows))
            run.update(measured)
            produced = produced or sl.produced(state)
            del state
        except Exception as err:  # noqa: BLE001 - recorded; the runs before it and other slices stand
            run["error"] = f"{type(err).__name__}: {err}"[:600]
            if clock.cuda:
                run["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if is_oom(err):
                too_big.append((mode, rows))
        if "error" in run:  # out of the except block, whose traceback holds the failed step's tensors
            sl.model.zero_grad(set_to_none=True)
        free_memory(clock.cuda)
        run["run_s"] = time.monotonic() - start
        if "step_ms" in run:
            budget.done.append({"slice": index, "key": (mode, split), "run_s": run["run_s"],
                                "step_s": run["step_ms"] / 1e3, "flops": run["flops"]["total"]})
        if essential:
            essential_s += run["run_s"]
        entry["runs"].append(run)
        print(json.dumps({k: v for k, v in run.items() if k not in ("per_layer", "parts", "flops", "per_expert")}),
              flush=True)
        save()
    if all(any(r["recompute"] == m and r["split"] == s and "step_ms" in r for r in entry["runs"]) for m, s in ESSENTIAL):
        budget.essential_s = essential_s
    del sl
    free_memory(clock.cuda)
    return produced


def standalone(res: dict, timer: Timer, args, device, rows_list: list[int], held: int, save) -> dict[int, float]:
    """``moe_ffn.case`` at the rank's rows (the routed experts alone, autocast and bf16 weights, and the dense chain
    of the same FLOPs), skewed too at the largest: returns the dense chain's ms by rows."""
    shape = dict(dim=args.dim, inter=args.moe.inter_dim, topk=args.moe.n_activated_experts, local_experts=held)
    dense = {}
    for rows in rows_list:
        for routing in ("uniform", "skewed") if rows == max(rows_list) else ("uniform",):
            r = case(timer, shape, rows // held, routing, device, seed=rows)
            dense.setdefault(rows, r.get("dense_ms"))
            r["dense_tflops"] = r["gemm_flops"] / dense[rows] / 1e9
            for name in ("routed", "routed_bf16"):
                r[f"{name}_efficiency_vs_dense"] = dense[rows] / r[f"{name}_ms"]
            res["routed_standalone"].append(r)
            print(json.dumps(r), flush=True)
            save()
        free_memory(device.type == "cuda")
    return dense


def table(res: dict) -> None:
    print(f"\nmatmul 8192^3 bf16: {res['matmul_bf16']['tflops']:.0f} TFLOP/s; ms over the slice's layers, fwd+bwd; "
          f"MFU goal {MFU_GOAL:.0%}")
    head = ("slice", "recompute", "split", "rows", "step", "fwd", "bwd", "TFLOP/s", "MFU", "attn", "mhc", "routed",
            "shared", "moe-rest", "a2a-si", "rest", "GG eff", "peak GiB")
    widths = (7, 14, 10, 7, 6, 6, 6, 7, 6, 6, 6, 6, 6, 8, 6, 6, 6, 8)
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, widths)))
    for entry in res["slices"]:
        name = f"{entry['layers'][0]}-{entry['layers'][-1]}"
        for run in entry.get("runs", []):
            first = f"{name:>7} {run['recompute']:>14} {run['split']:>10} {run['rows_per_layer']:>7}"
            if "step_ms" not in run:
                print(f"{first} {(run.get('skipped') or run.get('error', ''))[:90]}")
                continue
            s, eff = run["summary"], run["summary"]["grouped_gemm_efficiency"]
            cells = [run["step_ms"], run["fwd_ms"], run["bwd_ms"], run["model_tflops"]]
            cells += [s[f"{p}_ms"] for p in PARTS]
            print(f"{first} {cells[0]:6.0f} {cells[1]:6.0f} {cells[2]:6.0f} {cells[3]:7.0f} "
                  f"{run['mfu_vs_measured_matmul']:6.1%} " + " ".join(f"{v:{w}.0f}" for v, w in zip(cells[4:], widths[9:]))
                  + f" {'-' if eff is None else f'{eff:.2f}':>6} {run.get('peak_alloc_gib', float('nan')):8.1f}")
        if "error" in entry:
            print(f"{name:>7} {entry['error'][:120]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to test this script")
    p.add_argument("--bf16", action="store_true",
                   help="with --smoke: bf16 autocast and grouped_mm as on the GPU (slower on the CPU)")
    p.add_argument("--slices", default="20-23,24-27", help="first-last layers of each slice, in order")
    p.add_argument("--modes", default="layer,keep_attention", help=f"recomputation modes, of {','.join(MODES)}")
    p.add_argument("--splits", default=",".join(SPLITS), help=f"expert splits, of {','.join(SPLITS)}")
    p.add_argument("--tokens", type=int, default=None, help="T (default 65536; smoke 64)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 2; smoke 1)")
    p.add_argument("--warmup", type=int, default=None, help="steps before them (default 1; smoke 0)")
    p.add_argument("--kernel-table", action="store_true",
                   help="each run: one more step's device time by kernel and by host op (train_step.kernel_table)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds from the start: runs that would end after it are skipped (default 330; smoke none)")
    p.add_argument("overrides", nargs="*", help="config overrides after the preset's")
    a = p.parse_args(argv)
    started = time.monotonic()
    for name, gpu, smoke in (("steps", 2, 1), ("warmup", 1, 0), ("time_limit", 330, 10**6), ("tokens", 65536, 64)):
        if getattr(a, name) is None:
            setattr(a, name, smoke if a.smoke else gpu)
    a.modes, a.splits = a.modes.split(","), a.splits.split(",")
    if any(m not in MODES for m in a.modes):
        p.error(f"--modes {','.join(a.modes)}: use some of {','.join(MODES)}")
    if any(s not in SPLITS for s in a.splits):
        p.error(f"--splits {','.join(a.splits)}: use some of {','.join(SPLITS)}")
    if a.bf16 and not a.smoke:
        p.error("--bf16 is for --smoke (the GPU run is always bf16 autocast)")
    cuda = not a.smoke
    if a.smoke:
        torch.set_num_threads(1)  # tiny ops on a shared CPU: threads only wait on each other
    if cuda and not torch.cuda.is_available():
        p.error("no CUDA device: run on the GPU, or --smoke on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    a.autocast = cuda or a.bf16  # bf16 autocast over fp32 masters, as training; the smoke in fp32 unless --bf16
    overrides = (SMOKE if a.smoke else V41) + a.overrides
    cfg = compose(overrides)
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    T = a.tokens
    try:
        slices = parse_slices(a.slices, layout.n_layers)
    except ValueError as err:
        p.error(str(err))
    moe = args.moe
    dispatch = StandInDispatch(RANKS, grouped=True if a.bf16 else None)
    held = len(dispatch.experts_of(moe.n_routed_experts))
    rows = {name: rank_rows(T, moe.n_activated_experts, moe.n_routed_experts, held, senders)
            for name, (senders, _) in SPLITS.items()}
    clock = Clock(cuda)
    res = {**result_meta(), "overrides": overrides, "T": T, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "gpu_total_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
           "expert_parallel": {"ranks": RANKS, "rank": dispatch.rank, "experts": moe.n_routed_experts,
                               "held": [dispatch.experts_of(moe.n_routed_experts)[i] for i in (0, -1)],
                               "topk": moe.n_activated_experts, "all_to_all": "left out (AllToAllStandIn)",
                               "splits": {name: {"senders": senders, "rows": rows[name], "routing": routing,
                                                 "per_expert": expert_split(rows[name], held, routing)}
                                          for name, (senders, routing) in SPLITS.items()}},
           "timing": {"warmup": a.warmup, "steps": a.steps, "stat": "median", "time_limit_s": a.time_limit},
           "mfu_goal": MFU_GOAL, "slices": [], "routed_standalone": []}
    out = Path(a.out)

    def save():
        res["wall_s"] = time.monotonic() - started
        write_result(out, res)

    res["matmul_bf16"] = matmul_rate(Timer(cuda, 1 if a.smoke else 3, 2 if a.smoke else 10), device,
                                     64 if a.smoke else 8192)
    timer = Timer(cuda, 1, 1 if a.smoke else 3)
    used = sorted({rows[s] for s in a.splits}, reverse=True)
    dense = standalone(res, timer, args, device, used, held, save)
    budget = Budget(started + a.time_limit, a.warmup + a.steps + 1)
    carried = {}
    for index in range(len(slices)):
        carried.update(run_slice(res, index, slices, args, layout, device, carried, clock, a, save, dense, dispatch,
                                 budget))
        save()
    table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
