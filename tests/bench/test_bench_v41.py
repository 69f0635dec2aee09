"""Issue 34's benchmark helpers: the tokens per expert of bench/train_step.py and the health verdicts of
bench/health_criteria.py, on hand-made inputs whose answers are worked out here."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from health_criteria import criteria  # noqa: E402
from train_step import tokens_per_expert  # noqa: E402


def test_tokens_per_expert_per_layer_and_overall():
    """Two layers of 4 experts, 8 tokens top-2 = 16 slots each: the mean is 4; layer 1 leaves an expert idle; a
    layer whose loads do not sum to the slots (loads of another step, say) says so."""
    loads = {"layers.0.ffn": [4, 4, 4, 4], "layers.1.ffn": [10, 0, 3, 3], "layers.2.ffn": [4, 4, 4, 5]}
    result = tokens_per_expert(loads, slots=16)
    assert (result["mean"], result["experts"], result["min"], result["max"]) == (4, 4, 0, 10)
    assert result["layers_with_an_idle_expert"] == 1
    layer1 = result["per_layer"]["layers.1.ffn"]
    assert layer1 == {"min": 0, "max": 10, "max_over_mean": 2.5, "zero_experts": 1}
    assert "slots_counted" not in result["per_layer"]["layers.0.ffn"]
    assert result["per_layer"]["layers.2.ffn"]["slots_counted"] == 17


def row(step, lm_loss, grad_norm=1.0, **groups):
    return {"step": step, "lm_loss": lm_loss, "grad_norm": grad_norm,
            **{f"grad_norm/{g}": v for g, v in groups.items()}}


def evaluation(step, lm_loss):
    return {"step": step, "lm_loss": lm_loss, "split": "eval"}


HEALTHY = [row(1, 5.5, head=2.0, ffn=1.0, hc=0.1), row(2, 5.4), row(3, 5.0), row(4, 4.9), evaluation(2, 5.3),
           row(5, 4.5), row(6, 4.4), evaluation(4, 4.8), evaluation(6, 4.3)]


def test_a_healthy_run():
    result = criteria(HEALTHY, warmup_steps=4)
    assert result["init"]["holds"] and result["init"]["largest_other"] == "ffn"
    assert result["init"]["ratio_to_head"] == 0.5
    assert result["warmup"]["holds"] and result["warmup"]["evaluations"] == 2  # step 6 is after the warm-up
    assert result["after_warmup"]["healthy"] and result["healthy"]
    assert result["heldout_lm_loss_last"] == 4.3


def test_a_group_above_the_head_at_init_fails():
    rows = [row(1, 5.5, head=2.0, ffn=1.0, attn_out=2.5), *HEALTHY[1:]]
    result = criteria(rows, warmup_steps=4)
    assert not result["init"]["holds"] and result["init"]["largest_other"] == "attn_out"
    assert not result["healthy"]


@pytest.mark.parametrize("losses, rises", [((5.6, 4.8), [(2, 5.6)]),  # above step 1's training loss
                                           ((5.3, 5.3), [(4, 5.3)])])  # held, not lowered
def test_a_warmup_that_raises_or_holds_the_heldout_loss_fails(losses, rises):
    rows = [r for r in HEALTHY if r.get("split") != "eval"] + [evaluation(2, losses[0]), evaluation(4, losses[1])]
    result = criteria(rows, warmup_steps=4)
    assert not result["warmup"]["holds"] and result["warmup"]["rises"] == rises
    assert not result["healthy"]


def test_no_evaluation_inside_the_warmup_is_no_verdict():
    rows = [r for r in HEALTHY if r.get("split") != "eval"] + [evaluation(6, 4.3)]
    result = criteria(rows, warmup_steps=4)
    assert result["warmup"]["evaluations"] == 0 and not result["warmup"]["holds"] and not result["healthy"]


def test_a_run_cut_inside_the_warmup_is_judged_on_what_ran():
    result = criteria([r for r in HEALTHY if r["step"] <= 3], warmup_steps=4)
    assert "after_warmup" not in result and result["healthy"] and result["steps"] == 3
    assert criteria([], warmup_steps=4)["healthy"] is False
    assert math.isnan(criteria([row(1, 5.5, head=1.0)], warmup_steps=4)["heldout_lm_loss_last"])
