"""Training data: documents -> tokens -> best-fit packed rows of `seq_len` tokens -> micro-batches.

A batch is a dict of int64 tensors (DESIGN.md, "Data API"): `input_ids [B,T]`, `labels [B,T]`, `doc_ids [B,T]`.

Shift convention. A document of n tokens becomes `[BOS] t1 .. tn [EOS]`, i.e. n+1 *positions*, each an
(input, label) pair: (BOS, t1), (t1, t2), .., (tn, EOS). Positions are cut into chunks of at most `seq_len`; a
chunk is one document for the model (its doc-relative positions restart at 0). A chunk of L positions thus
holds L+1 tokens of its document, so every label is the next token of the *same* document, also at the last
position of a chunk (whose label is the first input of the following chunk). No prediction is lost at chunk
cuts, no label crosses a document, and labels are -100 (`IGNORE_INDEX`) only on padding (and, for fine-tuning
conversations, where the next token is a prompt token: `train/data/sft.py`). Padding sits at the
end of a row, reads `pad_id`, and has a doc id of its own (one more than the row's last chunk); doc ids
restart at 0 in every row.

Packing. Documents are read into a buffer until it holds `pack_buffer` rows' worth of positions; its chunks,
plus the chunks held back by the previous buffer, are packed best-fit decreasing into rows. The `pack_carry`
least-full rows are held back for the next buffer (except at the end of an epoch); the others are emitted in
a seeded random order (so one batch does not hold the consecutive chunks of a long document).

Determinism and resume. Epoch e reads documents in an order fixed by (shuffle_seed, e) (a permutation for
map-style datasets; for streaming ones the shards in a seeded order, then each block of `shuffle_buffer`
documents in a seeded order), and a buffer's row order is fixed by (shuffle_seed, e, index of its first
document). Hence "epoch, first document of the current buffer, the chunks held back into it, rows of it already
emitted" fixes all later batches: that is the `state_dict()`, with, for a streaming source, the `datasets`
state where that document's block starts (`seek`). Resuming re-reads the buffer from its first document (a
streaming source seeks to its block and reads that block) and skips the emitted rows.

Data parallelism. There is one global stream of micro-batches; rank r of W yields global batches r, W+r,
2W+r, ... Every rank reads and tokenizes the whole stream (W times the tokenizing work of sharding by
document) and in exchange the state is the same on every rank (checkpoint rank 0's), the ranks' batches are
disjoint by construction, and a run may resume on another number of ranks. The padding counters count the
global stream too.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np
import torch

from model.config import SAMPLE_BY, DataConfig, build
from train.data import sft
from train.data.bad_rows import Rows, check_rows, row_problem, unreadable
from train.data.rows import RankRows
from train.data.synthetic import SyntheticLoader, SyntheticTasks
from train.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

IGNORE_INDEX = -100

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- sources

class MapDocuments:
    """Texts (or conversations, ``format`` chat) of a map-style dataset, in a fresh seeded permutation every epoch."""

    _FETCH = 256  # rows fetched from Arrow per call: per-row access is slow

    def __init__(self, dataset: datasets.Dataset, text_field: str = "text", seed: int = 0,
                 description: str = "in-memory dataset", format: str = "text"):
        _check_field(dataset.column_names, text_field, description)
        if len(dataset) == 0:
            raise ValueError(f"dataset is empty: {description}")
        self._dataset = dataset.select_columns([text_field])
        self.text_field, self.seed, self.description, self.format = text_field, seed, description, format

    def __len__(self) -> int:
        return len(self._dataset)

    def texts(self, epoch: int, start: int, seek: None = None) -> Iterator[str]:
        """Texts of `epoch` from its `start`-th document on (`seek`: unused, see `seek`)."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self._dataset))
        for lo in range(start, len(order), self._FETCH):
            yield from self._dataset[order[lo:lo + self._FETCH].tolist()][self.text_field]

    @staticmethod
    def seek(texts: Iterator[str]) -> None:
        """Nothing: a map-style dataset reaches any document by its index."""
        return None


