"""Tests of train/observe/dashboards.py on hand-made metrics rows: the series it plots are the rows' numbers, the files
exist exactly when there is something to draw."""
import json
import math

import pytest

from model import layout_from_config
from model.cli import compose
from train.observe.dashboards import (_binned, distance_accuracy, draw_and_log, layer_series, log_layout_table,
                                      log_synthetic_charts, plot_layers, plot_synthetic)


def rows_of_a_run(steps=6):
    rows = [{"step": s, "loss": 1.0, "indexer_loss/layer2": 0.1 * s, "indexer_loss/layer6": 0.2 * s}
            for s in range(1, steps + 1)]
    rows.insert(3, {"step": 3, "split": "eval", "lm_loss": 2.0, "index_recall/layer2": 0.5, "index_recall/layer3": None})
    rows.append({"step": steps, "split": "eval", "lm_loss": 1.5, "index_recall/layer2": 0.7,
                 "index_recall/layer3": 0.6, "synthetic/mqar_acc/dist32-63": 0.9, "synthetic/mqar_acc/dist0-31": 1.0,
                 "synthetic/mqar_acc/dist64-127": None, "synthetic/mqar_chance": 0.0625,
                 "synthetic/copy_acc/dist0-31": 0.5, "synthetic/copy_chance": 0.03})
    return rows


def test_layer_series_are_the_rows_numbers():
    rows = rows_of_a_run()
    steps, layers, values = layer_series([r for r in rows if r.get("split") == "eval"], "index_recall")
    assert steps == [3, 6] and layers == [2, 3]
    assert values[0] == [0.5, 0.7] and math.isnan(values[1][0]) and values[1][1] == 0.6
    steps, layers, values = layer_series([r for r in rows if r.get("split") != "eval"], "indexer_loss")
    assert steps == list(range(1, 7)) and layers == [2, 6]
    assert values[1] == pytest.approx([0.2 * s for s in range(1, 7)])


def test_long_runs_are_averaged_into_bounded_columns():
    steps = list(range(1, 1001))
    binned_steps, (binned,) = _binned(steps, [[float(s) for s in steps]])
    assert len(binned_steps) == 200 and binned_steps[0] == 5 and binned_steps[-1] == 1000
    assert binned[0] == pytest.approx(3.0) and binned[-1] == pytest.approx(998.0)  # means of 1..5 and 996..1000
    _, (with_gap,) = _binned(steps, [[math.nan] * 5 + [1.0] * 995])
    assert math.isnan(with_gap[0]) and with_gap[1] == 1.0


def test_distance_accuracy_is_ordered_by_distance():
    final = rows_of_a_run()[-1]
    by_task = distance_accuracy(final)
    assert [label for label, _ in by_task["mqar"]] == ["0-31", "32-63", "64-127"]
    assert by_task["mqar"][1] == ("32-63", 0.9) and math.isnan(by_task["mqar"][2][1])
    assert by_task["copy"] == [("0-31", 0.5)]


def test_pictures_are_drawn_when_there_is_something_to_draw(tmp_path):
    rows = rows_of_a_run()
    assert plot_layers(rows, tmp_path / "layers.png") and (tmp_path / "layers.png").stat().st_size > 5000
    assert plot_synthetic(rows, tmp_path / "synthetic.png", 32) and (tmp_path / "synthetic.png").stat().st_size > 5000
    window_only = [{"step": 1, "loss": 1.0}, {"step": 1, "split": "eval", "lm_loss": 1.0}]
    assert not plot_layers(window_only, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
    assert not plot_synthetic(window_only, tmp_path / "none.png", 32) and not (tmp_path / "none.png").exists()


def test_wandb_gets_the_pictures_the_layout_table_and_the_distance_charts(tmp_path):
    """A real offline wandb run: both pictures as images, the v41_scaled plan as a Table (its rows as the preset
    defines them: 2 window layers, the m=2 encoder, the m=1 decoder whose Reindex layer reads layer 6's
    candidates), and one accuracy-by-distance table per synthetic task."""
    import wandb

    run = wandb.init(mode="offline", dir=tmp_path, project="dashboards-test")
    log_layout_table(run, layout_from_config(compose(["layout=v41_scaled"]).layout))
    rows = rows_of_a_run()
    log_synthetic_charts(run, rows[-1])
    drawn = draw_and_log(rows, tmp_path, 32, run)
    run.finish()
    (media,) = tmp_path.glob("wandb/offline-run-*/files/media")
    assert sorted(p.name.split("_")[0] for p in (media / "images" / "dashboards").glob("*.png")) == [
        "layers", "synthetic"]
    assert [p.name for p in drawn] == ["layers.png", "synthetic.png"]
    (plan,) = (media / "table" / "layout").glob("plan_*.table.json")
    table = json.loads(plan.read_text())
    assert table["columns"][:3] == ["layer", "ratio", "mode"]
    assert [(layer, ratio, mode) for layer, ratio, mode, *_ in table["data"]] == [
        (0, 0, "window"), (1, 0, "window"), (2, 2, "full"), (3, 2, "reuse"), (4, 2, "full"), (5, 2, "reuse"),
        (6, 1, "full"), (7, 1, "reuse"), (8, 1, "reindex"), (9, 1, "reuse")]
    assert table["data"][8][-1] == "from 6" and table["data"][6][-1] == "produces"
    charts = {p.name.split("_by_distance")[0]: json.loads(p.read_text())
              for p in (media / "table" / "synthetic").glob("*.table.json")}
    assert set(charts) == {"mqar", "copy"}
    assert charts["mqar"]["data"][:2] == [["0-31", 1.0], ["32-63", 0.9]]


def test_routing_series_and_picture_from_the_moe_scalars(tmp_path):
    """``routing.png``'s series are the rows' ``moe/layer<N>/*`` numbers (here the bias range, max - min; the draft
    head's ``mtp<K>`` layers and evaluation rows are not drawn), and the picture exists only for a MoE run; a
    ``null`` scalar (a non-finite one) is drawn as a gap."""
    from train.observe.routing import plot_routing, routing_series

    rows = [{"step": s, "loss": 1.0, **{f"moe/layer{layer}/{stat}": value for layer in (0, 3) for stat, value in (
        ("load_max_over_mean", 1.0 + layer * s), ("idle_experts", float(layer)), ("bias_min", -0.1 * s),
        ("bias_max", 0.2 * s), ("load_entropy", 2.0))}, "moe/mtp0/load_max_over_mean": 9.0} for s in (1, 2, 3)]
    rows.append({"step": 3, "split": "eval", "lm_loss": 1.0})
    steps, layers, values = routing_series(rows[:3], lambda r, layer: r[f"moe/layer{layer}/bias_max"]
                                           - r[f"moe/layer{layer}/bias_min"])
    assert steps == [1, 2, 3] and layers == [0, 3] and values[1] == pytest.approx([0.3, 0.6, 0.9])
    assert plot_routing(rows, tmp_path / "routing.png") and (tmp_path / "routing.png").stat().st_size > 5000
    rows[1]["moe/layer3/load_max_over_mean"] = None  # a non-finite scalar, as metrics.jsonl writes it
    assert plot_routing(rows, tmp_path / "with_null.png")
    assert not plot_routing(rows_of_a_run(), tmp_path / "none.png") and not (tmp_path / "none.png").exists()
