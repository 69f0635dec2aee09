"""bench/v41_slice.py's expert-parallel arithmetic, its rank MoE's wiring and its FLOP count, against counts worked
out here by hand; with them model/flops.py's ``layers`` (the attention terms of a slice of the stack)."""
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from model import ModelArgs, layout_from_config  # noqa: E402
from model.cli import compose  # noqa: E402
from model.config import MoEArgs  # noqa: E402
from model.flops import model_flops  # noqa: E402
from model.moe import MoE  # noqa: E402
from model.transformer import Transformer  # noqa: E402
import v41_slice  # noqa: E402
from v41_slice import StandInDispatch, expert_split, rank_rows, slice_flops, source_split  # noqa: E402


def test_rows_a_v41_rank_receives():
    """16 ranks of 65,536 tokens route top-6 over 384 experts; a rank holds 24 (1/16): it receives 1/16 of the
    16 x 393,216 slots, as many as its own tokens send; its own tokens alone give it 1/16 of those."""
    assert rank_rows(65536, 6, 384, 24, senders=16) == 393216
    assert rank_rows(65536, 6, 384, 24, senders=1) == 24576
    with pytest.raises(ValueError, match="whole number"):
        rank_rows(100, 6, 384, 24, senders=1)  # 37.5 rows


def test_expert_splits():
    assert expert_split(24576, 24, "uniform") == [1024] * 24
    skewed = expert_split(393216, 24, "skewed")
    assert sum(skewed) == 393216 and skewed == sorted(skewed, reverse=True)
    share_of_first = 1 / sum(e ** -0.5 for e in range(1, 25))  # (e + 1)^-0.5 normalised, e = 0
    assert skewed[0] / 393216 == pytest.approx(share_of_first, rel=1e-3)
    with pytest.raises(ValueError, match="split evenly"):
        expert_split(25, 24, "uniform")


def test_senders_shares():
    """Expert 0's 3 rows over 2 senders: 2 and 1; expert 1's one row from the first sender."""
    assert source_split([3, 1, 0], senders=2) == [[2, 1, 0], [1, 0, 0]]
    assert [sum(col) for col in zip(*source_split([17, 5, 9], senders=4))] == [17, 5, 9]


def swiglu_expert(x, w1, w2, w3, limit, weight=1.0):
    """One SwiGLU expert in fp64, SPEC §5.1: W2 (silu(min(W1 x, L)) * clamp(W3 x, -L, L) * w)."""
    g, u = x @ w1.T, x @ w3.T
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (torch.nn.functional.silu(g) * u * weight) @ w2.T


def reference_rank_moe(moe, x, by_source):
    """What the stand-in dispatch computes, worked out slot by slot in fp64: the rank's slots sorted by expert
    (stably), their rows and weights; the receive buffer is the first R of those (the stand-in's filling); received
    row i goes sender by sender, expert by expert to held expert ``arrival[i]``; the rows coming back are the
    outputs in arrival order, repeated to one per slot sent; each is added into its slot's token; plus the shared
    expert."""
    k, limit = moe.args.n_activated_experts, moe.args.swiglu_limit
    weights, indices = (t.detach() for t in moe.gate(x))
    slots = sorted(range(indices.numel()), key=lambda s: (indices.flatten()[s].item(), s))
    token = [s // k for s in slots]
    x64 = x.detach().double()
    arrival = [e for per_expert in by_source for e, n in enumerate(per_expert) for _ in range(n)]
    w = {name: getattr(moe.experts, name).detach().double() for name in ("w1", "w2", "w3")}
    outs = [swiglu_expert(x64[token[i]], w["w1"][e], w["w2"][e], w["w3"][e], limit,
                          weights.flatten()[slots[i]].double()) for i, e in enumerate(arrival)]
    y = torch.zeros_like(x64)
    for s, t in enumerate(token):
        y[t] += outs[s % len(outs)]
    shared = moe.shared_experts
    return y + swiglu_expert(x64, shared.w1.weight.double(), shared.w2.weight.double(), shared.w3.weight.double(),
                             limit)


@pytest.fixture
def rank_moe():
    """Rank 0 of 4 holding experts 0-1 of 8 (top-2); it receives 3 rows of expert 0 and 2 of expert 1 from 3
    senders: arrival order experts [0, 1, 0, 1, 0], expert order rows [0, 2, 4, 1, 3] (not its own inverse)."""
    torch.manual_seed(0)
    args = MoEArgs(n_routed_experts=8, n_activated_experts=2, inter_dim=8, swiglu_limit=1.0)

    def build(grouped=None):
        dispatch = StandInDispatch(4, grouped=grouped)
        moe = MoE(16, args, "torch", dispatch.experts_of(8), dispatch)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(p.numel()))
        dispatch.set_split([3, 2], senders=3, device=torch.device("cpu"))
        return moe
    return build


