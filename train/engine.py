"""The DeepSpeed engine every job runs on, and the one training step all jobs share.

Even a single CPU process goes through ``deepspeed.initialize`` (gloo, no launcher), so that data and pipeline
parallelism are settings of ``conf/parallel`` and not other code paths. The DeepSpeed config is generated
from Hydra (``deepspeed_config``); ZeRO stage 1 is the default because its optimizer checks the gradients for
inf/NaN and skips the update on its own, on CPU in fp32 as on GPU in bf16, which is how a non-finite step is
skipped without touching the weights, the optimizer state or the schedule.
"""
import math
import os
from dataclasses import dataclass

import deepspeed
import torch
from omegaconf import DictConfig

from train import distributed
from train.loss import compute_loss, mean_metrics

_SUPPORTED_ZERO_STAGES = (1, 2)  # stage 0 in fp32 has no overflow check, stage 3 partitions the weights


def resolve_device(name: str) -> torch.device:
    """``auto`` is the local GPU when there is one (``LOCAL_RANK`` picks it), else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device=cuda but no GPU is visible")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if name != "cpu":
        raise ValueError(f"train.device must be auto, cpu or cuda, got {name!r}")
    return torch.device("cpu")


def resolve_precision(name: str, device: torch.device) -> str:
    """``auto`` is bf16 on GPU and fp32 on CPU (CPU bf16 matmuls are slow and not what we test)."""
    if name == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if name not in ("bf16", "fp32"):
        raise ValueError(f"train.precision must be auto, bf16 or fp32, got {name!r}")
    return name


def deepspeed_config(cfg: DictConfig, precision: str) -> dict:
    """The DeepSpeed JSON config from ``cfg.train``, ``cfg.parallel`` and the batch size of ``cfg.data``.

    AdamW is torch's (``torch_adam``), so no fused or CPU-Adam extension is built. The schedule is not in
    here: it is ``warmup_cosine`` handed to ``deepspeed.initialize`` (DeepSpeed's WarmupCosineLR starts at
    lr 0 and warns before its first step).
    """
    train, parallel = cfg.train, cfg.parallel
    if parallel.zero_stage not in _SUPPORTED_ZERO_STAGES:
        raise ValueError(f"parallel.zero_stage must be one of {_SUPPORTED_ZERO_STAGES}, got {parallel.zero_stage}: "
                         "stage 0 in fp32 would apply NaN updates, stage 3 partitions the weights")
    return {
        "train_micro_batch_size_per_gpu": int(cfg.data.micro_batch_size),
        "gradient_accumulation_steps": int(train.grad_accum_steps),
        "gradient_clipping": float(train.grad_clip),
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": float(train.lr), "betas": [float(b) for b in train.betas], "eps": float(train.eps),
                       "weight_decay": float(train.weight_decay), "torch_adam": True},
        },
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": {"stage": int(parallel.zero_stage)},
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


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms' gains and attention sinks keep their scale."""
    decay, keep = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def build_engine(cfg: DictConfig, model: torch.nn.Module, precision: str):
    """``deepspeed.initialize`` on ``model`` with the generated config and the warmup-cosine schedule."""
    if cfg.parallel.pipeline_stages != 1:
        raise NotImplementedError("parallel.pipeline_stages > 1 needs the pipeline engine (issue 4)")
    schedule = warmup_cosine(int(cfg.train.warmup_steps), int(cfg.train.max_steps), float(cfg.train.min_lr_ratio))
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, float(cfg.train.weight_decay)),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        config=deepspeed_config(cfg, precision),
    )
    return engine


@dataclass
class StepResult:
    metrics: dict[str, float]  # loss parts averaged over micro-batches and ranks, lr, grad_norm
    tokens: int  # input tokens of the step, all ranks
    applied: bool  # False when DeepSpeed skipped the update (non-finite gradients)

    @property
    def bad(self) -> bool:
        """A step that did not train: skipped, or its loss is inf/NaN."""
        return not self.applied or not math.isfinite(self.metrics["loss"])


def _device_batch(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_step(engine, micro_batches: list[dict], indexer_loss_coef: float) -> StepResult:
    """One optimizer step over ``grad_accum_steps`` micro-batches (DeepSpeed steps on the last one)."""
    engine.train()
    lr = engine.get_lr()[0]
    rows, tokens = [], 0
    for batch in micro_batches:
        batch = _device_batch(batch, engine.device)
        loss = compute_loss(engine(batch["input_ids"], batch["doc_ids"]), batch["labels"], indexer_loss_coef)
        engine.backward(loss.total)
        engine.step()
        rows.append(loss.metrics())
        tokens += batch["input_ids"].numel()
    metrics = distributed.mean_over_ranks(mean_metrics(rows))
    norm = engine.get_global_grad_norm()
    metrics.update(lr=lr, grad_norm=float(norm) if norm is not None else float("nan"))
    return StepResult(metrics, tokens * distributed.world_size(), engine.was_step_applied())
