"""What a sweep's report says about noise (``train/report.py``): differences within the held-out loss's spread and
accuracies at chance are marked, with several seeds per setting a table of means and spreads; and the spread itself
(``train/evaluation/evaluate.py``: the standard error over the evaluation batches, gathered over ranks). The run dirs
are written by hand (config, overrides, metrics), so the expected marks follow from the numbers below."""
import itertools
import json
import math
import statistics

import numpy as np
import pytest
from omegaconf import OmegaConf

from model.cli import compose
from train.data.tokenizer import ByteTokenizer
from train.evaluation.evaluate import with_spread, with_squares
from train.evaluation.probes import chance_levels
from train.report import report

PROBE_EXAMPLES = 16


def write_run(directory, overrides, loss, se, probe=0.0, seed=0):
    directory.mkdir(parents=True)
    cfg = compose([*overrides, f"train.seed={seed}", f"train.eval.probe_examples={PROBE_EXAMPLES}"])
    OmegaConf.save(cfg, directory / "config.yaml", resolve=True)
    (directory / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create([*overrides, f"train.seed={seed}"]), directory / ".hydra" / "overrides.yaml")
    rows = [{"step": 1, "loss": 5.0, "tokens_per_s": 100.0, "tokens_per_step": 1024},
            {"split": "eval", "step": 1, "lm_loss": loss, "lm_loss_se": se, "passkey_acc/len256": probe,
             "mqar_acc/len256": probe}]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def table_rows(table: str, title: str = "| run |") -> list[list[str]]:
    """The cells of the table whose header starts with ``title``."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title)) + 2  # past the header and its rule
    body = itertools.takewhile(lambda line: line.startswith("| "), lines[start:])
    return [[c.strip() for c in line.strip("|").split("|")] for line in body]


def test_one_run_per_layout_marks_noise_and_chance(tmp_path):
    chance = chance_levels(ByteTokenizer())["passkey_acc"]
    floor = chance + 2 * math.sqrt(chance * (1 - chance) / PROBE_EXAMPLES)  # 2 binomial standard errors
    write_run(tmp_path / "0", ["layout=v41_scaled"], 4.50, 0.05, probe=0.0)
    write_run(tmp_path / "1", ["layout=all_full_scaled"], 4.60, 0.04, probe=floor - 0.01)  # 0.10 < 2 x 0.064
    write_run(tmp_path / "2", ["layout=window_only_scaled"], 5.40, 0.05, probe=floor + 0.05)
    table, _ = report(tmp_path)
    rows = table_rows(table)
    assert 2 * math.sqrt(0.05 ** 2 + 0.04 ** 2) > 0.10  # the second run is within noise, the third is not
    assert [r[4:7] for r in rows] == [["4.5000", "0.0500", "best"], ["4.6000", "0.0400", "+0.1000 (within noise)"],
                                      ["5.4000", "0.0500", "+0.9000"]]
    assert rows[0][7] == "0.000 (chance)" and rows[1][7] == f"{floor - 0.01:.3f} (chance)"
    assert rows[2][7] == f"{floor + 0.05:.3f}"
    assert "One run per setting measures no run-to-run variation: sweep train.seed=0,1,2" in table
    assert "Every probe is at chance" not in table and "Over seeds" not in table


def test_every_probe_at_chance_and_every_loss_tied_is_said(tmp_path):
    write_run(tmp_path / "0", ["layout=v41_scaled"], 4.50, 0.05)
    write_run(tmp_path / "1", ["layout=all_full_scaled"], 4.52, 0.05)
    table, _ = report(tmp_path)
    assert "Every run's held-out loss is within noise of the best: the loss does not rank them." in table
    assert "Every probe is at chance: the probes do not rank these runs" in table


def test_several_seeds_give_means_and_spreads(tmp_path):
    losses = {"v41_scaled": [4.50, 4.56, 4.47], "window_only_scaled": [4.70, 4.90, 4.62]}
    accuracies = {"v41_scaled": [0.9, 0.5, 0.7], "window_only_scaled": [0.1, 0.0, 0.2]}  # each probe's, per seed
    job = 0
    for layout, values in losses.items():
        for seed, loss in enumerate(values):
            write_run(tmp_path / str(job), [f"layout={layout}"], loss, 0.01, probe=accuracies[layout][seed], seed=seed)
            job += 1
    table, _ = report(tmp_path)
    rows = table_rows(table, "| runs |")
    columns = next(line for line in table.splitlines() if line.startswith("| runs |")).strip("|").split("|")
    probe = [c.strip() for c in columns].index("passkey@256")
    for row, layout in zip(rows, losses):  # the probe accuracy as spread over seeds, not the first seed's
        values = accuracies[layout]
        assert row[probe] == f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"
    means = {k: statistics.fmean(v) for k, v in losses.items()}
    sds = {k: statistics.stdev(v) for k, v in losses.items()}
    gap = means["window_only_scaled"] - means["v41_scaled"]
    noise = 2 * math.sqrt(sds["v41_scaled"] ** 2 / 3 + sds["window_only_scaled"] ** 2 / 3)
    assert [r[:6] for r in rows] == [
        ["0,1,2", "v41_scaled", "", "3", f"{means['v41_scaled']:.4f} ± {sds['v41_scaled']:.4f}", "best"],
        ["3,4,5", "window_only_scaled", "", "3", f"{means['window_only_scaled']:.4f} ± "
         f"{sds['window_only_scaled']:.4f}", f"+{gap:.4f}" + (" (within noise)" if gap <= noise else "")]]
    assert gap > noise  # 0.23 against 2 x 0.098: told apart over seeds, although each seed's own SE is 0.01
    assert "One run per setting" not in table


def test_heldout_spread_is_the_standard_error_over_batches_and_ranks():
    """Four batches on each of two ranks: each rank's mean and mean square, averaged over ranks as
    ``distributed.mean_over_ranks`` does, give the standard error of all eight batches' losses."""
    losses = np.array([2.1, 2.4, 1.9, 2.6, 2.2, 2.0, 2.8, 2.3])
    ranks = [with_squares([{"lm_loss": x} for x in part]) for part in (losses[:4], losses[4:])]
    gathered = {key: (ranks[0][key] + ranks[1][key]) / 2 for key in ranks[0]}
    row = with_spread(gathered, batches=8)
    assert row["lm_loss"] == pytest.approx(losses.mean())
    assert row["lm_loss_se"] == pytest.approx(losses.std(ddof=1) / math.sqrt(8))
    assert "lm_loss_sq" not in row and "lm_loss_se" not in with_spread(with_squares([{"lm_loss": 2.0}]), 1)
