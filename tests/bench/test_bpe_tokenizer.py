"""bench/bpe_tokenizer.py on a few files: the tokenizer the data pipeline loads, trained on the training part only,
and a summary whose shares and load floor a direct count confirms."""
import json
import sys
from collections import Counter
from pathlib import Path

from train.data.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import bpe_tokenizer  # noqa: E402


def test_trained_on_the_training_part_with_a_summary_that_a_count_confirms(tmp_path, monkeypatch):
    """Six files, one held out (data.heldout_fraction's smallest hash): five documents read, the held-out one's
    unique name never in the vocabulary. The pipeline finds the specials by name. The top share and the floor
    (share x E / k) against a count of the encoded training files. Planted: every document read (6, and the
    held-out name merged into a token), the floor without the x E / k, the share over the bytes: each fails."""
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
    texts = [p.read_text() for p in sorted(corpus.glob("*.py"))]
    encoded = {text: tokenizer.encode(text) for text in texts}
    held_out = [text for text in texts if len(tokenizer.encode(text)) > len(min(encoded.values(), key=len)) + 2]
    assert len(held_out) == 1  # the held-out file's unique name was never merged: more tokens than the others
    counts = Counter(i for text in texts if text not in held_out for i in encoded[text])
    tokens = sum(counts.values())
    assert summary["tokens"] == tokens
    share = counts.most_common(1)[0][1] / tokens
    assert abs(summary["top_tokens"][0]["share"] - share) < 1e-12
    assert abs(summary["load_floor"] - share * 32 / 4) < 1e-12
