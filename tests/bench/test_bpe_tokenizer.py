"""bench/bpe_tokenizer.py on a few files: the tokenizer the data pipeline loads, trained on the training part only,
and a summary whose shares and load floor a direct count confirms."""
import json
import sys
from collections import Counter
from pathlib import Path

from model.config import DataConfig
from train.data.loader import build_documents
from train.data.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import bpe_tokenizer  # noqa: E402


def test_trained_on_the_training_part_with_a_summary_that_a_count_confirms(tmp_path, monkeypatch):
    """Six files, one held out (the loader's split: data.heldout_fraction's smallest hash): five documents read. The
    pipeline finds the specials by name. The tokens, the top share and the floor (share x E / k) against a count of
    the encoded training files alone. Planted: every document read (6 documents, and the held-out file's tokens
    counted), the floor without the x E / k: each fails."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"m{i}.py").write_text(f"def unique_name_{i}_{i}_{i}(x):\n    return x + {i}\n\n" * 3)
    out = tmp_path / "tok.json"
    monkeypatch.setattr(sys, "argv", ["bpe_tokenizer.py", "--vocab", "400", "--experts", "32", "--topk", "4",
                                      "--out", str(out), f"data.path={corpus}"])
    bpe_tokenizer.main()
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["documents"] == 5
    tokenizer = HFTokenizer(str(out))
    assert sorted(tokenizer.token(i) for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)) == sorted(
        bpe_tokenizer.SPECIALS)
    held_out = list(build_documents(DataConfig(source="stdlib", path=str(corpus)), heldout=True).texts(0, 0))
    assert len(held_out) == 1
    texts = [p.read_text() for p in sorted(corpus.glob("*.py"))]
    counts = Counter(i for text in texts if text not in held_out for i in tokenizer.encode(text))
    tokens = sum(counts.values())
    assert summary["tokens"] == tokens
    share = counts.most_common(1)[0][1] / tokens
    assert abs(summary["top_tokens"][0]["share"] - share) < 1e-12
    assert abs(summary["load_floor"] - share * 32 / 4) < 1e-12
