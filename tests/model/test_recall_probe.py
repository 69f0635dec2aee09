"""The index recall that ``model.diagnostics.recording_index_recall`` records by wrapping the layers from outside,
against the slow oracle's (``tests/support/oracle.py``: each query's selection against the top-k of its own dense
attention over the visible compressed entries), and the wrapper's footprint: the forward's outputs bitwise the same,
nothing left on the layers after it.

Planted bugs each catches: the probe reading the queries before their RoPE, the window KV instead of the compressed
entries, or the Reuse layer's own id for its source's selection (the first test); the probe left on a layer after the
evaluation, or a probe that changes what the forward computes (the second).
"""
import statistics

import pytest
import torch

from model.diagnostics import recording_index_recall  # noqa: E402
from model.layout import Mode  # noqa: E402
from tests.support.model_oracle import DIMS, LAYOUTS, _pick_params, build_model, packed_doc_ids  # noqa: E402

T = 24
DOCS = [[15, 9], [24]]


def _inputs():
    ids = torch.randint(0, DIMS["vocab_size"], (2, T), generator=torch.Generator().manual_seed(7))
    return ids, packed_doc_ids(2, T, DOCS)


@pytest.mark.parametrize("name", ["m2", "mixed_cand", "cand_m2"])
def test_recall_is_the_oracles(name):
    layout = LAYOUTS[name]
    ids, docs = _inputs()
    P, diag = _pick_params(DIMS, layout, ids, docs)
    model = build_model(DIMS, layout, P)
    with torch.no_grad(), recording_index_recall(model) as recall:
        model(ids, docs)
    want = {layer: statistics.mean(values) for layer, values in diag["recall"].items()}
    assert want and sorted(recall) == sorted(want)
    assert len(set(want.values())) > 1  # the layers' recalls differ: each must be read from its own layer
    for layer, value in want.items():
        assert recall[layer].item() == pytest.approx(value, rel=1e-6), layer


def test_the_probe_changes_nothing_and_comes_off():
    layout = LAYOUTS["mixed_cand"]
    ids, docs = _inputs()
    P, _ = _pick_params(DIMS, layout, ids, docs)
    model = build_model(DIMS, layout, P)
    with torch.no_grad():
        plain = model(ids, docs)
        with recording_index_recall(model) as recall:
            probed = model(ids, docs)
        after = model(ids, docs)
    readers = {int(i) for i, block in model.layers.items() if block.attn.plan.mode is not Mode.WINDOW}
    assert set(recall) == readers
    assert not any("attend" in vars(block.attn) for block in model.layers.values())
    for output in (probed, after):
        assert torch.equal(output.logits, plain.logits)
        assert output.indexer_losses.keys() == plain.indexer_losses.keys()
        assert all(torch.equal(output.indexer_losses[k], v) for k, v in plain.indexer_losses.items())
