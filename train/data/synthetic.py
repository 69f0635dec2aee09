"""Trainable retrieval tasks (``data=synthetic``): multi-query associative recall, passkey and copy.

The text probes (``train/evaluation/probes.py``) ask a model zero-shot, and a tiny model trained for minutes scores 0 on
them whatever its layout. These tasks are *trained*, so a sweep's retrieval columns separate layouts on CPU: an answer
whose source lies beyond the sliding window can only come through the compressed branch.

An example is one document of exactly ``seq_len`` positions (``seq_len + 1`` tokens: BOS, the task, filler), so it
fills a row alone. Every symbol is one token of the data tokenizer (each configured string is encoded alone and
must give one id), and filler fills the room between facts. By default (``data.synthetic.loss=answers``) only
answers carry labels: everything else in an example is random by construction; ``all`` trains every next token.
At the tiny model's default init (matrices 0.006, embedding 1.0), answers-only training first learns the answers'
marginal by pushing a constant into the residual stream (RMS 1 -> 100s): every answer gets one value and the
attention starves of gradient (``bench/results/synthetic_sweep/explore_mqar_round3.json``); ``data=synthetic``
therefore sets its own init scales and lr schedule (``conf/data/synthetic.yaml`` says why).

- ``mqar``: ``k v`` records: every key once, stating its value, then questions: records of keys drawn at random
  among those whose value was last written ``distance`` tokens back, the value being the answer. Keys are distinct;
  values are drawn independently (a value seen in the window says nothing about another key's), so no guess that
  sees only the window beats ``1 / len(values)`` on an answer whose source lies beyond it, and the random order of
  the questions leaves the asked key as the only pointer to its source.
- ``passkey``: ``# d1 .. dn`` hidden at a uniform depth in the filler and asked at the end: ``=`` followed by the
  same digits, the answers (``#`` and ``=`` are ``markers``).
- ``copy``: blocks ``# s = s`` of random key and value symbols; the repeat is the answer.

An answer's *distance* is how far back its source lies: from the position that predicts it to the position of the
same token in the fact (a pair's value, a needle digit, the first copy). The source is beyond the window when it
is not among the ``window_size`` newest positions of that query: ``distance >= window_size``.

Determinism: example ``i`` of a split is a function of ``(seed, split, i)`` alone, so a stream's only state is a
row counter (exact resume, on any number of ranks), and the training, held-out and evaluation splits draw from
disjoint random streams.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from model.config import SYNTHETIC_TASKS as TASKS, SyntheticConfig, span
from train.data.rows import FIELDS, RankRows
from train.data.tokenizer import Tokenizer
from train.loss import IGNORE_INDEX

SPLITS = ("train", "heldout", "eval")  # each draws from its own random stream


@dataclasses.dataclass(frozen=True)
class Example:
    """One task document: its ``seq_len + 1`` tokens and, per answer, the position that predicts it and its
    distance back to its source. Inputs are ``tokens[:-1]``; only answers are labelled."""

    task: str
    tokens: np.ndarray
    answer_positions: np.ndarray
    distances: np.ndarray
    alphabet: int  # answers are drawn uniformly from this many symbols: chance accuracy is 1 / alphabet

    @property
    def input_ids(self) -> np.ndarray:
        return self.tokens[:-1]

    @property
    def labels(self) -> np.ndarray:
        """The next token at answer positions, IGNORE_INDEX elsewhere."""
        labels = np.full(len(self.tokens) - 1, IGNORE_INDEX, dtype=np.int64)
        labels[self.answer_positions] = self.tokens[self.answer_positions + 1]
        return labels

    def training_labels(self, loss: str) -> np.ndarray:
        """What the training loss counts: ``answers`` (``labels``) or ``all`` (every next token)."""
        return self.labels if loss == "answers" else self.tokens[1:].copy()

    @property
    def doc_ids(self) -> np.ndarray:
        """All 0: an example is one document."""
        return np.zeros(len(self.tokens) - 1, dtype=np.int64)


class SyntheticTasks:
    """The tasks of one ``SyntheticConfig`` at ``seq_len`` with the symbols' token ids; makes examples on demand.

    Construction checks what would otherwise fail mid-run: every symbol is one token, the symbol sets are
    disjoint (a filler token equal to a key would be a fact), and an example of every active task fits."""

    def __init__(self, config: SyntheticConfig, tokenizer: Tokenizer, seq_len: int, seed: int = 0):
        self.config, self.seq_len, self.seed = config, seq_len, seed
        self.bos_id = tokenizer.bos_id
        symbols = {name: _symbol_ids(tokenizer, getattr(config, name), name)
                   for name in ("keys", "values", "digits", "filler", "markers")}
        _check_disjoint(symbols)
        if len(symbols["markers"]) != 2:
            raise ValueError(f"data.synthetic.markers must be two symbols (fact start, repeat start), "
                             f"got {list(config.markers)}")
        self.keys, self.values, self.digits = symbols["keys"], symbols["values"], symbols["digits"]
        self.filler, (self.open_id, self.repeat_id) = symbols["filler"], symbols["markers"]
        self.copy_symbols = np.concatenate([self.keys, self.values])
        self.pairs, self.spacing = span(config.pairs, "pairs"), span(config.spacing, "spacing")
        self.distance, self.copy_length = span(config.distance, "distance"), span(config.copy_length, "copy_length")
        self.tasks = config.active_tasks
        shares = np.array([config.tasks[t] for t in self.tasks], dtype=np.float64)
        self.shares = shares / shares.sum()
        self._check_fits()

    def chance(self, task: str) -> float:
        """Accuracy of guessing each answer uniformly from its alphabet."""
        return 1.0 / {"mqar": len(self.values), "passkey": len(self.digits), "copy": len(self.copy_symbols)}[task]

    def example(self, split: str, index: int) -> Example:
        """Row ``index`` of ``split``: its task drawn by the configured shares."""
        rng = np.random.default_rng([self.seed, SPLITS.index(split), index])
        return self.make(self.tasks[rng.choice(len(self.tasks), p=self.shares)], rng)

    def task_examples(self, task: str, count: int, split: str = "eval") -> list[Example]:
        """``count`` examples of ``task`` (example i does not depend on ``count``)."""
        return [self.make(task, np.random.default_rng([self.seed, SPLITS.index(split), 1 + TASKS.index(task), i]))
                for i in range(count)]

    def make(self, task: str, rng: np.random.Generator) -> Example:
        canvas = _Canvas(self.seq_len, self.bos_id)
        getattr(self, f"_{task}")(canvas, rng)
        return canvas.finish(task, self.filler, rng, round(1 / self.chance(task)))

    def _mqar(self, canvas: _Canvas, rng: np.random.Generator) -> None:
        """``k v`` records, ``spacing`` filler tokens apart: first every key once, stating its value, then questions
        to the end of the row, each a key drawn at random among those whose value was last written ``distance``
        tokens back (filler waits while none is). The draw keeps the order of the questions from giving the
        answer away: with keys asked oldest first, a model learned to read the value of the oldest record and
        ignore the key (``bench/results/synthetic_sweep/explore_mqar_round9.json``)."""
        n = int(rng.integers(self.pairs[0], self.pairs[1] + 1))
        keys, values = rng.choice(self.keys, n, replace=False), rng.choice(self.values, n)  # values: independent
        last_value = np.zeros(n, dtype=np.int64)  # position of each key's value, last written
        nearest, farthest = self.distance

        def due(at: int) -> np.ndarray:  # the keys whose value lies `distance` back from position `at`
            return np.flatnonzero((at - last_value >= nearest) & (at - last_value <= farthest))

        position, record = 1, 0
        while True:
            position += int(rng.integers(self.spacing[0], self.spacing[1] + 1))
            if record >= n and not due(position).size:  # a question: filler until some key falls due
                waiting = last_value[position - last_value < nearest]
                position = max(position, int(waiting.min(initial=self.seq_len)) + nearest)
            position += -position % self.config.align
            if position + 1 > self.seq_len:
                return
            if record < n:
                key = record
            else:
                candidates = due(position)
                if not candidates.size:  # the alignment carried every candidate past `farthest`
                    continue
                key = int(rng.choice(candidates))
                canvas.answer(position, int(last_value[key]))
            canvas.put(position, [keys[key], values[key]])
            last_value[key], position, record = position + 1, position + 2, record + 1

    def _passkey(self, canvas: _Canvas, rng: np.random.Generator) -> None:
        digits = rng.choice(self.digits, self.config.passkey_digits)
        question = self.seq_len - len(digits)  # "= d1 .. dn" ends the example
        needle = int(rng.integers(1, question - len(digits)))  # "# d1 .. dn" anywhere before it
        canvas.put(needle, [self.open_id, *digits])
        canvas.put(question, [self.repeat_id, *digits])
        for j in range(len(digits)):
            canvas.answer(question + j, needle + 1 + j)

    def _copy(self, canvas: _Canvas, rng: np.random.Generator) -> None:
        position = 1
        while True:
            length = int(rng.integers(self.copy_length[0], self.copy_length[1] + 1))
            if position + 2 * length + 1 > self.seq_len:
                return
            block = rng.choice(self.copy_symbols, length)
            canvas.put(position, [self.open_id, *block, self.repeat_id, *block])
            for j in range(length):
                canvas.answer(position + length + 1 + j, position + 1 + j)
            position += 2 * length + 2

    def _check_fits(self) -> None:
        """Raise unless the longest example of every active task fits in ``seq_len`` positions."""
        record = 2 + self.spacing[1] + self.config.align - 1  # a record, its filler and its alignment, at most
        need = {"mqar": 1 + max(self.pairs[1] * record, record + self.distance[0]) + record,  # the keys, a question
                "passkey": 2 * (1 + self.config.passkey_digits) + 1,
                "copy": 2 * self.copy_length[0] + 2 + 1}
        for task in self.tasks:
            if need[task] > self.seq_len + 1:
                raise ValueError(f"data.seq_len={self.seq_len} is too short for the synthetic {task} task "
                                 f"({need[task] - 1} positions needed): lengthen data.seq_len or shrink the task")
        if "mqar" in self.tasks and self.pairs[1] > len(self.keys):
            raise ValueError(f"data.synthetic.pairs up to {self.pairs[1]} needs as many distinct keys, "
                             f"got {len(self.keys)}")


class _Canvas:
    """The ``seq_len + 1`` tokens of an example under construction (-1: free), and its answers."""

    def __init__(self, seq_len: int, bos_id: int):
        self.tokens = np.full(seq_len + 1, -1, dtype=np.int64)
        self.tokens[0] = bos_id
        self.answers: list[tuple[int, int]] = []  # (predicting position, source position)

    def put(self, position: int, ids) -> None:
        assert (self.tokens[position:position + len(ids)] == -1).all() and position + len(ids) <= len(self.tokens)
        self.tokens[position:position + len(ids)] = ids

    def answer(self, position: int, source: int) -> None:
        """The token at ``position + 1`` is an answer, a copy of the token at ``source`` (checked in ``finish``)."""
        self.answers.append((position, source))

    def nearest_free(self, target: int, width: int, start: int) -> int | None:
        """The free run of ``width`` tokens starting at or after ``start`` whose start is nearest ``target``."""
        free = self.tokens == -1
        runs = np.ones(len(free) - width + 1, dtype=bool)
        for offset in range(width):
            runs &= free[offset:len(free) - width + 1 + offset]
        runs[:start] = False
        candidates = np.flatnonzero(runs)
        return int(candidates[np.argmin(np.abs(candidates - target))]) if candidates.size else None

    def finish(self, task: str, filler: np.ndarray, rng: np.random.Generator, alphabet: int) -> Example:
        free = self.tokens == -1
        self.tokens[free] = rng.choice(filler, int(free.sum()))
        self.answers.sort()
        assert all(self.tokens[p + 1] == self.tokens[s] and s <= p for p, s in self.answers)
        return Example(task, self.tokens, np.array([p for p, _ in self.answers], dtype=np.int64),
                       np.array([p - s for p, s in self.answers], dtype=np.int64), alphabet)


def _symbol_ids(tokenizer: Tokenizer, symbols: Sequence[str], name: str) -> np.ndarray:
    """Token ids of ``symbols`` (a string: one symbol per character; or a list of strings), one token each."""
    symbols = list(symbols)
    if not symbols or len(set(symbols)) != len(symbols):
        raise ValueError(f"data.synthetic.{name} must list distinct symbols, got {symbols}")
    ids = []
    for symbol in symbols:
        encoded = tokenizer.encode(symbol)
        if len(encoded) != 1:
            raise ValueError(f"data.synthetic.{name}: symbol {symbol!r} is {len(encoded)} tokens of the data "
                             "tokenizer; every symbol must be exactly one token")
        ids.append(encoded[0])
    return np.array(ids, dtype=np.int64)


def _check_disjoint(symbols: dict[str, np.ndarray]) -> None:
    names = list(symbols)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            shared = set(symbols[first].tolist()) & set(symbols[second].tolist())
            if shared:
                raise ValueError(f"data.synthetic.{first} and data.synthetic.{second} share token ids "
                                 f"{sorted(shared)}: a symbol can play one role only")


class SyntheticLoader(RankRows):
    """Endless micro-batches of one data-parallel rank: synthetic examples, mixed with packed text rows.

    Row ``r`` of the global stream is synthetic with probability ``fraction`` (decided by ``(seed, r)``), and then
    it is example ``r`` of ``split``; the other rows are the next rows of ``text`` (a ``PackedLoader`` of the whole
    global stream: world size 1, one row per batch), which every rank reads, as the packed loader itself does.
    Rank ``k`` of ``W`` takes global batches ``k, W + k, ...``. The state is the row counter and the text loader's
    state; ``tokens_padding`` counts the text rows' padding (synthetic rows have none).
    """

    def __init__(self, tasks: SyntheticTasks, text, *, fraction: float, micro_batch_size: int, split: str = "train",
                 rank: int = 0, world_size: int = 1):
        if not 0 < fraction <= 1 or (text is None) != (fraction == 1):
            raise ValueError(f"data.synthetic_fraction must be in (0, 1] with a text loader below 1, got {fraction}")
        if split not in SPLITS[:2]:
            raise ValueError(f"a loader reads the train or heldout split, not {split!r}")
        self.tasks, self.text, self.fraction, self.split = tasks, text, fraction, split
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.seq_len = tasks.seq_len
        self._row = 0

    @property
    def tokens_total(self) -> int:
        return self._row * self.seq_len

    @property
    def tokens_padding(self) -> int:
        return self.text.tokens_padding if self.text is not None else 0

    def _next_row(self, keep: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        row, self._row = self._row, self._row + 1
        if self.fraction < 1 and np.random.default_rng([self.tasks.seed, 3, row]).random() >= self.fraction:
            batch = next(self.text)  # read on every rank: the text stream is global
            return tuple(batch[key][0].numpy() for key in FIELDS) if keep else None
        if not keep:
            return None
        example = self.tasks.example(self.split, row)
        return example.input_ids, example.training_labels(self.tasks.config.loss), example.doc_ids

    def state_dict(self) -> dict:
        return {"row": self._row, "text": self.text.state_dict() if self.text is not None else None,
                "stream": self._stream_settings()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("stream") != self._stream_settings():
            raise ValueError(f"data state was saved for stream {state.get('stream')}, "
                             f"this loader makes {self._stream_settings()}")
        self._row = state["row"]
        if self.text is not None:
            self.text.load_state_dict(state["text"])

    def _stream_settings(self) -> dict:
        return {"seq_len": self.seq_len, "seed": self.tasks.seed, "fraction": self.fraction,
                "synthetic": repr(self.tasks.config)}


def distance_bucket(distance: int, window: int) -> tuple[int, int]:
    """``[lo, hi]`` of the bucket holding ``distance``: inside the window ``[0, W-1]``, then ``[W, 2W-1]``,
    ``[2W, 4W-1]``, ... (each beyond-window bucket twice as wide as the one before)."""
    if distance < window:
        return 0, window - 1
    lo = window
    while distance >= 2 * lo:
        lo *= 2
    return lo, 2 * lo - 1


def count_keys(examples: dict[str, list[Example]], window: int) -> dict[str, float]:
    """Zeroed answer counters for every (task, distance bucket) present in ``examples``: ``<task>:<lo>-<hi>:hits``
    and ``...:answers`` (the same keys on every rank, as a sum over ranks needs)."""
    keys = {}
    for task, task_examples in examples.items():
        for distance in sorted({int(d) for example in task_examples for d in example.distances}):
            lo, hi = distance_bucket(distance, window)
            keys.update({f"{task}:{lo}-{hi}:hits": 0.0, f"{task}:{lo}-{hi}:answers": 0.0})
    return keys


def add_hits(counts: dict[str, float], logits: torch.Tensor, example: Example, window: int) -> None:
    """Count the answers of ``example`` that the argmax of ``logits [T,V]`` gets right, by distance bucket."""
    positions = torch.as_tensor(example.answer_positions, device=logits.device)
    right = (logits[positions].argmax(-1) == torch.as_tensor(example.labels, device=logits.device)[positions]).tolist()
    for hit, distance in zip(right, example.distances.tolist()):
        lo, hi = distance_bucket(distance, window)
        counts[f"{example.task}:{lo}-{hi}:hits"] += hit
        counts[f"{example.task}:{lo}-{hi}:answers"] += 1


def synthetic_metrics(counts: dict[str, float], chance: dict[str, float], window: int) -> dict[str, float]:
    """Evaluation rows from summed counters: per task ``synthetic/<task>_acc`` (all answers), ``_acc_within_window``
    and ``_acc_beyond_window`` (source inside / beyond the sliding window), ``_chance`` (uniform guessing), and
    ``synthetic/<task>_acc/dist<lo>-<hi>`` per distance bucket. A part without answers is NaN."""
    def accuracy(task: str, keep) -> float:
        buckets = [k.rsplit(":", 1)[0] for k in counts if k.startswith(f"{task}:") and k.endswith(":hits")]
        buckets = [b for b in buckets if keep(int(b.split(":")[1].split("-")[0]))]
        answers = sum(counts[f"{b}:answers"] for b in buckets)
        return sum(counts[f"{b}:hits"] for b in buckets) / answers if answers else math.nan

    row = {}
    for task in chance:
        row[f"synthetic/{task}_acc"] = accuracy(task, lambda lo: True)
        row[f"synthetic/{task}_acc_within_window"] = accuracy(task, lambda lo: lo < window)
        row[f"synthetic/{task}_acc_beyond_window"] = accuracy(task, lambda lo: lo >= window)
        row[f"synthetic/{task}_chance"] = chance[task]
        for key in counts:
            if key.startswith(f"{task}:") and key.endswith(":hits"):
                span = key.split(":")[1]
                row[f"synthetic/{task}_acc/dist{span}"] = accuracy(task, lambda lo, s=span: lo == int(s.split("-")[0]))
    return row
