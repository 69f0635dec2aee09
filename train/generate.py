"""``python -m train.generate <checkpoint | export> --prompt TEXT [--chat] [--max-new-tokens N] [--temperature T]
[--top-k K] [--top-p P] [--seed S] [--device auto|cpu|cuda]``: text sampled from trained weights, to judge a run by
reading it.

The weights are a checkpoint of ours (a checkpoint directory or one step directory) or an exported directory
(``python -m train.export``), read as ``train.init_from`` reads them; the model and layout are the ones saved with
them and the tokenizer the run's (a checkpoint's ``data.tokenizer``; an export's ``tokenizer.json``, else the
byte-level one). The prompt starts with BOS, as every training document does; with ``--chat`` it is one user
message in the run's chat format (``train/data/sft.py``: its template, or the default ``<|user|>`` / ``<|assistant|>``
markers) and the answer is generated. Sampling stops at EOS or after ``--max-new-tokens``: greedy at temperature 0
(the default), else from the softmax at ``--temperature``, cut to the ``--top-k`` most probable tokens, then to the
smallest set of tokens whose probability reaches ``--top-p`` (nucleus sampling), seeded by ``--seed``. Only the
tokenizer's own ids are sampled, never BOS or PAD.

There is no KV cache: every new token runs the whole prefix through the model's forward,
``Transformer(args, layout)(input_ids, doc_ids).logits``, so a sequence of n tokens costs n forwards of up to n
tokens. That is plenty for a CPU tool on short samples, and it keeps working whatever the model grows (MoE,
hyper-connections, Engram) because it uses nothing but that forward.
"""
import argparse
import sys
from pathlib import Path

import torch

from model import ModelArgs, Transformer, layout_from_config
from model.deepseek_config import model_and_layout
from model.engram import compressed_token_map
from train.data import sft
from train.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from train.formats import checkpoint, sources
from train.formats.reference_format import ExportedWeights, is_exported


def load(path: str, device: torch.device) -> tuple[Transformer, Tokenizer]:
    """The model (eval mode, fp32, on ``device``) and the tokenizer of the weights at ``path``."""
    location = Path(path).expanduser().resolve()
    if is_exported(location):
        source = ExportedWeights(location)
    else:
        try:
            ref = checkpoint.locate(path, "checkpoint")
        except checkpoint.NoCheckpoint:
            raise ValueError(f"{path}: no weights there ({location} is neither an exported directory with config.json "
                             "and model.safetensors, nor a checkpoint directory or one step directory) — give "
                             "<run dir>/checkpoints, one of its step directories, or an export") from None
        source = sources.CheckpointWeights(ref)
    if isinstance(source, ExportedWeights):
        args, layout = model_and_layout(source.config)
        beside = source.directory / "tokenizer.json"
        tokenizer = load_tokenizer(str(beside)) if beside.is_file() else ByteTokenizer()
    else:
        saved = checkpoint.read_trainer_state(ref)["config"]
        args, layout = ModelArgs.from_config(saved["model"]), layout_from_config(saved["layout"])
        data = saved.get("data", {})
        tokenizer = load_tokenizer(data.get("tokenizer"), data.get("bos_token"), data.get("eos_token"),
                                   data.get("pad_token"))
    model = Transformer(args, layout, init=False,
                        token_map=compressed_token_map(tokenizer) if args.engram.layers else None)
    model.load_state_dict(source.load(list(model.state_dict())), strict=True)
    return model.to(device).eval(), tokenizer


def prompt_tokens(tokenizer: Tokenizer, prompt: str, chat: bool, max_tokens: int) -> torch.Tensor:
    """The prompt as the model saw text in training: ``[BOS] prompt``, or a user turn and the assistant's header."""
    if chat:
        ids = sft.ChatEncoder(tokenizer, max_tokens).generation_prompt([{"role": "user", "content": prompt}])
    else:
        ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
    return torch.as_tensor(ids, dtype=torch.long)


