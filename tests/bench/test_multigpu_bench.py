"""bench/multigpu.py --smoke: the GPU benchmark's logic on CPU (2 gloo processes, tiny model), every section.

It checks what the benchmark would report on the GPU machine: the layer-times file the stage balance reads, per-stage
bubble against the 1F1B ideal, transfers in both index-K modes, and the equivalence verdicts (on CPU the
pipelined arithmetic is the single-stage one: payload bitwise, shadow indexers off only in the owner's index-key
gradient)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model.cli import compose
from model.config import ModelArgs
from model.layout import layout_from_config
from parallel.balance import LayerTimes, mode_key

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("multigpu")
    # without this process's own launcher variables (an in-process engine test sets them): the benchmark would
    # take itself for a torchrun worker and rendezvous on the port this process's store still holds
    launcher_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {**{k: v for k, v in os.environ.items() if k not in launcher_vars}, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "bench/multigpu.py"), "--smoke", "--out-dir", str(out),
                           "--budget", "3600"], env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "multigpu.json").read_text()), out


def test_every_section_ran(report):
    results, _ = report
    assert results["errors"] == {} and results["skipped"] == []
    assert set(results["sections"]) == {"single", "transfer", "pipeline", "equivalence_4k", "equivalence_tiny"}
    assert results["date"] and results["command"].startswith("python")
    summary = results["summary"]  # the yardsticks at the headline microbatch count (8 on the GPUs, 2 here)
    assert summary["microbatches"] == 2 and summary["bubble_ideal"] == pytest.approx(1 / 3)
    assert summary["of_ideal"] > 0 and summary["transfer_share"] > 0 and summary["overlap_speedup"] > 0
    assert summary["data_parallel_tokens_per_s"] == results["sections"]["single"]["steps"][0]["tokens_per_s"]


def test_layer_times_file_is_what_the_balance_reads(report):
    results, out = report
    single = results["sections"]["single"]
    cfg = compose(["model=tiny", "layout=v41_scaled"])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    times = LayerTimes.load(single["layer_times"])
    times.check(args, layout, 128, 1, "layer")
    assert set(times.modes) == {mode_key(p) for p in layout.plan} and times.head_ms > 0
    assert [row["layer"] for row in single["layers"]] == list(range(layout.n_layers))
    assert all(row["fwd_ms"] > 0 and row["bwd_ms"] > 0 for row in single["layers"])
    assert results["sections"]["pipeline"]["balanced_on"] == "measured ms"


def test_pipeline_steps_report_bubble_per_stage(report):
    pipeline = report[0]["sections"]["pipeline"]
    for row in pipeline["steps"] + [pipeline["before"]]:
        M = row["microbatches"]
        assert row["bubble_ideal"] == pytest.approx(1 / (M + 1))
        assert [r["stage"] for r in row["per_rank"]] == [0, 1]
        assert all(0 <= r["bubble"] < 1 and r["busy_ms"] > 0 for r in row["per_rank"])
        assert row["tokens_per_s"] == pytest.approx(M * 128 / row["step_s"])
    assert (pipeline["before"]["p2p"], pipeline["after"]["p2p"]) == ("deepspeed", "overlap")
    transfer = report[0]["sections"]["transfer"]
    assert transfer["cut"] == pipeline["cuts"][0]
    for mode in ("shadow", "payload"):
        moved = transfer["index_k"][mode]
        assert moved["activations"]["bytes"] > moved["gradient"]["bytes"] > 0 and moved["activations"]["ms"] > 0


def test_equivalence_verdicts(report):
    sections = report[0]["sections"]
    short = sections["equivalence_4k"]
    assert short["loss_rel_diff"][0] == 0.0 and short["max_loss_rel_diff"] <= 1e-6 and short["within_noise"]
    cases = sections["equivalence_tiny"]["cases"]
    payload = cases["cut 3 payload"]
    assert payload["grads_bitwise"] == payload["grads_count"] and payload["params_bitwise"] == payload["params_count"]
    shadow = cases["cut 8 shadow"]
    assert shadow["first_loss_rel_diff"] == 0.0 and shadow["grads_max_rel_diff"] <= 1e-6
    assert set(shadow["grads_differing"]) <= {"layers.6.attn.indexer.wk.weight", "layers.6.attn.indexer.k_norm.weight"}


def test_autotune_choices_carry_over_between_processes():
    """What the GPU run does to give every rank rank 0's kernels: the chosen config of each key, exported as an
    index and adopted by another copy of the kernel (another process), is the same config there."""
    import triton
    import triton.language as tl

    sys.path.insert(0, str(ROOT / "bench"))
    from multigpu import adopt_choices, autotune_choices

    def kernel():
        @triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (16, 32, 64)], key=["n"])
        @triton.jit
        def copy(x, n, BLOCK: tl.constexpr):
            pass
        return copy
    mine, theirs = kernel(), kernel()
    mine.cache[(4096, "torch.float32")] = mine.configs[2]
    mine.cache[(128, "torch.float32")] = mine.configs[0]
    adopt_choices({"k": theirs}, autotune_choices({"k": mine}))
    assert {key: theirs.configs.index(c) for key, c in theirs.cache.items()} == {(4096, "torch.float32"): 2,
                                                                                  (128, "torch.float32"): 0}
