"""Tests of train/data/loader.py and train/data/tokenizer.py: packing invariants, determinism, exact resume, sharding,
error cases and the hf sources (CPU, fast)."""

import io
import json
import logging
import math

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizerModel
from tokenizers import decoders, models, pre_tokenizers, trainers

from train.data.loader import (IGNORE_INDEX, DataConfig, MapDocuments, PackedLoader, StreamingDocuments, best_fit_pack,
                               build_documents, build_loader, chunk_spans, python_source_dataset)
from train.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

BYTE = ByteTokenizer()
# Printable ASCII: document k of a letter corpus is made of LETTERS[k] only, so every token tells its document.
LETTERS = [chr(c) for c in range(0x21, 0x7F)]


def letter_texts(n: int, seed: int = 0, longest: int = 50) -> list[str]:
    lengths = np.random.default_rng(seed).integers(0, longest, size=n)
    return [LETTERS[k] * int(length) for k, length in enumerate(lengths)]


def letter_loader(texts, *, streaming=False, seq_len=16, micro_batch_size=1, **options) -> PackedLoader:
    dataset = datasets.Dataset.from_dict({"text": texts})
    if streaming:
        iterable = dataset.to_iterable_dataset(num_shards=min(3, len(texts)))
        documents = StreamingDocuments(iterable, seed=3, shuffle_buffer=7)
    else:
        documents = MapDocuments(dataset, seed=3)
    options = {"pack_buffer": 4, "pack_carry": 2, **options}
    return PackedLoader(documents, BYTE, seq_len=seq_len, micro_batch_size=micro_batch_size, **options)


