"""bench/import_slice.py --smoke: the import benchmark's phases on the CPU (v41_mini widths, 64 experts a layer, rank
0 of 16 holding 4), its checks passing and its bytes read the rank's share, worked out here; the import of a LoRA run
over the base held as released (``import_quantized``) in the same run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run (its phases write, import_cold, import_quantized): its JSON (written when a check fails too),
    the directory it wrote in and the finished process."""
    directory = tmp_path_factory.mktemp("import_slice")
    out = directory / "import_slice.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/import_slice.py"), "--smoke", "--dir",
                           str(directory), "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert out.is_file(), done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text()), directory, done


def test_smoke_imports_the_ranks_share_exactly(smoke):
    """The write's quantised tensors come back exact, and the import's values equal the written ones, every stage
    tensor loaded. The bytes read are the file's stored bytes less the 60 experts a layer the rank does not hold:
    an expert's w1 and w3 [32, 128] and w2 [128, 32] in FP4 are 32 x 128 / 2 code bytes and 32 x 128 / 32 scale
    bytes each, 2,176, so 6,528 an expert. Planted and caught: every expert read (the bytes), an e8m0 bias off by
    one in ``model/quant.py`` (the values)."""
    result, tmp_path, done = smoke
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert {"command", "machine", "date", "code"} <= set(result)
    write, share = result["write"], result["write"]["slice"]
    assert share["held_experts"] == [0, 3] and share["routed_experts_in_file"] == 64
    assert write["quantised_exact"] == write["quantised_tensors"] > 0
    imported = result["import_cold"]
    assert imported["check"]["ok"] and all(imported["check"]["exact"].values()), imported["check"]
    assert imported["bytes_read"] == share["stored_bytes_in_file"] - 4 * 60 * 6528
    assert imported["bytes_read"] < imported["bytes_in_files"] / 2
    assert not list(tmp_path.glob("import_slice_*")), "the released files are removed without --keep"


def test_smoke_imports_the_quantized_base_as_stored(smoke):
    """``import_quantized`` holds the rank's FP8 / FP4 tensors as the file stores them, each layer's 5 attention
    matrices (and layer 20's indexer wq_b), 3 shared-expert and 4 x 3 routed-expert matrices, decodes none, reads the
    same share as the dequantised import, and checks the same first and last tensor of each stored form (the last
    layer's last held expert among them): their bytes the file's, their values the written ones. Planted and caught:
    ``fill_stored`` skipping the stage's last layer (its buffers keep ``torch.empty``'s bytes: the bytes read and the
    last tensors), ``fill_stored`` leaving the scales unfilled (the same bytes read: the exact check alone), the check
    reading the scale's bytes from the codes' tensor."""
    result, _, _ = smoke
    cold, quantized = result["import_cold"], result["import_quantized"]
    assert quantized["check"]["ok"] and all(quantized["check"]["exact"].values()), quantized["check"]
    assert quantized["quantized_base"] and not cold["quantized_base"]
    assert quantized["held_as_stored"] == 4 * (5 + 3 + 4 * 3) + 1 and cold["held_as_stored"] == 0
    assert quantized["dequantise_s"] == {} and set(cold["dequantise_s"]) == {"fp8 32x32", "fp4 1x32"}
    assert quantized["bytes_read"] == cold["bytes_read"] == cold["bytes_predicted"]
    assert quantized["values_loaded"] == cold["values_loaded"]
    assert set(quantized["check"]["exact"]) == set(cold["check"]["exact"])
    assert "layers.23.ffn.experts.3.w3.weight" in quantized["check"]["exact"]
    assert result["engram_tables_estimate"]["held_as_stored_s"] > 0
