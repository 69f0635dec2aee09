"""Synthetic long-context probes: can the model fetch a fact from far back in its context?

- passkey retrieval: a random 5-digit key hidden at a chosen depth in filler text, asked for at the end;
- MQAR (multi-query associative recall): key=value pairs at the start, queries for some keys spread over the
  rest of the context.

A sample is one document of exactly `seq_len` tokens, generated deterministically from (seed, index). The
answer tokens are inside `input_ids` (teacher forcing): the model gets an answer token right when the argmax
of its logits at the position before equals it (`probe_accuracy`). Prompt pieces are tokenized separately and
concatenated, so the answer positions are exact with any tokenizer, and each answer directly follows a "="
so that no answer token is a mere space. Depths (passkey) and query positions (MQAR) are stratified over the
context, so a set of samples covers near and far facts evenly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from train.data.tokenizer import Tokenizer

DEFAULT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_KEYS = range(10_000, 100_000)  # a passkey is one of these, uniformly
MQAR_VALUES = range(1000, 10_000)  # an MQAR value is one of these, uniformly


@dataclass(frozen=True)
class ProbeSample:
    """One probe document; `answer_ids == input_ids[answer_positions]`."""

    kind: str
    input_ids: torch.Tensor  # [T] int64
    doc_ids: torch.Tensor  # [T] int64, all 0: one document
    answer_positions: torch.Tensor  # [K] int64, positions of the answer tokens in input_ids (>= 1)
    answer_ids: torch.Tensor  # [K] int64
    fact_positions: torch.Tensor  # [K] int64, where the needle / key=value pair of each answer token starts


class _Builder:
    """Concatenates separately tokenized pieces, remembering where answers and facts are."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = [tokenizer.bos_id]
        self.answer_positions: list[int] = []
        self.fact_positions: list[int] = []

    def add(self, piece: str | list[int]) -> int:
        """Append text (or ids); return the position where it starts."""
        start = len(self.ids)
        self.ids += self.tokenizer.encode(piece) if isinstance(piece, str) else piece
        return start

    def add_answer(self, text: str, fact_position: int) -> None:
        start = self.add(text)
        self.answer_positions += range(start, len(self.ids))
        self.fact_positions += [fact_position] * (len(self.ids) - start)

    def finish(self, kind: str, seq_len: int) -> ProbeSample:
        assert len(self.ids) == seq_len, (len(self.ids), seq_len)
        ids = torch.tensor(self.ids, dtype=torch.int64)
        positions = torch.tensor(self.answer_positions, dtype=torch.int64)
        return ProbeSample(kind, ids, torch.zeros(seq_len, dtype=torch.int64), positions, ids[positions],
                           torch.tensor(self.fact_positions, dtype=torch.int64))


def _filler(ids: list[int], n: int, rng: np.random.Generator) -> list[int]:
    """`n` filler tokens read cyclically from a random offset of `ids`."""
    offset = int(rng.integers(len(ids)))
    repeats = (offset + n) // len(ids) + 1
    return (ids * repeats)[offset:offset + n]


def _tokens(tokenizer: Tokenizer, *texts: str) -> int:
    return sum(len(tokenizer.encode(t)) for t in texts)


def _filler_ids(tokenizer: Tokenizer, filler: str) -> list[int]:
    ids = tokenizer.encode(filler)
    if not ids:
        raise ValueError("probe filler text is empty")
    return ids


def _room(seq_len: int, fixed: int, kind: str) -> int:
    """Filler tokens left in a context of `seq_len` after `fixed` tokens of probe text and the BOS."""
    room = seq_len - 1 - fixed
    if room < 0:
        raise ValueError(f"seq_len {seq_len} is too short for the {kind} probe ({fixed + 1} tokens of prompt)")
    return room


def passkey_probes(tokenizer: Tokenizer, seq_len: int, n: int, seed: int = 0,
                   filler: str = DEFAULT_FILLER) -> list[ProbeSample]:
    """`n` passkey samples; sample i hides its key at a depth drawn in [i/n, (i+1)/n) of the filler.

    `filler` may be any text, e.g. held-out corpus documents; it is repeated as needed.
    """
    filler_ids = _filler_ids(tokenizer, filler)
    samples = []
    for i in range(n):
        rng = np.random.default_rng([seed, 0, i])
        samples.append(_passkey(tokenizer, seq_len, filler_ids, (i + rng.random()) / n, rng))
    return samples