def take(loader, n: int) -> list[dict]:
    return [next(loader) for _ in range(n)]


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def segments(doc_ids_row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of the runs of equal doc ids."""
    cuts = [0] + (torch.nonzero(doc_ids_row[1:] != doc_ids_row[:-1]).flatten() + 1).tolist()
    return list(zip(cuts, cuts[1:] + [len(doc_ids_row)]))


def check_row(input_ids, labels, doc_ids, tokenizer=BYTE) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row invariants; returns the (inputs, labels) of its document chunks."""
    runs = segments(doc_ids)
    assert [int(doc_ids[s]) for s, _ in runs] == list(range(len(runs)))  # ids 0, 1, 2, ... in the row
    chunks = []
    for index, (s, e) in enumerate(runs):
        if bool((input_ids[s:e] == tokenizer.pad_id).all()) and bool((labels[s:e] == IGNORE_INDEX).all()):
            assert index == len(runs) - 1, "padding only at the end of a row"
            continue
        assert bool((labels[s:e] != IGNORE_INDEX).all()), "labels are -100 on padding only"
        assert torch.equal(labels[s:e - 1], input_ids[s + 1:e]), "label = next input inside a chunk"
        chunks.append((input_ids[s:e], labels[s:e]))
    return chunks


def chunk_letter(inputs: torch.Tensor, targets: torch.Tensor) -> str:
    """The one letter of a chunk of a letter corpus."""
    letters = {chr(i) for i in inputs.tolist() if i != BYTE.bos_id} | \
              {chr(i) for i in targets.tolist() if i != BYTE.eos_id}
    assert len(letters) == 1, "a chunk holds one document"
    return letters.pop()


def epoch_rows(loader, epoch: int = 0):
    """Rows (micro_batch_size 1) of one epoch, read off the loader state after each batch."""
    rows = []
    while True:
        batch = next(loader)
        if loader.state_dict()["epoch"] != epoch:
            return rows
        rows.append((batch["input_ids"][0], batch["labels"][0], batch["doc_ids"][0]))


# ------------------------------------------------------------------------------------------------ packing

def test_best_fit_pack_fills_bins_and_places_every_item_once():
    assert best_fit_pack([5, 5, 4, 3, 2, 1], 10) == [[0, 1], [2, 3, 4, 5]]
    lengths = np.random.default_rng(0).integers(1, 100, size=500).tolist()
    bins = best_fit_pack(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert len(bins) <= 11 / 9 * math.ceil(sum(lengths) / 100) + 1  # the best-fit-decreasing guarantee
    with pytest.raises(ValueError):
        best_fit_pack([101], 100)


def test_chunk_spans():
    assert chunk_spans(5, 16) == [(0, 5)]
    assert chunk_spans(16, 16) == [(0, 16)]
    assert chunk_spans(33, 16) == [(0, 16), (16, 16), (32, 1)]


@pytest.mark.parametrize("pack_carry", [0, 2])
@pytest.mark.parametrize("streaming", [False, True])
def test_packing_invariants_over_an_epoch(pack_carry, streaming):
    """Each document (BOS text EOS) comes out exactly once per epoch, cut into chunks of <= seq_len, and no
    label crosses a document."""
    texts = letter_texts(60)
    loader = letter_loader(texts, streaming=streaming, pack_carry=pack_carry)
    label_count = {letter: 0 for letter in LETTERS[:60]}
    bos_count = dict(label_count)
    for input_ids, labels, doc_ids in epoch_rows(loader):
        assert input_ids.shape == labels.shape == doc_ids.shape == (16,)
        for inputs, targets in check_row(input_ids, labels, doc_ids):
            letter = chunk_letter(inputs, targets)
            label_count[letter] += len(targets)
            bos_count[letter] += int((inputs == BYTE.bos_id).sum())
            assert int((targets == BYTE.eos_id).sum()) <= 1
    for k, text in enumerate(texts):
        assert label_count[LETTERS[k]] == (len(text) + 1 if text else 0)  # text + EOS, each exactly once
        assert bos_count[LETTERS[k]] == (1 if text else 0)


def test_long_documents_are_split_into_chunks():
    texts = ["a" * 40, "b" * 3]  # "a": 41 positions -> chunks 16, 16, 9
    rows = epoch_rows(letter_loader(texts, pack_buffer=8, pack_carry=0))
    chunks = [chunk for row in rows for chunk in check_row(*row)]
    assert sorted(len(inputs) for inputs, targets in chunks if chunk_letter(inputs, targets) == "a") == [9, 16, 16]


def test_stdlib_batches_have_little_padding_and_valid_rows():
    loader = build_loader({"seq_len": 512, "micro_batch_size": 8})
    for step, batch in enumerate(take(loader, 250)):
        assert {k: (v.dtype, tuple(v.shape)) for k, v in batch.items()} == {
            k: (torch.int64, (8, 512)) for k in ("input_ids", "labels", "doc_ids")}
        if step % 25 == 0:
            for row in zip(batch["input_ids"], batch["labels"], batch["doc_ids"]):
                check_row(*row)
    assert loader.tokens_total == 250 * 8 * 512
    assert loader.padding_fraction < 1e-3


# ---------------------------------------------------------------------------------- determinism / resume

def test_same_seed_same_batches_other_seed_other_batches():
    config = {"seq_len": 64, "micro_batch_size": 4, "pack_buffer": 16, "pack_carry": 4}
    first = take(build_loader(config), 5)
    assert_same(first, take(build_loader(config), 5))
    other = take(build_loader({**config, "shuffle_seed": 1}), 5)
    assert not torch.equal(first[0]["input_ids"], other[0]["input_ids"])


def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("n_before", [1, 3, 9, 12, 18])
def test_resume_continues_with_the_same_batches(streaming, n_before):
    """Positions mid-buffer, at buffer ends, at and after epoch ends (an epoch is about 9 batches long)."""
    texts = letter_texts(12)
    uninterrupted = letter_loader(texts, streaming=streaming, micro_batch_size=2)
    reference = take(uninterrupted, n_before + 12)
    interrupted = letter_loader(texts, streaming=streaming, micro_batch_size=2)
    assert_same(take(interrupted, n_before), reference[:n_before])
    resumed = letter_loader(texts, streaming=streaming, micro_batch_size=2)
    resumed.load_state_dict(_roundtrip(interrupted.state_dict()))
    assert_same(take(resumed, 12), reference[n_before:])
    assert (resumed.tokens_total, resumed.tokens_padding) == (uninterrupted.tokens_total,
                                                              uninterrupted.tokens_padding)


def counted_stream_loader(texts, reads: list, **options) -> PackedLoader:
    """`letter_loader(streaming=True)`'s loader, whose source appends each document it reads to `reads`."""
    iterable = datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset(num_shards=3)
    counted = iterable.map(lambda example: reads.append(example["text"]) or example)
    documents = StreamingDocuments(counted, seed=3, shuffle_buffer=7)
    return PackedLoader(documents, BYTE, seq_len=16, micro_batch_size=2, **{"pack_buffer": 4, "pack_carry": 2,
                                                                             **options})


def test_streaming_resume_seeks_instead_of_re_reading(caplog):
    """A streaming source resumes from the dataset's own state at the block of the saved position, also on
    another number of ranks: it reads at most that block and the next before its first batch, where re-reading
    reads the epoch up to the position. A state without the seek (an older checkpoint) re-reads, saying so."""
    texts, reads = letter_texts(len(LETTERS), longest=30), []
    reference = take(counted_stream_loader(texts, reads), 30)
    interrupted = counted_stream_loader(texts, reads, rank=1, world_size=2)
    take(interrupted, 10)  # global batches 0..19
    state = _roundtrip(interrupted.state_dict())
    block, shards = 7, 3  # the source's shuffle_buffer and shards
    # datasets (5.x) interleaves the shards through a thread pool that reads one example of each shard ahead, so
    # up to `shards` more documents than the loader asked for may have been read when it returns
    bound = 2 * block + shards
    assert state["epoch"] == 0 and state["buf_start"] > bound, "the position should lie blocks into the epoch"
    for seek in (True, False):
        reads.clear()
        resumed = counted_stream_loader(texts, reads)
        resumed.load_state_dict(state if seek else {key: value for key, value in state.items() if key != "seek"})
        with caplog.at_level(logging.INFO, logger="train.data.loader"):
            first = take(resumed, 1)
        if seek:
            assert len(reads) <= bound, f"the resume read {len(reads)} documents: it re-read the epoch"
            assert "re-reading" not in caplog.text
        else:
            assert len(reads) >= state["buf_start"]
            assert f"document {state['buf_start']} of epoch 0 is reached by re-reading" in caplog.text
        assert_same(first + take(resumed, 9), reference[20:])


def test_resume_on_the_stdlib_corpus():
    config = {"seq_len": 128, "micro_batch_size": 2, "pack_buffer": 8, "pack_carry": 3}
    reference = take(build_loader(config), 30)
    interrupted = build_loader(config)
    take(interrupted, 17)
    resumed = build_loader(config)
    resumed.load_state_dict(_roundtrip(interrupted.state_dict()))
    assert_same(take(resumed, 13), reference[17:])


def test_resume_with_another_micro_batch_size_and_settings_check():
    texts = letter_texts(30)
    reference = take(letter_loader(texts, micro_batch_size=1), 10)
    interrupted = letter_loader(texts, micro_batch_size=2)
    take(interrupted, 3)
    resumed = letter_loader(texts, micro_batch_size=1)
    resumed.load_state_dict(interrupted.state_dict())
    assert_same(take(resumed, 4), reference[6:])
    with pytest.raises(ValueError, match="seq_len"):
        letter_loader(texts, seq_len=8).load_state_dict(interrupted.state_dict())


def test_ranks_get_disjoint_shares_of_the_global_stream():
    texts = letter_texts(40)
    world = 3
    global_batches = take(letter_loader(texts, micro_batch_size=2), 4 * world)
    ranks = [letter_loader(texts, micro_batch_size=2, rank=r, world_size=world) for r in range(world)]
    for step in range(4):
        for rank, loader in enumerate(ranks):
            assert_same([next(loader)], [global_batches[step * world + rank]])
    states = [loader.state_dict() for loader in ranks]
    assert all(str(state) == str(states[0]) for state in states)  # one state for all ranks


# ------------------------------------------------------------------------------------------------ errors

class ShiftedBytes(ByteTokenizer):
    """A tokenizer whose ids do not fit the model: bytes shifted up by 200."""

    def encode_array(self, text):
        return super().encode_array(text) + 200


def test_token_id_outside_the_vocabulary_is_an_error():
    loader = PackedLoader(MapDocuments(datasets.Dataset.from_dict({"text": ["a"]})), ShiftedBytes(),
                          seq_len=8, micro_batch_size=1, pack_buffer=2, pack_carry=0, vocab_size=259)
    with pytest.raises(ValueError, match=r"token id 297 .*vocab_size 259"):
        next(loader)
    with pytest.raises(ValueError, match=r"token id 256 .*vocab_size 100"):
        letter_loader(["a"], vocab_size=100)


def test_empty_datasets_are_errors(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        MapDocuments(datasets.Dataset.from_dict({"text": []}), description="nothing")
    with pytest.raises(ValueError, match="empty.*in-memory"):
        next(letter_loader(["", ""]))
    with pytest.raises(ValueError, match="empty.*streaming"):
        next(letter_loader(["", ""], streaming=True))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.*empty.jsonl"):
        build_loader({"source": "hf", "path": str(tmp_path / "empty.jsonl")})
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="empty.*dir"):
        build_loader({"source": "hf", "path": str(tmp_path / "dir")})
    with pytest.raises(ValueError, match="empty.*held-out"):  # nothing held out
        build_loader({"heldout_fraction": 0.0}, heldout=True)


def test_missing_paths_are_errors(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=missing):
        build_loader({"source": "hf", "path": missing})
    with pytest.raises(FileNotFoundError, match=missing):
        build_loader({"source": "stdlib", "path": missing})
    with pytest.raises(FileNotFoundError, match="nope.json"):
        build_loader({"tokenizer": missing + "/nope.json"})


def test_bad_config_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['data.seq_length'\]"):
        build_loader({"seq_length": 10})
    with pytest.raises(ValueError, match="source"):
        build_loader({"source": "web"})
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="text field 'text'"):
        build_loader({"source": "hf", "path": str(tmp_path / "a.jsonl")})


def test_non_utf8_bytes_do_not_crash(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bad.py").write_bytes(b"x = 1  # \xff\xfe\x80 latin-1: caf\xe9\n")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 \xff\n")
    replacement = list("\ufffd".encode())
    for config in ({"source": "stdlib", "path": str(tmp_path)},
                   {"source": "hf", "path": str(tmp_path / "bad.txt")}):
        batch = next(build_loader({**config, "heldout_fraction": 0.0, "seq_len": 64, "micro_batch_size": 1}))
        ids = batch["input_ids"][0].tolist()
        assert any(ids[i:i + 3] == replacement for i in range(len(ids)))


# ------------------------------------------------------------------------------------------- hf sources

def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_jsonl_and_text_directory(tmp_path, streaming):
    texts = letter_texts(25, longest=30)
    write_jsonl(tmp_path / "docs.jsonl", texts)
    (tmp_path / "txt").mkdir()
    for k, text in enumerate(texts):
        (tmp_path / "txt" / f"{k:02d}.txt").write_text(text)  # one document per file
    for path in (tmp_path / "docs.jsonl", tmp_path / "txt"):
        config = {"source": "hf", "path": str(path), "streaming": streaming, "heldout_fraction": 0.0,
                  "seq_len": 16, "micro_batch_size": 1, "pack_buffer": 4, "pack_carry": 1}
        loader = build_loader(config)
        assert isinstance(loader.documents, StreamingDocuments if streaming else MapDocuments)
        seen = {chr(int(i)) for row in epoch_rows(loader) for i in row[0] if int(i) < 256}
        assert seen == {t[0] for t in texts if t}
        reference = take(build_loader(config), 8)
        resumed = build_loader(config)
        take(resumed, 5)
        fresh = build_loader(config)
        fresh.load_state_dict(resumed.state_dict())
        assert_same(take(fresh, 3), reference[5:])


def test_heldout_split_is_deterministic_and_disjoint(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [f"document number {i}" for i in range(200)])
    config = DataConfig(source="hf", path=str(tmp_path / "d.jsonl"), heldout_fraction=0.2)
    train = set(build_documents(config).texts(0, 0))
    heldout = set(build_documents(config, heldout=True).texts(0, 0))
    assert len(train | heldout) == 200 and not train & heldout and 20 < len(heldout) < 60
    assert heldout == set(build_documents(config, heldout=True).texts(1, 0))
    stdlib = DataConfig(heldout_fraction=0.2)
    counts = [sum(1 for _ in build_documents(stdlib, heldout=part).texts(0, 0)) for part in (False, True)]
    assert sum(counts) == len(python_source_dataset()) and 0.1 < counts[1] / sum(counts) < 0.3


# ------------------------------------------------------------------------------------------- tokenizers

def _texts(documents) -> list[str]:
    return list(documents.texts(0, 0))


def test_a_single_text_file_is_split_into_documents(tmp_path, caplog):
    """One file (the README, notes): documents by paragraph (by line without blank lines), and a held-out part
    even where no paragraph's hash falls below heldout_fraction (the lowest-hash one is held out)."""
    paragraphs = [f"Paragraph {k} says {LETTERS[k] * (k + 3)}.\nIt has two lines." for k in range(12)]
    notes = tmp_path / "notes.md"
    notes.write_text("\n\n".join(paragraphs) + "\n")
    config = DataConfig(source="hf", path=str(notes), heldout_fraction=0.01)
    with caplog.at_level("INFO", logger="train.data.loader"):
        train, heldout = _texts(build_documents(config)), _texts(build_documents(config, heldout=True))
    assert "single text file: one document per paragraph (data.sample_by=paragraph" in caplog.text
    assert len(heldout) == 1 and len(train) == 11 and not set(train) & set(heldout)
    assert {t.strip() for t in train + heldout} == set(paragraphs)
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"line {k}\n" for k in range(30)))
    split = [_texts(build_documents(DataConfig(source="hf", path=str(lines)), heldout=h)) for h in (False, True)]
    assert sum(map(len, split)) == 30 and all(split)
    batch = next(build_loader({"source": "hf", "path": str(notes), "seq_len": 32, "micro_batch_size": 2}))
    assert batch["input_ids"].shape == (2, 32)
    # one document per file, asked for explicitly: nothing to hold out, and the error says what to set
    with pytest.raises(ValueError, match="held-out part.* — .*data.sample_by=paragraph or line"):
        build_documents(DataConfig(source="hf", path=str(notes), sample_by="document"), heldout=True)
    with pytest.raises(ValueError, match="data.sample_by='chapter' — use one of auto, document"):
        build_documents(DataConfig(source="hf", path=str(notes), sample_by="chapter"))


