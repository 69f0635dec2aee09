"""Expert parallelism in the plan, the memory model, the 1F1B simulator and the V4.1 projection (issue 35), against
hand computations from SPEC §7: a rank holds the dense weights and 1/E of the routed experts, expert AdamW state
is partitioned over the D / E ranks holding the same experts, and every MoE layer exchanges tokens x top-k x dim
rows (dispatch, combine and their gradients, (E - 1) / E of them leaving the rank)."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from model import ModelArgs, layout_from_config  # noqa: E402
from model.cli import compose  # noqa: E402
from model.layout import Layout  # noqa: E402
from parallel.experts import routed_bytes  # noqa: E402
from parallel.memory import estimate, parameter_counts  # noqa: E402
from parallel.partition import StagePlan  # noqa: E402
from parallel.plan import describe_experts  # noqa: E402
from parallel.simulate import Cluster, Layers, simulate, stage_work  # noqa: E402

T, B = 64, 2


@pytest.fixture(scope="module")
def mini():
    cfg = compose(["model=v41_mini", "layout=v41", "model.kernel_backend=torch"])
    return ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)


def hand_experts(args, layout: Layout) -> list[int]:
    """Routed-expert parameters per layer by the formula: experts x 3 x dim x inter; the draft head's on the last."""
    moe, d = args.moe, args.dspark
    per = [moe.n_routed_experts * 3 * args.dim * moe.inter_dim] * layout.n_layers
    per[-1] += d.blocks * d.n_routed_experts * 3 * args.dim * args.dspark_moe.inter_dim
    return per


def test_plan_prints_experts_per_rank_and_all_to_all_bytes(mini):
    args, layout = mini
    plan = StagePlan((range(0, 10), range(10, 40)))
    E, D = 2, 4
    text = describe_experts(args, layout, plan, B, T, torch.bfloat16, E, D, recomputed=True)
    # one exchange: B*T tokens x top-2 x dim 128 x 2 B, half of it leaves the rank
    exchange = B * T * 2 * 128 * 2 * (E - 1) / E
    stage0 = 10 * exchange * (2 + 4)  # forward: dispatch + combine; backward: their gradients and the recomputed pair
    assert f"a rank holds {8 // E} of the 8 routed experts" in text and f"{4 // E} of the draft head's 4" in text
    assert f"({D // E} group(s) of {E})" in text and "uniform routing assumed" in text
    assert f"stage 0: 10 MoE layer(s), {stage0 / 2**20:,.1f} MiB sent per microbatch" in text
    assert f"forward {10 * exchange * 2 / 2**20:,.1f} MiB" in text
    assert describe_experts(args, layout, plan, B, T, torch.bfloat16, 1, D, True) == ""
    # received rows: B*T x top-2 under uniform routing; per row (2 x dim 128 + 3 x inter 64) x 2 B, twice (backward)
    rows, per_row = B * T * 2, (2 * 128 + 3 * 64) * 2 * 2
    assert (f"received rows per MoE and microbatch: {rows:,} a rank under uniform routing (tokens x top-k), up to 2x "
            f"when every token goes to one rank's experts; the experts' working set at 1x, 2x, ... that: "
            f"1x {rows * per_row / 2**20:,.1f} MiB, 2x {2 * rows * per_row / 2**20:,.1f} MiB") in text
    drafting = routed_bytes(args, layout, B, T, 2, dspark=True)
    assert drafting[-1] - drafting[0] == 1 * B * T * 5 * 2 * 128 * 2  # 1 block x T x block_size 5 x top-2


