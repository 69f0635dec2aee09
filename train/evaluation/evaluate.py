"""Evaluation: the training objective on held-out documents, the synthetic tasks' accuracies, and the
long-context retrieval probes.

The loss is ``train/loss.py``'s, so held-out and training numbers mean the same thing. A fresh held-out loader
per evaluation gives the same batches every time (comparable across steps), and no part touches the training
stream or the RNGs (an evaluation never changes what a resumed run sees).
"""
import logging
import math

import torch
import torch.nn.functional as F
from model.config import DataConfig, JobConfig
from model.diagnostics import recording_index_recall
from parallel.job import Job
from train.data.loader import build_loader, synthetic_tasks
from train.data.synthetic import add_hits, count_keys, synthetic_metrics
from train.data.tokenizer import load_tokenizer
from train.evaluation.probes import mqar_probes, passkey_probes, probe_accuracy
from train.loss import compute_loss, mean_metrics
from train.processes import distributed

log = logging.getLogger(__name__)


def data_tokenizer(data: DataConfig):
    """The tokenizer ``data`` names (byte-level by default)."""
    return load_tokenizer(data.tokenizer, data.bos_token, data.eos_token, data.pad_token)


def probe_lengths(config: JobConfig) -> list[int]:
    """``train.eval.probe_lens``, or by default the training length and twice it: retrieval inside the
    context the model was trained on and beyond it."""
    lengths = config.train.eval.probe_lens
    return list(lengths) if lengths else [config.data.seq_len, 2 * config.data.seq_len]


def build_probes(config: JobConfig, stages: int) -> dict[tuple[str, int], list]:
    """``train.eval.probe_examples`` passkey and MQAR samples at each probe length, keyed by (kind, length). Through
    several pipeline ``stages`` a probe fits in ``data.seq_len`` at most (the stages' buffers): longer ones are
    skipped with a warning."""
    spec = config.train.eval
    if not spec.probe_examples:
        return {}
    tokenizer = data_tokenizer(config.data)
    lengths = probe_lengths(config)
    max_len = config.data.seq_len if stages > 1 else None
    if max_len is not None and max(lengths) > max_len:
        log.warning("probe lengths %s skipped: through pipeline stages a probe fits in data.seq_len=%d at most",
                    [n for n in lengths if n > max_len], max_len)
        lengths = [n for n in lengths if n <= max_len]
    probes = {}
    try:
        for length in lengths:
            probes["passkey", length] = passkey_probes(tokenizer, length, spec.probe_examples, seed=spec.probe_seed)
            probes["mqar", length] = mqar_probes(tokenizer, length, spec.probe_examples, seed=spec.probe_seed,
                                                 n_pairs=spec.mqar_pairs, n_queries=spec.mqar_queries)
    except ValueError as error:
        raise ValueError(f"{error} — set longer train.eval.probe_lens (default: data.seq_len and twice it) or "
                         "train.eval.probe_examples=0") from error
    return probes


