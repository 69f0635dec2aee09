"""``python -m train.score <checkpoint | export | released dir> (--text FILE | --tokens FILE) [--out FILE]
[--logits] [--device auto|cpu|cuda]``: how well trained weights predict given documents.

The weights are read as ``train.generate`` reads them (a checkpoint of ours or an export), or DeepSeek's released
directory (``train/formats/released_format.py``: its config.json gives the model, its FP8 / FP4 tensors are dequantised;
its ``tokenizer.json`` tokenizes and gives Engram its normalised ids; without one the byte-level tokenizer
tokenizes and Engram hashes the ids unnormalised). ``--text``: every non-empty line is a document (a paragraph over
several lines is several documents: put each document on one line), tokenized with BOS in front as training does;
``--tokens``: a JSON list of documents, each a list of token ids, scored as given. Each document runs through the
model's forward alone (fp32, no KV cache); the per-document perplexity ``exp(mean -log p)`` over its predicted tokens
is printed, and ``--out`` (default: beside the input, ``<FILE>.score.safetensors``, not the current directory)
receives ``doc<i>.tokens``, ``doc<i>.logprobs`` (the log-probability of every token after the first) and with
``--logits`` ``doc<i>.logits``, written atomically; the last line prints its absolute path.
The quickest check that an import matches its source: score both and compare.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from model import Transformer
from model.deepseek_config import is_released, released_model
from model.engram import compressed_token_map
from train.data.tokenizer import ByteTokenizer, load_tokenizer
from train.formats.init_from import load_stage
from train.formats.released_format import ReleasedWeights
from train.generate import load as load_ours


def load(path: str, device: torch.device):
    """(model in eval mode on ``device``, tokenizer) of the weights at ``path``."""
    location = Path(path).expanduser().resolve()
    if not is_released(location):
        return load_ours(path, device)
    source = ReleasedWeights(location)
    args, layout = released_model(source.source_config)
    beside = location / "tokenizer.json"
    tokenizer = load_tokenizer(str(beside)) if beside.is_file() else ByteTokenizer()
    # Engram hashes normalised ids: the release's tokenizer's map; without one, the ids as they are
    model = Transformer(args, layout, init=False,
                        token_map=compressed_token_map(tokenizer) if args.engram.layers and beside.is_file() else None)
    load_stage(model, source, set(model.state_dict()))
    return model.to(device).eval(), tokenizer


def documents(options, tokenizer) -> list[list[int]]:
    if options.tokens:
        docs = json.loads(Path(options.tokens).read_text())
        if not isinstance(docs, list) or not all(isinstance(d, list) and len(d) >= 2 for d in docs):
            raise ValueError(f"--tokens {options.tokens}: give a JSON list of documents, each a list of >= 2 ids")
        return docs
    lines = [line for line in Path(options.text).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [[tokenizer.bos_id, *tokenizer.encode(line)] for line in lines]


@torch.no_grad()
def score(model, doc: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities of tokens 1.. [n-1], logits [n, vocab]) of one document."""
    ids = torch.as_tensor(doc, dtype=torch.long, device=device)[None]
    logits = model(ids, torch.zeros_like(ids)).logits[0].float()
    logprobs = F.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logprobs.cpu(), logits.cpu()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.score", description=__doc__.split("\n\n")[1])
    parser.add_argument("weights", help="a checkpoint (directory or step), an export, or a released directory")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--text", help="a text file: one document per non-empty line")
    given.add_argument("--tokens", help="a JSON file: a list of documents, each a list of token ids")
    parser.add_argument("--out", type=Path, help="where the log-probs go (default: <FILE>.score.safetensors "
                                                 "beside the --text or --tokens file)")
    parser.add_argument("--logits", action="store_true", help="also write every position's logits")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    options = parser.parse_args(argv)
    device = torch.device("cuda" if options.device == "cuda" or options.device == "auto" and
                          torch.cuda.is_available() else "cpu")
    try:
        model, tokenizer = load(options.weights, device)
        docs = documents(options, tokenizer)
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
    out = {}
    for i, doc in enumerate(docs):
        logprobs, logits = score(model, doc, device)
        out[f"doc{i}.tokens"], out[f"doc{i}.logprobs"] = torch.as_tensor(doc), logprobs
        if options.logits:
            out[f"doc{i}.logits"] = logits
        print(f"doc {i}: {len(doc)} tokens, perplexity {math.exp(-logprobs.double().mean().item()):.4f}")
    target = (options.out or Path(f"{options.text or options.tokens}.score.safetensors")).resolve()
    partial = target.with_name(f".{target.name}.tmp")
    save_file(out, str(partial))
    partial.replace(target)  # atomic: a reader never sees half a file
    print(f"wrote {target} ({len(docs)} documents)")


if __name__ == "__main__":
    main(sys.argv[1:])
