"""The routing checker (train/routing_criteria.py) on synthetic metrics.jsonl rows: a healthy run passes, each way
of failing is caught and named, and the loss comparison reads the dense run at the same step."""
import json

import pytest

from train import routing_criteria
from train.routing_criteria import criteria

LAYERS = ("layer0", "layer1", "layer2")


def row(step, loads, idle=(0, 0, 0), lm_loss=3.0):
    r = {"step": step, "lm_loss": lm_loss, "tokens_per_step": 16384}
    for layer, load, n in zip(LAYERS, loads, idle):
        r.update({f"moe/{layer}/load_max_over_mean": load, f"moe/{layer}/idle_experts": n,
                  f"moe/{layer}/load_entropy": 3.0, f"moe/{layer}/bias_min": 0.0, f"moe/{layer}/bias_max": 0.0})
    return r


def run(first=(1.5, 1.9, 2.0), late=(1.2, 1.25, 1.3), steps=300, **late_kw):
    """Every step logged: step 1 with ``first``, the last 100 with ``late``, the others 1.6."""
    return [row(1, first)] + [row(s, late if s > steps - 100 else (1.6,) * 3, **(late_kw if s > steps - 100 else {}))
                              for s in range(2, steps + 1)]


def test_a_healthy_run_passes():
    """At the limits exactly (2.0 at step 1, 1.3 averaged at the end): healthy. Planted: < instead of <= (fails)."""
    result = criteria(run())
    assert result["healthy"] and result["init"]["holds"] and result["end"]["holds"]
    assert result["init"]["worst_layer"] == "layer2" and result["end"]["rows"] == 100


def test_collapse_at_step_one_fails_naming_the_layer():
    """Planted: the init limit checked on the mean over layers instead of every layer (1.63 < 2: passes)."""
    result = criteria(run(first=(1.0, 1.0, 2.9)))
    assert not result["healthy"] and result["init"]["layers_over"] == {"layer2": 2.9}


def test_the_end_is_averaged_over_the_last_window_per_layer():
    """One layer at 1.4 over the last 100 steps fails; a spike of one row that keeps the average under 1.3 passes;
    the 1.6 before the window does not count. Planted: the average over the whole run (the 1.6 counts: fails)."""
    assert criteria(run(late=(1.2, 1.2, 1.4)))["end"]["layers_over"] == {"layer2": pytest.approx(1.4)}
    rows = run()
    rows[-50][f"moe/layer0/load_max_over_mean"] = 3.0  # one spike: layer0 averages 1.2 + 1.8 / 100 = 1.218
    assert criteria(rows)["end"]["holds"]


def test_an_idle_expert_at_the_end_fails():
    rows = run()
    rows[-3][f"moe/layer1/idle_experts"] = 2
    end = criteria(rows)["end"]
    assert not end["holds"] and end["idle"] == {f"layer1@{rows[-3]['step']}": 2}


def test_missing_series_cannot_pass():
    """No step-1 row (log_every > 1), a run shorter than the window, rows without idle_experts: each fails with a
    reason, not silently."""
    assert "step 1" in criteria(run()[9::10])["init"]["why"]
    assert "fewer than the window" in criteria(run(steps=60))["end"]["why"]
    rows = run()
    for r in rows:
        for layer in LAYERS:
            del r[f"moe/{layer}/idle_experts"]
    end = criteria(rows)["end"]
    assert not end["holds"] and "idle experts not logged" in end["why"]


def test_loss_against_the_dense_run_at_the_same_step():
    """The last held-out evaluation both runs have, else the training losses of the last window both logged."""
    moe, dense = run(), [row(s, (1.0,) * 3, lm_loss=3.5) for s in range(1, 301)]
    loss = criteria(moe, dense)["loss"]
    assert loss["below_dense"] and loss["train_lm_loss"] == 3.0 and loss["dense_train_lm_loss"] == 3.5
    moe.append({"step": 200, "split": "eval", "lm_loss": 2.6})
    dense += [{"step": 200, "split": "eval", "lm_loss": 2.5}, {"step": 300, "split": "eval", "lm_loss": 2.0}]
    loss = criteria(moe, dense)["loss"]
    assert loss["step"] == 200 and loss["below_dense"] is False and loss["dense_heldout_lm_loss"] == 2.5


def test_persistent_imbalance_sums_the_loads_before_max_over_mean(tmp_path, capsys):
    """Four experts: in layer0 expert 0 takes half the slots at every step (persistent: summed max/mean 2.0); in
    layer1 the busy expert turns with the step (per step 2.0 too, summed 1.0: the rows' own spread). Only the last
    ``window`` steps count (an early busy expert 3 in layer1 is outside it). Planted: the per-step max/mean averaged
    instead of the summed loads' (layer1 2.0), or the whole run summed (layer1 over 1.0): each fails. The command line
    reads experts.jsonl beside metrics.jsonl."""
    def loads(step):
        turning = [0.5] * 4
        turning[step % 4 if step > 200 else 3] = 2.0
        return {"step": step, "loads": {"layer0": [2.0, 0.5, 1.0, 0.5], "layer1": turning}}

    rows = [loads(s) for s in range(1, 301)]
    persistent = criteria(run(), loads=rows, window=100)["persistent"]
    assert persistent["steps"] == [201, 300] and persistent["rows"] == 100
    assert persistent["summed_max_over_mean"] == {"layer0": 2.0, "layer1": 1.0}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run()))
    (tmp_path / "experts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert routing_criteria.main([str(tmp_path)]) == 0  # reported, not judged
    assert json.loads(capsys.readouterr().out)["persistent"]["summed_max_over_mean"]["layer1"] == 1.0


def test_command_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run(first=(3.0, 1.0, 1.0))))
    assert routing_criteria.main([str(tmp_path)]) == 1
    assert json.loads(capsys.readouterr().out)["init"]["layers_over"] == {"layer0": 3.0}
    assert routing_criteria.main([str(tmp_path / "missing")]) == 2
