"""Evaluation: the training objective on held-out documents, and the long-context retrieval probes.

The loss is ``train/loss.py``'s, so held-out and training numbers mean the same thing. A fresh held-out loader
per evaluation gives the same batches every time (comparable across steps), and neither part touches the
training stream or the RNGs (an evaluation never changes what a resumed run sees).
"""
import math

import torch
from omegaconf import DictConfig

from train import distributed
from train.data import build_loader
from train.loss import compute_loss, mean_metrics
from train.probes import mqar_probes, passkey_probes, probe_accuracy
from train.tokenizer import load_tokenizer


def data_tokenizer(data: DictConfig):
    """The tokenizer ``cfg.data`` names (byte-level by default)."""
    return load_tokenizer(data.tokenizer, data.bos_token, data.eos_token, data.pad_token)


def probe_lengths(cfg: DictConfig) -> list[int]:
    """``train.eval.probe_lens``, or by default the training length and twice it: retrieval inside the
    context the model was trained on and beyond it."""
    lengths = cfg.train.eval.probe_lens
    return [int(n) for n in lengths] if lengths else [cfg.data.seq_len, 2 * cfg.data.seq_len]


def build_probes(cfg: DictConfig) -> dict[tuple[str, int], list]:
    """``train.eval.probe_examples`` passkey and MQAR samples at each probe length, keyed by (kind, length)."""
    spec = cfg.train.eval
    tokenizer = data_tokenizer(cfg.data)
    probes = {}
    try:
        for length in probe_lengths(cfg):
            probes["passkey", length] = passkey_probes(tokenizer, length, spec.probe_examples, seed=spec.probe_seed)
            probes["mqar", length] = mqar_probes(tokenizer, length, spec.probe_examples, seed=spec.probe_seed,
                                                 n_pairs=spec.mqar_pairs, n_queries=spec.mqar_queries)
    except ValueError as error:
        raise ValueError(f"{error}: set longer train.eval.probe_lens (default: data.seq_len and twice it) or "
                         "train.eval.probe_examples=0") from error
    return probes


class Evaluator:
    """The evaluation of one run: held-out loss parts, index recall, and the probes.

    Built before training, so that an empty held-out set or a probe that does not fit fails before any step.
    Every evaluation rewinds the held-out loader to its start: the same batches each time. With one pipeline
    stage the whole model runs here; with several, the held-out objective runs through the pipeline
    (``pipeline_heldout``) and the probes and index recall, which need the whole model's logits at other
    lengths, are not computed.
    """

    def __init__(self, cfg: DictConfig, device: torch.device, engine):
        self.cfg, self.device, self.engine = cfg, device, engine
        self.loader = build_loader(cfg.data, rank=engine.grid.data_parallel_id, world_size=engine.dp_world_size,
                                   heldout=True, vocab_size=cfg.model.vocab_size)
        self.loader_start = self.loader.state_dict()
        self.probes = build_probes(cfg) if cfg.train.eval.probe_examples and engine.num_stages == 1 else {}

    def __call__(self, probes: bool) -> dict[str, float]:
        """Held-out numbers, and with ``probes`` the probe accuracies; the model runs in eval mode."""
        module = self.engine.module
        was_training = module.training
        module.eval()
        try:
            if self.engine.num_stages > 1:
                return self.pipeline_heldout()
            row = self.heldout(module.stage.whole_model)
            if probes and self.probes:
                row.update(self.probe_accuracy(module.stage.whole_model))
            return row
        finally:
            module.train(was_training)

    @torch.no_grad()
    def pipeline_heldout(self) -> dict[str, float]:
        """The held-out objective through the pipeline stages: ``loss`` averaged over batches and ranks."""
        self.loader.load_state_dict(self.loader_start)
        total = 0.0
        for _ in range(self.cfg.train.eval.batches):
            batch = next(self.loader)
            data = iter([((batch["input_ids"], batch["doc_ids"]), batch["labels"])])
            total += self.engine.eval_batch(data, num_micro_batches=1).item()
        return {"loss": total / self.cfg.train.eval.batches}

    @torch.no_grad()
    def heldout(self, model) -> dict[str, float]:
        """Loss parts (``Loss.metrics``) and ``index_recall/layer{N}`` of every layer that reads a selection,
        averaged over ``train.eval.batches`` held-out micro-batches and over ranks.

        Index recall is the share of a layer's selected entries that are also in the top-k of its own dense
        attention (the model's evaluation diagnostic); a batch where a layer selected nothing does not count.
        """
        self.loader.load_state_dict(self.loader_start)
        rows, recalls = [], {}
        for _ in range(self.cfg.train.eval.batches):
            batch = {k: v.to(self.device) for k, v in next(self.loader).items()}
            output = model(batch["input_ids"], batch["doc_ids"], collect_recall=True)
            rows.append(compute_loss(output, batch["labels"], float(self.cfg.train.indexer_loss_coef)).metrics())
            for layer, recall in output.index_recall.items():
                recalls.setdefault(f"index_recall/layer{layer}", []).append(recall.item())
        row = mean_metrics(rows)
        for key, values in sorted(recalls.items()):  # every rank has every key: the ranks sum them below
            counted = [v for v in values if not math.isnan(v)]
            row[key] = sum(counted) / len(counted) if counted else math.nan
        return distributed.mean_over_ranks(row)

    @torch.no_grad()
    def probe_accuracy(self, module: torch.nn.Module) -> dict[str, float]:
        """``passkey_acc/len{L}`` and ``mqar_acc/len{L}``, the share of answer tokens predicted right at each
        probe length, and ``passkey_acc`` / ``mqar_acc``, their mean over the lengths. The ranks split the
        samples; each rank scores its share in micro-batches."""
        batch_size = self.cfg.data.micro_batch_size
        sums = {}
        for (kind, length), samples in self.probes.items():
            mine = samples[distributed.rank()::distributed.world_size()]
            correct = 0.0
            for start in range(0, len(mine), batch_size):
                chunk = mine[start:start + batch_size]
                logits = module(torch.stack([s.input_ids for s in chunk]).to(self.device),
                                torch.stack([s.doc_ids for s in chunk]).to(self.device)).logits
                correct += sum(probe_accuracy(row, sample) for row, sample in zip(logits, chunk))
            sums[f"{kind}_acc/len{length}"] = correct
        scores = {k: v / self.cfg.train.eval.probe_examples for k, v in distributed.sum_over_ranks(sums).items()}
        for kind in ("passkey", "mqar"):
            per_length = [v for k, v in scores.items() if k.startswith(f"{kind}_acc/")]
            scores[f"{kind}_acc"] = sum(per_length) / len(per_length)
        return scores
