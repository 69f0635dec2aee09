"""Supervised fine-tuning data: conversations become token sequences whose loss counts only the responses.

Formats (``data.format``, for ``data=hf``): ``chat``, a column (``data.messages_field``) of messages
``[{"role": ..., "content": ...}, ...]``; ``prompt_response``, two text columns (``data.prompt_field``,
``data.response_field``), read as the conversation ``[user: prompt, assistant: response]``; ``text``, plain
documents; ``auto`` (the default) picks ``text`` when the text column exists, else ``chat``, else
``prompt_response``. Every conversation is one document of the packed rows (its own doc id: packing never
joins two examples into one attention context); one longer than ``data.seq_len`` is cut to its first
``seq_len + 1`` tokens (a warning counts them), and one with no response left is skipped.

Template. When the tokenizer file (or the ``tokenizer_config.json`` beside it) has a ``chat_template``, that Jinja
template renders the conversation (variables ``messages``, ``add_generation_prompt``, and the tokenizer's special
tokens ``bos_token``, ``eos_token``: ``train/data/tokenizer.py``); the tokens of assistant turn ``i`` are the text that
``messages[:i + 1]`` adds to ``messages[:i]`` rendered with ``add_generation_prompt``, so what the template appends
after a response (an end-of-turn token) is trained too, and the header before it is not. Segments are tokenized
one by one, so a token never straddles a prompt/response boundary. Without a template, the default is::

    <BOS><|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}<EOS><|user|>\\n...

(one ``<|{role}|>\\n{content}\\n`` per non-assistant message; an assistant message is ``<|assistant|>\\n``, then
its content and the EOS token, both trained). The ``<|...|>`` markers are plain text to the tokenizer.

In a document's token array a token whose prediction is not trained (everything but the responses) is stored as
its bitwise complement ``~id`` (negative), so the loader's arrays and checkpointed state keep their one-array
form; ``split_labels`` turns a row back into input ids and labels.
"""
from __future__ import annotations

import logging

import numpy as np
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from train.data.tokenizer import Tokenizer
from train.loss import IGNORE_INDEX

log = logging.getLogger(__name__)

FORMATS = ("auto", "text", "chat", "prompt_response")
ASSISTANT = "assistant"
CONVERSATION = "conversation"  # the column prompt/response rows become


def resolve_format(fmt: str, columns: list[str] | None, text_field: str, messages_field: str, prompt_field: str,
                   response_field: str, description: str) -> str:
    """``data.format`` with ``auto`` decided by the dataset's columns; a format whose columns are missing is an
    error naming them."""
    if fmt not in FORMATS:
        raise ValueError(f"data.format={fmt!r}: use one of {FORMATS}")
    needs = {"text": [text_field], "chat": [messages_field], "prompt_response": [prompt_field, response_field]}
    chosen = fmt
    if fmt == "auto":
        chosen = next((f for f, cols in needs.items() if columns is not None and set(cols) <= set(columns)), "text")
    missing = [c for c in needs[chosen] if columns is not None and c not in columns]
    if missing:
        raise ValueError(f"{chosen} field {missing[0]!r} is not a column of {description} (columns: {columns}); "
                         f"data.format={fmt} looks for {needs if fmt == 'auto' else needs[chosen]}: set "
                         "data.text_field (plain text), data.messages_field (chat) or data.prompt_field and "
                         "data.response_field")
    return chosen


