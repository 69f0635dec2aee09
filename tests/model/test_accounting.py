"""The accounting CLI reproduces SPEC §1.6 at V4.1-Flash dims, from the real modules; indexer FLOPs by hand."""
import functools
import json

import pytest

from model.accounting import account, main, mean_scored_entries
from model.cli import compose
from model.config import ModelArgs
from model.layout import layout_from_config
from tests.support.cli import run_module


def accounting(*overrides):
    out = run_module("model.accounting", *overrides, "format=json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def v41_flash():
    """The CLI's figures of V4.1-Flash (one run for the tests that read them)."""
    return accounting("model=v41_flash", "layout=v41")


def test_v41_flash_numbers_match_spec(v41_flash):
    figures = v41_flash
    assert figures["params_common_per_layer"] / 1e6 == pytest.approx(126.6, abs=0.05)  # "约 127M"
    assert figures["params_reindex_extra"] / 1e6 == pytest.approx(5.4, abs=0.05)
    assert figures["params_compress_index_total"] / 1e6 == pytest.approx(62, abs=0.5)
    assert figures["entries_per_token"] == 2.5
    assert figures["kv_bytes_per_token"] == 890  # 3 x 178 + 356
    assert figures["params_full_extra_m2"] - figures["params_full_extra_m1"] == 5120 * 512  # only m>1 has wgate


def test_v41_flash_parts_match_spec(v41_flash):
    """SPEC §5.5: backbone ~552 B without the Engram tables and the draft head, the tables 2 x ~384.0 M x 256 rows
    (exactly the released row counts), ~16 B active per token; §5.1's 13.59 B routed parameters a layer. Counting the
    tables or the draft head in the backbone, or every routed expert as active, misses these by billions."""
    figures = v41_flash
    routed_per_layer = 384 * 3 * 2304 * 5120
    assert routed_per_layer / 1e9 == pytest.approx(13.59, abs=0.005)
    assert figures["params_backbone"] / 1e9 == pytest.approx(552, abs=1)
    assert figures["params_engram_tables"] == (384006168 + 384016682) * 256
    assert figures["params_active_per_token"] / 1e9 == pytest.approx(16, abs=0.5)
    idle = 40 * routed_per_layer * (384 - 6) // 384
    assert figures["params_active_per_token"] == figures["params_backbone"] - 129280 * 5120 - idle
    assert figures["params_total"] == (figures["params_backbone"] + figures["params_engram_tables"]
                                       + figures["params_dspark"])


def test_all_full_shows_what_sharing_saves():
    figures = accounting("model=v41_flash", "layout=all_full")
    assert figures["entries_per_token"] == 18 / 2 + 20
    assert figures["kv_bytes_per_token"] == 356 * (9 + 20)


def test_bad_override_is_one_line_error():
    out = run_module("model.accounting", "layout.kv_source_layer_ids=[3]")
    assert out.returncode != 0 and out.stderr.strip().startswith("error:") and "Traceback" not in out.stderr


@functools.cache  # a pure function of its arguments: the tests that ask for the same figures share them
def figures_at(seq_len, *overrides):
    cfg = compose(["model=v41_flash", *overrides])
    return account(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout), seq_len)


def test_indexer_flops_by_hand_at_v41_flash_dims():
    T = 2**20
    per_entry = 2 * 32 * 128  # one q·k product per index head
    projection = 2 * (1280 * 32 * 128 + 5120 * 32)  # wq_b from qr, and weights_proj
    full = 3 * mean_scored_entries(T, 2) + mean_scored_entries(T, 1)  # layers 2, 8, 14 (m=2) and 20 (m=1)
    reindex = 4 * mean_scored_entries(T, 1, cap=2048 * 8)  # 24..36 score only their candidate blocks
    expected = 8 * projection + per_entry * (full + reindex)
    assert figures_at(T, "layout=v41")["indexer_flops_per_token"] == pytest.approx(expected)
    assert mean_scored_entries(T, 2) == pytest.approx(T / 4, rel=1e-5)  # T/m/2 on average
    assert mean_scored_entries(T, 1, cap=16384) == pytest.approx(16384, rel=0.01)


def test_candidates_keep_reindex_cost_flat_in_context_length():
    def reindex_flops(seq_len, *overrides):
        """What the decoder's four Reindex layers add to the indexer FLOPs per token."""
        with_reindex, without = (figures_at(seq_len, "layout=v41", *overrides, *extra)["indexer_flops_per_token"]
                                 for extra in ((), ("layout.decoder.reindex_every=0",)))
        return with_reindex - without

    short, long = 2**18, 2**20
    assert reindex_flops(long) == pytest.approx(reindex_flops(short), rel=0.05)  # capped at 2048 blocks of 8
    assert reindex_flops(long, "layout.candidates=false") > 3.5 * reindex_flops(short, "layout.candidates=false")


def test_window_only_has_no_indexer_cost():
    figures = figures_at(4096, "layout=window_only")
    assert figures["indexer_flops_per_token"] == 0 and figures["kv_bytes_per_token"] == 0


def test_seq_len_argument_defaults_to_the_data_config(capsys):
    def cli(*args):
        main([*args, "format=json"])
        return json.loads(capsys.readouterr().out)

    default, longer = cli("data.seq_len=512"), cli("data.seq_len=512", "seq_len=4096")
    assert default["seq_len"] == 512 and longer["seq_len"] == 4096
    assert longer["indexer_flops_per_token"] > default["indexer_flops_per_token"]
    assert {k: v for k, v in longer.items() if k not in ("seq_len", "indexer_flops_per_token")} == \
        {k: v for k, v in default.items() if k not in ("seq_len", "indexer_flops_per_token")}
    with pytest.raises(SystemExit, match="seq_len='long'"):
        main(["seq_len=long"])
