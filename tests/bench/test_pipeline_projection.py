"""bench/pipeline_projection.py after the two-GPU run: the calibration recovers what a run was made of, the check
compares each 2-stage step with its own simulation, and the docs block is rewritten in place.

The "run" here is synthetic, in the GPU result's format: the simulator's steps of ``small`` whose layer times are
the committed v5 file's times 1.1 plus 0.3 s of optimizer. Calibrating on its 1-stage steps must give back the
factor 1.1 and the 0.3 s exactly (the 1-stage step is linear in M: its slope and intercept), and then every
2-stage step, simulated at the run's cuts and transfer mode, must match (error 0)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import pipeline_projection as pp  # noqa: E402
from parallel.balance import LayerTimes  # noqa: E402
from parallel.simulate import Layers  # noqa: E402

TFLOPS, SCALE, OPTIMIZER_S, CUTS = 786.0, 1.1, 0.3, [21]


@pytest.fixture(scope="module")
def run():
    times = LayerTimes.load(str(pp.V5_TIMES))
    shaped = pp.layer_inputs("small", times, 0.0, TFLOPS, SCALE)
    true = Layers(shaped.fwd_s, shaped.bwd_s, shaped.boundary_bytes, shaped.gradient_bytes, shaped.params,
                  OPTIMIZER_S * 2 / sum(shaped.params))  # 2 data-parallel replicas share the optimizer step
    two = pp.two_gpus(pp.Cluster())

    def step(stages, dp, M, p2p="overlap"):
        r = pp.project("small", true, stages, dp, M, two, p2p, CUTS if stages == 2 else None)
        return {"microbatches": M, "p2p": p2p, "step_s": r["step_s"],
                "per_rank": [{"bubble": b, "peak_allocated_gib": g} for b, g in zip(r["bubble"], r["peak_gib"])]}

    single = [step(1, 2, 2), step(1, 2, 4)]
    slope = (single[1]["step_s"] - single[0]["step_s"]) / 2
    measured = {"sections": {
        "single": {"steps": single, "data_parallel": 2, "per_microbatch_s": slope,
                   "fixed_s": single[0]["step_s"] - 2 * slope},
        "transfer": {"index_k": {"shadow": {"activations": {"gbps": pp.Cluster.p2p_gbps}}}},
        "pipeline": {"cuts": CUTS, "steps": [step(2, 1, 8), step(2, 1, 4)], "before": step(2, 1, 4, "deepspeed")}}}
    return measured, times


def test_calibration_recovers_the_layer_scale_and_optimizer(run):
    measured, times = run
    layers, calibration = pp.calibrate(measured, times, TFLOPS)
    assert calibration["layer_times_scale"] == pytest.approx(SCALE, rel=1e-9)
    assert calibration["optimizer_s"] == pytest.approx(OPTIMIZER_S, rel=1e-9)
    assert pp.measured_p2p_gbps(measured) == pp.Cluster.p2p_gbps
    rows = pp.check_against(measured, layers, pp.Cluster(), times)
    assert [r["fitted"] for r in rows] == [True, True, False, False, False]
    assert rows[-1]["what"] == "2 stages, M=4, p2p=deepspeed"
    for r in rows:
        assert r["error"] == pytest.approx(0, abs=1e-9)
        assert r.get("predicted_bubble") == r.get("measured_bubble") or \
            r["predicted_bubble"] == pytest.approx(r["measured_bubble"])
    error = pp.calibration_error(rows)
    assert error["steps"] == 3 and error["max_abs_step_error"] < 1e-9


def test_check_reports_a_slower_run_as_its_error(run):
    measured, times = run
    slow = json.loads(json.dumps(measured))
    slow["sections"]["pipeline"]["steps"][0]["step_s"] *= 1.25  # the M=8 step ran 25% slower than simulated
    layers, _ = pp.calibrate(slow, times, TFLOPS)
    rows = pp.check_against(slow, layers, pp.Cluster(), times)
    assert rows[2]["error"] == pytest.approx(1 / 1.25 - 1)
    assert pp.calibration_error(rows)["max_abs_step_error"] == pytest.approx(0.2)


def test_docs_block_is_replaced_in_place(tmp_path, run):
    measured, times = run
    layers, _ = pp.calibrate(measured, times, TFLOPS)
    check = pp.check_against(measured, layers, pp.Cluster(), times)
    rows = [pp.project("small", layers, stages, dp, M, pp.Cluster(), measured=times)
            for stages, dp in ((1, 8), (2, 4)) for M in (8, 32)]
    result = {"command": "python bench/pipeline_projection.py", "date": "2026-11-30", "times": "t.json",
              "measured": "m.json", "measured_check": check, "calibration_error": pp.calibration_error(check),
              "rows": rows}
    doc = tmp_path / "PERF.md"
    doc.write_text(f"# before\n{pp.DOCS_BEGIN}\nold table\n{pp.DOCS_END}\nafter\n")
    pp.write_docs(doc, result)
    text = doc.read_text()
    assert text.startswith("# before\n") and text.endswith(f"{pp.DOCS_END}\nafter\n") and "old table" not in text
    assert "| 2 stages, M=8, p2p=overlap | " in text and "| small | 8 (1) | 2 x 4 |" in text
    pp.write_docs(doc, result)  # again: the same text (the block is found by its markers)
    assert doc.read_text() == text
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="needs one"):
        pp.write_docs(doc, result)


def test_keep_prediction_adds_measured_growth_to_the_last_stage_only(run):
    """keep_attention_layers=[0,k] on the synthetic run: stage 0's peak stays, stage 1's grows by k x the growth per
    kept layer of the committed one-GPU steps (15.4 GiB over 4 layers), and each kept layer shortens the step (its
    backward no longer re-runs attention), by at most its saving per microbatch."""
    measured, times = run
    for s in measured["sections"]["pipeline"]["steps"]:
        s["stages"] = 2
    layers, _ = pp.calibrate(measured, times, TFLOPS)
    out = pp.keep_prediction(measured, layers, pp.Cluster(), max_keep=2)
    peaks = measured["sections"]["pipeline"]["steps"][0]["per_rank"]
    growth = out["peak_gib_per_kept_layer"]
    assert growth == pytest.approx((100.4073600769043 - 85.00105667114258) / 4)
    assert out["prediction"] and [r["keep_attention_layers"] for r in out["rows"]] == [[0, 0], [0, 1], [0, 2]]
    for k, row in enumerate(out["rows"]):
        assert row["peak_gib"] == pytest.approx([peaks[0]["peak_allocated_gib"],
                                                 peaks[1]["peak_allocated_gib"] + k * growth])
    steps = [r["step_s"] for r in out["rows"]]
    assert steps[0] > steps[1] > steps[2] >= steps[0] - 2 * 8 * out["saving_s_per_kept_layer"]