class StreamingDocuments:
    """Texts of an IterableDataset, reached by seeking. Epoch e reads the shards in an order seeded by (seed, e)
    (`IterableDataset.shuffle` with a buffer of one), cut into blocks of `shuffle_buffer` documents, each block
    read whole and emitted in an order seeded by (seed, e, block). A position is reached through the dataset's own
    `state_dict()` taken where its block starts (`seek`), and the rest of that block: at most `shuffle_buffer`
    documents read, wherever in the epoch. (`datasets`' rolling shuffle buffer is not part of its `state_dict`,
    so its resume would not continue the same stream.) Rows are checked as they stream by (`train/data/bad_rows.py`);
    `rows` names the local files a parse error is in."""

    def __init__(self, dataset: datasets.IterableDataset, text_field: str = "text", seed: int = 0,
                 shuffle_buffer: int = 10_000, description: str = "streaming dataset", format: str = "text",
                 rows: Rows | None = None):
        if dataset.column_names is not None:
            _check_field(dataset.column_names, text_field, description)
        self._dataset = dataset
        self.text_field, self.seed, self.shuffle_buffer = text_field, seed, shuffle_buffer
        self.description, self.format, self.rows = description, format, rows

    def texts(self, epoch: int, start: int, seek: dict | None = None) -> StreamBlocks:
        """Texts of `epoch` from its `start`-th document on; `seek` is what `seek()` said for that document."""
        shards = self._dataset.shuffle(generator=np.random.default_rng([self.seed, epoch]), buffer_size=1)
        if start > 0 and (seek is None or seek["block_size"] != self.shuffle_buffer):
            log.info("streaming data: the saved position has no %s, so document %d of epoch %d is reached by "
                     "re-reading the epoch up to it", "seek state (a checkpoint from before it was kept, whose "
                     "streaming order was another: this epoch may repeat or miss some documents)"
                     if seek is None else f"seek state for data.shuffle_buffer={self.shuffle_buffer} (it was "
                     f"{seek['block_size']})", start, epoch)
            seek = None
        return StreamBlocks(self, shards, epoch, start, seek)

    @staticmethod
    def seek(texts: StreamBlocks) -> dict:
        """Where `texts` stands, as `texts()` takes it back: plain values (`torch.load(weights_only=True)`)."""
        return texts.seek()

    def check(self, example: dict, position: int, epoch: int) -> str:
        """The text of `example`, the `position`-th of `epoch`; a bad row is a ValueError naming it."""
        if self.text_field not in example:
            _check_field(list(example), self.text_field, self.description)
        problem = row_problem(example[self.text_field], "text" if self.format == "text" else "chat", self.text_field)
        if problem:
            raise ValueError(f"a row of {self.description} (row {position + 1} of epoch {epoch}'s shuffled "
                             f"stream): {problem} — fix or remove that row")
        return example[self.text_field]


class StreamBlocks(Iterator[str]):
    """One epoch of a `StreamingDocuments` from a document on, block by block (see there)."""

    def __init__(self, documents: StreamingDocuments, shards: datasets.IterableDataset, epoch: int, start: int,
                 seek: dict | None):
        self._documents, self._shards, self._epoch = documents, shards, epoch
        self._block, self._block_state = (seek["block"], seek["source"]) if seek else (0, None)
        if self._block_state is not None:
            shards.load_state_dict(self._block_state)
        self._examples: Iterator[dict] | None = None  # opened at the first read, after the seek
        self._skip = start - self._block * documents.shuffle_buffer  # documents still to pass over
        self._block_texts: list = []
        self._offset = 0

    def seek(self) -> dict:
        """The block of the next document and the dataset's state where that block starts."""
        self._advance()
        return {"block": self._block, "block_size": self._documents.shuffle_buffer, "source": self._block_state}

    def __next__(self) -> str:
        if not self._advance():
            raise StopIteration
        self._offset += 1
        return self._block_texts[self._offset - 1]

    def _advance(self) -> bool:
        """Stand at the next document (reading blocks, passing over `_skip` documents); False at the epoch's end."""
        while self._offset == len(self._block_texts) or self._skip:
            if self._offset == len(self._block_texts) and not self._read_block():
                return False
            passed = min(self._skip, len(self._block_texts) - self._offset)
            self._offset, self._skip = self._offset + passed, self._skip - passed
        return True

    def _read_block(self) -> bool:
        """Read the next block whole and put it in its order; False when the epoch has no document left."""
        opening = self._examples is None
        if opening:
            self._examples = iter(self._shards)
        else:
            self._block, self._block_state = self._block + 1, self._shards.state_dict()
        # The dataset warns, when it starts from a loaded state, that its shuffle buffer's content is not in it:
        # that buffer holds one example, passed on at once.
        documents = self._documents
        with _quiet("datasets.iterable_dataset") if opening else contextlib.nullcontext():
            examples = self._take(documents.shuffle_buffer)
        order = np.random.default_rng([documents.seed, self._epoch, self._block]).permutation(len(examples))
        first = self._block * documents.shuffle_buffer
        self._block_texts = [documents.check(examples[k], first + i, self._epoch) for i, k in enumerate(order)]
        self._offset = 0
        return bool(examples)

    def _take(self, count: int) -> list[dict]:
        """Up to `count` examples of the dataset; a local file the builder cannot parse is a ValueError naming it."""
        examples = []
        try:
            examples.extend(itertools.islice(self._examples, count))
        except Exception as error:
            rows = self._documents.rows
            if rows is None or not rows.files:
                raise
            raise ValueError(unreadable(rows.builder, rows.files, error)) from error
        return examples