def test_stand_in_dispatch_against_the_slots_worked_out_by_hand(rank_moe):
    moe = rank_moe()
    assert moe.experts.expert_ids == range(0, 2)
    seen = {}
    moe.experts.register_forward_hook(lambda module, inputs, out: seen.update(counts=inputs[1].tolist()))
    x = torch.randn(5, 16, requires_grad=True)
    y = moe(x)
    assert seen["counts"] == [3, 2]
    torch.testing.assert_close(y, reference_rank_moe(moe, x, source_split([3, 2], 3)).float())  # fp32's tolerance
    y.square().sum().backward()
    assert all(t.grad is not None for t in (x, moe.gate.weight, moe.experts.w1, moe.shared_experts.w2.weight))


def test_stand_in_dispatch_on_the_gpu_path_grouped_mm_in_bf16(rank_moe, monkeypatch):
    """The GPU's path on the CPU: bf16 autocast and one grouped_mm for w1 and w3 (stacked), one for w2 (the rows of
    16 bytes it needs)."""
    calls = []
    grouped_mm = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **kw: calls.append(1) or grouped_mm(*a, **kw))
    moe = rank_moe(grouped=True)
    x = torch.randn(5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert len(calls) == 2 and y.dtype == torch.float32
    expected = reference_rank_moe(moe, x, source_split([3, 2], 3))
    torch.testing.assert_close(y.double(), expected, atol=2e-2 * expected.abs().max().item(), rtol=2e-2)
    y.square().sum().backward()
    assert all(getattr(moe.experts, name).grad is not None for name in ("w1", "w2", "w3"))


@pytest.fixture(scope="module")
def v41_tiny():
    cfg = compose(["model=v41_mini", "layout=v41", "model.moe.n_routed_experts=384", "model.moe.n_activated_experts=6"])
    return ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)


def test_attention_terms_of_a_slice(v41_tiny):
    """Layers 20-23 at T = 40 counted by hand: m = 1, each query t sees min(W, t+1) window slots and min(K, t+1)
    selected entries; layer 20's indexer (the candidate source, unrestricted) scores all t+1 entries and its
    student logits the K selected; the slices of 4 layers add up to the whole stack."""
    args, layout = v41_tiny
    T, W, K = 40, args.window_size, args.index_topk
    H, D, HI = args.n_heads, args.head_dim, args.index_n_heads * args.index_head_dim
    counts = model_flops(nn.Module(), layout, args, T, 1, layers=range(20, 24))
    slots = sum(min(W, t + 1) + min(K, t + 1) for t in range(T))
    assert counts["attention"] == 4 * 3 * 4 * H * D * slots
    assert counts["indexer"] == 2 * HI * sum(t + 1 for t in range(T)) + 3 * 2 * HI * sum(min(K, t + 1) for t in range(T))
    whole = model_flops(nn.Module(), layout, args, T, 1)
    by_slice = [model_flops(nn.Module(), layout, args, T, 1, layers=range(s, s + 4)) for s in range(0, 40, 4)]
    for term in ("attention", "indexer"):
        assert sum(c[term] for c in by_slice) == whole[term]


def test_slice_flops_count_the_routed_experts_at_the_rows_received(v41_tiny):
    """``model_flops`` counts 24 held of 384 experts as the share of the slice's own T tokens (T x 6 x 24 / 384
    rows a layer); ``slice_flops`` replaces that with the rows received: 18 x rows x dim x inter a layer."""
    args, layout = v41_tiny
    T, layers = 128, range(24, 28)
    with torch.device("meta"):
        model = Transformer(args, layout, layer_ids=layers, init=False, experts=StandInDispatch(16))
    own = T * 6 * 24 // 384
    assert slice_flops(model, layout, args, layers, T, own)["total"] == \
        model_flops(model, layout, args, T, 1, layers=layers)["total"]
    many = slice_flops(model, layout, args, layers, T, 16 * own)
    assert many["routed"] == 4 * 18 * 16 * own * args.dim * args.moe.inter_dim
    assert many["total"] - slice_flops(model, layout, args, layers, T, own)["total"] == \
        4 * 18 * 15 * own * args.dim * args.moe.inter_dim


# ------------------------------------------------------------------------------------- the script, end to end

