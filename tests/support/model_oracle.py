"""What test_model_oracle.py shares with other tests (DIMS, LAYOUTS, _one_thread, _pick_params, build_model, mk_layout,
packed_doc_ids), here so that no test module imports another."""
import pytest
import torch
from tests.support.oracle import oracle_forward, random_params


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """conftest's ``one_thread`` for every test of the modules that import this fixture."""
    yield


DIMS = dict(vocab_size=50, dim=64, n_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2,
            o_lora_rank=16, window_size=8, index_n_heads=8, index_head_dim=16, index_topk=4, inter_dim=96,
            norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=500.0, rope_factor=4.0, original_seq_len=64,
            beta_fast=32.0, beta_slow=1.0)


def mk_layout(ratios, kv, index, cand=None, keep=2, bs=2):
    return dict(compress_ratios=list(ratios), kv_source_layer_ids=list(kv), index_source_layer_ids=list(index),
                candidate_source_layer_id=cand, candidate_topk_blocks=keep, candidate_block_size=bs)


# layouts covering every mode for m in {1,2,3}, plus candidates
LAYOUTS = {
    "m1": mk_layout([0, 1, 1, 1], [1], [1, 2]),
    "m2": mk_layout([0, 2, 2, 2], [1], [1, 2]),
    "m3": mk_layout([0, 3, 3, 3], [1], [1, 2]),
    # two KVs of different ratios, a candidate source (m=1) with a Reindex and a Reuse after it
    "mixed_cand": mk_layout([0, 2, 2, 1, 1, 1], [1, 3], [1, 3, 4], cand=3, keep=3, bs=2),
    # a Full layer after the candidate source: it and the Reindex layer on its KV select inside the candidate
    # source's blocks too (the reference restricts every later index source)
    "cand_full": mk_layout([0, 1, 1, 1, 1, 1], [1, 3], [1, 2, 3, 4], cand=1, keep=3, bs=2),
    # candidate source with m=2, two later Reindex layers (both restricted), block size 3
    "cand_m2": mk_layout([2, 2, 2, 2], [0], [0, 1, 3], cand=0, keep=2, bs=3),
}


def _pick_params(dims, layout, ids, doc_ids=None, seed=0, min_gap=1e-6, tries=20):
    """Random fp64 params whose selections (for these inputs) have a clear gap at every boundary."""
    for k in range(tries):
        P = random_params(dims, layout, seed=seed + 1000 * k)
        diag = {}
        with torch.no_grad():
            oracle_forward(P, dims, layout, ids, doc_ids, diag=diag)
        if min(diag["topk_margin"], diag["block_margin"]) > min_gap:
            return P, diag
    raise RuntimeError("no seed with unambiguous selections")


# ----------------------------------------------------------------------------------------------------------
# the model against the oracle
# ----------------------------------------------------------------------------------------------------------
def build_model(dims, layout, params, dtype=torch.float64):
    """The real model with the given parameter values (names must match exactly)."""
    from model import Layout, ModelArgs, Transformer

    args = ModelArgs(**dims, kernel_backend="torch")
    model = Transformer(args, Layout(**layout)).to(dtype)
    names = dict(model.named_parameters())
    assert set(names) == set(params), (sorted(set(names) ^ set(params)))
    with torch.no_grad():
        for n, p in names.items():
            assert p.shape == params[n].shape, n
            p.copy_(params[n])
    return model


def packed_doc_ids(B, T, lens_per_row):
    rows = []
    for lens in lens_per_row:
        assert sum(lens) == T
        rows.append(torch.cat([torch.full((n,), d) for d, n in enumerate(lens)]))
    return torch.stack(rows)