def _passkey(tokenizer: Tokenizer, seq_len: int, filler_ids: list[int], depth: float,
             rng: np.random.Generator) -> ProbeSample:
    key = str(rng.integers(PASSKEY_KEYS.start, PASSKEY_KEYS.stop))
    intro = "A pass key is hidden in the text below. Find it and remember it.\n"
    needle = f"\nThe pass key is {key}. Remember it: pass_key={key}\n"
    question = "\nWhat is the pass key? pass_key="
    room = _room(seq_len, _tokens(tokenizer, intro, needle, question, key), "passkey")
    before = round(depth * room)
    sample = _Builder(tokenizer)
    sample.add(intro)
    sample.add(_filler(filler_ids, before, rng))
    needle_position = sample.add(needle)
    sample.add(_filler(filler_ids, room - before, rng))
    sample.add(question)
    sample.add_answer(key, needle_position)
    return sample.finish("passkey", seq_len)


def mqar_probes(tokenizer: Tokenizer, seq_len: int, n: int, seed: int = 0, n_pairs: int = 16,
                n_queries: int = 8, filler: str = DEFAULT_FILLER) -> list[ProbeSample]:
    """`n` MQAR samples: `n_pairs` lines `key=value` (4 letters = 4 digits) after a short header, then
    `n_queries` queries `key=` for distinct keys, answered by the value, each in a stratified slot of the
    filler that fills the rest of the context."""
    if not 1 <= n_queries <= n_pairs:
        raise ValueError(f"need 1 <= n_queries <= n_pairs, got n_queries={n_queries} n_pairs={n_pairs}")
    filler_ids = _filler_ids(tokenizer, filler)
    return [_mqar(tokenizer, seq_len, filler_ids, n_pairs, n_queries, np.random.default_rng([seed, 1, i]))
            for i in range(n)]


def _mqar(tokenizer: Tokenizer, seq_len: int, filler_ids: list[int], n_pairs: int, n_queries: int,
          rng: np.random.Generator) -> ProbeSample:
    pairs = _distinct_pairs(n_pairs, rng)
    asked = [pairs[k] for k in rng.choice(n_pairs, size=n_queries, replace=False)]
    header = "Remember the value of every key below.\n"
    lines = [f"{key}={value}\n" for key, value in pairs]
    queries = [(f"\n{key}=", value, "\n") for key, value in asked]
    room = _room(seq_len, _tokens(tokenizer, header, *lines, *(t for q in queries for t in q)), "mqar")
    cuts = [round(room * (j + rng.random()) / n_queries) for j in range(n_queries)]
    sample = _Builder(tokenizer)
    sample.add(header)
    line_position = {key: sample.add(line) for (key, _), line in zip(pairs, lines)}
    used = 0
    for cut, (prompt, value, newline), (key, _) in zip(cuts, queries, asked):
        sample.add(_filler(filler_ids, cut - used, rng))
        sample.add(prompt)
        sample.add_answer(value, line_position[key])
        sample.add(newline)
        used = cut
    sample.add(_filler(filler_ids, room - used, rng))
    return sample.finish("mqar", seq_len)


def _distinct_pairs(n: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    """`n` (key, value) pairs: distinct 4-letter keys, 4-digit values."""
    keys: dict[str, None] = {}
    while len(keys) < n:
        keys["".join(chr(ord("a") + int(c)) for c in rng.integers(26, size=4))] = None
    return [(key, str(rng.integers(MQAR_VALUES.start, MQAR_VALUES.stop))) for key in keys]


def probe_accuracy(logits: torch.Tensor, sample: ProbeSample) -> float:
    """Fraction of answer tokens predicted right: argmax of `logits [T,V]` at the position before each."""
    positions = sample.answer_positions.to(logits.device)
    predicted = logits[positions - 1].argmax(dim=-1)
    return (predicted == sample.answer_ids.to(logits.device)).float().mean().item()


def chance_accuracy(tokenizer: Tokenizer, values: range) -> float:
    """The accuracy of guessing: each answer token drawn uniformly from the tokens its position takes over all
    ``values`` (e.g. 1/9 for a key's first digit and 1/10 for the others, byte-level). What a model scores that
    knows the answer's format but cannot find the fact."""
    answers = [tokenizer.encode(str(value)) for value in values]
    seen: dict[int, set[int]] = {}
    for ids in answers:
        for position, token in enumerate(ids):
            seen.setdefault(position, set()).add(token)
    per_answer = [sum(1 / len(seen[p]) for p in range(len(ids))) / len(ids) for ids in answers]
    return sum(per_answer) / len(per_answer)


def chance_levels(tokenizer: Tokenizer) -> dict[str, float]:
    """``chance_accuracy`` of the passkey and MQAR probes, keyed like their accuracies' prefixes."""
    return {"passkey_acc": chance_accuracy(tokenizer, PASSKEY_KEYS), "mqar_acc": chance_accuracy(tokenizer, MQAR_VALUES)}