def run_script(tmp_path, monkeypatch, *argv) -> dict:
    """``python bench/v41_slice.py --smoke --tokens 64 ...`` in this process; the file it writes."""
    out = tmp_path / "slice.json"
    monkeypatch.setattr(sys, "argv", ["bench/v41_slice.py", "--smoke", "--tokens", "64", "--out", str(out), *argv])
    assert v41_slice.main() == 0
    return json.loads(out.read_text())


def test_smoke_on_the_gpu_path_reports_every_part(tmp_path, monkeypatch, one_thread):
    """Both slices under bf16 autocast with grouped_mm (the GPU's code but for the Triton kernels and CUDA events):
    64 tokens x top-6 x 4 held / 64 experts = 24 rows a layer from the rank's own tokens, 16 x 24 from 16 ranks;
    the second slice reads layer 20's latent and candidate blocks and recomputes its index keys; the stand-in is
    one part of 3 calls a layer; the FLOPs, MFU and grouped-GEMM efficiency follow from the file's own numbers."""
    monkeypatch.setenv("CSA2_CODE", "code-under-test")
    res = run_script(tmp_path, monkeypatch, "--bf16", "--splits", "own_tokens,uniform", "--modes", "layer")
    assert res["code"] == "code-under-test" and res["machine"] == "cpu" and res["date"] and "--bf16" in res["command"]
    assert [s["layers"] for s in res["slices"]] == [[20, 21, 22, 23], [24, 25, 26, 27]]
    second = res["slices"][1]
    assert set(second["reads"]) == {"kv[20]", "candidates[20]"} and second["shadow_index_keys"] == [20]
    args = ModelArgs.from_config(compose(v41_slice.SMOKE).model)
    dense = {r["rows"]: r["dense_ms"] for r in res["routed_standalone"] if "dense_ms" in r}
    for entry in res["slices"]:
        assert [(r["recompute"], r["split"], r["rows_per_layer"]) for r in entry["runs"]] == \
            [("layer", "own_tokens", 24), ("layer", "uniform", 384)]
        for run in entry["runs"]:
            rows, s, parts = run["rows_per_layer"], run["summary"], run["parts"]["parts"]
            assert run["flops"]["routed"] == 4 * 18 * rows * args.dim * args.moe.inter_dim
            assert run["mfu_vs_measured_matmul"] == pytest.approx(
                run["flops"]["total"] / run["step_ms"] / 1e9 / res["matmul_bf16"]["tflops"])
            assert set(s) >= {f"{p}_ms" for p in v41_slice.PARTS} and run["parts"]["anomalies"] == 0
            assert parts["all_to_all_standin"]["forward_spans"] == 3 * 4 and parts["routed"]["forward_spans"] == 4
            assert parts["all_to_all_standin"]["recompute_spans"] == 3 * 4
            assert sum(s[f"{p}_ms"] for p in v41_slice.PARTS) == pytest.approx(run["parts"]["step_ms"])
            assert s["grouped_gemm_efficiency"] == pytest.approx(4 * dense[rows] / s["routed_fwd_bwd_ms"])
            assert run["fwd_ms"] + run["bwd_ms"] == pytest.approx(run["step_ms"])


def test_out_of_memory_is_recorded_and_runs_needing_as_much_are_skipped(tmp_path, monkeypatch, one_thread):
    """A step that runs out of memory at 384 rows a layer: that run records the error, skewed (384 rows) is
    skipped, keep_attention at 24 rows still runs; with no time left nothing runs and the file says why."""
    step = v41_slice.Slice.step

    def step_or_oom(self, clock):
        if self.dispatch.received.sum() >= 384:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return step(self, clock)
    monkeypatch.setattr(v41_slice.Slice, "step", step_or_oom)
    runs = run_script(tmp_path, monkeypatch, "--slices", "20-23")["slices"][0]["runs"]
    assert [(r["recompute"], r["split"]) for r in runs] == [("layer", "own_tokens"), ("layer", "uniform"),
                                                            ("layer", "skewed"), ("keep_attention", "own_tokens")]
    assert "step_ms" in runs[0] and "step_ms" in runs[3]
    assert runs[1]["error"].startswith("OutOfMemoryError") and "step_ms" not in runs[1]
    assert "ran out of memory" in runs[2]["skipped"]
    late = run_script(tmp_path, monkeypatch, "--slices", "20-23", "--splits", "own_tokens", "--time-limit", "0")
    assert ["time-limit" in r["skipped"] for r in late["slices"][0]["runs"]] == [True, True]
    assert late["matmul_bf16"]["tflops"] > 0 and late["routed_standalone"]