def test_byte_tokenizer():
    assert (BYTE.vocab_size, BYTE.bos_id, BYTE.eos_id, BYTE.pad_id) == (259, 256, 257, 258)
    assert BYTE.encode("aé") == [97, 0xC3, 0xA9]
    assert BYTE.decode([256, 97, 0xC3, 0xA9, 257]) == "aé"
    assert isinstance(load_tokenizer(None), ByteTokenizer)


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    tokenizer = HFTokenizerModel(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    tokenizer.save(str(path))
    return str(path)


def test_hf_tokenizer_file(bpe_file, tmp_path):
    tokenizer = load_tokenizer(bpe_file)
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id) == (1, 1, 2)  # no BOS token: BOS = EOS
    assert tokenizer.decode(tokenizer.encode("the lazy fox")) == "the lazy fox"
    with pytest.raises(ValueError, match="<s>"):
        load_tokenizer(bpe_file, bos_token="<s>")
    write_jsonl(tmp_path / "d.jsonl", ["the quick brown fox", "jumps over the lazy dog"] * 5)
    batch = next(build_loader({"source": "hf", "path": str(tmp_path / "d.jsonl"), "tokenizer": bpe_file,
                               "heldout_fraction": 0.0, "seq_len": 32, "micro_batch_size": 2}))
    assert int(batch["input_ids"].max()) < tokenizer.vocab_size
    for row in zip(batch["input_ids"], batch["labels"], batch["doc_ids"]):
        check_row(*row, tokenizer=tokenizer)
