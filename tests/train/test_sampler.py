"""Generation's sampler (``train/generate.py``) against distributions computed by hand (issue 57): temperature,
top-k, the nucleus exactly at its boundary, the draws themselves, and the loop's end of sequence.

The probabilities are powers of two (or their ratios) so that softmax, sums and cut-offs are exact in float64 and
a boundary is a boundary. Planted bugs each test catches: temperature ignored or applied twice
(``test_temperature``, ``test_draws_follow_the_distribution``); top-k keeping one token too many or too few, or
mapping the kept tokens back to the wrong ids (``test_top_k``); the nucleus cut with ``<=`` or on the running sum
including the token itself (``test_nucleus_at_its_boundary``); top-p applied before top-k
(``test_top_k_cuts_before_the_nucleus``); EOS not stopping the loop, or returned with the text
(``test_eos_ends_the_text``); BOS, PAD or a spare row sampled (``test_only_the_tokenizers_text_ids_are_sampled``).
"""
import math
from types import SimpleNamespace

import pytest
import torch

from train.data.tokenizer import ByteTokenizer
from train.generate import generate, next_token, sampling_probabilities


def logits_of(*weights: float) -> torch.Tensor:
    """Logits whose softmax is ``weights`` normalised."""
    return torch.tensor([math.log(w) for w in weights], dtype=torch.float64)


def normalised(*weights: float) -> torch.Tensor:
    total = sum(weights)
    return torch.tensor([w / total for w in weights], dtype=torch.float64)


def assert_distribution(got: torch.Tensor, *weights: float) -> None:
    torch.testing.assert_close(got, normalised(*weights), rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature, expected", [
    (1.0, (4, 2, 1)),
    (0.5, (16, 4, 1)),  # logits doubled: the weights squared
    (2.0, (2, math.sqrt(2), 1)),  # logits halved: the weights' square roots
])
def test_temperature(temperature, expected):
    assert_distribution(sampling_probabilities(logits_of(4, 2, 1), temperature), *expected)


def test_top_k():
    """The k most probable tokens, at their ids (the logits are not in order), renormalised."""
    logits = logits_of(1, 4, 2, 8)
    assert_distribution(sampling_probabilities(logits, 1.0, top_k=2), 0, 4, 0, 8)
    assert_distribution(sampling_probabilities(logits, 1.0, top_k=3), 0, 4, 2, 8)
    assert_distribution(sampling_probabilities(logits, 1.0, top_k=1), 0, 0, 0, 1)
    for everything in (0, 4, 10):
        assert_distribution(sampling_probabilities(logits, 1.0, top_k=everything), 1, 4, 2, 8)


@pytest.mark.parametrize("top_p, expected", [
    (0.4, (0, 8, 0, 0)),  # the most probable token alone already reaches it
    (0.5, (0, 8, 0, 0)),  # exactly reached by the first token
    (0.5 + 1e-9, (0, 8, 0, 4)),
    (0.75, (0, 8, 0, 4)),  # exactly reached by the first two: the third stays out
    (0.75 + 1e-9, (0, 8, 3, 4)),
    (1.0, (1, 8, 3, 4)),
])
def test_nucleus_at_its_boundary(top_p, expected):
    """Probabilities 8/16, 4/16, 3/16, 1/16 (at ids 1, 3, 2, 0): running sums 0.5, 0.75, 0.9375, 1, exact."""
    assert_distribution(sampling_probabilities(logits_of(1, 8, 3, 4), 1.0, top_p=top_p), *expected)


def test_top_k_cuts_before_the_nucleus():
    """Top-3 of 8/16, 4/16, 3/16, 1/16 is 8/15, 4/15, 3/15, whose first two reach 0.78 (12/15 = 0.8); the nucleus of
    the uncut distribution would need the third (0.75 < 0.78)."""
    assert_distribution(sampling_probabilities(logits_of(1, 8, 3, 4), 1.0, top_p=0.78, top_k=3), 0, 8, 0, 4)


def test_draws_follow_the_distribution():
    """20,000 seeded draws at temperature 0.5 and top-p 0.9 (weights 16, 4, 1 of 4, 2, 1 squared; 16/21 + 4/21 >= 0.9
    keeps two: 4/5 and 1/5): each frequency within 5 standard deviations of its probability; temperature 0 is the
    argmax."""
    generator, n = torch.Generator().manual_seed(0), 20_000
    logits = logits_of(2, 1, 4).float()
    counts = torch.bincount(torch.tensor([next_token(logits, 0.5, 0.9, generator) for _ in range(n)]), minlength=3)
    expected = normalised(4, 0, 16)
    sigma = (expected * (1 - expected) / n).sqrt()
    assert counts[1] == 0
    assert ((counts / n - expected).abs() <= 5 * sigma + 1e-12).all(), (counts, expected)
    assert next_token(logits, 0.0, 0.9, generator) == 2


class Scripted(torch.nn.Module):
    """A model whose next token after the prompt is ``script[i]`` at step ``i`` (by a wide margin); every row else,
    BOS, PAD and the spare rows past the tokenizer's ids included, gets a higher logit than the rest, so that only the
    banning keeps them out. Counts its forwards."""

    def __init__(self, script: list[int], prompt_length: int, vocab_size: int, banned: list[int]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))  # generate() finds the device through the parameters
        self.args = SimpleNamespace(vocab_size=vocab_size)
        self.script, self.prompt_length, self.banned, self.forwards = script, prompt_length, banned, 0

    def forward(self, ids: torch.Tensor, doc_ids: torch.Tensor) -> SimpleNamespace:
        self.forwards += 1
        logits = torch.zeros(1, ids.shape[1], self.args.vocab_size)
        logits[0, -1, self.banned] = 50.0
        logits[0, -1, self.script[ids.shape[1] - self.prompt_length]] = 40.0
        return SimpleNamespace(logits=logits)


def scripted(script: list[int]) -> tuple[Scripted, ByteTokenizer, torch.Tensor]:
    tok = ByteTokenizer()
    prompt = torch.tensor([tok.bos_id, ord("a")])
    return Scripted(script, len(prompt), tok.vocab_size + 5, [tok.bos_id, tok.pad_id, tok.vocab_size + 2]), tok, prompt


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_ends_the_text(temperature):
    """The tokens before EOS, EOS left out, and no forward after it; ``max_new_tokens`` stops earlier."""
    eos = ByteTokenizer.eos_id
    model, tok, prompt = scripted([ord("x"), ord("y"), eos, ord("z"), ord("w")])
    assert generate(model, tok, prompt, 10, temperature=temperature) == [ord("x"), ord("y")]
    assert model.forwards == 3
    model, tok, prompt = scripted([ord("x"), ord("y"), eos])
    assert generate(model, tok, prompt, 1, temperature=temperature) == [ord("x")]


def test_only_the_tokenizers_text_ids_are_sampled():
    """BOS, PAD and a spare row outscore the scripted tokens, and are never drawn: greedy takes the scripted token,
    and at a temperature that makes every id nearly equally likely 5 x 40 draws never hit them."""
    model, tok, prompt = scripted([ord("q")] * 40)
    assert generate(model, tok, prompt, 4) == [ord("q")] * 4
    drawn = {t for seed in range(5) for t in generate(model, tok, prompt, 40, temperature=1000.0, seed=seed)}
    assert len(drawn) > 20 and not {tok.bos_id, tok.pad_id, tok.vocab_size + 2} & drawn
