"""Tests of train/evaluation/probes.py: deterministic generation, exact answer positions, spread, and the scorer."""

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizerModel
from tokenizers import decoders, models, pre_tokenizers, trainers

from train.data.tokenizer import ByteTokenizer, HFTokenizer
from train.evaluation.probes import (MQAR_VALUES, PASSKEY_KEYS, ProbeSample, chance_accuracy, chance_levels,
                                     mqar_probes, passkey_probes, probe_accuracy)

BYTE = ByteTokenizer()
GENERATORS = {"passkey": passkey_probes, "mqar": mqar_probes}


def assert_same(a: ProbeSample, b: ProbeSample):
    for field in ("input_ids", "doc_ids", "answer_positions", "answer_ids", "fact_positions"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("kind", GENERATORS)
def test_probes_are_deterministic_per_seed(kind):
    make = GENERATORS[kind]
    first = make(BYTE, 1024, 4, seed=5)
    for a, b in zip(first, make(BYTE, 1024, 4, seed=5)):
        assert_same(a, b)
    assert not torch.equal(first[0].input_ids, make(BYTE, 1024, 4, seed=6)[0].input_ids)


@pytest.mark.parametrize("kind", GENERATORS)
def test_probe_layout(kind):
    for sample in GENERATORS[kind](BYTE, 700, 5, seed=0):
        assert sample.kind == kind
        assert sample.input_ids.shape == sample.doc_ids.shape == (700,)
        assert sample.input_ids.dtype == sample.answer_positions.dtype == torch.int64
        assert int(sample.input_ids[0]) == BYTE.bos_id and not sample.doc_ids.any()  # one document
        assert torch.equal(sample.input_ids[sample.answer_positions], sample.answer_ids)
        assert BYTE.decode(sample.answer_ids).isdigit()
        assert bool((sample.fact_positions < sample.answer_positions).all())
        before = BYTE.decode(sample.input_ids[:int(sample.answer_positions[0])])
        assert before.endswith("=")


def test_passkey_is_in_the_needle_and_needles_spread_over_the_context():
    samples = passkey_probes(BYTE, 2048, 10, seed=1)
    for sample in samples:
        key = BYTE.decode(sample.answer_ids)
        assert len(key) == 5
        needle = BYTE.decode(sample.input_ids[int(sample.fact_positions[0]):])
        assert needle.startswith(f"\nThe pass key is {key}.")
    depths = sorted(int(s.fact_positions[0]) / 2048 for s in samples)
    assert depths[0] < 0.15 and depths[-1] > 0.85
    assert all(b - a < 0.25 for a, b in zip(depths, depths[1:]))


def test_mqar_queries_spread_and_answer_their_keys():
    samples = mqar_probes(BYTE, 2048, 3, seed=2, n_pairs=12, n_queries=6)
    for sample in samples:
        starts = sample.answer_positions[::4]  # 4-digit values
        assert len(starts) == 6 and int(starts[0]) < 0.4 * 2048 and int(starts[-1]) > 0.75 * 2048
        for start, fact in zip(starts.tolist(), sample.fact_positions[::4].tolist()):
            key_line = BYTE.decode(sample.input_ids[fact:fact + 10])  # the pair's line "abcd=1234\n"
            query = BYTE.decode(sample.input_ids[start - 5:start + 4])
            assert key_line.split("\n")[0] == query
    assert mqar_probes(BYTE, 2048, 1, seed=2, n_pairs=12, n_queries=6)[0].answer_ids.tolist() == \
        samples[0].answer_ids.tolist()  # sample i does not depend on how many are made


def test_context_too_short_is_an_error():
    with pytest.raises(ValueError, match="too short"):
        passkey_probes(BYTE, 64, 1)
    with pytest.raises(ValueError, match="n_queries"):
        mqar_probes(BYTE, 4096, 1, n_pairs=2, n_queries=3)


def test_probes_with_a_bpe_tokenizer(tmp_path):
    model = HFTokenizerModel(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(["The grass is green. The pass key is 12345. pass_key=12345"] * 20, trainer)
    model.save(str(tmp_path / "bpe.json"))
    tokenizer = HFTokenizer(str(tmp_path / "bpe.json"))
    for sample in passkey_probes(tokenizer, 512, 2) + mqar_probes(tokenizer, 512, 2, n_pairs=4, n_queries=2):
        assert sample.input_ids.shape == (512,)
        assert tokenizer.decode(sample.answer_ids.tolist()).isdigit()


def test_probe_accuracy_on_hand_made_logits():
    ids = torch.tensor([0, 5, 6, 7, 9, 1])
    sample = ProbeSample("toy", ids, torch.zeros(6, dtype=torch.int64), torch.tensor([3, 4]), ids[[3, 4]],
                         torch.tensor([1, 1]))
    logits = torch.zeros(6, 10)
    logits[2, 7] = 1.0  # predicts answer token 7 at position 3: right
    logits[3, 2] = 1.0  # predicts 2 instead of 9 at position 4: wrong
    logits[4, 9] = 5.0  # the answer's own position does not count
    assert probe_accuracy(logits, sample) == 0.5
    logits[3, 9] = 2.0
    assert probe_accuracy(logits, sample) == 1.0


class WholeNumberTokenizer(ByteTokenizer):
    """Every number is one token (its value): guessing a 5-digit key is 1 in 90,000."""

    def encode(self, text: str) -> list[int]:
        return [int(text)] if text.isdigit() else super().encode(text)


def test_chance_level_of_the_probes():
    """Byte-level: a key's first digit is one of 9, the others one of 10; a value has 4 digits."""
    assert chance_levels(BYTE) == pytest.approx({"passkey_acc": (1 / 9 + 4 / 10) / 5, "mqar_acc": (1 / 9 + 3 / 10) / 4})
    assert chance_accuracy(WholeNumberTokenizer(), PASSKEY_KEYS) == pytest.approx(1 / 90_000)
    assert chance_accuracy(WholeNumberTokenizer(), MQAR_VALUES) == pytest.approx(1 / 9_000)
    key = passkey_probes(BYTE, 256, 1)[0].answer_ids
    assert int(bytes(key.tolist()).decode()) in PASSKEY_KEYS  # the probes draw from the ranges chance is taken on


def test_the_summary_says_what_the_probes_guessing_level_means():
    """Each probe accuracy is printed beside the accuracy of guessing, and one line says why a model trained on
    other text scores below it (issue 57: the default run's 0s sat beside "chance" unexplained); no probes, no line."""
    from model.cli import compose
    from train.run.app import PROBES_NOTE, summary_table

    config = compose([])
    final = {"step": 3, "lm_loss": 2.5, "passkey_acc/len256": 0.0, "mqar_acc": 0.25}
    lines = summary_table(final, config, chance_levels(ByteTokenizer())).splitlines()
    assert lines[2].endswith(f"(guessing {chance_levels(ByteTokenizer())['passkey_acc']:.4f})")
    assert lines[3].endswith(f"(guessing {chance_levels(ByteTokenizer())['mqar_acc']:.4f})")
    assert lines[-1] == PROBES_NOTE and "zero-shot" in PROBES_NOTE and "below it" in PROBES_NOTE
    assert PROBES_NOTE not in summary_table({"step": 3, "lm_loss": 2.5}, config, {})
