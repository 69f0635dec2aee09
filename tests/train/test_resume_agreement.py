"""``checkpoint.agree``: the ranks resume one checkpoint, rank 0's choice, and hash each file once between them (2 gloo
processes, checkpoints of plain files). The newest checkpoint has one flipped byte, which only a digest sees: every
rank gets the older one, and each file of the candidates was hashed by exactly one rank.

Planted bugs it catches: every rank checking every file (each hashed twice); a rank choosing on its own (rank 1 is
shown another checkpoint directory, in which it would find another step); a flipped byte not seen (the damaged one
taken)."""
from collections import Counter
from pathlib import Path

import torch

from parallel.local import spawn
from tests.support.checkpoint_recovery import damage, make_checkpoint


def _worker(rank, out):
    from train.formats import checkpoint, manifest

    hashed = []
    real = manifest.sha256

    def counting(path):
        hashed.append(str(path))
        return real(path)
    manifest.sha256 = counting
    mine = Path(out) / ("checkpoints" if rank == 0 else "elsewhere")  # only rank 0's directory counts
    ref = checkpoint.agree("auto", mine)
    torch.save({"ref": str(ref.path), "hashed": hashed}, f"{out}/rank{rank}.pt")


def test_ranks_agree_and_hash_each_file_once(tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoint(ckpt, 100)
    damage(make_checkpoint(ckpt, 200), "flip")
    other = tmp_path / "elsewhere"
    make_checkpoint(other, 300)
    spawn(_worker, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [r["ref"] for r in ranks] == [str(ckpt / "step00000100")] * 2
    data = Counter(p for r in ranks for p in r["hashed"] if not p.endswith("manifest.json"))
    expected = {str(ckpt / tag / name) for tag in ("step00000100", "step00000200")
                for name in ("layer_000.pt", "optimizer_stage00_dp00.pt", "trainer_state.json")}
    assert set(data) <= expected and set(data) >= {p for p in expected if "step00000100" in p}, data
    assert all(count == 1 for count in data.values()), data
    assert all(r["hashed"] for r in ranks)  # both ranks did a share
