"""The V4.1 parts' settings (issue 34, "Bad input"): an inconsistent model is one line naming the setting, before any
engine or weight exists; and the switches compose as an ablation."""
import subprocess
import sys
from pathlib import Path

import pytest

from model.cli import compose
from train.run.preflight import planned

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("override, message", [
    ("model.moe.n_activated_experts=9", "model.moe.n_activated_experts=9 (top-k) must be in 1..model.moe."
                                        "n_routed_experts=8"),
    ("model.dspark.n_activated_experts=5", "model.dspark.n_activated_experts=5 (top-k) must be in 1..model.dspark."
                                           "n_routed_experts=4"),
    ("model.engram.layers=[1,12]", "model.engram.layers=[1, 12] names layer(s) [12] outside the stack's layers 0..9"),
    ("model.dspark.target_layers=[7,8,10]", "model.dspark.target_layers=[7, 8, 10] names layer(s) [10] outside the "
                                            "stack's layers 0..9"),
    ("model.hc_mult=0", "model.hc_mult=0 is out of range — set a whole number >= 1"),
    ("model.moe.bias_update_rate=-0.001", "model.moe.bias_update_rate=-0.001 is out of range — set a number >= 0"),
    ("model.moe.score_func=relu", "model.moe.score_func='relu' is not a choice — use one of sqrtsoftplus, softmax, "
                                  "sigmoid"),
    ("model.dspark.noise_token_id=300", "model.dspark.noise_token_id=300 is outside the vocabulary [0, "
                                        "model.vocab_size=259)"),
    ("model.engram.pad_id=259", "model.engram.pad_id=259 is outside the vocabulary"),
    ("model.engram.num_embeddings=[10,10]", "model.engram.num_embeddings=[10, 10] disagrees with the rows its bucket "
                                            "layout gives"),
])
def test_an_inconsistent_model_is_one_line_naming_the_setting(override, message):
    with pytest.raises(ValueError) as error:
        planned(compose(["model=v41_mini", override]), world_size=1)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_train_refuses_it_with_status_2_and_no_run_dir(tmp_path):
    done = subprocess.run([sys.executable, "-m", "train", "model=v41_mini", "model.moe.n_activated_experts=9",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: model.moe.n_activated_experts=9 (top-k) must be in 1..")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("switch, absent", [
    ("model.ffn=dense", "ffn.gate.weight"), ("model.hc_mult=1", "hc_attn_fn"),
    ("model.engram.layers=[]", "engram.wkv.weight"), ("model.dspark.blocks=0", "mtp.0."),
])
def test_each_part_has_its_switch(switch, absent):
    """Turning one part off removes exactly its parameters (names of the released checkpoint) and keeps the others."""
    from model import build_model

    on = set(build_model(compose(["model=v41_mini"]).model, compose([]).layout, device="meta").state_dict())
    cfg = compose(["model=v41_mini", switch])
    off = set(build_model(cfg.model, cfg.layout, device="meta").state_dict())
    assert any(absent in n for n in on) and not any(absent in n for n in off)
    parts = ("ffn.gate.weight", "hc_attn_fn", "engram.wkv.weight", "mtp.0.")
    assert all(any(p in n for n in off) for p in parts if p != absent)
