"""A job planned once: the model and layout its config describes, the device and precision it runs in, the batch
and the stage split, every ``parallel`` setting checked (``parallel/checks.py``). ``train/run/preflight.py`` plans the
job it runs and ``python -m parallel.plan`` the job it prints (``parallel.plan.check_memory`` judges its memory);
everything below them reads the ``Job``, not the config.
"""
import os
from dataclasses import dataclass

import torch

from model.config import JobConfig, LoRA, ModelArgs
from model.layout import Layout, layout_from_config
from parallel.balance import Split, split_stages
from parallel.batch import BatchPlan, batch_plan
from parallel.checks import check_context, check_experts, check_parallel
from parallel.memory import kept_per_stage, recomputed_layers


@dataclass(frozen=True)
class Job:
    """What a job runs: its settings (``config``), and what they resolve to on ``world_size`` processes."""
    config: JobConfig
    args: ModelArgs
    layout: Layout
    lora: LoRA | None  # train.lora when its rank is > 0
    device: torch.device  # of this process (a plan's may name a GPU this machine lacks)
    precision: str  # bf16 | fp32
    world_size: int
    batch: BatchPlan
    split: Split

    @property
    def dtype(self) -> torch.dtype:
        return compute_dtype(self.precision)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def trains_dspark(self) -> bool:
        return trains_dspark(self.args, self.config)

    @property
    def recomputed_layers(self) -> int:
        """How many leading layers of every stage run as activation checkpoints: ``layer``, all of them; ``block``,
        the first ``parallel.recompute_layers`` (Megatron's method: under 1F1B a stage keeps the activations of up
        to P microbatches, so recomputing part of each stage trades memory for time where all is more than
        needed)."""
        return recomputed_layers(self.config.parallel, self.layout.n_layers)

    @property
    def kept_attention_layers(self) -> tuple[int, ...]:
        """Per stage, how many of its leading recomputed layers keep their sparse-attention outputs (out, LSE,
        selected mass) so that their backward does not re-run attention (``kernels.checkpoint_policy``). A kept
        layer holds its output until its backward (bf16 B x T x 64 x 512: 4.3 GB at 64K) for every microbatch in
        flight; a list gives the later stages, which hold fewer microbatches under 1F1B, their own count."""
        return kept_per_stage(self.config.parallel.keep_attention_layers, self.batch.stages)


def trains_dspark(args: ModelArgs, config: JobConfig) -> bool:
    """The model has a draft head and ``train.dspark_loss_coef`` > 0 (otherwise it is carried, loaded and exported,
    but never run)."""
    return args.dspark.blocks > 0 and config.train.dspark_loss_coef > 0


def resolve_device(name: str) -> torch.device:
    """``train.device`` for this process: ``auto`` is the local GPU when there is one (``LOCAL_RANK`` picks it),
    else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device=cuda but no GPU is visible — use train.device=auto or cpu, or run where "
                             "a GPU is")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def planned_device(name: str) -> torch.device:
    """``train.device`` as a plan reads it: ``auto`` is ``cuda`` when this machine has a GPU; a plan may name
    ``cuda`` on a machine without one (planning a GPU job elsewhere)."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype a job computes in: bf16 (autocast over fp32 master weights) or fp32."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def resolve_precision(name: str, device: torch.device) -> str:
    """``train.precision``: ``auto`` is bf16 on GPU and fp32 on CPU (CPU bf16 matmuls are slow and not what we
    test)."""
    return ("bf16" if device.type == "cuda" else "fp32") if name == "auto" else name


def plan(config: JobConfig, world_size: int, device: torch.device, capacity: float | None = None) -> Job:
    """The job of ``config`` on ``world_size`` processes of ``device``: its model and layout, the batch and a stage
    split that keeps every stage under ``capacity`` bytes when one does (None: no bound), after the model's checks
    against its layout and row (a ``CandidateCapacityError`` for blocks that hold too few entries) and those of
    ``parallel/checks.py``. Bad settings raise one line each."""
    args, layout = config.model.args, layout_from_config(config.layout)
    layout.check_candidate_capacity(args.index_topk)  # first: a model preset on another preset's layout fails both
    args.check_stack(layout.n_layers)
    layout.check_row(config.data.seq_len)
    lora = config.train.lora if config.train.lora.rank else None
    if lora is not None:
        lora.check(args)
        if config.train.optimizer == "muon":
            raise ValueError("train.optimizer=muon trains whole matrices, and train.lora.rank > 0 trains only low-rank "
                             "adapters: use train.optimizer=adamw for LoRA")
    parallel, data = config.parallel, config.data
    check_parallel(parallel)
    batch = batch_plan(config, world_size)
    check_context(parallel, data.seq_len, args, layout, trains_dspark(args, config))
    check_experts(parallel.expert_parallel, args, batch.data_parallel * batch.context)
    precision = resolve_precision(config.train.precision, device)
    split = split_stages(args, layout, parallel, data.seq_len, data.micro_batch_size, compute_dtype(precision),
                         batch.microbatches, batch.data_parallel, capacity, cuda=device.type == "cuda", lora=lora,
                         muon=config.train.optimizer == "muon")
    return Job(config, args, layout, lora, device, precision, world_size, batch, split)
