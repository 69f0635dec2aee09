"""Model FLOPs (model/flops.py): the count behind TFLOP/s and MFU in training metrics and bench/train_step.py."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from model import ModelArgs, layout_from_config
from model.cli import compose
from model.flops import causal_slots, model_flops, training_flops

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "train"


@pytest.mark.parametrize("T, m, cap", [(1, 1, 1), (10, 1, 3), (17, 2, 4), (100, 3, 7), (5, 4, 100), (64, 2, 16)])
def test_causal_slots_counts_what_each_query_sees(T, m, cap):
    assert causal_slots(T, m, cap) == sum(min(cap, (t + 1) // m) for t in range(T))


def test_training_flops_is_the_count_of_the_committed_benchmark():
    """The 64K step of bench/results/train (small model, V4.1 layout): the count moved out of the benchmark is
    unchanged."""
    result = json.loads((RESULTS / "train_step_csa2_65536.json").read_text())
    cfg = compose(result["overrides"])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    assert training_flops(args, layout, result["T"], result["micro_batch"]) == result["flops"]["total"]


def test_training_flops_scale_with_rows_and_count_dense_attention():
    cfg = compose([])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    assert training_flops(args, layout, 256, 4) == 4 * training_flops(args, layout, 256, 1)
    result = json.loads((RESULTS / "train_step_dense_65536.json").read_text())  # model.attention=dense
    cfg = compose(result["overrides"])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    assert training_flops(args, layout, result["T"], result["micro_batch"]) == result["flops"]["total"]


def test_a_frozen_matrix_counts_no_weight_gradient():
    """Per value and token: a trained matrix 6 (forward, input and weight gradients), the indexer's 4 (its input is
    detached); frozen (LoRA's base) 4 and 2."""
    cfg = compose([])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    named = {"layers.0.attn.wq_a.weight": torch.zeros(3, 5, requires_grad=True),
             "layers.0.attn.indexer.wq_b.weight": torch.zeros(2, 7, requires_grad=True)}
    stage = SimpleNamespace(named_parameters=lambda: iter(named.items()))
    T = 11
    assert model_flops(stage, layout, args, T, 1, layers=range(0))["matmul"] == (6 * 15 + 4 * 14) * T
    for p in named.values():
        p.requires_grad_(False)
    assert model_flops(stage, layout, args, T, 1, layers=range(0))["matmul"] == (4 * 15 + 2 * 14) * T