@contextlib.contextmanager
def _quiet(logger: str):
    """The block's log records of `logger` below CRITICAL are dropped."""
    target = logging.getLogger(logger)
    level = target.level
    target.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        target.setLevel(level)


def _check_field(columns: list[str], text_field: str, description: str) -> None:
    if text_field not in columns:
        raise ValueError(f"text field {text_field!r} is not a column of {description} (columns: {columns}) — set "
                         "data.text_field to the column that holds the text")


_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_STRING_FEATURES = datasets.Features({"path": datasets.Value("string"), "text": datasets.Value("string")})


def python_source_dataset(root: str | None = None) -> datasets.Dataset:
    """Every `*.py` file under `root` (default: this interpreter's standard library) as one document.

    It is the default corpus because it is real text present on every machine, needing no download. Columns:
    `path` (relative to root, posix: a key stable across machines) and `text`. Files are read as bytes and
    decoded with replacement so that a stray non-UTF-8 byte cannot stop training. Test and third-party
    package directories are skipped.
    """
    base = Path(root).expanduser() if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"data.path {str(base)!r} does not exist or is not a directory — give a directory of "
                                "*.py files, or data.path=null for the standard library")
    files = sorted(_python_files(base), key=lambda f: f.relative_to(base).as_posix())
    return datasets.Dataset.from_dict(
        {"path": [f.relative_to(base).as_posix() for f in files],
         "text": [f.read_bytes().decode("utf-8", errors="replace") for f in files]},
        features=_STRING_FEATURES)


def _python_files(base: Path) -> Iterator[Path]:
    for directory, subdirs, names in os.walk(base):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        yield from (Path(directory, n) for n in names if n.endswith(".py"))


_FILE_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
                  ".parquet": "parquet", ".csv": "csv"}


def hf_dataset(path: str, name: str | None = None, split: str = "train", streaming: bool = False,
               sample_by: str = "auto") -> tuple[datasets.Dataset | datasets.IterableDataset, Rows]:
    """A `datasets` source: local data files (a file or a directory of them), else `load_dataset(path, name)`;
    with the `Rows` that say where each row came from.

    A directory is read recursively; all its data files must have one format. Text files are decoded with
    replacement of invalid bytes and give one document per file, per paragraph or per line (`sample_by`);
    `auto` splits a single file by paragraph (by line if it has no blank line), so that it has documents to
    hold out, and says so. A local file that cannot be parsed is a ValueError naming its first bad line.
    """
    if sample_by not in SAMPLE_BY:
        raise ValueError(f"data.sample_by={sample_by!r} — use one of {', '.join(SAMPLE_BY)}")
    local = _local_data_files(path)
    if local is None:
        rows = Rows(f"dataset {path!r} (name={name}, split={split})")
        return datasets.load_dataset(path, name, split=split, streaming=streaming), rows
    builder, files = local
    rows = Rows(f"data.path {path!r}", builder, files)
    if builder == "text" and sample_by == "auto":
        sample_by = _text_sampling(files)
        if sample_by != "document":
            log.info("data.path %s is a single text file: one document per %s (data.sample_by=%s; "
                     "data.sample_by=document|paragraph|line chooses)", path, sample_by, sample_by)
    options = {"sample_by": sample_by, "encoding_errors": "replace", "keep_linebreaks": True} \
        if builder == "text" else {}
    try:
        with _quiet("datasets.packaged_modules"):  # the builders log a parse error before raising it
            return datasets.load_dataset(builder, data_files={split: files}, split=split, streaming=streaming,
                                         **options), rows
    except Exception as error:  # the builders' own (ArrowInvalid, pandas' ParserError, UnicodeDecodeError, ...)
        raise ValueError(unreadable(builder, files, error)) from error


