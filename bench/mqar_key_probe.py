"""Does a model trained on the synthetic MQAR task match keys, or read its answers off positions?

    python bench/mqar_key_probe.py <run dir or checkpoint> --out FILE.json [--examples 256]

Scores the checkpoint on held-out MQAR examples (regenerated from the run's own data settings) three ways, one
answer at a time:
- ``clean``: the example as it is;
- ``key_removed``: the asked key replaced by an unused key at every record up to the answer's source, so that no
  earlier record states it: a model that finds the source by its key falls to chance, one that finds it by
  position does not notice (examples that state every key have no unused key and are left out here);
- ``value_moved``: the source record's value replaced by another value: scored against the new value, a model that
  reads the source record follows it.
Each accuracy is also given by the number of records between the source and the question. The JSON holds the
command, machine, date and code (``result_meta``), the checkpoint, the run's overrides (given a run dir) and MQAR
settings, and the accuracies.
"""
import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from result_meta import result_meta

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import build_model  # noqa: E402
from train.data.synthetic import SyntheticConfig, SyntheticTasks  # noqa: E402
from train.evaluation.evaluate import data_tokenizer  # noqa: E402
from train.formats import checkpoint  # noqa: E402

CONDITIONS = ("clean", "key_removed", "value_moved")


def variants(example, keys: np.ndarray, values: np.ndarray, rng: np.random.Generator):
    """(tokens, predicting position, expected answer, condition, records between source and question) for every
    answer of ``example`` under every condition."""
    tokens = example.tokens
    is_key = np.isin(tokens, keys)
    unused = np.setdiff1d(keys, tokens)
    for position, distance in zip(example.answer_positions, example.distances):
        source = position - distance  # the value's position; its key is at source - 1
        key, value = tokens[position], tokens[position + 1]
        between = int(is_key[source + 1:position].sum())
        yield tokens, position, value, "clean", between
        if unused.size:
            removed = tokens.copy()
            removed[:source][removed[:source] == key] = unused[0]
            yield removed, position, value, "key_removed", between
        moved, other = tokens.copy(), rng.choice(values[values != value])
        moved[source] = other
        yield moved, position, other, "value_moved", between


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a run dir (its checkpoints/), a checkpoint dir or a tag dir")
    p.add_argument("--out", required=True)
    p.add_argument("--examples", type=int, default=256)
    p.add_argument("--batch", type=int, default=128)
    a = p.parse_args()
    path = Path(a.checkpoint)
    ref = checkpoint.locate(str(path / "checkpoints" if (path / "checkpoints").is_dir() else path), "checkpoint")
    cfg = OmegaConf.create(checkpoint.read_trainer_state(ref)["config"])
    model = build_model(cfg.model, cfg.layout)
    model.load_state_dict(checkpoint.read_weights(ref))
    model.eval()
    tasks = SyntheticTasks(SyntheticConfig.from_mapping(cfg.data.synthetic), data_tokenizer(cfg.data),
                           cfg.data.seq_len, cfg.data.shuffle_seed)
    rng = np.random.default_rng(0)
    cases = [case for example in tasks.task_examples("mqar", a.examples, "eval")
             for case in variants(example, tasks.keys, tasks.values, rng)]
    hits = defaultdict(lambda: [0, 0])
    with torch.no_grad():
        for start in range(0, len(cases), a.batch):
            chunk = cases[start:start + a.batch]
            ids = torch.stack([torch.as_tensor(tokens[:-1]) for tokens, *_ in chunk])
            logits = model(ids, torch.zeros_like(ids)).logits
            for (_, position, answer, condition, between), row in zip(chunk, logits):
                hit = int(row[position].argmax() == answer)
                for key in (condition, f"{condition}/records_between_{min(between, 6)}"):
                    hits[key][0] += hit
                    hits[key][1] += 1
    accuracy = {key: round(h / n, 4) for key, (h, n) in sorted(hits.items())}
    counts = {key: n for key, (_, n) in sorted(hits.items())}
    overrides = path / ".hydra" / "overrides.yaml"  # how the run was started, when given a run dir
    result = {**result_meta(), "checkpoint": str(ref.path), "layout": cfg.layout.name,
              "run_overrides": OmegaConf.to_container(OmegaConf.load(overrides)) if overrides.exists() else None,
              "mqar": OmegaConf.to_container(cfg.data.synthetic), "window_size": cfg.model.window_size,
              "chance": tasks.chance("mqar"), "accuracy": accuracy, "answers": counts}
    Path(a.out).write_text(json.dumps(result, indent=1))
    for condition in CONDITIONS:
        print(f"{condition:12s} {accuracy.get(condition, float('nan')):.3f}  "
              + "  ".join(f"{k.rsplit('_', 1)[1]}:{v:.2f}" for k, v in accuracy.items()
                          if k.startswith(condition + "/")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
