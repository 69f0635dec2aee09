"""Context parallelism and LoRA in the plan, the memory model and the 1F1B simulator (issues 36, 37), against hand
computations from SPEC §7 and model/lora.py: a rank computes its chunk of seq_len / C tokens (per-token activations
at 1/C), the compressed entries a Full layer gathers stay whole-row on every rank, a stage's ZeRO-1 state and table
rows are partitioned over its C x D ranks; the frozen base of a LoRA run keeps its weights only (bf16 for the
matrices autocast reads, fp32 for the rest) and the adapters r x (in + out) a matrix their full state."""
import json
import sys
from pathlib import Path

import pytest
import torch

from model import ModelArgs, layout_from_config
from model.cli import compose
from model.lora import LoRA
from parallel.memory import estimate, lora_counts, parameter_counts
from parallel.partition import StagePlan
from parallel.plan import describe_context, main as plan_main
from parallel.simulate import Cluster, Layers, ring_reduce_s, stage_work

ROOT = Path(__file__).resolve().parents[2]
T = 4096  # v41_mini on v41_scaled: window 32, ratios 2 and 1, candidate blocks of 4 (a chunk: a multiple of 8)


@pytest.fixture(scope="module")
def mini():
    cfg = compose(["model=v41_mini", "model.kernel_backend=torch"])
    return ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)


def whole_and_per_query(args, layout, source: int, tokens: int) -> tuple[float, float]:
    """Bytes a source layer produces (model/state.py's fields, by hand): the row's entries (latent fp32 for m = 2,
    bf16 for m = 1; index keys bf16) and its chunk's per-query fields (top-k int64, candidate blocks int64, the
    indexer's logits and target fp32)."""
    m = layout.compress_ratios[source]
    whole = per_query = 0.0
    for name, s in layout.last_use:
        if s != source:
            continue
        if name == "kv":
            whole += T // m * 64 * (4 if m > 1 else 2)
        elif name == "index_k":
            whole += T // m * 32 * 2
        elif name == "candidates":
            per_query += tokens * 8 * 8  # min(candidate_topk_blocks 8, T / 4) blocks
        else:  # topk int64, index_logits and index_target fp32, 16 entries a query
            per_query += tokens * 16 * (8 if name == "topk" else 4)
    return whole, per_query