def _text_sampling(files: list[str]) -> str:
    """`auto` for text files: one document per file, unless there is only one file: then per paragraph, or per
    line when its start (the first MiB) holds no blank line."""
    if len(files) > 1:
        return "document"
    with open(files[0], "rb") as f:
        head = f.read(2**20).replace(b"\r\n", b"\n")
    return "paragraph" if b"\n\n" in head.strip(b"\n") else "line"


def _local_data_files(path: str) -> tuple[str, list[str]] | None:
    """(builder, files) for a local path; None for a dataset name; errors for missing or empty paths."""
    location = Path(path).expanduser()
    if location.is_dir():
        files = sorted(str(f) for f in location.rglob("*") if f.is_file() and f.suffix in _FILE_BUILDERS)
    elif location.is_file():
        files = [str(location)]
    elif os.path.isabs(path) or path.startswith((".", "~")) or location.suffix in _FILE_BUILDERS:
        raise FileNotFoundError(f"data.path {path!r} does not exist — give an existing file or directory, or a "
                                "dataset name")
    else:
        return None
    if not files:
        raise ValueError(f"dataset is empty: {path!r} holds no data files — give files ending in "
                         f"{', '.join(_FILE_BUILDERS)}")
    formats = {_FILE_BUILDERS.get(Path(f).suffix) for f in files}
    if len(formats) != 1 or None in formats:
        raise ValueError(f"data.path {path!r}: need data files of one known format {_FILE_BUILDERS}, "
                         f"got {sorted(Path(f).suffix for f in files)}")
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"dataset is empty: every data file of {path!r} is empty — give files with text in them")
    return formats.pop(), files


def is_heldout(key: str, fraction: float) -> bool:
    """Stable (machine- and run-independent) hash split: a key is held out iff its hash falls below `fraction`."""
    return int.from_bytes(_hash(key), "big") < fraction * 2**64


def _split(dataset, key_field: str, fraction: float, heldout: bool):
    """The held-out part (`heldout`) or the rest; keys are file paths (stdlib), texts or conversations (hf:
    duplicates of a document land on the same side). A small map-style dataset whose hashes put nothing below
    `fraction > 0` holds out its one document with the lowest hash, so that a few documents still give both parts."""
    part = dataset.filter(lambda batch: [is_heldout(_key(k), fraction) == heldout for k in batch[key_field]],
                          batched=True)
    if isinstance(dataset, datasets.IterableDataset) or fraction <= 0 or len(dataset) < 2:
        return part
    if len(part) != (0 if heldout else len(dataset)):
        return part
    hashes = [_hash(_key(key)) for key in dataset[key_field]]
    lowest = hashes.index(min(hashes))
    return dataset.select([lowest] if heldout else [i for i in range(len(dataset)) if i != lowest])


def _key(value) -> str:
    """The split key of a document: its text (or path), or its conversation as JSON."""
    return value or "" if isinstance(value, str) or value is None else json.dumps(value, sort_keys=True)


