"""Stage balance on measured layer times, memory-aware (parallel/balance.py, parallel/partition.py), and the
per-stage memory model (parallel/memory.py)."""
import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from model import ModelArgs, layout_from_config
from model.cli import compose, resolved
from parallel.balance import DIMS, LayerTimes, ModeTimes, mode_key
from parallel.job import plan
from parallel.memory import estimate
from parallel.partition import balanced_cuts

ROOT = Path(__file__).resolve().parents[2]


def brute_force(costs, n_stages, memory, capacity, slack):
    """Every contiguous split, the rule of balanced_cuts written out: fastest fitting (any split if none fits),
    then the smallest largest memory among those within the slack."""
    n = len(costs)
    splits = []
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = [0, *cuts, n]
        spans = list(zip(bounds, bounds[1:]))
        splits.append((list(cuts), max(sum(costs[a:b]) for a, b in spans),
                       max(memory(s, range(a, b)) for s, (a, b) in enumerate(spans))))
    fitting = [s for s in splits if capacity is None or s[2] <= capacity] or splits
    fastest = min(t for _, t, _ in fitting)
    chosen = min((s for s in fitting if s[1] <= fastest * (1 + slack)), key=lambda s: s[2])
    return chosen[1], chosen[2]


def test_memory_aware_split_matches_brute_force():
    rng = random.Random(0)
    for trial in range(60):
        n, stages = rng.randint(3, 9), rng.randint(2, 4)
        if stages > n:
            continue
        costs = [rng.uniform(1, 10) for _ in range(n)]
        per_layer = [rng.uniform(1, 5) for _ in range(n)]

        def memory(stage, layers):  # stage 0 holds the most microbatches, as under 1F1B
            return sum(per_layer[i] for i in layers) * (stages - stage)
        capacity = rng.choice([None, sum(per_layer) * stages / 3, 1.0])  # 1.0: nothing fits
        slack = rng.choice([0.0, 0.05, 0.3])
        cuts = balanced_cuts(costs, stages, memory, capacity, slack)
        bounds = [0, *cuts, n]
        spans = list(zip(bounds, bounds[1:]))
        got = (max(sum(costs[a:b]) for a, b in spans), max(memory(s, range(a, b)) for s, (a, b) in enumerate(spans)))
        assert got == pytest.approx(brute_force(costs, stages, memory, capacity, slack)), trial


def test_memory_aware_split_prefers_the_lighter_first_stage():
    """Equal costs: without memory the middle cut; stage 0 holding two microbatches' activations, the split
    within 30% of the fastest that lowers the largest stage peak gives stage 0 fewer layers."""
    costs = [1.0] * 10
    assert balanced_cuts(costs, 2) == [5]
    assert balanced_cuts(costs, 2, lambda stage, layers: len(layers) * (2 - stage), None, 0.3) == [4]


@pytest.fixture(scope="module")
def small():
    cfg = compose(["model=small", "layout=v41"])
    return ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)


def write_times(path, args, layout, slow_mode=None, **geometry):
    modes = {mode_key(p): ModeTimes(10.0, 30.0) for p in layout.plan}
    if slow_mode:
        modes[slow_mode] = ModeTimes(100.0, 300.0)
    times = LayerTimes(geometry.get("seq_len", 65536), 1, "layer", "bf16", {k: getattr(args, k) for k in DIMS}, modes)
    times.save(str(path))
    return times


def test_layer_times_round_trip_and_refuse_another_job(small, tmp_path):
    args, layout = small
    path = tmp_path / "times.json"
    times = write_times(path, args, layout)
    assert LayerTimes.load(str(path)) == times
    assert LayerTimes.load(str(path)).layer_costs(layout) == [40.0] * layout.n_layers
    with pytest.raises(ValueError, match=r"seq_len, micro_batch, recompute \(65536, 1, 'layer'\) vs \(4096"):
        times.check(args, layout, 4096, 1, "layer")
    other = ModelArgs.from_config(compose(["model=v41_flash"]).model)
    with pytest.raises(ValueError, match="dim 2048 vs 5120"):
        times.check(other, layout, 65536, 1, "layer")
    partial = json.loads(path.read_text())
    del partial["modes"]["reuse"]
    path.write_text(json.dumps(partial))
    with pytest.raises(ValueError, match=r"no time for layer mode\(s\) \['reuse'\]"):
        LayerTimes.load(str(path)).check(args, layout, 65536, 1, "layer")
    with pytest.raises(FileNotFoundError, match="bench/multigpu.py writes one"):
        LayerTimes.load(str(tmp_path / "missing.json"))


def split_of(*extra):
    """The stage split of ``model=small`` at 64K on two stages, 8 microbatches, bf16 (planned on the CPU: no memory
    bound)."""
    config = resolved(compose(["model=small", "layout=v41", "data.seq_len=65536", "data.micro_batch_size=1",
                               "parallel.pipeline_stages=2", "parallel.recompute=layer", "train.grad_accum_steps=8",
                               "train.precision=bf16", *extra]))
    return plan(config, 2, torch.device("cpu")).split