def test_memory_per_rank_with_two_expert_groups_halves_the_experts_only(mini):
    args, layout = mini
    counts = parameter_counts(args, layout)
    assert list(counts["experts"]) == hand_experts(args, layout)
    D = 4
    one = estimate(args, layout, B, T, torch.bfloat16, layout.n_layers, D, 1, False)
    two = estimate(args, layout, B, T, torch.bfloat16, layout.n_layers, D, 1, False, expert_parallel=2)
    for i, (dense, experts, tables) in enumerate(zip(counts["dense"], counts["experts"], counts["tables"])):
        table = tables * 12 / D  # Engram rows: fp32 weight + sparse Adam's moments, sharded over D
        assert one.state[i] == pytest.approx(dense * (8 + 8 / D) + experts * (8 + 8 / D) + table)
        # E = 2: half the experts, their moments over D / E = 2 ranks; the dense part as before
        assert two.state[i] == pytest.approx(dense * (8 + 8 / D) + experts / 2 * (8 + 8 / 2) + table)
        assert one.casts[i] == pytest.approx(2 * (dense + experts)) and two.casts[i] == pytest.approx(
            2 * (dense + experts / 2))
        assert two.retained[i] == one.retained[i]
        # the two receive buffers of the all-to-all: B*T x top-2 x dim x 2 B each
        assert two.transient[i] - one.transient[i] == pytest.approx(2 * B * T * 2 * args.dim * 2)


def layers_of(n=4, routed=1e9, shared=0.01):
    return Layers([0.1] * n, [0.2] * n, [1e6] * n, [1e6] * n, [1000] * n, routed_bytes=[routed] * n,
                  shared_fwd_s=[shared] * n, shared_bwd_s=[2 * shared] * n, expert_params=[500] * n, recomputed=True)


def test_all_to_all_enters_the_step_and_overlap_hides_at_most_the_shared_expert():
    cluster = Cluster(alltoall_gbps=100.0, alltoall_internode_gbps=10.0, latency_s=0.0)
    stages, M = (range(0, 2), range(2, 4)), 4
    layers = layers_of()
    base = simulate(stage_work(layers, stages, 4, cluster), M)
    work = stage_work(layers, stages, 4, cluster, expert_parallel=4)
    exchange = 1e9 * 3 / 4 / 100e9  # 3/4 of a GB over 100 GB/s: the group of 4 is inside a node
    assert work[0].all_to_all_s == pytest.approx(2 * (2 + 4) * exchange)
    assert work[0].fwd_s == pytest.approx(0.2 + 2 * 2 * exchange) and work[0].bwd_s == pytest.approx(
        0.4 + 2 * 4 * exchange)
    with_a2a = simulate(work, M)
    assert with_a2a.step_s - base.step_s == pytest.approx((M + 1) * work[0].all_to_all_s, rel=1e-6)
    hidden = stage_work(layers, stages, 4, cluster, expert_parallel=4, overlap=True)
    # each pass hides at most its shared expert's time: forward 0.01 s a layer, backward 0.02 s
    assert hidden[0].all_to_all_s == pytest.approx(work[0].all_to_all_s - 2 * (0.01 + 0.02))
    assert simulate(hidden, M).step_s < with_a2a.step_s
    # a group of 16 spans two nodes: 7/16 of the rows over NVLink, 8/16 between nodes (the slower one)
    assert cluster.all_to_all_s(1e9, 16) == pytest.approx(max(1e9 * 7 / 16 / 100e9, 1e9 * 8 / 16 / 10e9))
    # expert gradients reduced over D / E = 1 rank: only the dense ones' ring all-reduce is left
    assert work[0].reduce_s == pytest.approx(3 * 3 / 4 * 4 * 2 * 500 / (cluster.allreduce_gbps * 1e9))
    assert stage_work(layers, stages, 4, cluster, expert_parallel=1) == stage_work(layers, stages, 4, cluster)


