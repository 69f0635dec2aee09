"""Layout sweeps: multirun overrides resolve to the intended layouts, and ``train.report`` compares the runs of a
real (tiny) ``python -m train -m`` sweep with numbers that are the runs' own."""
import json
import math
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import wandb
from hydra import compose as hydra_compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import open_dict

from model.accounting import account
from model.cli import CONF_DIR, compose, resolved
from model.config import ModelArgs
from model.layout import Layout, layout_from_config
from parallel.job import plan
from train.observe.metrics import MetricsLogger, read_rows
from train.processes import distributed
from train.report import find_runs, main, newest_sweep, report

V41_RATIOS = [0, 0] + [2] * 18 + [1] * 20
SCALED_RATIOS = [0, 0, 2, 2, 2, 2, 1, 1, 1, 1]
SCALED_BLOCKS = dict(candidate_topk_blocks=8, candidate_block_size=4)


def sweep_jobs(*overrides: str) -> list[list[str]]:
    """The per-job overrides ``python -m train -m <overrides>`` runs (Hydra's own basic sweeper)."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    (jobs,) = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return jobs


def sweep_layouts(*overrides: str) -> list[tuple[str, Layout]]:
    return [(cfg.layout.name, layout_from_config(cfg.layout)) for cfg in map(compose, sweep_jobs(*overrides))]


def test_layout_presets_sweep():
    encoder_full = [2, 8, 14]
    assert sweep_layouts("layout=v41_scaled,all_full,no_reindex,single_selection") == [
        ("v41_scaled", Layout(SCALED_RATIOS, [2, 4, 6], [2, 4, 6, 8], 6, **SCALED_BLOCKS)),
        ("all_full", Layout(V41_RATIOS, range(2, 40), range(2, 40), None)),
        ("no_reindex", Layout(V41_RATIOS, encoder_full + [20], encoder_full + [20], None)),  # no candidate reader
        ("single_selection", Layout(V41_RATIOS, [2, 20], [2, 20], None)),
    ]


def test_scaled_layout_presets_sweep():
    """The ablation presets at the 10-layer shape of the default layout (2 window, encoder 2-5, decoder 6-9)."""
    assert sweep_layouts("layout=all_full_scaled,no_reindex_scaled,single_selection_scaled,window_only_scaled") == [
        ("all_full_scaled", Layout(SCALED_RATIOS, range(2, 10), range(2, 10), None, **SCALED_BLOCKS)),
        ("no_reindex_scaled", Layout(SCALED_RATIOS, [2, 4, 6], [2, 4, 6], None, **SCALED_BLOCKS)),
        ("single_selection_scaled", Layout(SCALED_RATIOS, [2, 6], [2, 6], None, **SCALED_BLOCKS)),
        ("window_only_scaled", Layout([0] * 10, [], [], None, **SCALED_BLOCKS)),
    ]


def test_layout_knob_sweep():
    assert sweep_layouts("layout.decoder.reindex_every=2,4") == [
        ("v41_scaled", Layout(SCALED_RATIOS, [2, 4, 6], [2, 4, 6, 8], 6, **SCALED_BLOCKS)),  # Reindex at layer 8
        # the 4-layer decoder never reaches 4: no Reindex layer, so no candidate source either
        ("v41_scaled", Layout(SCALED_RATIOS, [2, 4, 6], [2, 4, 6], None, **SCALED_BLOCKS)),
    ]


def test_knob_override_wins_over_the_preset():
    """A knob swept with presets overrides each preset's own value (here no_reindex gets Reindex layers)."""
    (_, v41), (_, no_reindex) = sweep_layouts("layout=v41,no_reindex", "layout.decoder.reindex_every=4")
    assert no_reindex == v41


# A two-job sweep of the 10-layer layout that differs only in the decoder's Reindex layer; each job trains 4
# steps on 64-token rows, half of them text of a small corpus and half synthetic tasks, evaluates at step 2 and at
# the end (with the three synthetic tasks, and probes at 160 and 192 tokens).
SWEEP = ["layout.decoder.reindex_every=0,2"]
TINY = ["train.max_steps=4", "train.eval.every=2", "train.warmup_steps=2", "data=synthetic", "data.seq_len=64",
        "data.micro_batch_size=2", f"data.path={sysconfig.get_paths()['stdlib']}/email", "data.heldout_fraction=0.2",
        "data.synthetic_fraction=0.5", "data.synthetic.tasks={mqar: 1, passkey: 1, copy: 1}",
        "data.synthetic.eval_examples=4", "data.synthetic.copy_length=[4,12]",
        "train.progress=false", "logger.mode=disabled", "train.eval.batches=1", "train.eval.probe_examples=2",
        "train.eval.probe_lens=[160,192]", "train.eval.mqar_pairs=2", "train.eval.mqar_queries=1"]
SYNTHETIC_TASKS = ("mqar", "passkey", "copy")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    subprocess.run([sys.executable, "-m", "train", "-m", *SWEEP, *TINY, f"hydra.sweep.dir={root}"], check=True,
                   capture_output=True, text=True)
    return root, report(root)