def test_chunk_halves_activations_but_not_the_gathered_entries(mini):
    args, layout = mini
    one = estimate(args, layout, 1, T, torch.bfloat16, layout.n_layers, 2, cuda=False)
    two = estimate(args, layout, 1, T, torch.bfloat16, layout.n_layers, 2, cuda=False, context_parallel=2)
    counts = parameter_counts(args, layout)
    for i in range(layout.n_layers):
        # 4 bf16 copies of the stream (dim 128) and the fp32 pending pre-mix, per token of the rank's chunk
        stream = {C: 4 * (T // C) * 128 * 2 + 4 * (T // C) * 4 for C in (1, 2)}
        for C, memory in ((1, one), (2, two)):
            whole, per_query = whole_and_per_query(args, layout, i, T // C)
            assert memory.retained[i] == pytest.approx(stream[C] + whole + per_query), (i, C)
        # the state over C x D ranks: AdamW's moments (8 B) over 2 ranks, then 4; Engram rows (12 B) likewise
        dense, experts, tables = counts["dense"][i], counts["experts"][i], counts["tables"][i]
        assert one.state[i] == pytest.approx((dense + experts) * (8 + 8 / 2) + tables * 12 / 2)
        assert two.state[i] == pytest.approx((dense + experts) * (8 + 8 / 4) + tables * 12 / 4)
        assert two.casts[i] == one.casts[i]
        # the backward's working set: per token, except the row's rotated entries and their gradient (bf16) and,
        # for a Full layer under C > 1, the all-gather's parts and their concatenation
        plan = layout.plan[i]
        rows = 0 if plan.mode.value == "window" else T // plan.ratio * 64
        rotated = 2 * rows * 2
        gather = 2 * rows * (4 if plan.ratio > 1 else 2) if plan.mode.value == "full" else 0
        assert two.transient[i] == pytest.approx((one.transient[i] - rotated) / 2 + rotated + gather), i
    assert two.kept[0] == one.kept[0] / 2


def test_lora_keeps_the_frozen_base_without_state(mini):
    """rank 4 on wq_a and the routed experts, bf16, 2 replicas x C = 2, E = 2: weights only for the base (bf16 for
    the attention projections, the shared and routed experts and the head; fp32 for the rest, the tables too, over
    the 4 ranks), full state for the adapters."""
    args, layout = mini
    lora = LoRA(4, 16.0, ("wq_a", "experts"))
    memory = estimate(args, layout, 1, T, torch.bfloat16, layout.n_layers, 2, cuda=False, expert_parallel=2,
                      context_parallel=2, lora=lora)
    counts, found = parameter_counts(args, layout), lora_counts(args, layout, lora)
    # by hand from the dims: wq_a 128x64, wq_b 64x256, wkv 128x64, wo_a 128x128, wo_b 128x128, shared expert 3x128x64
    low = 128 * 64 + 64 * 256 + 128 * 64 + 128 * 128 + 128 * 128 + 3 * 128 * 64
    low_experts = 8 * 3 * 128 * 64
    adapters, adapter_experts = 4 * (128 + 64), 8 * 3 * 4 * (128 + 64)  # r (in + out) a matrix
    head = 259 * 128
    assert found["low"] == (low,) * 9 + (low + head,) and found["low_experts"] == (low_experts,) * 10
    assert found["adapters"] == (adapters,) * 10 and found["adapter_experts"] == (adapter_experts,) * 10
    for i in range(layout.n_layers):
        dense, experts, tables = counts["dense"][i], counts["experts"][i], counts["tables"][i]
        lo = found["low"][i]
        base = 4 * (dense - lo) + 2 * lo + (4 * (experts - low_experts) + 2 * low_experts) / 2 + 4 * tables / 4
        trained = adapters * (8 + 8 / 4) + adapter_experts / 2 * (8 + 8 / 2)
        assert memory.state[i] == pytest.approx(base + trained), i
        assert memory.casts[i] == pytest.approx(2 * (dense - lo + (experts - low_experts) / 2 + adapters
                                                     + adapter_experts / 2)), i


def test_lora_and_full_memory_against_the_measured_small_moe_steps():
    """The committed one-GPU steps of small_moe at 16K (bench/results/finetune/, full fine-tuning and LoRA rank 16 on
    the attention projections, the shared and the routed experts, in one call on an H100, with the bf16 stream):
    each estimate within 10%."""
    cfg = compose(["model=small_moe", "layout=v41"])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    lora = LoRA(16, 16.0, ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts", "experts"))
    for name, settings in (("full", None), ("lora", lora)):
        measured = json.loads((ROOT / f"bench/results/finetune/train_step_small_moe_{name}_16384.json").read_text())
        memory = estimate(args, layout, 1, 16384, torch.bfloat16, layout.n_layers, lora=settings)
        peak = memory.peaks((range(layout.n_layers),), 1)[0] / 2 ** 30
        assert peak == pytest.approx(measured["peak_alloc_gib"], rel=0.10), name


def test_plan_prints_the_chunk_and_the_gathered_bytes(mini):
    args, layout = mini
    C, big = 4, 65536
    text = describe_context(args, layout, StagePlan((range(0, 5), range(5, 10))), 1, big, torch.bfloat16, C, 3,
                            recomputed=True)
    assert f"parallel.context_parallel=4: each row of 65,536 tokens in 4 chunks of 16,384 tokens" in text
    assert "(3 group(s) of 4 consecutive ranks a stage)" in text
    # Full layers 2 and 4 (m = 2, fp32 latent) and 6 (m = 1, bf16): 3/4 of the row's entries x 64 values
    gathered = {2: big // 2 * 64 * 4, 4: big // 2 * 64 * 4, 6: big * 64 * 2}
    window = (C - 1) * 31 * 64 * 2  # 3 tails of window - 1 rows of bf16 window KV
    halo = {i: window + ((C - 1) * 128 * 4 if i in (2, 4) else 0) for i in range(10)}  # + one fp32 input row, m = 2
    for i, g in gathered.items():
        assert f"layer {i} (full, m={layout.compress_ratios[i]}): all-gather {g * 3 / 4 / 2 ** 20:,.1f} MiB" in text
    for s, layers in enumerate((range(0, 5), range(5, 10))):
        fwd = sum(gathered.get(i, 0) * 3 / 4 + halo[i] for i in layers)
        assert (f"stage {s}: {fwd / 2 ** 20:,.1f} MiB received per microbatch in the forward, "
                f"{3 * fwd / 2 ** 20:,.1f} MiB with the backward and the recomputation" in text), s
    assert describe_context(args, layout, StagePlan((range(0, 10),)), 1, big, torch.bfloat16, 1, 3, True) == ""


def test_plan_cli_prints_context_and_refuses_a_world_it_does_not_divide(capsys):
    plan_main(["--world-size", "4", "model=v41_mini", "data.seq_len=256", "data.micro_batch_size=1",
               "parallel.context_parallel=2", "train.dspark_loss_coef=0"])
    out = capsys.readouterr().out
    assert "each row split over 2 context-parallel ranks" in out
    assert "each row of 256 tokens in 2 chunks of 128 tokens" in out
    assert "h                      (1, 128, 4, 128)" not in out  # one stage: no boundary
    with pytest.raises(SystemExit) as stopped:
        plan_main(["--world-size", "6", "model=v41_mini", "data.seq_len=256", "parallel.context_parallel=4",
                   "train.dspark_loss_coef=0"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: parallel.context_parallel=4 does not divide the 6 process(es) of a pipeline stage")


def test_simulated_passes_are_the_slowest_chunk_plus_the_collectives():
    """C = 2 on 2 replicas: a pass is its layers' time / 2, the growing scoring's 3/4 (the last chunk), each
    layer's all-gathers (1/2 of the gathered latent, one halo) once forward and twice backward (reduce-scatter and
    the recomputation); gradients reduced over the 4 ranks; a group of 16 crosses nodes."""
    n = 4
    layers = Layers([0.1] * n, [0.2] * n, [1e6] * n, [1e6] * n, [1000] * n, recomputed=True,
                    growing_fwd_s=[0.04, 0.0, 0.0, 0.0], gathered_bytes=[1e9, 0.0, 0.0, 0.0], halo_bytes=[1e6] * n)
    cluster = Cluster(latency_s=0.0)
    stages = (range(0, 2), range(2, 4))
    work = stage_work(layers, stages, 2, cluster, context_parallel=2)
    gathers = (0.5e9 + 1e6 + 1e6) / 300e9
    assert work[0].fwd_s == pytest.approx((0.06 / 2 + 0.04 * 3 / 4) + 0.1 / 2 + gathers)
    assert work[0].bwd_s == pytest.approx(2 * 0.2 / 2 + 2 * gathers)
    assert work[0].context_s == pytest.approx(3 * gathers)
    assert work[1].fwd_s == pytest.approx(2 * 0.1 / 2 + 2e6 / 300e9)
    assert work[0].reduce_s == pytest.approx(ring_reduce_s(2000, 4, cluster.allreduce_gbps))
    assert cluster.context_s(1e9, 16) == pytest.approx(1e9 / 50e9) and cluster.context_s(1e9, 8) == 1e9 / 300e9
    assert stage_work(layers, stages, 2, cluster, context_parallel=1)[0].fwd_s == pytest.approx(0.2)


def test_long_row_projection_scales_each_part_and_fits_planted_factors():
    """bench/context_projection.py: at 4 x the reference length the linear part grows 4 x and the indexer's growing
    part 16 x; the slowest of C = 4 ranks computes 1/4 of the first and 7/16 of the second; two steps made with
    factors 1.2 and 0.8 on those parts give the factors back."""
    sys.path.insert(0, str(ROOT / "bench"))
    import context_projection as cp

    step = json.loads(cp.STEPS[0].read_text())
    base = cp.small_base(step, json.loads(cp.INDEXER.read_text())["indexer_64k"])
    assert sum(base.linear_fwd) + sum(base.linear_bwd) + sum(base.growing) == pytest.approx(step["step_s"]
                                                                                             - cp.fixed_s(step))
    long = base.at(4 * base.length, 4)
    assert long.growing_fwd_s == pytest.approx([16 * g for g in base.growing])
    assert long.fwd_s == pytest.approx([4 * f + 16 * g for f, g in zip(base.linear_fwd, base.growing)])
    costs = cp.row_costs(long, 4)
    assert costs["compute_s"] == pytest.approx(sum(base.linear_fwd) + sum(base.linear_bwd)
                                               + 16 * sum(base.growing) * 7 / 16)
    made = [{**step, "T": T, "overrides": [*step["overrides"], f"parallel.context_parallel={C}"],
             "step_s": cp.row_costs(base.at(T, C, 1.2, 0.8), C)["step_s"]} for T, C in ((131072, 1), (262144, 2))]
    assert cp.fit([(s, base) for s in made]) == pytest.approx((1.2, 0.8))
    assert cp.fit([(step, base)]) == (1.0, 1.0)


def test_offloaded_inputs_and_the_chunked_head_in_the_memory_model():
    """``parallel.recompute_offload``: each recomputed layer's fp32 input (B x T x dim x 4 bytes; tiny: 1 x 128 x 128
    x 4) leaves the retained bytes and two of them join the backward's transient. ``parallel.head_chunk``: the last
    layer's transient is at least 16 bytes per token and vocabulary entry of the head's logits (vocab 100,000 here),
    of a chunk when chunked (catches an offload that is not subtracted, a head counted per chunk of the wrong size)."""
    import torch
    from model import ModelArgs, layout_from_config
    from model.cli import compose
    from parallel.memory import HEAD_BYTES, estimate

    cfg = compose(["model=tiny", "model.vocab_size=100000"])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    n = layout.n_layers
    plain = estimate(args, layout, 1, 128, torch.float32, n, cuda=False)
    offloaded = estimate(args, layout, 1, 128, torch.float32, n, cuda=False, offload_inputs=True)
    chunked = estimate(args, layout, 1, 128, torch.float32, n, cuda=False, head_chunk=32)
    stream = 128 * 128 * 4
    assert [p - o for p, o in zip(plain.retained, offloaded.retained)] == [stream] * n
    assert [o - p for p, o in zip(plain.transient[:-1], offloaded.transient[:-1])] == [2 * stream] * (n - 1)
    assert plain.transient[-1] == HEAD_BYTES * 128 * 100000 and chunked.transient[-1] == HEAD_BYTES * 32 * 100000
