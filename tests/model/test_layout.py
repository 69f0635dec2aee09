"""Layouts: the V4.1 preset is SPEC §1.5 exactly, presets and overrides compose, every rule is enforced."""
import pytest
import torch

from model import Layout, LayoutError, Mode, Transformer, layout_from_config
from model.cli import compose
from model.config import ModelArgs

PRESETS = ["v41", "v41_scaled", "all_full", "no_reindex", "single_selection", "window_only"]


def layout(*overrides):
    return layout_from_config(compose(list(overrides)).layout)


def test_v41_is_the_reference_config():
    v41 = layout("layout=v41")
    assert list(v41.compress_ratios) == [0, 0] + [2] * 18 + [1] * 20
    assert list(v41.kv_source_layer_ids) == [2, 8, 14, 20]
    assert list(v41.index_source_layer_ids) == [2, 8, 14, 20, 24, 28, 32, 36]
    assert (v41.candidate_source_layer_id, v41.candidate_topk_blocks, v41.candidate_block_size) == (20, 2048, 8)
    counts = v41.counts()
    assert (counts[Mode.FULL], counts[Mode.REINDEX], counts[Mode.REUSE], counts[Mode.WINDOW]) == (4, 4, 30, 2)
    plan = v41.plan
    assert plan[25].kv_source == 20 and plan[25].index_source == 24
    assert [p.layer_id for p in plan if p.candidate_source == 20] == [24, 28, 32, 36]
    assert plan[19].kv_source == 14 and plan[19].index_source == 14


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_are_valid(preset):
    assert layout(f"layout={preset}").n_layers == 40 or preset == "v41_scaled"


def test_ablation_presets():
    assert layout("layout=all_full").counts()[Mode.REUSE] == 0
    assert layout("layout=no_reindex").counts()[Mode.REINDEX] == 0
    single = layout("layout=single_selection")
    assert list(single.index_source_layer_ids) == [2, 20]
    assert set(layout("layout=window_only").compress_ratios) == {0}


def test_command_line_overrides():
    assert list(layout("layout=v41", "layout.decoder.reindex_every=2").index_source_layer_ids) == \
        [2, 8, 14, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38]
    moved = layout("layout=v41", "layout.kv_source_layer_ids=[2,8,14,20,30]")
    assert moved.plan[30].mode is Mode.FULL and moved.plan[33].kv_source == 30
    # as in the reference, every index source after the candidate source selects inside its blocks
    assert moved.plan[30].candidate_source == 20 and moved.plan[32].candidate_source == 20
    moved = layout("layout=v41", "layout.decoder.ratio=2", "layout.candidate_source_layer_id=8")
    assert moved.plan[8].makes_candidates and moved.plan[14].candidate_source == 8
    with pytest.raises(LayoutError, match="other tokens at another ratio"):  # layer 20 (m=1) after 8 (m=2)
        layout("layout=v41", "layout.candidate_source_layer_id=8")


RULES = [
    (dict(kv_source_layer_ids=[3], index_source_layer_ids=[3]), "layer 2 (ratio 2) has no KV source"),
    (dict(compress_ratios=[0, 2, 1, 1], kv_source_layer_ids=[1], index_source_layer_ids=[1]),
     "layer 2 (ratio 1) has no KV source"),
    (dict(index_source_layer_ids=[3]), "every KV source is an index source"),
    (dict(kv_source_layer_ids=[0, 2], index_source_layer_ids=[0, 2]), "layer 0 is window-only"),
    (dict(index_source_layer_ids=[1, 2]), "layer 1 is window-only"),
    (dict(candidate_source_layer_id=1), "layer 1 is window-only"),
    (dict(candidate_source_layer_id=3, index_source_layer_ids=[2, 3]), "candidate source layer 3 is not a Full"),
    (dict(kv_source_layer_ids=[9]), "names layer 9, but the model has layers 0..4"),
    (dict(compress_ratios=[0, 0, 2, 2, 1], kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 3, 4],
          candidate_source_layer_id=None), None),
    (dict(compress_ratios=[0, 0, 2, 1, 2], kv_source_layer_ids=[2, 3], index_source_layer_ids=[2, 3]),
     "layer 4 reads the KV of layer 2 but its latest index source, layer 3"),
    (dict(compress_ratios=[0, 0, -1, 2, 2]), "layer 2 has compress ratio -1"),
]


@pytest.mark.parametrize("change,message", RULES)
def test_each_rule_is_enforced_with_its_message(change, message):
    base = dict(compress_ratios=[0, 0, 2, 2, 2], kv_source_layer_ids=[2], index_source_layer_ids=[2],
                candidate_source_layer_id=None)
    if message is None:
        Layout(**{**base, **change})
        return
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Layout(**{**base, **change})


def test_bad_override_is_a_config_error():
    with pytest.raises(LayoutError, match="has no KV source"):
        layout("layout=v41", "layout.kv_source_layer_ids=[3,8,14,20]")


def test_parameter_names_read_like_the_reference():
    args = ModelArgs(**{**ModelArgs().__dict__, "vocab_size": 16})
    with torch.device("meta"):
        model = Transformer(args, layout("layout=v41"))
    names = set(model.state_dict())

    def own(layer):
        prefix = f"layers.{layer}."
        return {n[len(prefix):] for n in names if n.startswith(prefix)}

    assert all("attn.compressor.wgate.weight" in own(i) for i in (2, 8, 14))
    assert "attn.compressor.wgate.weight" not in own(20) and "attn.compressor.wkv.weight" in own(20)
    assert own(24) - own(25) == {"attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight"}
    assert own(25) == own(0)  # a Reuse layer's names equal a window-only layer's
    assert {"attn.indexer.wk.weight", "attn.indexer.k_norm.weight"} <= own(20)
