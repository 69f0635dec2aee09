"""The accounting CLI reproduces SPEC §1.6 at V4.1-Flash dims, from the real modules."""
import json
import subprocess
import sys

import pytest


def accounting(*overrides):
    out = subprocess.run([sys.executable, "-m", "model.accounting", *overrides, "format=json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_v41_flash_numbers_match_spec():
    figures = accounting("model=v41_flash", "layout=v41")
    assert figures["params_common_per_layer"] / 1e6 == pytest.approx(126.6, abs=0.05)  # "约 127M"
    assert figures["params_reindex_extra"] / 1e6 == pytest.approx(5.4, abs=0.05)
    assert figures["params_compress_index_total"] / 1e6 == pytest.approx(62, abs=0.5)
    assert figures["entries_per_token"] == 2.5
    assert figures["kv_bytes_per_token"] == 890  # 3 x 178 + 356
    assert figures["params_full_extra_m2"] - figures["params_full_extra_m1"] == 5120 * 512  # only m>1 has wgate


def test_all_full_shows_what_sharing_saves():
    figures = accounting("model=v41_flash", "layout=all_full")
    assert figures["entries_per_token"] == 18 / 2 + 20
    assert figures["kv_bytes_per_token"] == 356 * (9 + 20)


def test_bad_override_is_one_line_error():
    out = subprocess.run([sys.executable, "-m", "model.accounting", "layout.kv_source_layer_ids=[3]"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and out.stderr.strip().startswith("error:") and "Traceback" not in out.stderr
