"""The DeepSpeed engine every job runs on, and the one training step all jobs share.

Every job, a single CPU process included, runs on DeepSpeed's pipeline engine (``parallel/engine.py``) with
``parallel.pipeline_stages`` stages (1 by default), so pipeline and data parallelism are settings of
``conf/parallel`` and not other code paths. The DeepSpeed config is generated from the job (``deepspeed_config``).
The engine itself clips gradients over all stages and skips a step whose loss or gradient norm is not finite,
without touching the weights, the optimizer state or the schedule.
"""
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from model.config import DataConfig, ModelArgs, TrainConfig
from model.dspark import DRAFT_PARTS
from model.matrices import matrix_shape
from model.transformer import ModelOutput
from parallel.engine import CSA2PipelineEngine, CSA2PipelineModule, build_engine as build_pipeline_engine
from parallel.job import Job
from parallel.muon import MuonWithAdamW
from parallel.plan import describe
from train.loss import chunked_lm_loss, compute_loss
from train.observe.quiet import prints_to_debug
from train.processes import distributed

def deepspeed_config(train: TrainConfig, micro_batch: int, microbatches: int, zero_stage: int,
                     fused_adam: bool = False) -> dict:
    """The DeepSpeed JSON config of ``train``'s optimizer, ``micro_batch`` rows per microbatch and the
    ``microbatches`` per step of ``parallel/batch.py``'s plan.

    AdamW is torch's (``torch_adam``), so no DeepSpeed fused or CPU-Adam extension is built; on a GPU it runs as
    torch's fused kernel (``fused_adam``: at 3.16 B parameters on an H200 the optimizer's multi-tensor kernels took
    67 ms a step with the default foreach form, 25 ms fused; ``kernel_table`` in
    ``bench/results/train/train_step_csa2_65536_kernel_table.json`` and ``train_step_csa2_65536.json``). The
    schedule is not in here: it is ``warmup_cosine`` handed to the engine (DeepSpeed's WarmupCosineLR starts at
    lr 0). Precision is not in here either: bf16 runs under autocast over fp32 master weights (``parallel/stage.py``),
    so gradients and optimizer state stay fp32 and the engine's clipping sees them. ``gradient_clipping`` and
    ``zero_optimization.stage`` (``parallel.zero_stage``) are carried out by our engine, not DeepSpeed's
    (``parallel/engine.py``, ``parallel/zero.py``). Under ``train.optimizer=muon`` the engine is handed
    ``muon_optimizer`` instead; the AdamW settings here still hold for its AdamW part and the Engram tables.
    """
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": microbatches,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": train.lr, "betas": list(train.betas), "eps": train.eps,
                       "weight_decay": train.weight_decay, "torch_adam": True, **({"fused": True} if fused_adam else {})},
        },
        "steps_per_print": 2**62,  # progress is ours (tqdm, metrics.jsonl); DeepSpeed's would interleave
        "wall_clock_breakdown": False,
    }


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float):
    """LR multiplier after ``step`` updates: linear warmup to 1 (never 0), then cosine down to ``min_ratio``."""
    def ratio(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return ratio


def param_groups(parameters: list[tuple[str, torch.nn.Parameter]], weight_decay: float,
                 matrices: dict[str, tuple[int, int]] | None = None) -> list[dict]:
    """Weight decay on matrices only; norms' gains and attention sinks keep their scale. ``matrices``: the
    parameters Muon trains, by name, with the ``(rows, columns)`` of their matrices (``muon_matrices``); one group per
    such shape, after AdamW's two."""
    matrices = matrices or {}
    decay = [p for n, p in parameters if p.dim() >= 2 and n not in matrices]
    keep = [p for _, p in parameters if p.dim() < 2]
    by_shape: dict[tuple[int, int], list[torch.nn.Parameter]] = {}
    for name, p in parameters:
        if name in matrices:
            by_shape.setdefault(matrices[name], []).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0},
            *({"params": ps, "weight_decay": weight_decay, "matrix": shape} for shape, ps in by_shape.items())]


def muon_matrices(parameters: list[tuple[str, torch.nn.Parameter]], train: TrainConfig,
                  args: ModelArgs) -> dict[str, tuple[int, int]]:
    """What ``train.optimizer=muon`` trains with Muon (``model/matrices.py``), by name; nothing under AdamW."""
    if train.optimizer != "muon":
        return {}
    return {n: shape for n, p in parameters if (shape := matrix_shape(n, tuple(p.shape), args)) is not None}