def test_projection_runs_and_its_rows_hold_together(monkeypatch):
    import v41_projection as vp

    step, moe_ffn = (vp.json.loads(p.read_text()) for p in (vp.SMALL_MOE, vp.MOE_FFN))
    shapes = vp.configurations(64)
    assert all(P * D * C == 64 and (C * D) % E == 0 for P, E, D, C in shapes) and (4, 16, 1, 16) in shapes
    few = [s for s in shapes if s[0] == 4 and s[3] in (1, 16)]  # the test's share: seconds, not minutes
    monkeypatch.setattr(vp, "configurations", lambda n: few)
    rows = vp.projection([64], [vp.Job("pretraining", 256)], step, moe_ffn)
    assert {(r["stages"], r["expert_parallel"], r["data_parallel"], r["context_parallel"]) for r in rows} == set(few)
    for r in rows:
        assert r["stages"] * r["data_parallel"] * r["context_parallel"] == 64
        assert r["microbatches"] * r["data_parallel"] == 256
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["microbatches"] * vp.T / r["step_s"] / r["stages"]
                                                          / r["context_parallel"])
        assert 0 < r["all_to_all_share"] < 1 and r["overlap_all_to_all_share"] <= r["all_to_all_share"]
    # 552 B parameters at 8 B each (fp32 weight and gradient, never partitioned) over 64 GPUs: ~69 GB before AdamW
    assert all(not r["fits"] for r in rows)


def test_slice_residual_is_what_the_slice_adds_to_the_derived_times():
    import v41_projection as vp

    step, moe_ffn = (vp.json.loads(p.read_text()) for p in (vp.SMALL_MOE, vp.MOE_FFN))
    derived, _ = vp.layer_inputs(step, moe_ffn, 16)
    per_layer = [{"layer": i, "fwd_ms": (derived.fwd_s[i] + 0.01) * 1e3, "bwd_ms": (derived.bwd_s[i] + 0.03) * 1e3}
                 for i in range(20, 24)]
    standin = 7.0  # ms, left out of the step: the simulator adds the real all-to-alls
    run = {"recompute": "layer", "split": "uniform", "per_layer": per_layer, "mfu_vs_measured_matmul": 0.3,
           "step_ms": sum(r["fwd_ms"] + r["bwd_ms"] for r in per_layer) + standin,
           "summary": {"all_to_all_standin_ms": standin}}
    other = {**run, "split": "own_tokens", "step_ms": 1.0}  # not the split an expert-parallel rank computes
    found = vp.slice_correction({"slices": [{"layers": [20, 21, 22, 23], "runs": [other, run]}]}, step, moe_ffn)
    assert found["fwd_s"] == pytest.approx(0.01) and found["bwd_s"] == pytest.approx(0.03)
    with pytest.raises(ValueError):
        vp.slice_correction({"slices": [{"layers": [20], "runs": [other]}]}, step, moe_ffn)


def test_a_rank_that_would_run_out_names_the_layer_and_its_load():
    """``check_received``: silent while the experts' working set fits, one line naming the MoE, the rank and its
    load when it does not."""
    from parallel.experts import ExpertOverload, check_received

    check_received("layers.17.ffn", 3, 8, 524_288, 65_536, need=2 * 2**30, free=2 * 2**30)
    with pytest.raises(ExpertOverload) as caught:
        check_received("layers.17.ffn", 3, 8, 524_288, 65_536, need=9 * 2**30, free=2.5 * 2**30)
    assert str(caught.value).startswith(
        "layers.17.ffn: expert-parallel rank 3 of 8 received 524,288 routed rows, 8.0x the 65,536 it sent (uniform "
        "routing: about 1x); its experts would need 9.0 GiB, 2.5 GiB is free — routing has collapsed")


def test_an_overloaded_rank_ends_the_job_in_its_line_with_status_1(capsys, monkeypatch):
    """The job's error handling (``train.processes.errors.reported``) prints the overload's one line, not a traceback or
    the generic out-of-memory advice, and exits 1 (the run cannot go on; the input was not wrong)."""
    import train.processes.errors as errors
    from parallel.experts import ExpertOverload, check_received

    monkeypatch.setattr(errors, "SHOW_TRACEBACK", False)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # reported() sets it to 1: undone after the test, for later jobs
    with pytest.raises(ExpertOverload) as caught:
        check_received("layers.17.ffn", 3, 8, 524_288, 65_536, need=9 * 2**30, free=2.5 * 2**30)
    with pytest.raises(SystemExit) as stopped, errors.reported():
        raise caught.value
    assert stopped.value.code == 1
    assert capsys.readouterr().err == f"error: {caught.value}\n"
