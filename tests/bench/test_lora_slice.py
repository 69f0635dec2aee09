"""bench/lora_slice.py in its smoke mode on the CPU: the quantised run's base is held as released and never built in
full precision, both bases compute the same function (their adapters' gradients agree), the LoRA FLOPs count the
frozen matrices without their weight gradients (worked out here by hand), and an out-of-memory run is recorded."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import lora_slice  # noqa: E402
import v41_slice  # noqa: E402
from model import ModelArgs, layout_from_config  # noqa: E402
from model.cli import compose  # noqa: E402
from model.config import LoRA  # noqa: E402
from model.quantized_base import QuantizedMatrix  # noqa: E402
from tests.support.float_shapes import FloatShapes  # noqa: E402


def run_script(tmp_path, *argv) -> dict:
    out = tmp_path / "lora_slice.json"
    assert lora_slice.main(["--smoke", "--out", str(out), *argv]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def smoke():
    cfg = compose(v41_slice.SMOKE)
    return ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)


def test_both_bases_compute_the_same_step_and_the_quantised_one_holds_the_release(tmp_path, one_thread, smoke):
    """Layers 20-23 then 24-27 (reading 20's latent and candidates), each over both bases. Per layer the release
    stores 8 FP8 matrices (wq_a, wq_b, wkv, wo_a, wo_b, shared w1-w3) and the indexer's wq_b in a selecting layer (20,
    24), and 3 FP4 stacks of the rank's 8 of 64 experts: the quantised stage holds all of them quantised and none in
    floating point, the bf16 one all in floating point. The quantised base is the dequantised one's values, so the
    adapters' gradients agree to fp32's summation order. The routed FLOPs per row and layer: the frozen w1, w2, w3 at
    4 per value (no weight gradient), their adapters (r x (dim + inter) values each) at 6."""
    args, _ = smoke
    res = run_script(tmp_path)
    dim, inter, r = args.dim, args.moe.inter_dim, 16
    rows = 8 * 64 * 6 * 8 // 64
    assert res["T"] == 64 and res["plan"]["expert_parallel"] == 8 and res["expert_parallel"]["held"] == [0, 7]
    assert [s["layers"] for s in res["slices"]] == [[20, 21, 22, 23], [24, 25, 26, 27]]
    for entry in res["slices"]:
        runs = {run["base"]: run for run in entry["runs"]}
        assert list(runs) == ["quantized", "bf16"] and all("step_ms" in run for run in runs.values())
        q, b = runs["quantized"], runs["bf16"]
        assert q["base_held"]["quantized_matrices"] == {"fp8": 4 * 8 + 1, "fp4": 4 * 3}
        assert q["base_held"]["fp4_expert_matrices"] == 4 * 3 * 8
        assert q["base_held"]["base_in_floating_point"] == 0
        assert b["base_held"]["base_in_floating_point"] == 4 * 8 + 1 + 4 * 3 * 8
        assert b["base_held"]["quantized_matrices"] == {"fp8": 0, "fp4": 0}
        assert q["base_held"]["frozen_gib"] < b["base_held"]["frozen_gib"] / 2
        assert q["base_held"]["adapter_params"] == b["base_held"]["adapter_params"] > 0
        assert q["adapter_grad_norm"] > 0
        for run in (q, b):  # AdamW's two fp32 moments of every adapter parameter, held through the measured steps
            assert run["optimizer_state_gib"] * 2 ** 30 == 8 * run["base_held"]["adapter_params"]
        assert q["adapter_grad_norm"] == pytest.approx(b["adapter_grad_norm"], rel=1e-5)
        assert q["rows_per_layer"] == rows and q["flops"] == b["flops"]
        assert q["flops"]["routed"] == rows * 4 * (3 * 4 * dim * inter + 3 * 6 * r * (dim + inter))
        ratio = entry["quantized_over_bf16"]
        assert ratio["step_ms"] == pytest.approx(q["step_ms"] / b["step_ms"])
        est = entry["estimate"]
        assert est["quantized"]["as_run"]["state_gib"] < est["bf16"]["as_run"]["state_gib"]
        assert est["quantized"]["plan"]["state_gib"] == est["quantized"]["as_run"]["state_gib"]
        assert est["quantized"]["plan"]["seq_len"] == 8 * est["quantized"]["as_run"]["seq_len"] == 8 * 64


def test_the_quantised_slice_is_never_built_in_full_precision(one_thread, smoke):
    """No floating-point tensor of a routed stack's shape is ever made while the quantised slice is built, filled
    and adapted (each expert's matrix is drawn alone, as a writer of the release would); the bf16 slice makes them."""
    args, layout = smoke
    lora = LoRA(rank=16, targets=lora_slice.TARGETS, quantized_base=True)
    build = [args, layout, range(24, 28), v41_slice.StandInDispatch(8), 0]
    with FloatShapes() as seen:
        model = lora_slice.quantized_layers(lora, None, *build)
    stacks = {tuple(m.shape) for m in model.modules() if isinstance(m, QuantizedMatrix) and m.experts > 1}
    assert len(stacks) == 2 and not seen.shapes & stacks
    with FloatShapes() as seen:
        lora_slice.bf16_layers(lora, None, *build)
    assert stacks <= seen.shapes


def test_a_run_out_of_memory_is_recorded_and_the_other_base_still_runs(tmp_path, monkeypatch, one_thread):
    step = v41_slice.Slice.step

    def step_or_oom(self, clock):
        if any(isinstance(m, QuantizedMatrix) for m in self.model.modules()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return step(self, clock)
    monkeypatch.setattr(v41_slice.Slice, "step", step_or_oom)
    entry = run_script(tmp_path, "--slices", "20-23")["slices"][0]
    q, b = entry["runs"]
    assert q["out_of_memory"] and q["error"].startswith("OutOfMemoryError") and "step_ms" not in q
    assert "step_ms" in b and "quantized_over_bf16" not in entry


@pytest.mark.parametrize("argv, message", [
    (["--bases", "fp8"], "--bases fp8: use some of quantized,bf16"),
    (["--slices", "4-7"], "--slices 4-7: layers [5] hold Engram tables"),  # smoke: Engram in 1 and 5
    (["--tokens", "63"], "378 rows do not split evenly over 8 experts")])
def test_bad_input_is_a_one_line_error_before_anything_is_built(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        lora_slice.main(["--smoke", "--out", str(tmp_path / "x.json"), *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_optimizer_state_is_held_and_the_weights_do_not_move():
    """``hold_optimizer_state`` allocates AdamW's moments: both for every trained parameter, none for a frozen one,
    and no weight moves by a bit (a step at another rate, or over real gradients, would move them)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model[0].weight.requires_grad_(False)  # a frozen base matrix
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = lora_slice.hold_optimizer_state(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert set(optimizer.state) == set(trained)
    assert lora_slice.state_gib(optimizer) * 2 ** 30 == 8 * sum(p.numel() for p in trained)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None, n
