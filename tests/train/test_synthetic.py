"""Tests of train/data/synthetic.py: what each task writes, its answers and their distances (checked against the
tokens themselves), determinism and splits, the mixing loader, and the accuracy counters."""
import math

import numpy as np
import pytest
import torch

from model.cli import compose
from train.data.loader import DataConfig, build_loader, data_config, synthetic_tasks
from train.data.synthetic import (TASKS, SyntheticConfig, SyntheticLoader, SyntheticTasks, add_hits, count_keys,
                                  distance_bucket, synthetic_metrics)
from train.data.tokenizer import ByteTokenizer
from train.loss import IGNORE_INDEX, lm_loss

BYTE = ByteTokenizer()
ALL = {"mqar": 1.0, "passkey": 1.0, "copy": 1.0}


def make_tasks(seq_len=128, seed=0, **settings) -> SyntheticTasks:
    return SyntheticTasks(SyntheticConfig.from_mapping({"tasks": ALL, **settings}), BYTE, seq_len, seed)


def text(ids) -> str:
    return BYTE.decode(ids)


@pytest.mark.parametrize("task", TASKS)
def test_answers_copy_their_source(task):
    """Every answer's label is the next input token, and the token ``distance`` back from the predicting position
    is the same token: the fact it retrieves. Nothing but answers is labelled."""
    tasks = make_tasks()
    for example in tasks.task_examples(task, 40):
        assert example.input_ids.shape == example.labels.shape == example.doc_ids.shape == (128,)
        assert example.input_ids[0] == BYTE.bos_id and not example.doc_ids.any()
        positions, distances = example.answer_positions, example.distances
        assert len(positions) > 0 and (distances >= 1).all()
        assert np.array_equal(example.labels[positions], example.tokens[positions + 1])
        assert np.array_equal(example.labels[positions], example.input_ids[positions - distances])
        unlabelled = np.ones(128, dtype=bool)
        unlabelled[positions] = False
        assert (example.labels[unlabelled] == IGNORE_INDEX).all()


def test_mqar_records_state_then_ask():
    """Records ``k v``: first every key once, stating its value (no label), then questions only, each asking a
    stated key (the value labelled) whose value was last written ``distance`` (lo..hi) tokens back, answered by
    that value."""
    tasks = make_tasks(pairs=[3, 6], distance=[10, 40], align=1)
    for example in tasks.task_examples("mqar", 30):
        tokens = text(example.tokens[1:])
        records = [(i + 1, tokens[i:i + 2]) for i in range(len(tokens) - 1) if tokens[i].islower()]
        assert "".join(r for _, r in records) == tokens.replace(" ", "")  # only records besides the filler
        value_of, last, expected = {}, {}, []
        for position, (key, value) in records:
            assert value.isupper() and value_of.setdefault(key, value) == value  # a key keeps its value
            if key in last:
                expected.append((position, position - last[key]))
            else:
                assert not expected  # statements before any question
            last[key] = position + 1
        assert 3 <= len(value_of) <= 6
        assert [(int(p), int(d)) for p, d in zip(example.answer_positions, example.distances)] == expected
        assert (example.distances >= 10).all() and (example.distances <= 40).all() and example.alphabet == 16


@pytest.mark.parametrize("pairs, ceiling", [([12, 16], 0.2), (None, 0.3)])  # None: data=synthetic's own keys
def test_mqar_question_order_does_not_give_the_answer_away(pairs, ceiling):
    """The asked key is drawn among those due, so a rule that picks the source by position alone scores near
    1 / (keys due), not near 1: here reading the value of the oldest (or the newest) record written at least
    ``distance`` back, which is right every time when the keys are asked oldest first. The sweep's 0.8 beyond the
    window lies far above this ceiling: only key matching reaches it."""
    pairs = pairs or list(compose(["data=synthetic"]).data.synthetic.pairs)
    tasks = make_tasks(seq_len=64, pairs=pairs, distance=[12, 64])
    right = {"oldest": 0, "newest": 0}
    answers = 0
    for example in tasks.task_examples("mqar", 100):
        is_key = np.isin(example.tokens, tasks.keys)
        for position, distance in zip(example.answer_positions, example.distances):
            last = {example.tokens[q]: q + 1 for q in range(1, position) if is_key[q]}  # key -> its value's position
            due = [value for value in last.values() if position - value >= 12]
            right["oldest"] += min(due) == position - distance
            right["newest"] += max(due) == position - distance
            answers += 1
    assert answers > 1000 and right["oldest"] / answers < ceiling and right["newest"] / answers < ceiling