def muon_optimizer(train: TrainConfig, fused: bool):
    """The engine's optimizer under ``train.optimizer=muon``, as a function of its param groups (None: DeepSpeed
    builds the config's AdamW). AdamW's part takes the config's lr, betas and epsilon."""
    if train.optimizer != "muon":
        return None
    return lambda groups: MuonWithAdamW(groups, lr=train.lr, betas=train.betas, eps=train.eps,
                                        weight_decay=train.weight_decay, momentum=train.muon.momentum,
                                        update_rms=train.muon.update_rms, fused=fused or None)


def plain_optimizer(parameters: list[tuple[str, torch.nn.Parameter]], train: TrainConfig, args: ModelArgs,
                    fused: bool = False) -> torch.optim.Optimizer:
    """The engine's optimizer over ``parameters`` without the engine (the probes of ``bench/``): the same groups, AdamW
    or Muon with AdamW as ``train.optimizer`` says; ``fused``: torch's fused AdamW (a GPU's)."""
    groups = param_groups(parameters, train.weight_decay, muon_matrices(parameters, train, args))
    build = muon_optimizer(train, fused)
    if build:
        return build(groups)
    return torch.optim.AdamW(groups, lr=train.lr, betas=tuple(train.betas), eps=train.eps, fused=fused or None)


class PipelineLoss:
    """The last stage's loss function: ``train/loss.py``'s objective on (logits, stacked auxiliary losses: the
    indexer KLs by source, then the draft head's parts when it trains).

    Keeps the parts of its latest microbatch (``parts``, named by ``part_names``) for the engine to average
    over microbatches and data-parallel ranks.

    Under context parallelism (``context``: the rank's ``ContextShard``) the logits are its chunk's and the labels
    the whole rows': the LM loss is the chunk's cross-entropy over the rows' label count, the indexer KLs the
    chunk's shares already, and every part is multiplied by the C chunks, so that the data-parallel mean over the
    C x D ranks of a stage is the mean over replicas of whole-row losses (and gradients).

    With ``head_chunk`` (``parallel.head_chunk``) the stage's first output is the head's input features and the LM
    loss runs the head a chunk of tokens at a time (``chunked_lm_loss``)."""

    def __init__(self, coef: float, sources: list[int], dspark_coef: float = 0.0,
                 draft_parts: tuple[str, ...] = (), context=None, head_chunk: int = 0, head=None):
        self.coef, self.sources, self.dspark_coef, self.draft_parts = coef, sources, dspark_coef, draft_parts
        self.context, self.head_chunk, self.head = context, head_chunk, head  # head: with head_chunk, the LM head
        self.parts: OrderedDict | None = None

    def part_names(self) -> list[str]:
        draft = ["dspark_loss", *(f"dspark_loss/{p}" for p in self.draft_parts)] if self.draft_parts else []
        return ["loss", "lm_loss", "indexer_loss", *(f"indexer_loss/layer{s}" for s in self.sources), *draft]

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        logits, aux = outputs
        indexer, draft = aux[:len(self.sources)], aux[len(self.sources):]
        output = ModelOutput(logits, dict(zip(self.sources, indexer)), dict(zip(self.draft_parts, draft)))
        count, chunks = None, 1
        if self.context is not None:
            count, chunks = int((labels != -100).sum()), self.context.size
            labels = labels[:, self.context.start:self.context.stop]
        lm = chunked_lm_loss(logits, self.head, labels, self.head_chunk, count) if self.head_chunk else None
        loss = compute_loss(output, labels, self.coef, self.dspark_coef, count, lm)
        values = [loss.total, loss.lm, loss.indexer_total, *(loss.indexer[s] for s in self.sources)]
        if self.draft_parts:
            values += [loss.draft_total, *(loss.draft[p] for p in self.draft_parts)]
        self.parts = OrderedDict(zip(self.part_names(), (v.detach().float() * chunks for v in values)))
        return loss.total * chunks if chunks > 1 else loss.total