def test_report_numbers_are_the_runs_own(sweep):
    root, (_, summaries) = sweep
    runs = find_runs(root)
    assert [r.name for r in runs] == ["0", "1"] and len(summaries) == 2
    for run, figures in zip(runs, summaries):
        rows = read_rows(root / run.name / "metrics.jsonl")
        steps = [r for r in rows if r.get("split") != "eval"]
        final = [r for r in rows if r.get("split") == "eval"][-1]
        assert final["step"] == figures["steps"] == 4
        assert figures["eval_lm_loss"] == final["lm_loss"]
        assert figures["probes"] == {f"{kind}@{n}": final[f"{kind}_acc/len{n}"]
                                     for kind in ("passkey", "mqar") for n in (160, 192)}
        assert final["passkey_acc"] == pytest.approx((final["passkey_acc/len160"] + final["passkey_acc/len192"]) / 2)
        assert list(figures["synthetic"]) == list(SYNTHETIC_TASKS)
        for task in SYNTHETIC_TASKS:  # null in the file (no answer beyond the window at 64 tokens): NaN
            expected = {key: final[f"synthetic/{task}_{key}"] for key in ("acc", "acc_beyond_window", "chance")}
            assert figures["synthetic"][task] == pytest.approx({k: math.nan if v is None else v
                                                                for k, v in expected.items()}, nan_ok=True)
        assert final["synthetic/mqar_chance"] == 1 / 16 and 0 <= final["synthetic/copy_acc"] <= 1
        assert (root / run.name / "layers.png").is_file() and (root / run.name / "synthetic.png").is_file()
        readers = [p.layer_id for p in layout_from_config(run.cfg.layout).plan if p.index_source is not None]
        recall = [final[f"index_recall/layer{layer}"] for layer in readers]
        assert figures["index_recall"] == pytest.approx(statistics.mean(recall))
        assert figures["tokens_per_s"] == statistics.median(r["tokens_per_s"] for r in steps)
        assert steps[0]["tokens_per_step"] == 2 * 64 and all("tokens_per_step" not in r for r in rows[1:])
        assert figures["step_time_s"] == 2 * 64 / figures["tokens_per_s"]
        cfg = run.cfg
        accounting = account(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout), 64)
        for key in ("kv_bytes_per_token", "indexer_flops_per_token"):  # logged once, in the first row
            assert figures[key] == accounting[key] == steps[0][key]
        assert all(math.isfinite(v) for v in (figures["eval_lm_loss"], figures["index_recall"], figures["step_time_s"]))
    no_reindex, reindex = summaries
    assert no_reindex["kv_bytes_per_token"] == reindex["kv_bytes_per_token"]  # a Reindex layer stores nothing
    assert no_reindex["indexer_flops_per_token"] < reindex["indexer_flops_per_token"]  # but it scores again


def test_report_files_name_the_runs(sweep):
    root, (table, summaries) = sweep
    assert (root / "report.md").read_text() == table
    assert (root / "report.png").stat().st_size > 10_000
    records = json.loads((root / "report.json").read_text())
    assert [r["run"] for r in records] == ["0", "1"]
    assert json.dumps(records[1]["synthetic"]) == json.dumps(summaries[1]["synthetic"]).replace("NaN", "null")
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert "| passkey@160 | passkey@192 | mqar@160 | mqar@192 | mqar acc | mqar beyond window | mqar chance |" \
        " passkey acc | passkey beyond window | passkey chance | copy acc |" in rows[0]
    for job, (row, figures) in enumerate(zip(rows[1:], summaries)):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:4] == [str(job), "v41_scaled", f"`layout.decoder.reindex_every={2 * job}`", "4"]
        assert cells[4] == f"{figures['eval_lm_loss']:.4f}"
    assert "Common overrides: `train.max_steps=4 " in table


def test_dir_without_runs_is_a_clear_error(tmp_path):
    (tmp_path / "0").mkdir()
    with pytest.raises(SystemExit, match="no runs under"):
        main([str(tmp_path)])
    with pytest.raises(SystemExit, match="not a directory"):
        main([str(tmp_path / "missing")])


def test_without_a_dir_the_newest_sweep_is_reported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="no sweep under"):
        main([])
    for sweep in ("2026-11-29/23-59-59", "2026-11-30/00-00-01", "2026-11-30/00-00-00"):
        (tmp_path / "multirun" / sweep).mkdir(parents=True)
    assert newest_sweep() == Path("multirun/2026-11-30/00-00-01")
    with pytest.raises(SystemExit, match="no runs under multirun/2026-11-30/00-00-01"):
        main([])


@pytest.fixture
def hydra_job():
    """Make a composed config the running Hydra job's (as under ``python -m train``), for this test only."""
    def start(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        job = cfg.copy()
        with open_dict(job):
            del job["hydra"]  # the job sees its config without the hydra node
        return job

    yield start
    HydraConfig.instance().cfg = None


def test_wandb_run_is_grouped_and_tagged_by_layout(hydra_job, monkeypatch, tmp_path):
    cfg = hydra_job("layout=no_reindex", "layout.decoder.reindex_every=8", "train.max_steps=3",
                    "logger.tags=[ablation]")
    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs))
    distributed.init(torch.device("cpu"))
    MetricsLogger(plan(resolved(cfg), 1, torch.device("cpu")), tmp_path, start_step=0, enabled=True)
    (kwargs,) = calls
    assert kwargs["group"] == "no_reindex decoder.reindex_every=8"  # the preset and its knob: one layout
    assert kwargs["tags"] == ["ablation", "no_reindex", "tiny"]
    layout_plan = kwargs["config"]["layout_plan"]
    assert layout_plan["index_source_layer_ids"] == [2, 8, 14, 20, 28, 36] and layout_plan["reindex"] == 2
    constants = kwargs["config"]["run_constants"]
    assert constants["tokens_per_step"] == cfg.data.micro_batch_size * cfg.data.seq_len
    assert constants["kv_bytes_per_token"] == account(ModelArgs.from_config(cfg.model), layout_from_config(
        cfg.layout), cfg.data.seq_len)["kv_bytes_per_token"]  # from the composed config, not the job