def test_mqar_records_align_to_compressed_entries():
    """With ``align=2`` (the default) every record starts at an even position, so a ratio-2 compressed entry
    (positions 2j, 2j+1) holds a whole ``k v`` record."""
    for example in make_tasks().task_examples("mqar", 20):
        starts = [i for i, token in enumerate(text(example.tokens[1:]), start=1) if token.islower()]
        assert starts and all(start % 2 == 0 for start in starts)
        assert (example.answer_positions % 2 == 0).all()  # the key of a question predicts its value


def test_mqar_chance_is_the_best_guess_without_the_source():
    """``chance`` = 1 / len(values), for answers whose source lies beyond the window: no guess from the window's
    tokens does better. Checked here with the best such guess a window-only model could learn, uniform among the
    values absent from the window (values drawn without replacement across keys would make it beat 1/16),
    and with the most frequent answer overall."""
    tasks, window = make_tasks(), 32
    values = set(text(tasks.values))
    guessed, answers, labels = 0.0, 0, []
    for example in tasks.task_examples("mqar", 400):
        for position, distance in zip(example.answer_positions, example.distances):
            answer = text([example.labels[position]])
            labels.append(answer)
            if distance >= window:
                seen = set(text(example.input_ids[position - window + 1:position + 1])) & values
                guessed += (answer not in seen) / (len(values) - len(seen))
                answers += 1
    assert tasks.chance("mqar") == 1 / 16 and set(labels) == values
    assert answers > 2000 and guessed / answers == pytest.approx(1 / 16, abs=0.006)
    assert max(labels.count(v) for v in values) / len(labels) < 1 / 16 + 0.01


def test_passkey_needle_and_question():
    tasks = make_tasks(passkey_digits=4)
    for example in tasks.task_examples("passkey", 20):
        body = text(example.tokens[1:])
        key = body[body.index("#") + 1:][:4]
        assert key.isdigit() and body.endswith("=" + key) and body.replace(" ", "") == f"#{key}={key}"
        assert text(example.labels[example.answer_positions]) == key
        assert len(set(example.distances.tolist())) == 1


def test_copy_blocks_repeat_after_the_marker():
    tasks = make_tasks(copy_length=[5, 9])
    for example in tasks.task_examples("copy", 20):
        blocks = text(example.tokens[1:]).rstrip(" ").split("#")[1:]
        for block in blocks:
            first, second = block.split("=")
            assert 5 <= len(first) <= 9 and second == first
        assert set(example.distances.tolist()) == {len(b.split("=")[0]) for b in blocks}


def test_examples_are_deterministic_per_seed_and_split():
    tasks = make_tasks()
    first = tasks.example("train", 7)
    assert np.array_equal(first.input_ids, make_tasks().example("train", 7).input_ids)
    assert not np.array_equal(first.input_ids, make_tasks(seed=1).example("train", 7).input_ids)
    assert not np.array_equal(first.input_ids, tasks.example("heldout", 7).input_ids)
    assert np.array_equal(tasks.task_examples("mqar", 3)[2].input_ids, tasks.task_examples("mqar", 5)[2].input_ids)
    counts = {task: 0 for task in TASKS}
    for i in range(300):
        counts[tasks.example("train", i).task] += 1
    assert all(70 < n < 130 for n in counts.values())  # equal shares