def engram_token_map(data: DataConfig, args: ModelArgs):
    """The Engram hashes' normalised token ids, built from the data tokenizer (None without Engram layers). Every
    hash multiplier depends on their count: a model whose tables were hashed with another tokenizer
    (``model.engram.compressed_vocab_size``) is refused."""
    if not args.engram.layers:
        return None
    from model.engram import compressed_token_map
    from train.evaluation.evaluate import data_tokenizer

    token_map, size = compressed_token_map(data_tokenizer(data))
    expected = args.engram.compressed_vocab_size
    if expected is not None and size != expected:
        raise ValueError(f"the data tokenizer ({data.tokenizer or 'byte-level'}) normalises to {size} ids for the "
                         f"Engram hashes, but model.engram.compressed_vocab_size={expected} (its tables were hashed "
                         "with another tokenizer) — use that tokenizer, or model.engram.compressed_vocab_size=null "
                         "for new tables")
    return token_map, size


def build_engine(job: Job, memory_line: str | None = None) -> CSA2PipelineEngine:
    """This process's pipeline stage of the job's model, on the engine, with the warmup-cosine schedule.

    Prints the pipeline plan (batch and bubble, stages, layers, payload bytes per boundary) and ``memory_line``
    (the preflight's memory verdict) on rank 0 before training."""
    config, args, layout, batch, split = job.config, job.args, job.layout, job.batch, job.split
    parallel, train, data = config.parallel, config.train, config.data
    if distributed.rank() == 0:
        print(describe(args, layout, split.plan, data.micro_batch_size, data.seq_len, job.dtype, parallel.index_k,
                       batch, split.costs, split.unit, split.peaks), flush=True)
        if memory_line:
            print(memory_line, flush=True)
    head_chunk = parallel.head_chunk

    def make_loss(context, head):
        return PipelineLoss(train.indexer_loss_coef, list(layout.index_source_layer_ids), train.dspark_loss_coef,
                            DRAFT_PARTS if job.trains_dspark else (), context, head_chunk, head)
    with torch.device(job.device), prints_to_debug():  # DeepSpeed prints seeds, topology and stage split
        module = CSA2PipelineModule(args, layout, split.plan, make_loss, data.micro_batch_size, data.seq_len, job.dtype,
                                    parallel.index_k, train.seed, job.recomputed_layers, job.kept_attention_layers,
                                    engram_token_map(data, args), job.trains_dspark, parallel.expert_parallel,
                                    parallel.expert_overlap, parallel.context_parallel, job.lora,
                                    parallel.recompute_offload, head_chunk)
    schedule = warmup_cosine(train.warmup_steps, train.max_steps, train.min_lr_ratio)
    named = list(module.optimized_named_parameters().items())
    groups = param_groups(named, train.weight_decay, muon_matrices(named, train, args))
    ds_config = deepspeed_config(train, data.micro_batch_size, batch.microbatches, parallel.zero_stage,
                                 fused_adam=job.on_gpu)
    return build_pipeline_engine(module, ds_config, model_parameters=groups,
                                 lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
                                 p2p=parallel.p2p, optimizer=muon_optimizer(train, job.on_gpu))


@dataclass
class StepResult:
    metrics: dict[str, float]  # loss parts averaged over micro-batches and ranks, lr, grad_norm
    tokens: int  # input tokens of the step, all ranks
    applied: bool  # False when the engine skipped the update (``parallel/step_guard.py``)
    cause: str = ""  # what was not finite when skipped: "loss", "gradient norm" or both

    @property
    def bad(self) -> bool:
        """A step that did not train: skipped, or its loss is inf/NaN."""
        return not self.applied or not math.isfinite(self.metrics["loss"])


def train_step(engine: CSA2PipelineEngine, micro_batches: list[dict]) -> StepResult:
    """One optimizer step over the engine's microbatches through the pipeline (1F1B)."""
    engine.train()
    lr = engine.get_lr()[0]
    data = iter([((b["input_ids"], b["doc_ids"]), b["labels"]) for b in micro_batches])
    engine.train_batch(data)
    metrics = {name: value.item() for name, value in engine.get_additional_losses().items()}
    norm = engine.grad_norm
    metrics.update(lr=lr, grad_norm=norm.item() if norm is not None else math.nan)
    metrics.update({f"grad_norm/{group}": value.item() for group, value in engine.group_grad_norms.items()})
    tokens = sum(b["input_ids"].numel() for b in micro_batches) * engine.replicas  # a row's C ranks: one row
    return StepResult(metrics, tokens, not engine.last_step_skipped, engine.guard.cause)
