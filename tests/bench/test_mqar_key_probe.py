"""bench/mqar_key_probe.py's altered examples: removing the asked key must leave no earlier record stating it and
touch nothing else; moving the value must change the source alone, to another value."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from mqar_key_probe import variants  # noqa: E402
from train.data.synthetic import SyntheticConfig, SyntheticTasks  # noqa: E402
from train.data.tokenizer import ByteTokenizer  # noqa: E402


def test_variants_change_only_what_they_name():
    settings = {"tasks": {"mqar": 1.0}, "pairs": [12, 15]}  # a key is always left unused, to stand in
    tasks = SyntheticTasks(SyntheticConfig.from_mapping(settings), ByteTokenizer(), 64, 0)
    rng = np.random.default_rng(0)
    for example in tasks.task_examples("mqar", 20):
        cases = list(variants(example, tasks.keys, tasks.values, rng))
        assert len(cases) == 3 * len(example.answer_positions)
        triples = zip(*[iter(cases)] * 3)  # clean, key_removed, value_moved of each answer in turn
        for distance, ((clean, position, answer, kind, _), (removed, *_), (moved, _, new_value, *_)) in zip(
                example.distances, triples):
            source, key = position - distance, clean[position]
            assert kind == "clean" and answer == clean[position + 1] == clean[source]
            assert key not in removed[:source] and key in clean[:source]
            changed = np.flatnonzero(removed != clean)
            assert (changed < source).all() and (clean[changed] == key).all()
            assert np.flatnonzero(moved != clean).tolist() == [source]
            assert new_value == moved[source] != answer and new_value in tasks.values
