"""Where our layouts allow what DeepSeek's reference inference code allows, the same semantics (issue 14).

(a) Every index source after the candidate source selects inside the candidate blocks, Full layers included
(the model against the oracle on such a layout: ``tests/model/test_model_oracle.py``, case ``cand_full``).
(b) Candidate blocks that may hold fewer entries than ``index_topk`` are refused (the reference would pick
entries outside them). (c) ``original_seq_len: 0`` means no YaRN.
"""
import math

import pytest
import torch

from model import Layout, LayoutError, Mode, Transformer, layout_from_config
from model.cli import compose
from model.config import ModelArgs
from model.rope import Rotary


def test_every_index_source_after_the_candidate_source_is_restricted():
    layout = Layout(compress_ratios=[0, 1, 1, 1, 1, 1], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 2, 3, 4],
                    candidate_source_layer_id=1)
    restricted = {p.layer_id: p.candidate_source for p in layout.plan}
    assert layout.plan[3].mode is Mode.FULL
    assert restricted == {0: None, 1: None, 2: 1, 3: 1, 4: 1, 5: None}  # Full 3 and Reindex 4 on its KV too
    assert layout.last_use[("candidates", 1)] == 4


def test_a_later_index_source_of_another_ratio_is_refused():
    with pytest.raises(LayoutError, match=r"layer 4 \(ratio 2\) is an index source after the candidate source, "
                                          r"layer 2 \(ratio 1\).*other tokens at another ratio"):
        Layout(compress_ratios=[0, 0, 1, 1, 2], kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4],
               candidate_source_layer_id=2)


def test_generated_candidate_source_serves_later_full_layers():
    """A decoder of Full layers only (no Reindex) still gets its candidate source: the later Full layers read it."""
    layout = layout_from_config(compose(["layout=v41_scaled", "layout.decoder.full_every=2",
                                         "layout.decoder.reindex_every=0"]).layout)
    assert layout.candidate_source_layer_id == 6 and layout.plan[8].candidate_source == 6
    plain = layout_from_config(compose(["layout=v41_scaled", "layout.decoder.reindex_every=0"]).layout)
    assert plain.candidate_source_layer_id is None  # nothing after layer 6 selects: no blocks are made


def _build(*overrides):
    cfg = compose(list(overrides))
    with torch.device("meta"):
        return Transformer(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout))


def test_candidates_fewer_than_topk_are_refused_with_the_fix():
    """``model=small layout=v41_scaled``: 8 blocks of 4 guarantee (8-1)*4+1 = 29 entries < index_topk 512."""
    with pytest.raises(LayoutError, match=r"guarantee a query only 29 candidate entries, fewer than index_topk=512.*"
                                          r"layout.candidate_topk_blocks>=129, or model.index_topk<=29"):
        _build("model=small", "layout=v41_scaled")
    with pytest.raises(LayoutError, match="only 509 candidate entries"):  # one block short
        _build("model=small", "layout=v41_scaled", "layout.candidate_topk_blocks=128")
    _build("model=small", "layout=v41_scaled", "layout.candidate_topk_blocks=129")
    _build("model=small", "layout=no_reindex_scaled")  # candidate blocks nobody reads are not checked
    _build("model=tiny", "layout=v41_scaled")  # (8-1)*4+1 = 29 >= 16
    _build("model=v41_flash", "layout=v41")


def test_original_seq_len_zero_means_no_yarn():
    args = ModelArgs(rope_head_dim=8, head_dim=16, index_head_dim=16, n_heads=2, o_groups=1,
                     compress_rope_theta=500.0, original_seq_len=0)
    plain = torch.tensor([500.0 ** (-i / 8) for i in range(0, 8, 2)], dtype=torch.float64)
    assert torch.equal(Rotary.for_layer(args, compressed=True)._freqs[torch.device("cpu")], plain)
    yarn = Rotary.for_layer(ModelArgs(**{**args.__dict__, "original_seq_len": 64}), compressed=True)
    assert not torch.allclose(yarn._freqs[torch.device("cpu")], plain)  # the comparison above can fail
    with pytest.raises(ValueError, match="model.original_seq_len=-1 is out of range"):  # checked on resolution
        ModelArgs.from_config({"original_seq_len": -1})


def test_a_model_without_yarn_runs():
    cfg = compose(["model.original_seq_len=0"])
    model = Transformer(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout))
    logits = model(torch.randint(0, 259, (1, 40))).logits
    assert logits.shape == (1, 40, 259) and math.isfinite(logits.sum().item())
