"""Pipeline parallelism on CPU (gloo): a pipelined step equals the single-stage step (SPEC §3).

Cuts separate every kind of edge of the tiny V4.1-shaped layout (layers: 0-1 window, 2 Full | 3 Reuse, 4 Full,
5 Reuse, 6 Full (candidate source), 7 Reuse, 8 Reindex, 9 Reuse): Full|Reuse inside an encoder group (cut 3),
Full|Reindex and candidate source|later Reindex (cut 8), Reindex|Reuse (cut 9).
"""
import pytest
import torch

from tests import pipeline_harness as harness

CASES = {  # name -> (stages, cuts, index_k, recompute)
    "2-stage shadow": (2, [8], "shadow", False),
    "2-stage payload": (2, [3], "payload", False),
    "4-stage shadow recompute": (4, [3, 8, 9], "shadow", True),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return harness.run(str(tmp_path_factory.mktemp("p1")), 1)[0]


@pytest.fixture(scope="module", params=list(CASES))
def pipelined(request, tmp_path_factory):
    stages, cuts, index_k, recompute = CASES[request.param]
    return CASES[request.param], harness.run(str(tmp_path_factory.mktemp("pp")), stages, cuts, index_k, recompute)


def _merged(ranks, key):
    merged = {}
    for r in ranks:
        merged.update(r[key])
    return merged


def test_losses_equal_single_stage(reference, pipelined):
    (_, _, index_k, _), ranks = pipelined
    assert ranks[-1]["losses"][0] == reference["losses"][0]  # the first step's forward is the same arithmetic
    assert ranks[-1]["losses"][1] == pytest.approx(reference["losses"][1], rel=1e-6)
    for name, value in reference["parts"].items():
        assert ranks[-1]["parts"][name] == pytest.approx(value, rel=1e-5, abs=1e-9), name


def test_parameters_equal_single_stage(reference, pipelined):
    """Bitwise, except where the reduction order differs: with shadow indexers the index-key projection's
    gradient is summed over stages instead of inside one backward (then every indexer tensor, whose inputs at
    step 2 depend on it, may differ by rounding)."""
    (_, _, index_k, _), ranks = pipelined
    params = _merged(ranks, "params")
    assert params.keys() == reference["params"].keys()
    for name, want in reference["params"].items():
        got = params[name]
        if index_k == "payload" or ".indexer." not in name:
            assert torch.equal(got, want), name
        else:
            assert (got - want).norm() <= 1e-6 * want.norm(), name


def test_replicas_equal_owners(pipelined):
    _, ranks = pipelined
    params = _merged(ranks, "params")
    replicas = _merged(ranks, "shadows")
    assert replicas or pipelined[0][2] == "payload"
    for name, value in replicas.items():
        source, tensor = name.split(".", 1)
        assert torch.equal(value, params[f"layers.{source}.attn.indexer.{tensor}"]), name


def test_shared_state_lifetime(pipelined):
    (stages, *_), ranks = pipelined
    for r in ranks:
        assert all(live == [] for live in r["live_after"]), r["live_after"]
        assert 1 <= r["peak_microbatches"] <= min(harness.MICROBATCHES, stages - r["stage"])


def test_one_backward_traversal_per_microbatch(pipelined):
    _, ranks = pipelined
    for r in ranks:
        assert r["backward_traversals"] == harness.MICROBATCHES * harness.STEPS