def as_conversation(prompt: str, response: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": ASSISTANT, "content": response}]


def prompt_response_conversations(dataset, prompt_field: str, response_field: str):
    """The dataset as one column, ``conversation``: each row's prompt and response as a two-message chat."""
    def convert(batch):
        return {CONVERSATION: [as_conversation(p, r) for p, r in zip(batch[prompt_field], batch[response_field])]}

    return dataset.map(convert, batched=True).select_columns([CONVERSATION])


def split_labels(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(input ids, labels) of ``tokens`` (a chunk's positions plus the next token): the label of position ``i`` is
    token ``i + 1``, ``IGNORE_INDEX`` where that token is a prompt token (stored as ``~id``)."""
    ids = np.where(tokens < 0, ~tokens, tokens)
    labels = np.where(tokens[1:] < 0, IGNORE_INDEX, ids[1:])
    return ids[:-1], labels


class ChatEncoder:
    """Conversations -> token arrays with the prompt tokens complemented (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.template = _compile(tokenizer) if tokenizer.chat_template else None
        self.truncated = 0

    def __call__(self, messages: list[dict]) -> np.ndarray | None:
        """The document of one conversation, or None when it holds no response tokens (within ``max_tokens``)."""
        _check(messages)
        pieces = self._templated(messages) if self.template else self._default(messages)
        tokens = np.concatenate([ids if trained else ~ids for ids, trained in pieces])
        if len(tokens) > self.max_tokens:
            tokens = tokens[:self.max_tokens]
            self.truncated += 1
            if self.truncated == 1 or self.truncated % 1000 == 0:
                log.warning("%d conversation(s) longer than data.seq_len + 1 = %d tokens were cut to it",
                            self.truncated, self.max_tokens)
        return tokens if (tokens[1:] >= 0).any() else None

    def generation_prompt(self, messages: list[dict]) -> np.ndarray:
        """The tokens that precede an assistant's answer to ``messages``, as training showed them: the template
        rendered with ``add_generation_prompt``, or the default's messages and its ``<|assistant|>`` header (what
        ``python -m train.generate --chat`` feeds the model)."""
        _check(messages)
        if self.template:
            return self._encode(self._render(messages, True))
        pieces = self._default(messages) + [(self._encode(f"<|{ASSISTANT}|>\n"), False)]
        return np.concatenate([ids for ids, _ in pieces])

    def _encode(self, text: str) -> np.ndarray:
        return self.tokenizer.encode_array(text).astype(np.int64)

    def _default(self, messages: list[dict]) -> list[tuple[np.ndarray, bool]]:
        tok = self.tokenizer
        pieces = [(np.array([tok.bos_id], dtype=np.int64), False)]
        for message in messages:
            if message["role"] == ASSISTANT:
                pieces += [(self._encode(f"<|{ASSISTANT}|>\n"), False), (self._encode(message["content"]), True),
                           (np.array([tok.eos_id], dtype=np.int64), True)]
            else:
                pieces.append((self._encode(f"<|{message['role']}|>\n{message['content']}\n"), False))
        return pieces

    def _templated(self, messages: list[dict]) -> list[tuple[np.ndarray, bool]]:
        text = self._render(messages, False)
        pieces, done = [], 0
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            start, end = self._render(messages[:i], True), self._render(messages[:i + 1], False)
            if not (end.startswith(start) and text.startswith(end) and len(start) >= done):
                raise ValueError(f"the tokenizer's chat template does not render conversations incrementally (turn "
                                 f"{i}: the text up to a response is not a prefix of the text with it), so the "
                                 "response tokens cannot be found; remove chat_template to use the default")
            pieces += [(self._encode(text[done:len(start)]), False), (self._encode(text[len(start):len(end)]), True)]
            done = len(end)
        pieces.append((self._encode(text[done:]), False))
        return pieces

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        tok = self.tokenizer
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=tok.token(tok.bos_id), eos_token=tok.token(tok.eos_id))
        except TemplateError as error:
            raise ValueError(f"the chat template of {tok.path} fails on a conversation: {error}") from error


def check_template(tokenizer: Tokenizer) -> None:
    """Encode a one-question conversation, so that a chat template that cannot be used (a syntax error, or one
    that does not render incrementally) fails before any work rather than at the first batch."""
    ChatEncoder(tokenizer, max_tokens=2**31)(as_conversation("Hello?", "Hello."))


def _check(messages) -> None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"a conversation must be a list of {{'role': str, 'content': str}} messages, got "
                         f"{str(messages)[:200]}")


def _compile(tokenizer: Tokenizer):
    """The tokenizer's chat template as a Jinja template in a sandbox, as Hugging Face renders chat templates
    (``raise_exception`` available)."""
    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    try:
        return environment.from_string(tokenizer.chat_template)
    except TemplateError as error:
        raise ValueError(f"the chat template of {tokenizer.path} is not a valid Jinja template: {error}") from error