def sampling_probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                           top_k: int = 0) -> torch.Tensor:
    """The distribution a token is drawn from at ``temperature`` > 0 (float64, summing to 1): the softmax of
    ``logits / temperature``, cut to the ``top_k`` most probable tokens (0: no cut), then to the nucleus, the most
    probable tokens whose probabilities first reach ``top_p`` (at least one), renormalised. Its own function so that
    tests can compare it with distributions computed by hand."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    if top_k:
        ordered = ordered * (torch.arange(len(ordered)) < top_k)
        ordered = ordered / ordered.sum()
    before = ordered.cumsum(0).roll(1)  # the sum of the tokens before each one (not cumsum - p: that rounds)
    before[0] = 0.0
    keep = before < top_p  # a token joins while the ones before it fall short of top_p; the first always does
    nucleus = ordered * keep
    return torch.zeros_like(probs).scatter(0, order, nucleus / nucleus.sum())


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
               top_k: int = 0) -> int:
    """Greedy at temperature 0; else a draw from ``sampling_probabilities``."""
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(sampling_probabilities(logits, temperature, top_p, top_k), 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, tokenizer: Tokenizer, prompt: torch.Tensor, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, top_k: int = 0) -> list[int]:
    """The tokens after ``prompt`` (1-D ids), up to EOS (not included) or ``max_new_tokens``; on a GPU under bf16
    autocast over the fp32 weights, as training runs there."""
    device = next(model.parameters()).device
    banned = torch.zeros(model.args.vocab_size, dtype=torch.bool, device=device)
    banned[tokenizer.vocab_size:] = True  # ids past the tokenizer's: the model's spare rows
    banned[[i for i in (tokenizer.bos_id, tokenizer.pad_id) if i != tokenizer.eos_id]] = True
    generator = torch.Generator().manual_seed(seed)
    ids, new = prompt.to(device)[None], []
    for _ in range(max_new_tokens):
        with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):  # as training computes on a GPU
            logits = model(ids, torch.zeros_like(ids)).logits[0, -1].masked_fill(banned, float("-inf"))
        token = next_token(logits.float().cpu(), temperature, top_p, generator, top_k)
        if token == tokenizer.eos_id:
            break
        new.append(token)
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return new


def parser() -> argparse.ArgumentParser:
    command = argparse.ArgumentParser(prog="python -m train.generate", description=__doc__.split("\n\n")[1])
    command.add_argument("weights", help="a checkpoint directory (its latest), one step directory, or an export")
    command.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    command.add_argument("--chat", action="store_true", help="answer the prompt as one user turn, in the run's "
                                                             "chat format (for fine-tuned conversation models)")
    command.add_argument("--max-new-tokens", type=_positive, default=200, metavar="N")
    command.add_argument("--temperature", type=_non_negative, default=0.0, metavar="T",
                         help="0 (default): greedy; else sample from softmax(logits / T)")
    command.add_argument("--top-p", type=_probability, default=1.0, metavar="P",
                         help="sample only from the most probable tokens whose probabilities reach P (default 1)")
    command.add_argument("--top-k", type=_count, default=0, metavar="K",
                         help="sample only from the K most probable tokens (default 0: all), before --top-p")
    command.add_argument("--seed", type=int, default=0, help="the sampling seed (temperature > 0)")
    command.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                         help="auto (default): the GPU if there is one")
    return command


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(text)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def _probability(text: str) -> float:
    value = _non_negative(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not in (0, 1]")
    return value


def main(argv: list[str]) -> None:
    from model.cli import USAGE_ERROR, error_line

    options = parser().parse_args(argv)
    if options.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no GPU is visible — use --device cpu (or auto)")
    device = torch.device("cuda" if options.device != "cpu" and torch.cuda.is_available() else "cpu")
    try:
        model, tokenizer = load(options.weights, device)
        prompt = prompt_tokens(tokenizer, options.prompt, options.chat, 2 ** 31)
    except (checkpoint.CheckpointError, ValueError, OSError, KeyError) as error:
        print(error_line(error), file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None
    new = generate(model, tokenizer, prompt, options.max_new_tokens, options.temperature, options.top_p,
                   options.seed, options.top_k)
    print(tokenizer.decode(new), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
