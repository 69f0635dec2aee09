"""Supervised fine-tuning data (``train/data/sft.py`` through ``train/data/loader.py``): the labels that count are
exactly the response tokens, one example per document, with the default template and with a tokenizer's own template.

The expectations are built here from the messages and the tokenizer alone (bytes of each response and EOS for the
default template; the tokenizer's encoding of "response<|im_end|>\\n" for the ChatML-like one)."""
import json

import pytest
import torch
from tokenizers import Tokenizer as HFModel, decoders, models, pre_tokenizers, trainers

from train.data.loader import IGNORE_INDEX, build_loader
from train.data.tokenizer import ByteTokenizer, load_tokenizer
from train.loss import lm_loss

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
    with pytest.raises(ValueError, match=r"bad.jsonl, line 1: message 1 of 'messages' has no 'content'"):
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


def tokenizer_dir(chatml_tokenizer, tmp_path, config):
    """The ChatML tokenizer with ``config`` as the ``tokenizer_config.json`` beside it."""
    (tmp_path / "tokenizer.json").write_text((chatml_tokenizer / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path / "tokenizer.json")


# A template that writes the special tokens it is given: the end of a response is ``eos_token``.
ROLE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}"
                 "{{ eos_token if m.role == 'assistant' }}\n{% endfor %}{% if add_generation_prompt %}assistant: "
                 "{% endif %}")


def test_special_tokens_come_from_tokenizer_config(chatml_tokenizer, tmp_path):
    """Hugging Face's ``tokenizer_config.json`` names the special tokens (a string or an AddedToken object); without
    it the guessed EOS would be ``<|endoftext|>``. ``data.eos_token`` still wins, and a name the vocabulary lacks
    is an error naming where it came from."""
    path = tokenizer_dir(chatml_tokenizer, tmp_path, {
        "chat_template": ROLE_TEMPLATE, "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "special": True}, "pad_token": None})
    tokenizer = load_tokenizer(path)
    model = HFModel.from_file(path)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (model.token_to_id("<|im_start|>"), model.token_to_id("<|im_end|>"))
    assert tokenizer.pad_id == tokenizer.eos_id  # pad_token null: none of the usual names, so EOS
    assert load_tokenizer(path, eos_token="<|endoftext|>").eos_id == model.token_to_id("<|endoftext|>")
    docs, _ = documents(jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS]), tokenizer=path)
    expected = {tuple(t for m in chat if m["role"] == "assistant"
                      for t in tokenizer.encode(m["content"] + "<|im_end|>\n")) for chat in CHATS}
    assert {tuple(counted(labels)) for _, labels in docs} == expected  # the template got the config's EOS
    assert all(ids[0] == tokenizer.bos_id for ids, _ in docs)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=r"eos token '</s>' \(eos_token of .*tokenizer_config.json\) is not in"):
        load_tokenizer(path)


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m.content }", "is not a valid Jinja template"),
    ("{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}", "does not render conversations "
                                                                                    "incrementally"),
    ("{{ raise_exception('no system message') }}", "chat template: no system message"),
])
def test_an_unusable_chat_template_fails_before_any_work(chatml_tokenizer, tmp_path, template, message):
    """Checked in the preflight (no engine, no run directory), on a one-question conversation."""
    from model.cli import compose
    from tests.support.train_run import SMALL
    from train.run.preflight import preflight

    path = tokenizer_dir(chatml_tokenizer, tmp_path, {"chat_template": template})
    data = jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS * 2])
    cfg = compose(SMALL + ["data=hf", f"data.path={data}", f"data.tokenizer={path}", "data.heldout_fraction=0.3",
                           "model.vocab_size=300"])
    with pytest.raises(ValueError, match=message):
        preflight(cfg, tmp_path / "run", 1)
    assert not (tmp_path / "run").exists()


def test_export_carries_the_tokenizer_with_its_template_and_special_tokens(chatml_tokenizer, tmp_path):
    """``python -m train.export`` copies the run's tokenizer in Hugging Face's layout: read back, it has the run's
    chat template and special tokens (``data.pad_token`` of the run over the file's ``pad_token``)."""
    from train.export import _copy_tokenizer

    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    out.mkdir()
    path = tokenizer_dir(chatml_tokenizer, run, {"chat_template": CHATML, "eos_token": "<|im_end|>",
                                                 "pad_token": "<|endoftext|>"})
    assert _copy_tokenizer({"tokenizer": path, "pad_token": "<|im_start|>"}, out) == ["tokenizer.json",
                                                                                       "tokenizer_config.json"]
    original, copied = load_tokenizer(path, pad_token="<|im_start|>"), load_tokenizer(str(out / "tokenizer.json"))
    assert copied.chat_template == CHATML
    assert (copied.bos_id, copied.eos_id, copied.pad_id) == (original.bos_id, original.eos_id, original.pad_id)
    assert copied.eos_id != load_tokenizer(str(chatml_tokenizer / "tokenizer.json")).eos_id  # the config mattered