def test_default_distances_lie_beyond_the_relay_of_stacked_windows():
    """The defaults (``conf/data/synthetic.yaml`` agrees) put every source at least 12 tokens back: beyond what
    ten layers of 2-token windows can pass along (10 tokens), spread over the row."""
    tasks = make_tasks(seq_len=64)
    distances = np.concatenate([e.distances for e in tasks.task_examples("mqar", 64)])
    assert distances.min() >= 12 and (distances >= 24).mean() > 0.2


@pytest.mark.parametrize("settings, message", [
    ({"keys": ["ab", "c"]}, "'ab' is 2 tokens"),
    ({"filler": " a"}, "share token ids"),
    ({"markers": "#"}, "two symbols"),
    ({"pairs": [1, 20]}, "needs as many distinct keys"),
    ({"align": 0}, "data.synthetic.align=0 is out of range — set a whole number >= 1"),
    ({"pairs": [3, 1]}, "range"),
    ({"tasks": {"recall": 1.0}}, "tasks must map"),
    ({"window": 3}, r"unknown setting\(s\) \['data.synthetic.window'\]"),
])
def test_bad_settings_are_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        make_tasks(**settings)


def test_task_that_does_not_fit_is_an_error():
    with pytest.raises(ValueError, match="too short for the synthetic copy task"):
        make_tasks(seq_len=24, pairs=[1, 2], copy_length=[12, 14])


def synthetic_data(**overrides) -> DataConfig:
    return data_config({"seq_len": 64, "micro_batch_size": 2, "synthetic_fraction": 1.0,
                        "synthetic": {"tasks": ALL, "copy_length": [4, 12]}, **overrides})


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_loader_rows_are_the_examples_and_resume_exactly():
    loader = build_loader(synthetic_data())
    assert isinstance(loader, SyntheticLoader) and loader.text is None
    tasks = synthetic_tasks(synthetic_data())
    batch = next(loader)
    for row in range(2):
        example = tasks.example("train", row)
        assert torch.equal(batch["input_ids"][row], torch.from_numpy(example.input_ids))
        assert torch.equal(batch["labels"][row], torch.from_numpy(example.labels))
    state = loader.state_dict()
    after = take(loader, 3)
    resumed = build_loader(synthetic_data())
    resumed.load_state_dict(state)
    for a, b in zip(after, take(resumed, 3)):
        assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="data state was saved for stream"):
        build_loader(synthetic_data(seq_len=96)).load_state_dict(state)


def mqar_answer_positions(input_ids: list[int], keys: str) -> set[int]:
    """Independent of the generator: read the row as text; a key seen before is a question whose answer (the
    next token) is trained."""
    row, seen, asked = [text([token]) for token in input_ids], set(), set()
    for position, symbol in enumerate(row):
        if symbol in keys:
            if symbol in seen:
                asked.add(position)
            seen.add(symbol)
    return asked


@pytest.mark.parametrize("loss", ["answers", "all"])
def test_training_loss_counts_the_answers_or_every_token(loss):
    keys = "abcdefghijklmnop"
    data = synthetic_data(seq_len=96, micro_batch_size=4, synthetic={"tasks": {"mqar": 1.0}, "loss": loss})
    batch = next(build_loader(data))
    logits = torch.randn(*batch["labels"].shape, 259)
    summed, counted = 0.0, 0
    for ids, labels, row_logits in zip(batch["input_ids"].tolist(), batch["labels"], logits):
        trained = set(range(len(ids))) if loss == "all" else mqar_answer_positions(ids, keys)
        assert set(torch.nonzero(labels != IGNORE_INDEX).flatten().tolist()) == trained
        positions = sorted(trained)
        assert all(labels[p] == ids[p + 1] for p in positions if p + 1 < len(ids))  # the next token
        summed += sum(-torch.log_softmax(row_logits[p], -1)[labels[p]].item() for p in positions)
        counted += len(positions)
    mean, tokens = lm_loss(logits, batch["labels"])
    assert tokens == counted and mean.item() == pytest.approx(summed / counted, rel=1e-5)