def test_split_follows_measured_times(small, tmp_path):
    """Uniform measured times: the cut is at the middle, not where the FLOP model puts it; a slow mode near the end
    (the Reindex layers 24-36) pulls the cut after it."""
    args, layout = small
    flops = split_of()
    uniform = tmp_path / "uniform.json"
    write_times(uniform, args, layout)
    even = split_of(f"parallel.layer_times={uniform}")
    assert (flops.unit, even.unit) == ("FLOPs", "measured ms")
    assert even.plan.cuts[0] in (19, 20) and even.costs == [40.0] * 40
    slow = tmp_path / "slow.json"
    write_times(slow, args, layout, slow_mode="reindex_cand")
    late = split_of(f"parallel.layer_times={slow}")
    assert late.plan.cuts[0] > 24


def test_stage_peak_counts_microbatches_in_flight(small):
    """Under 1F1B stage s keeps min(M, P - s) microbatches: the retained part scales with it, state does not."""
    args, layout = small
    memory = estimate(args, layout, 1, 65536, torch.bfloat16, layout.n_layers)
    layers = range(10, 20)
    retained = sum(memory.retained[i] for i in layers) + 2 * memory.boundary[9] + memory.boundary[19]
    for stages, microbatches in ((4, 8), (4, 2), (8, 3)):
        for stage in (1, 2):
            expected = (sum(memory.state[i] for i in layers) + min(microbatches, stages - stage) * retained
                        + max(sum(memory.casts[i] for i in layers), max(memory.transient[i] for i in layers)))
            assert memory.stage_peak(stage, layers, stages, microbatches) == pytest.approx(expected)


def test_memory_estimate_of_the_measured_64k_step(small):
    """The committed one-stage 64K step (bench/results/train/train_step_csa2_65536.json: small, v41, recompute=layer,
    bf16, micro-batch 1, one GPU) peaked at 84.3 GiB allocated: the analytic estimate is within 10% of it."""
    args, layout = small
    measured = json.loads((ROOT / "bench/results/train/train_step_csa2_65536.json").read_text())
    memory = estimate(args, layout, 1, 65536, torch.bfloat16, layout.n_layers, data_parallel=1)
    estimate_gib = memory.peaks((range(layout.n_layers),), 1)[0] / 2 ** 30
    assert estimate_gib == pytest.approx(measured["peak_alloc_gib"], rel=0.10)


def test_backward_figures_that_are_not_peaks_are_left_out(small):
    """The committed two-GPU layer-times file holds true backward peaks (the fixed probe): each mode's measured
    transient replaces the analytic one, as do its retained bytes. A file from the probe before its fix had net
    changes instead (most negative): then the analytic transients stay."""
    args, layout = small
    times = LayerTimes.load(str(ROOT / "bench/results/multigpu/layer_times_small_65536.json"))
    analytic = estimate(args, layout, 1, 65536, torch.bfloat16, layout.n_layers)
    measured = estimate(args, layout, 1, 65536, torch.bfloat16, layout.n_layers, measured=times)
    assert times.backward_peaks_valid()
    assert measured.transient[3] == times.modes["reuse"].backward_bytes != analytic.transient[3]
    assert measured.retained[3] == times.modes["reuse"].retained_bytes != analytic.retained[3]
    net = dataclasses.replace(times, modes={k: dataclasses.replace(v, backward_bytes=-v.retained_bytes)
                                            for k, v in times.modes.items()})
    unfixed = estimate(args, layout, 1, 65536, torch.bfloat16, layout.n_layers, measured=net)
    assert not net.backward_peaks_valid()
    assert unfixed.transient == analytic.transient
    assert unfixed.retained[3] == times.modes["reuse"].retained_bytes


def test_kept_attention_counts_per_stage_and_microbatch_in_flight():
    """parallel.keep_attention_layers=[0,2] at cut 21, M = 8: stage 1 (one microbatch in flight) grows by two
    attention outputs (64K x 64 heads x (512 bf16 + LSE and mass in fp32) = 4.03 GiB each), stage 0 not at all;
    an integer 2 keeps on both, and stage 0 (two in flight) grows by four."""
    kept_bytes = 65536 * 64 * (512 * 2 + 8)
    base = split_of("parallel.cuts=[21]")
    last = split_of("parallel.cuts=[21]", "parallel.keep_attention_layers=[0,2]")
    every = split_of("parallel.cuts=[21]", "parallel.keep_attention_layers=2")
    assert last.peaks[0] == base.peaks[0]
    assert last.peaks[1] - base.peaks[1] == pytest.approx(2 * kept_bytes)
    assert every.peaks[0] - base.peaks[0] == pytest.approx(4 * kept_bytes)
    assert every.peaks[1] == pytest.approx(last.peaks[1])
