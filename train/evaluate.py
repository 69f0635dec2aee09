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


def build_probes(cfg: DictConfig) -> dict[str, list]:
    """``train.eval.probe_examples`` passkey and MQAR samples of ``train.eval.probe_len`` tokens."""
    spec = cfg.train.eval
    length = spec.probe_len or cfg.data.seq_len
    tokenizer = data_tokenizer(cfg.data)
    try:
        return {"passkey": passkey_probes(tokenizer, length, spec.probe_examples, seed=spec.probe_seed),
                "mqar": mqar_probes(tokenizer, length, spec.probe_examples, seed=spec.probe_seed,
                                    n_pairs=spec.mqar_pairs, n_queries=spec.mqar_queries)}
    except ValueError as error:
        raise ValueError(f"{error}: set a longer train.eval.probe_len (default: data.seq_len) or "
                         "train.eval.probe_examples=0") from error


class Evaluator:
    """The evaluation of one run: held-out loss parts, index recall, and the probes.

    Built before training, so that an empty held-out set or a probe that does not fit fails before any step.
    Every evaluation rewinds the held-out loader to its start: the same batches each time.
    """

    def __init__(self, cfg: DictConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.loader = build_loader(cfg.data, rank=distributed.rank(), world_size=distributed.world_size(),
                                   heldout=True, vocab_size=cfg.model.vocab_size)
        self.loader_start = self.loader.state_dict()
        self.probes = build_probes(cfg) if cfg.train.eval.probe_examples else {}

    def __call__(self, module: torch.nn.Module, probes: bool) -> dict[str, float]:
        """Held-out numbers, and with ``probes`` the probe accuracies; ``module`` runs in eval mode."""
        was_training = module.training
        module.eval()
        try:
            row = self.heldout(module)
            if probes and self.probes:
                row.update(self.probe_accuracy(module))
            return row
        finally:
            module.train(was_training)

    @torch.no_grad()
    def heldout(self, module: torch.nn.Module) -> dict[str, float]:
        """Loss parts (``Loss.metrics``) and ``index_recall/layer{N}`` of every layer that reads a selection,
        averaged over ``train.eval.batches`` held-out micro-batches and over ranks.

        Index recall is the share of a layer's selected entries that are also in the top-k of its own dense
        attention (the model's evaluation diagnostic); a batch where a layer selected nothing does not count.
        """
        self.loader.load_state_dict(self.loader_start)
        rows, recalls = [], {}
        for _ in range(self.cfg.train.eval.batches):
            batch = {k: v.to(self.device) for k, v in next(self.loader).items()}
            output = module(batch["input_ids"], batch["doc_ids"], collect_recall=True)
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
        """``passkey_acc`` and ``mqar_acc``: the share of answer tokens predicted right. The ranks split the
        samples; each rank scores its share in micro-batches."""
        batch_size = self.cfg.data.micro_batch_size
        sums = {}
        for kind, samples in self.probes.items():
            mine = samples[distributed.rank()::distributed.world_size()]
            correct = 0.0
            for start in range(0, len(mine), batch_size):
                chunk = mine[start:start + batch_size]
                logits = module(torch.stack([s.input_ids for s in chunk]).to(self.device),
                                torch.stack([s.doc_ids for s in chunk]).to(self.device)).logits
                correct += sum(probe_accuracy(row, sample) for row, sample in zip(logits, chunk))
            sums[f"{kind}_acc"] = correct
        return {k: v / len(self.probes["passkey"]) for k, v in distributed.sum_over_ranks(sums).items()}