def test_unknown_loss_is_an_error():
    with pytest.raises(ValueError, match="data.synthetic.loss"):
        SyntheticConfig.from_mapping({"loss": "values"})


def test_ranks_split_the_global_stream():
    whole = take(build_loader(synthetic_data(micro_batch_size=2)), 2)
    ranks = [take(build_loader(synthetic_data(micro_batch_size=1), rank=r, world_size=2), 2) for r in range(2)]
    for step in range(2):
        for rank in range(2):
            assert torch.equal(ranks[rank][step]["input_ids"][0], whole[step]["input_ids"][rank])


def test_mixing_with_text_keeps_both_streams_in_order(tmp_path):
    (tmp_path / "a.txt").write_text("plain text " * 40)
    (tmp_path / "b.txt").write_text("more words " * 30)
    config = synthetic_data(source="hf", path=str(tmp_path), heldout_fraction=0.0, synthetic_fraction=0.5)
    loader = build_loader(config)
    rows = torch.cat([b["input_ids"] for b in take(loader, 20)])
    synthetic = [i for i, row in enumerate(rows) if "plain" not in text(row) and "more" not in text(row)]
    assert 8 < len(synthetic) < 32  # about half
    tasks = synthetic_tasks(config)
    for i in synthetic:  # a synthetic row is the example of its global row index
        assert torch.equal(rows[i], torch.from_numpy(tasks.example("train", i).input_ids))
    assert 0 < loader.padding_fraction < 1  # the text rows' padding over all rows' tokens
    state = loader.state_dict()
    after = take(loader, 4)
    resumed = build_loader(config)
    resumed.load_state_dict(state)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(after, take(resumed, 4)))


def test_fraction_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="synthetic_fraction"):
        build_loader(synthetic_data(synthetic_fraction=1.5))


def test_distance_buckets():
    assert [distance_bucket(d, 32) for d in (0, 31, 32, 63, 64, 127, 128, 300)] == [
        (0, 31), (0, 31), (32, 63), (32, 63), (64, 127), (64, 127), (128, 255), (256, 511)]


def test_accuracy_by_distance_on_hand_made_logits():
    """Logits right at exactly the answers within the window (and at one chosen far answer): the counters and
    rows must match a count done here answer by answer."""
    tasks = make_tasks()
    examples = {task: tasks.task_examples(task, 6) for task in TASKS}
    counts = count_keys(examples, 32)
    expected = {task: {"all": [0, 0], "within": [0, 0], "beyond": [0, 0]} for task in TASKS}
    for task, task_examples in examples.items():
        for example in task_examples:
            logits = torch.zeros(128, 259)
            wrong = (example.labels[example.answer_positions] + 1) % 259
            logits[example.answer_positions, wrong] = 1.0
            far = int(np.argmax(example.distances))
            for k, (position, distance) in enumerate(zip(example.answer_positions, example.distances)):
                right = distance < 32 or k == far
                if right:
                    logits[position, example.labels[position]] = 2.0
                for part in ("all", "within" if distance < 32 else "beyond"):
                    expected[task][part][0] += right
                    expected[task][part][1] += 1
            add_hits(counts, logits, example, 32)
    row = synthetic_metrics(counts, {task: tasks.chance(task) for task in TASKS}, 32)
    for task in TASKS:
        for part, key in (("all", "acc"), ("within", "acc_within_window"), ("beyond", "acc_beyond_window")):
            hits, answers = expected[task][part]
            value = row[f"synthetic/{task}_{key}"]
            assert (math.isnan(value) and answers == 0) or value == pytest.approx(hits / answers)
    assert row["synthetic/mqar_chance"] == 1 / 16 and row["synthetic/passkey_chance"] == 1 / 10
    assert row["synthetic/copy_chance"] == 1 / 32
    assert row["synthetic/mqar_acc/dist0-31"] == 1.0
