"""Supervised fine-tuning data (``train/sft.py`` through ``train/data.py``): the labels that count are exactly the
response tokens, one example per document, with the default template and with a tokenizer's own template.

The expectations are built here from the messages and the tokenizer alone (bytes of each response and EOS for the
default template; the tokenizer's encoding of "response<|im_end|>\\n" for the ChatML-like one)."""
import json

import pytest
import torch
from tokenizers import Tokenizer as HFModel, decoders, models, pre_tokenizers, trainers

from train.data import IGNORE_INDEX, build_loader
from train.loss import lm_loss
from train.tokenizer import ByteTokenizer, load_tokenizer

CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"},
     {"role": "assistant", "content": "6."}],
    [{"role": "user", "content": "Capital of Peru?"}, {"role": "assistant", "content": "Lima."}],
    [{"role": "user", "content": "Spell cat backwards."}, {"role": "assistant", "content": "tac"}],
]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def documents(path, seq_len=256, **data):
    """The documents of the first row (a small file packs into it) as (input ids, labels); padding left out."""
    config = dict(source="hf", path=path, seq_len=seq_len, micro_batch_size=1, heldout_fraction=0.0, **data)
    batch = next(build_loader(config))
    docs = []
    for ids, labels, doc_ids in zip(batch["input_ids"], batch["labels"], batch["doc_ids"]):
        padding = int(doc_ids.max()) if (labels[doc_ids == doc_ids.max()] == IGNORE_INDEX).all() else None
        for d in doc_ids.unique().tolist():
            if d != padding:
                docs.append((ids[doc_ids == d], labels[doc_ids == d]))
    return docs, batch


def counted(labels):
    return [t for t in labels.tolist() if t != IGNORE_INDEX]


def byte_responses(chat):
    """The default template's trained tokens of a chat: each response's UTF-8 bytes, then EOS."""
    out = []
    for message in chat:
        if message["role"] == "assistant":
            out += list(message["content"].encode()) + [ByteTokenizer.eos_id]
    return out


def test_counted_tokens_are_exactly_the_responses(tmp_path):
    docs, batch = documents(jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS]))
    assert len(docs) == len(CHATS)  # one document (doc id) per example, none split or joined
    byte = ByteTokenizer()
    found = {}
    for ids, labels in docs:
        assert ids[0] == byte.bos_id
        text = byte.decode(ids.tolist())
        chat = next(c for c in CHATS if f"<|user|>\n{c[-2]['content']}\n" in text)
        found[id(chat)] = True
        assert counted(labels) == byte_responses(chat)
        rendered = "".join(f"<|assistant|>\n{m['content']}" if m["role"] == "assistant"
                           else f"<|{m['role']}|>\n{m['content']}\n" for m in chat)
        assert text == rendered  # the documented default template (EOS is special, not in the decoded text)
    assert len(found) == len(CHATS)
    _, count = lm_loss(torch.zeros(*batch["labels"].shape, 259), batch["labels"])
    assert count == sum(len(byte_responses(c)) for c in CHATS)  # what the loss averages over


def test_prompt_response_rows_are_two_turn_chats(tmp_path):
    rows = [{"prompt": "Capital of Peru?", "response": "Lima."}, {"prompt": "1 + 1?", "response": "2"}]
    docs, _ = documents(jsonl(tmp_path / "pr.jsonl", rows))
    got = sorted(counted(labels) for _, labels in docs)
    assert got == sorted(list(r["response"].encode()) + [ByteTokenizer.eos_id] for r in rows)


def test_long_examples_are_cut_and_promptless_ones_skipped(tmp_path):
    long_prompt = [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "never seen"}]
    long_answer = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 " * 4}]
    docs, _ = documents(jsonl(tmp_path / "long.jsonl", [{"messages": long_prompt}, {"messages": long_answer}]),
                        seq_len=48)
    assert len(docs) == 1  # the first one has no response within 49 tokens: skipped
    ids, labels = docs[0]
    assert len(ids) == 48
    response = byte_responses(long_answer)
    prompt_tokens = 1 + len("<|user|>\nCount.\n<|assistant|>\n")
    assert counted(labels) == response[:49 - prompt_tokens]


def test_a_missing_column_is_named(tmp_path):
    path = jsonl(tmp_path / "text.jsonl", [{"body": "hello"}])
    with pytest.raises(ValueError, match=r"chat field 'messages' is not a column of .*data.format=chat looks for"):
        documents(path, format="chat")
    with pytest.raises(ValueError, match="must be a list of"):
        documents(jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}]}]))


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    """A small byte-level BPE with ChatML's special tokens, as a ``tokenizers`` JSON."""
    directory = tmp_path_factory.mktemp("tokenizer")
    model = HFModel(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    model.train_from_iterator([m["content"] for chat in CHATS for m in chat] * 5, trainer)
    model.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.parametrize("where", ["tokenizer_config.json", "tokenizer.json"])
def test_the_tokenizers_chat_template_is_used(chatml_tokenizer, tmp_path, where):
    """ChatML from ``tokenizer_config.json`` beside the tokenizer (Hugging Face's layout) or inside its JSON."""
    spec = json.loads((chatml_tokenizer / "tokenizer.json").read_text())
    if where == "tokenizer.json":
        spec["chat_template"] = CHATML
    else:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    path = str(tmp_path / "tokenizer.json")
    tokenizer = load_tokenizer(path)
    docs, _ = documents(jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS]), tokenizer=path)
    assert len(docs) == len(CHATS)
    expected = {tuple(t for m in chat if m["role"] == "assistant"
                      for t in tokenizer.encode(m["content"] + "<|im_end|>\n")) for chat in CHATS}
    assert {tuple(counted(labels)) for _, labels in docs} == expected
    im_start = tokenizer.encode("<|im_start|>")
    assert len(im_start) == 1 and all(ids[0] == im_start[0] for ids, _ in docs)  # no BOS: the template's tokens