def with_squares(rows: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each loss part over evaluation batches, and ``lm_loss_sq``, the mean square of the LM loss
    (``with_spread`` turns it into its standard error once averaged over ranks)."""
    return {**mean_metrics(rows), "lm_loss_sq": sum(r["lm_loss"] ** 2 for r in rows) / len(rows)}


def with_spread(row: dict[str, float], batches: int) -> dict[str, float]:
    """``row`` with ``lm_loss_sq`` replaced by ``lm_loss_se``: the standard error of the held-out LM loss, the
    sample standard deviation over its ``batches`` evaluation batches (all ranks) over sqrt(batches); left out for
    one batch. Runs whose held-out losses differ by less than about twice it are not told apart by this evaluation
    (``train/report.py``)."""
    row = dict(row)
    mean, square = row["lm_loss"], row.pop("lm_loss_sq")
    if batches > 1:
        row["lm_loss_se"] = math.sqrt(max(square - mean ** 2, 0.0) / (batches - 1))  # sqrt(sample variance / n)
    return row


class Evaluator:
    """The evaluation of one run: held-out loss parts, index recall, the synthetic tasks, and the probes.

    Built before training, so that an empty held-out set or a probe that does not fit fails before any step.
    Every evaluation rewinds the held-out loader to its start: the same batches each time. With one pipeline
    stage the whole model runs here; with several, the held-out objective and the probes run through the
    pipeline (``pipeline_heldout``, ``pipeline_logits``): the stages' buffers are sized for ``data.seq_len``, so
    probes longer than that are skipped (with a warning), and index recall, which needs every layer's attention
    in one place, is not computed.
    """

    def __init__(self, job: Job, engine, documents=None, probes=None):
        """``documents``, ``probes``: the held-out documents and the probes if already built (``build_documents``,
        ``build_probes``)."""
        self.config, self.device, self.engine = job.config, job.device, engine
        self.loader = build_loader(job.config.data, rank=engine.replica_id, world_size=engine.replicas,
                                   heldout=True, vocab_size=job.args.vocab_size, documents=documents)
        self.loader_start = self.loader.state_dict()
        self.probes = build_probes(job.config, engine.num_stages) if probes is None else probes
        tasks = synthetic_tasks(job.config.data)
        self.synthetic = {task: tasks.task_examples(task, tasks.config.eval_examples) for task in tasks.tasks} \
            if tasks is not None and tasks.config.eval_examples else {}
        self.chance = {task: tasks.chance(task) for task in self.synthetic}
        self.pad_id = data_tokenizer(job.config.data).pad_id
        self.window = job.args.window_size

    def __call__(self, probes: bool) -> dict[str, float]:
        """Held-out numbers and the synthetic tasks' accuracies, and with ``probes`` the probe accuracies; the
        model runs in eval mode."""
        module = self.engine.module
        was_training = module.training
        module.eval()
        try:
            if self.engine.num_stages > 1:
                row, logits_of = self.pipeline_heldout(), self.pipeline_logits
            else:
                row, logits_of = self.heldout(module.stage), self.whole_model_logits
            if self.synthetic:
                row.update(self.synthetic_accuracy(logits_of))
            if probes and self.probes:
                row.update(self.probe_accuracy(logits_of))
            return row
        finally:
            module.train(was_training)

    @torch.no_grad()
    def pipeline_heldout(self) -> dict[str, float]:
        """The held-out objective through the pipeline stages: the loss parts of ``heldout`` (the last stage's
        loss function keeps them), averaged over batches and data-parallel replicas."""
        self.loader.load_state_dict(self.loader_start)
        loss_fn, rows = self.engine.module.loss_fn, []
        for _ in range(self.config.train.eval.batches):
            batch = next(self.loader)
            self.engine.eval_batch(iter([((batch["input_ids"], batch["doc_ids"]), batch["labels"])]),
                                   num_micro_batches=1)
            last = self.engine.is_last_stage()  # the other stages add zeros to the sum over ranks
            rows.append({name: loss_fn.parts[name].item() if last else 0.0 for name in loss_fn.part_names()})
        row = {k: v / self.engine.dp_world_size for k, v in distributed.sum_over_ranks(with_squares(rows)).items()}
        return with_spread(row, len(rows) * self.engine.dp_world_size)

    @torch.no_grad()
    def whole_model_logits(self, input_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        return self.engine.module.stage.whole_model(input_ids.to(self.device), doc_ids.to(self.device)).logits

    @torch.no_grad()
    def pipeline_logits(self, input_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor | None:
        """The whole model's logits of a [micro_batch, L] batch (L <= data.seq_len) through the pipeline stages:
        on the last stage, None on the others. Rows are padded to data.seq_len with a document of their own,
        which no token of the row's documents can see, so the logits of the first L positions are unchanged."""
        length, pad = input_ids.shape[1], self.config.data.seq_len - input_ids.shape[1]
        ids = F.pad(input_ids, (0, pad), value=self.pad_id)
        docs = F.pad(doc_ids, (0, pad), value=int(doc_ids.max()) + 1)
        data = iter([((ids, docs), torch.full_like(ids, -100))])
        _, outputs = self.engine.eval_batch(data, return_logits=True, compute_loss=False, reduce_output=None,
                                            bcast_loss=False, num_micro_batches=1)
        if not self.engine.is_last_stage():
            return None
        stage, logits = self.engine.module.stage, outputs[0]
        if stage.head_chunk:  # the stage returned the head's features (a no-grad pass holds the logits once)
            logits = stage.head(logits)
        context = self.engine.module.context  # context parallelism: each rank's logits are its chunk's
        return (logits if context is None else context.gather(logits))[:, :length]

    @torch.no_grad()
    def heldout(self, stage) -> dict[str, float]:
        """Loss parts (``Loss.metrics``) and ``index_recall/layer{N}`` of every layer that reads a selection,
        averaged over ``train.eval.batches`` held-out micro-batches and over ranks, of the whole model on one
        pipeline ``stage`` (``parallel.stage.PipelineStage``).

        Index recall is the share of a layer's selected entries that are also in the top-k of its own dense
        attention (the model's evaluation diagnostic); a batch where a layer selected nothing does not count.
        """
        self.loader.load_state_dict(self.loader_start)
        rows, recalls = [], {}
        for _ in range(self.config.train.eval.batches):
            batch = {k: v.to(self.device) for k, v in next(self.loader).items()}
            with recording_index_recall(stage.model) as recall_of:
                output = stage.whole_model(batch["input_ids"], batch["doc_ids"])
            rows.append(compute_loss(output, batch["labels"], self.config.train.indexer_loss_coef,
                                     self.config.train.dspark_loss_coef).metrics())
            for layer, recall in recall_of.items():
                recalls.setdefault(f"index_recall/layer{layer}", []).append(recall.item())
        row = with_squares(rows)
        for key, values in sorted(recalls.items()):  # every rank has every key: the ranks sum them below
            counted = [v for v in values if not math.isnan(v)]
            row[key] = sum(counted) / len(counted) if counted else math.nan
        return with_spread(distributed.mean_over_ranks(row), len(rows) * distributed.world_size())

    def scored(self, samples: list, logits_of):
        """``(logits [T,V], sample)`` for this replica's share of ``samples``.

        The data-parallel replicas split the samples; each runs its share in full micro-batches (the last one
        filled up with samples it does not yield), the same number on every replica, because a pipelined
        evaluation is collective. ``logits_of(input_ids, doc_ids)`` returns None where no logits are (pipeline
        stages before the last), which then yield nothing."""
        batch_size = self.config.data.micro_batch_size
        replica, replicas = self.engine.replica_id, self.engine.replicas
        mine = samples[replica::replicas]
        for start in range(0, -(-len(samples) // replicas), batch_size):
            chunk = mine[start:start + batch_size]
            full = chunk + [samples[0]] * (batch_size - len(chunk))
            logits = logits_of(torch.stack([torch.as_tensor(s.input_ids) for s in full]),
                               torch.stack([torch.as_tensor(s.doc_ids) for s in full]))
            if logits is not None:
                yield from zip(logits, chunk)

    @torch.no_grad()
    def synthetic_accuracy(self, logits_of) -> dict[str, float]:
        """``synthetic/<task>_acc`` and its parts by distance (``train.data.synthetic.synthetic_metrics``), over the
        held-out examples of every synthetic task, summed over the replicas that scored them."""
        window = self.window
        counts = count_keys(self.synthetic, window)
        for examples in self.synthetic.values():
            for logits, example in self.scored(examples, logits_of):
                add_hits(counts, logits, example, window)
        return synthetic_metrics(distributed.sum_over_ranks(counts), self.chance, window)

    @torch.no_grad()
    def probe_accuracy(self, logits_of) -> dict[str, float]:
        """``passkey_acc/len{L}`` and ``mqar_acc/len{L}``, the share of answer tokens predicted right at each
        probe length, and ``passkey_acc`` / ``mqar_acc``, their mean over the lengths (replicas split the samples:
        ``scored``)."""
        sums = {f"{kind}_acc/len{length}": sum(probe_accuracy(logits, sample)
                                               for logits, sample in self.scored(samples, logits_of))
                for (kind, length), samples in self.probes.items()}
        scores = {k: v / self.config.train.eval.probe_examples for k, v in distributed.sum_over_ranks(sums).items()}
        for kind in ("passkey", "mqar"):
            per_length = [v for k, v in scores.items() if k.startswith(f"{kind}_acc/")]
            scores[f"{kind}_acc"] = sum(per_length) / len(per_length)
        return scores