def _hash(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()


def _columns(dataset) -> list[str] | None:
    """Column names; a streaming dataset that does not declare them shows them in its first example."""
    if dataset.column_names is not None:
        return dataset.column_names
    first = next(iter(dataset), None)
    return None if first is None else list(first)


_CHECKED: set[str] = set()  # fingerprints of the datasets whose rows were checked (train and held-out part: once)


def build_documents(config: DataConfig, heldout: bool = False) -> MapDocuments | StreamingDocuments:
    """The document source of `config`, train part or held-out part. Every row of a map-style `hf` dataset is
    checked first (`train/data/bad_rows.py`): a bad one is a ValueError naming its file and line (or its row)."""
    part = f"{'held-out' if heldout else 'train'} part, heldout_fraction={config.heldout_fraction}"
    rows = None  # stdlib: every row is a file read by us
    if config.source == "stdlib":
        root = config.path or sysconfig.get_paths()["stdlib"]
        description = f"Python sources under {root!r} ({part})"
        dataset = _split(python_source_dataset(root), "path", config.heldout_fraction, heldout)
        if config.streaming and len(dataset) > 0:
            dataset = dataset.to_iterable_dataset()
        text_field, fmt = "text", "text"
    elif config.source == "hf":
        if config.path is None:
            raise ValueError("data.source=hf needs data.path (data files, a directory or a dataset name)")
        description = f"dataset {config.path!r} (name={config.name}, split={config.split}, {part})"
        dataset, rows = hf_dataset(config.path, config.name, config.split, config.streaming, config.sample_by)
        fmt = sft.resolve_format(config.format, _columns(dataset), config.text_field, config.messages_field,
                                 config.prompt_field, config.response_field, description)
        fields = {"text": {config.text_field: "text"}, "chat": {config.messages_field: "chat"},
                  "prompt_response": {config.prompt_field: "text", config.response_field: "text"}}[fmt]
        if isinstance(dataset, datasets.Dataset) and dataset._fingerprint not in _CHECKED:
            check_rows(dataset, fields, rows)
            _CHECKED.add(dataset._fingerprint)
        text_field = {"text": config.text_field, "chat": config.messages_field}.get(fmt, sft.CONVERSATION)
        if fmt == "prompt_response":
            dataset = sft.prompt_response_conversations(dataset, config.prompt_field, config.response_field)
        dataset = _split(dataset, text_field, config.heldout_fraction, heldout)
    else:
        raise ValueError(f"unknown data.source {config.source!r} — use data=stdlib or data=hf")
    kind = "text" if fmt == "text" else "chat"
    if isinstance(dataset, datasets.IterableDataset):
        return StreamingDocuments(dataset, text_field, config.shuffle_seed, config.shuffle_buffer, description, kind,
                                  rows)
    if len(dataset) == 0:
        fix = ("raise data.heldout_fraction or give more documents (split one text file with data.sample_by="
               "paragraph or line)" if heldout else "lower data.heldout_fraction or give more documents")
        raise ValueError(f"dataset is empty: {description} — {fix}")
    return MapDocuments(dataset, text_field, config.shuffle_seed, description, kind)


# ---------------------------------------------------------------------------------------------- packing

def best_fit_pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing bin packing: indices of `lengths` per bin, no bin summing above `capacity`.

    Items go longest first (ties in input order) into the open bin with the least room that fits them, so
    bins are nearly full and the result is deterministic.
    """
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (free room, bin index), sorted
    for item in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        size = lengths[item]
        if not 0 < size <= capacity:
            raise ValueError(f"item length {size} is not in 1..{capacity}")
        slot = bisect.bisect_left(open_bins, (size, -1))
        if slot == len(open_bins):
            room, index = capacity, len(bins)
            bins.append([])
        else:
            room, index = open_bins.pop(slot)
        bins[index].append(item)
        if room > size:
            bisect.insort(open_bins, (room - size, index))
    return bins


def chunk_spans(num_positions: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, length) of the chunks of a document with `num_positions` positions, each at most `seq_len`."""
    return [(start, min(seq_len, num_positions - start)) for start in range(0, num_positions, seq_len)]


class PackedLoader(RankRows):
    """Endless iterator over packed micro-batches of one data-parallel rank, with exact resume.

    `documents` is a `MapDocuments` / `StreamingDocuments` (anything with `texts(epoch, start)` and
    `description`). `encode` turns one document into its tokens (default: `[BOS] text [EOS]`, every label
    trained; `sft.ChatEncoder` for conversations: prompt tokens complemented, None for nothing to train).
    `vocab_size` (default: the tokenizer's) bounds the token ids; a larger id (a tokenizer
    that does not match the model) is a ValueError. `tokens_total` / `tokens_padding` count the global
    stream; `padding_fraction` is their ratio.

    The `pack_carry` least-full rows of a buffer are not emitted: their chunks join the next buffer, where
    new chunks can fill them up. On the stdlib corpus (12M tokens) this takes the padding of plain best-fit
    packing from 2.7e-3 to 2.7e-5 of the tokens at seq_len 512 (5.6e-3 to 1.0e-4 at 4096; SPEC 4 asks for
    <= 1e-4), for `pack_carry` rows of tokens in the state. The last buffer of an epoch holds nothing back, so
    an epoch emits each of its tokens exactly once; its few part-filled rows are what a small corpus shows
    (whole stdlib epoch: 3.4e-4 at 512, 1.4e-3 at 4096).
    """

    def __init__(self, documents, tokenizer: Tokenizer, *, seq_len: int, micro_batch_size: int,
                 shuffle_seed: int = 0, pack_buffer: int = 256, pack_carry: int = 64, rank: int = 0,
                 world_size: int = 1, vocab_size: int | None = None, encode=None):
        if (min(seq_len, micro_batch_size, world_size) < 1 or not 0 <= pack_carry < pack_buffer
                or not 0 <= rank < world_size):
            raise ValueError(f"bad loader geometry: seq_len={seq_len} micro_batch_size={micro_batch_size} "
                             f"pack_buffer={pack_buffer} pack_carry={pack_carry} rank={rank} "
                             f"world_size={world_size} (need 0 <= pack_carry < pack_buffer)")
        if shuffle_seed < 0:
            raise ValueError(f"shuffle_seed must be >= 0, got {shuffle_seed}")
        self.documents, self.tokenizer = documents, tokenizer
        self.encode = encode or self._text_tokens
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.pack_buffer, self.pack_carry = pack_buffer, pack_carry
        self.shuffle_seed, self.rank, self.world_size = shuffle_seed, rank, world_size
        self.vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        self._check_ids(np.array([tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id]), "the special tokens")
        self.tokens_total = self.tokens_padding = 0
        # Position in the global stream (all of the state): the current buffer starts at document
        # `_buf_start` of `_epoch` plus the chunks `_carry_in` left by the buffer before; `_rows_done` of
        # its rows are out. `_seek`: how the source reaches `_buf_start` without re-reading up to it.
        self._epoch = self._buf_start = self._rows_done = 0
        self._carry_in: list[np.ndarray] = []
        self._seek: dict | None = None
        self._rows: list[list[tuple[int, int, int]]] | None = None  # None: rebuild from the position
        # Derived from the current buffer, to go on without re-reading.
        self._docs: list[np.ndarray] = []
        self._carry_out: list[np.ndarray] = []
        self._texts: Iterator[str] | None = None
        self._next_doc = 0
        self._epoch_done = False

    def _next_row(self, keep: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        row = self._take_row()
        return self._build_row(row) if keep else None

    def state_dict(self) -> dict:
        """Position in the global stream (same on every rank) and the settings that fix the stream.

        Only ints and int64 tensors, so `torch.load(weights_only=True)` reads it back.
        """
        return {"epoch": self._epoch, "buf_start": self._buf_start, "rows_done": self._rows_done,
                "carry": [torch.tensor(chunk) for chunk in self._carry_in], "seek": self._seek,
                "tokens_total": self.tokens_total, "tokens_padding": self.tokens_padding,
                "stream": self._stream_settings()}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batch at which `state` was taken (any rank count / micro-batch size)."""
        if state["stream"] != self._stream_settings():
            raise ValueError(f"data state was saved for stream {state['stream']}, "
                             f"this loader makes {self._stream_settings()}")
        self._epoch, self._buf_start, self._rows_done = state["epoch"], state["buf_start"], state["rows_done"]
        self._carry_in = [chunk.cpu().numpy().astype(np.int64) for chunk in state["carry"]]
        self._seek = state.get("seek")  # absent from the states saved before it was kept: the source re-reads
        self.tokens_total, self.tokens_padding = state["tokens_total"], state["tokens_padding"]
        self._rows = None

    def _stream_settings(self) -> dict:
        return {"seq_len": self.seq_len, "shuffle_seed": self.shuffle_seed, "pack_buffer": self.pack_buffer,
                "pack_carry": self.pack_carry, "vocab_size": self.vocab_size}

    def _take_row(self) -> list[tuple[int, int, int]]:
        """Next row of the global stream as (document, start, length) chunks; updates the counters."""
        if self._rows is None:
            texts = self.documents.texts(self._epoch, self._buf_start, self._seek)
            self._fill(self._epoch, self._buf_start, texts, self._carry_in)
        while self._rows_done == len(self._rows):
            self._next_buffer()
        row = self._rows[self._rows_done]
        self._rows_done += 1
        self.tokens_total += self.seq_len
        self.tokens_padding += self.seq_len - sum(length for _, _, length in row)
        return row

    def _next_buffer(self) -> None:
        if self._epoch_done:
            self._fill(self._epoch + 1, 0, self.documents.texts(self._epoch + 1, 0), [])
        else:
            self._fill(self._epoch, self._next_doc, self._texts, self._carry_out)
        self._rows_done = 0

    def _fill(self, epoch: int, start: int, texts: Iterator[str], carry_in: list[np.ndarray]) -> None:
        """Read and pack the buffer at document `start` of `epoch` (where `texts` stands) plus `carry_in`."""
        seek = self.documents.seek(texts)
        docs, consumed, epoch_done = self._read(texts)
        if start == 0 and not docs:
            raise ValueError(f"dataset is empty (no non-empty document): {self.documents.description}")
        self._docs = carry_in + docs
        chunks = [(doc, span_start, length) for doc, tokens in enumerate(self._docs)
                  for span_start, length in chunk_spans(len(tokens) - 1, self.seq_len)]
        bins = [[chunks[i] for i in b] for b in best_fit_pack([c[2] for c in chunks], self.seq_len)]
        fills = [sum(length for _, _, length in b) for b in bins]
        partial = sorted((fill, b) for b, fill in enumerate(fills) if fill < self.seq_len)
        held = [] if epoch_done else [b for _, b in partial[:self.pack_carry]]
        emitted = sorted(set(range(len(bins))) - set(held))
        order = np.random.default_rng([self.shuffle_seed, epoch, start]).permutation(len(emitted))
        self._rows = [bins[emitted[k]] for k in order]
        self._carry_out = [self._docs[doc][s:s + length + 1].copy() for b in held for doc, s, length in bins[b]]
        self._epoch, self._buf_start, self._carry_in, self._seek = epoch, start, carry_in, seek
        self._texts, self._next_doc, self._epoch_done = texts, start + consumed, epoch_done

    def _read(self, texts: Iterator[str]) -> tuple[list[np.ndarray], int, bool]:
        """Tokenized documents up to the buffer budget, the number of texts consumed, and whether the epoch
        ran out."""
        budget, positions, consumed, docs = self.pack_buffer * self.seq_len, 0, 0, []
        for text in texts:
            consumed += 1
            tokens = self.encode(text) if text else None
            if tokens is not None:
                self._check_ids(tokens, f"a document of {self.documents.description}")
                docs.append(tokens)
                positions += len(tokens) - 1
                if positions >= budget:
                    return docs, consumed, False
        return docs, consumed, True

    def _text_tokens(self, text: str) -> np.ndarray:
        return np.concatenate(([self.tokenizer.bos_id], self.tokenizer.encode_array(text),
                               [self.tokenizer.eos_id])).astype(np.int64)

    def _check_ids(self, tokens: np.ndarray, where: str) -> None:
        tokens = np.where(tokens < 0, ~tokens, tokens)  # prompt tokens of SFT documents are stored complemented
        bad = tokens[tokens >= self.vocab_size]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} in {where} is outside the vocabulary (vocab_size "
                             f"{self.vocab_size}): the tokenizer does not match the model")

    def _build_row(self, row: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        input_ids = np.full(self.seq_len, self.tokenizer.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        doc_ids = np.full(self.seq_len, len(row), dtype=np.int64)  # padding: one id past the last chunk
        position = 0
        for chunk_id, (doc, start, length) in enumerate(row):
            end = position + length
            input_ids[position:end], labels[position:end] = sft.split_labels(self._docs[doc][start:start + length + 1])
            doc_ids[position:end] = chunk_id
            position = end
        return input_ids, labels, doc_ids


def build_loader(cfg, *, rank: int = 0, world_size: int = 1, heldout: bool = False,
                 vocab_size: int | None = None, documents=None) -> PackedLoader | SyntheticLoader:
    """The loader of `cfg` (the `data` group: a DataConfig, or a mapping of its settings: `data_config`).

    `heldout=True` gives the held-out documents (for evaluation: build a fresh loader per evaluation to see
    the same batches each time). `vocab_size` is the model's, if it should bound the token ids. `documents`:
    the `build_documents(cfg, heldout)` already made (a job builds them before its engine, to fail early). With
    `synthetic_fraction` > 0 rows are synthetic tasks mixed with packed text rows (`train/data/synthetic.py`); at 1 the
    text source is not read at all.
    """
    config = data_config(cfg)
    tokenizer = load_tokenizer(config.tokenizer, config.bos_token, config.eos_token, config.pad_token)
    tasks = synthetic_tasks(config, tokenizer)
    if tasks is None:
        return _packed_loader(config, tokenizer, heldout, rank, world_size, vocab_size, documents)
    text = None if config.synthetic_fraction == 1 else _packed_loader(config, tokenizer, heldout, 0, 1, vocab_size,
                                                                      documents, micro_batch_size=1)
    return SyntheticLoader(tasks, text, fraction=config.synthetic_fraction,
                           micro_batch_size=config.micro_batch_size, split="heldout" if heldout else "train",
                           rank=rank, world_size=world_size)


def synthetic_tasks(config: DataConfig, tokenizer: Tokenizer | None = None) -> SyntheticTasks | None:
    """The synthetic tasks of `config` (None when `synthetic_fraction` is 0), seeded by `shuffle_seed`."""
    if config.synthetic_fraction == 0:
        return None
    tokenizer = tokenizer or load_tokenizer(config.tokenizer, config.bos_token, config.eos_token, config.pad_token)
    return SyntheticTasks(config.synthetic, tokenizer, config.seq_len, config.shuffle_seed)


def _packed_loader(config: DataConfig, tokenizer: Tokenizer, heldout: bool, rank: int, world_size: int,
                   vocab_size: int | None, documents=None, micro_batch_size: int | None = None) -> PackedLoader:
    documents = build_documents(config, heldout) if documents is None else documents
    return PackedLoader(documents, tokenizer, seq_len=config.seq_len,
                        micro_batch_size=micro_batch_size or config.micro_batch_size,
                        shuffle_seed=config.shuffle_seed, pack_buffer=config.pack_buffer,
                        pack_carry=config.pack_carry, rank=rank, world_size=world_size, vocab_size=vocab_size,
                        encode=document_encoder(documents, tokenizer, config.seq_len))


def document_encoder(documents, tokenizer: Tokenizer, seq_len: int):
    """How the loader turns one of ``documents`` into tokens: None (``[BOS] text [EOS]``, every label trained) for
    text, a ``sft.ChatEncoder`` (cut to ``seq_len + 1`` tokens) for conversations."""
    return sft.ChatEncoder(tokenizer, seq_len + 1) if documents.format == "chat" else None


@dataclasses.dataclass(frozen=True)
class SetSize:
    """How big a part of the data is: documents, and the tokens the loader makes of them (positions: a document
    of n tokens trains n + 1 next-token predictions, BOS and EOS included)."""

    documents: int | None  # None: a streaming source, not counted in advance
    tokens: int | None
    exact: bool  # False: tokens estimated from the first ``SIZE_SAMPLE`` characters' documents

    def describe(self) -> str:
        if self.documents is None:
            return "streaming (its size is not counted in advance)"
        return f"{self.documents:,} documents, {'' if self.exact else '~'}{self.tokens:,} tokens"


SIZE_SAMPLE = 4_000_000  # characters tokenised to estimate a set's tokens, with a tokenizer that is not byte-level


def set_size(documents, tokenizer: Tokenizer, seq_len: int) -> SetSize:
    """The size of ``documents`` (``build_documents``), tokenised as the loader does (``document_encoder``):
    exact with the byte tokenizer, else estimated from the first ``SIZE_SAMPLE`` characters of epoch 0's (random)
    order when the set is larger."""
    if not isinstance(documents, MapDocuments):
        return SetSize(None, None, False)
    chat = document_encoder(documents, tokenizer, seq_len)

    def positions(text) -> int:
        if chat is not None:
            tokens = chat(text)
            return 0 if tokens is None else len(tokens) - 1
        byte_level = isinstance(tokenizer, ByteTokenizer)  # its tokens are the UTF-8 bytes: no need to encode
        return (len(text.encode("utf-8", errors="surrogatepass")) if byte_level else len(tokenizer.encode_array(text))
                ) + 1  # [BOS] text [EOS]: one prediction more than the text's tokens

    budget = None if isinstance(tokenizer, ByteTokenizer) else SIZE_SAMPLE
    total, counted, tokens, characters = len(documents), 0, 0, 0
    sft_log = logging.getLogger(sft.__name__)
    level = sft_log.level
    sft_log.setLevel(logging.ERROR)  # the loader warns about conversations it cuts; counting them need not
    try:
        for text in documents.texts(0, 0):
            counted += 1
            tokens += positions(text) if text else 0
            characters += len(text) if isinstance(text, str) else sum(len(m["content"]) for m in text)
            if budget is not None and characters >= budget and counted < total:
                return SetSize(total, round(tokens * total / counted), False)
    finally:
        sft_log.setLevel(level)
    return SetSize(total, tokens, True)


def data_config(values) -> DataConfig:
    """``values`` (a DataConfig, or the ``data`` group as a mapping of plain values: unset keys take DataConfig's
    defaults) as a DataConfig."""
    return values if isinstance(values, DataConfig) else build(DataConfig, values, "data")
