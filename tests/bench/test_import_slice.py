"""bench/import_slice.py --smoke: the import benchmark's phases on the CPU (v41_mini widths, 64 experts a layer, rank
0 of 16 holding 4), its checks passing and its bytes read the rank's share, worked out here."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_imports_the_ranks_share_exactly(tmp_path):
    """The write's quantised tensors come back exact, and the import's values equal the written ones, every stage
    tensor loaded. The bytes read are the file's stored bytes less the 60 experts a layer the rank does not hold:
    an expert's w1 and w3 [32, 128] and w2 [128, 32] in FP4 are 32 x 128 / 2 code bytes and 32 x 128 / 32 scale
    bytes each, 2,176, so 6,528 an expert. Planted and caught: every expert read (the bytes), an e8m0 bias off by
    one in ``model/quant.py`` (the values)."""
    out = tmp_path / "import_slice.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/import_slice.py"), "--smoke", "--dir",
                           str(tmp_path), "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {"command", "machine", "date", "code"} <= set(result)
    write, share = result["write"], result["write"]["slice"]
    assert share["held_experts"] == [0, 3] and share["routed_experts_in_file"] == 64
    assert write["quantised_exact"] == write["quantised_tensors"] > 0
    imported = result["import_cold"]
    assert imported["check"]["ok"] and all(imported["check"]["exact"].values()), imported["check"]
    assert imported["bytes_read"] == share["stored_bytes_in_file"] - 4 * 60 * 6528
    assert imported["bytes_read"] < imported["bytes_in_files"] / 2
    assert not list(tmp_path.glob("import_slice_*")), "the released files are removed without --keep"
