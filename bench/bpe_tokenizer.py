"""A byte-level BPE tokenizer trained on the training part of a corpus, for GPU runs on real text with a real
vocabulary (issue 54): the byte tokenizer's unigram law routes by character at initialisation, so a layer's load
can be no flatter than its most frequent byte (a space is 29% of the standard library's bytes: max/mean >= 2.3 at
top-4 of 32 experts), where a BPE vocabulary's most frequent token is a few percent.

  python bench/bpe_tokenizer.py --vocab 32768 --out tok.json                  # the standard library's *.py files
  python bench/bpe_tokenizer.py --vocab 32768 --out tok.json data.path=<dir>  # any data= source, as in training

Held-out documents (data.heldout_fraction) are not read. The file names its specials <|bos|>, <|eos|>, <|pad|>,
which `train.data.tokenizer` finds by name; a JSON beside it says what it was trained on, with each token's share
of the training text and the load floor that share sets.
"""
import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model.cli import job_config  # noqa: E402
from train.data.loader import build_documents  # noqa: E402

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]


def train(texts, vocab: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--out", required=True, help="the tokenizers JSON")
    parser.add_argument("--experts", type=int, default=32, help="E, for the load floor of the most frequent token")
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="data settings, as python -m train takes them (data.path=...)")
    args = parser.parse_args()
    config = job_config(args.overrides).data  # the data settings as `python -m train <overrides>` resolves them
    texts = list(build_documents(config).texts(0, 0))
    tokenizer = train(texts, args.vocab)
    out = Path(args.out)
    tokenizer.save(str(out))
    counts = Counter(i for encoding in tokenizer.encode_batch(texts) for i in encoding.ids)
    tokens = counts.total()
    top = counts.most_common(8)
    text_bytes = sum(len(t.encode("utf-8", errors="surrogatepass")) for t in texts)
    share = top[0][1] / tokens
    summary = {"command": " ".join(sys.argv), "data": {"source": config.source, "path": config.path}, "documents": len(texts), "bytes": text_bytes,
               "tokens": tokens, "bytes_per_token": text_bytes / tokens, "vocab": tokenizer.get_vocab_size(),
               "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
               "top_tokens": [{"token": tokenizer.id_to_token(i), "share": n / tokens} for i, n in top],
               "load_floor": share * args.experts / args.topk}
    out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "top_tokens"}))


if __name__ == "__main__":
    main()
