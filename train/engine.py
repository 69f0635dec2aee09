"""The DeepSpeed engine every job runs on, and the one training step all jobs share.

Every job, a single CPU process included, runs on DeepSpeed's pipeline engine (``parallel/engine.py``) with
``parallel.pipeline_stages`` stages (1 by default), so pipeline and data parallelism are settings of
``conf/parallel`` and not other code paths. The DeepSpeed config is generated from Hydra (``deepspeed_config``).
The engine itself clips gradients over all stages and skips a step whose loss is not finite, without touching
the weights, the optimizer state or the schedule.
"""
import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, ListConfig

from model import ModelArgs, layout_from_config
from model.dspark import DRAFT_PARTS
from model.lora import LoRA
from model.transformer import ModelOutput
from parallel.balance import Split, split_stages
from parallel.batch import batch_plan
from parallel.context import chunk_length
from parallel.engine import P2P, CSA2PipelineEngine, CSA2PipelineModule, build_engine as build_pipeline_engine
from parallel.memory import kept_per_stage
from parallel.plan import describe
from train import distributed
from train.loss import chunked_lm_loss, compute_loss
from train.quiet import prints_to_debug

RECOMPUTE = ("none", "layer", "block")
INDEX_K = ("shadow", "payload")


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


def deepspeed_config(cfg: DictConfig, microbatches: int, fused_adam: bool = False) -> dict:
    """The DeepSpeed JSON config from ``cfg.train``, the batch size of ``cfg.data`` and the ``microbatches`` per
    step of ``parallel/batch.py``'s plan.

    AdamW is torch's (``torch_adam``), so no DeepSpeed fused or CPU-Adam extension is built; on a GPU it runs as
    torch's fused kernel (``fused_adam``: at 3.16 B parameters on an H200 the optimizer's multi-tensor kernels took
    67 ms a step with the default foreach form, 25 ms fused; ``kernel_table`` in
    ``bench/results/train/train_step_csa2_65536_kernel_table.json`` and ``train_step_csa2_65536.json``). The
    schedule is not in here: it is ``warmup_cosine`` handed to the engine (DeepSpeed's WarmupCosineLR starts at
    lr 0). Precision is not in here either: bf16 runs under autocast over fp32 master weights (``parallel/stage.py``),
    so gradients and optimizer state stay fp32 and the engine's clipping sees them. ``gradient_clipping`` and
    ``zero_optimization.stage`` (``parallel.zero_stage``) are carried out by our engine, not DeepSpeed's
    (``parallel/engine.py``, ``parallel/zero.py``).
    """
    train = cfg.train
    return {
        "train_micro_batch_size_per_gpu": int(cfg.data.micro_batch_size),
        "gradient_accumulation_steps": microbatches,
        "gradient_clipping": float(train.grad_clip),
        "zero_optimization": {"stage": int(cfg.parallel.zero_stage)},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": float(train.lr), "betas": [float(b) for b in train.betas], "eps": float(train.eps),
                       "weight_decay": float(train.weight_decay), "torch_adam": True,
                       **({"fused": True} if fused_adam else {})},
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


def check_parallel(parallel: DictConfig) -> None:
    """The choices of ``conf/parallel`` that need no process group; each message names the setting."""
    if parallel.recompute not in RECOMPUTE:
        raise ValueError(f"parallel.recompute={parallel.recompute!r}: use one of {RECOMPUTE}")
    if parallel.index_k not in INDEX_K:
        raise ValueError(f"parallel.index_k={parallel.index_k!r}: use one of {INDEX_K}")
    if parallel.p2p not in P2P:
        raise ValueError(f"parallel.p2p={parallel.p2p!r}: use one of {P2P}")
    if parallel.zero_stage not in (0, 1):
        raise ValueError(f"parallel.zero_stage={parallel.zero_stage!r}: use 0 or 1 (DeepSpeed's pipeline engine "
                         "refuses the stages that partition gradients or weights)")
    count = parallel.get("recompute_layers")
    if parallel.recompute == "block" and (not isinstance(count, int) or count < 1):
        raise ValueError(f"parallel.recompute=block needs parallel.recompute_layers >= 1 (the leading layers of "
                         f"each stage to recompute), got {count!r}")
    keep = parallel.get("keep_attention_layers", 0)
    counts = list(keep) if isinstance(keep, ListConfig) else [keep]
    if not all(isinstance(k, int) and k >= 0 for k in counts):
        raise ValueError(f"parallel.keep_attention_layers={keep!r}: use an integer >= 0 (every stage) or a list "
                         "of them, one per stage")
    if isinstance(keep, ListConfig) and len(counts) != parallel.pipeline_stages:
        raise ValueError(f"parallel.keep_attention_layers={list(keep)} has {len(counts)} entries for "
                         f"parallel.pipeline_stages={parallel.pipeline_stages}: give one per stage")
    if any(counts) and parallel.recompute == "none":
        raise ValueError(f"parallel.keep_attention_layers={keep} keeps the attention outputs of recomputed layers, "
                         "but parallel.recompute=none recomputes none")
    chunk = parallel.get("head_chunk", 0)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
        raise ValueError(f"parallel.head_chunk={chunk!r}: use an integer >= 0 (tokens per chunk of the LM head and "
                         "loss; 0: the whole logits at once)")
    offload = parallel.get("recompute_offload", False)
    if not isinstance(offload, bool):
        raise ValueError(f"parallel.recompute_offload={offload!r}: use true or false")
    if offload and parallel.recompute == "none":
        raise ValueError("parallel.recompute_offload=true keeps recomputed layers' inputs on the host, but "
                         "parallel.recompute=none recomputes none: use parallel.recompute=layer (or block)")


def recomputed_layers_per_stage(parallel: DictConfig, n_layers: int) -> int:
    """How many leading layers of every stage run as activation checkpoints.

    ``layer``: all of them. ``block``: the first ``parallel.recompute_layers`` (Megatron's "block" method): under
    1F1B a stage keeps the activations of up to P microbatches, so recomputing only part of each stage trades
    memory for time where the full recompute is more than needed."""
    return {"none": 0, "layer": n_layers, "block": parallel.get("recompute_layers")}[parallel.recompute]


def offload_inputs(parallel: DictConfig) -> bool:
    """Whether the recomputed layers' inputs wait in pinned host memory (``model/offload.py``): bit-identical, the
    GPU memory of one fp32 stream per recomputed layer freed for the copies' PCIe traffic."""
    return bool(parallel.get("recompute_offload", False))


def kept_attention_layers_per_stage(parallel: DictConfig) -> tuple[int, ...]:
    """How many of the leading recomputed layers of each stage keep their sparse-attention outputs (out, LSE,
    selected mass) so that their backward does not re-run attention: a selective checkpoint
    (``kernels.checkpoint_policy``). Each kept layer holds its attention output until its backward (bf16
    B x T x 64 x 512: 4.3 GB per layer at T = 65,536) for every microbatch in flight, so this trades memory for
    the attention forward's time. One integer applies to every stage; a list gives each stage its own count, so
    that the later stages, which hold fewer microbatches under 1F1B, spend their spare memory on speed."""
    return kept_per_stage(parallel.get("keep_attention_layers", 0), parallel.pipeline_stages)


def param_groups(parameters: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms' gains and attention sinks keep their scale."""
    decay = [p for _, p in parameters if p.dim() >= 2]
    keep = [p for _, p in parameters if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


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
                 draft_parts: tuple[str, ...] = (), context=None, head_chunk: int = 0):
        self.coef, self.sources, self.dspark_coef, self.draft_parts = coef, sources, dspark_coef, draft_parts
        self.context, self.head_chunk = context, head_chunk
        self.head = None  # with head_chunk: the last stage's LM head (``PipelineStage.head``), set once it exists
        self.parts: OrderedDict | None = None

    def part_names(self) -> list[str]:
        draft = ["dspark_loss", *(f"dspark_loss/{p}" for p in self.draft_parts)] if self.draft_parts else []
        return ["loss", "lm_loss", "indexer_loss", *(f"indexer_loss/layer{s}" for s in self.sources), *draft]

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        logits, aux = outputs
        indexer, draft = aux[:len(self.sources)], aux[len(self.sources):]
        output = ModelOutput(logits, dict(zip(self.sources, indexer)), {}, dict(zip(self.draft_parts, draft)))
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


def check_experts(cfg: DictConfig, replicas: int) -> None:
    """``parallel.expert_parallel`` against the world and the model, before any process group: one line naming the
    values that work."""
    ep, args = cfg.parallel.expert_parallel, ModelArgs.from_config(cfg.model)
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"parallel.expert_parallel={ep!r}: use an integer >= 1 (1: no expert parallelism)")
    if ep == 1:
        return
    if args.ffn != "moe":
        raise ValueError(f"parallel.expert_parallel={ep} needs routed experts: model.ffn={args.ffn} has none (use "
                         "model.ffn=moe, or parallel.expert_parallel=1)")
    if replicas % ep:
        works = [e for e in range(1, replicas + 1) if replicas % e == 0]
        raise ValueError(f"parallel.expert_parallel={ep} does not divide the {replicas} data-parallel replica(s) of a "
                         f"stage (processes / parallel.pipeline_stages): use one of {works}, or more processes")
    counts = [args.moe.n_routed_experts] + ([args.dspark.n_routed_experts] if args.dspark.blocks else [])
    if any(n % ep for n in counts):
        works = [e for e in range(1, replicas + 1) if replicas % e == 0 and all(n % e == 0 for n in counts)]
        raise ValueError(f"parallel.expert_parallel={ep} does not divide the routed experts ({' and '.join(map(str, counts))}"
                         f"): use one of {works}")


def check_context(cfg: DictConfig, args: ModelArgs, layout, run_dspark: bool) -> None:
    """``parallel.context_parallel`` against the row and the model, and ``parallel.head_chunk`` against the draft
    head, before any process group (one line each)."""
    context = cfg.parallel.context_parallel
    chunk_length(context, int(cfg.data.seq_len), args.window_size, layout.compress_ratios,
                 layout.candidate_block_size)
    if context > 1 and run_dspark:
        raise ValueError(f"parallel.context_parallel={context} cannot train the DSpark draft head (its blocks read the "
                         "tokens and logits after their anchor, in the next chunk): set train.dspark_loss_coef=0 or "
                         "parallel.context_parallel=1")
    if run_dspark and cfg.parallel.get("head_chunk", 0):
        raise ValueError("parallel.head_chunk cannot train the DSpark draft head (its loss reads the main logits at "
                         "its anchors): set train.dspark_loss_coef=0 or parallel.head_chunk=0")
    if context > 1 and args.attention == "dense":
        raise ValueError(f"parallel.context_parallel={context} splits CSA2 attention only: model.attention=dense "
                         "needs parallel.context_parallel=1")


def lora_settings(cfg: DictConfig) -> LoRA | None:
    """``train.lora`` checked against the model (None: rank 0, full fine-tuning)."""
    lora = LoRA.from_config(cfg.train.get("lora"))
    if lora is not None:
        lora.check(ModelArgs.from_config(cfg.model))
    return lora


def trains_dspark(cfg: DictConfig) -> bool:
    """Whether the job trains the draft head: the model has one and ``train.dspark_loss_coef`` > 0 (otherwise it
    is carried, loaded and exported, but never run)."""
    return int(cfg.model.dspark.blocks) > 0 and float(cfg.train.dspark_loss_coef) > 0


def engram_token_map(cfg: DictConfig, args: ModelArgs):
    """The Engram hashes' normalised token ids, built from the data tokenizer (None without Engram layers). Every
    hash multiplier depends on their count: a model whose tables were hashed with another tokenizer
    (``model.engram.compressed_vocab_size``) is refused."""
    if not args.engram.layers:
        return None
    from model.engram import compressed_token_map
    from train.evaluate import data_tokenizer

    token_map, size = compressed_token_map(data_tokenizer(cfg.data))
    expected = args.engram.compressed_vocab_size
    if expected is not None and size != expected:
        raise ValueError(f"the data tokenizer ({cfg.data.tokenizer or 'byte-level'}) normalises to {size} ids for the "
                         f"Engram hashes, but model.engram.compressed_vocab_size={expected} (its tables were hashed "
                         "with another tokenizer) — use that tokenizer, or model.engram.compressed_vocab_size=null "
                         "for new tables")
    return token_map, size


def build_engine(cfg: DictConfig, precision: str, device: torch.device, split: Split | None = None,
                 memory_line: str | None = None) -> CSA2PipelineEngine:
    """This process's pipeline stage of the model, on the engine, with the warmup-cosine schedule.

    Prints the pipeline plan (batch and bubble, stages, layers, payload bytes per boundary) and ``memory_line``
    (the preflight's memory verdict) on rank 0 before training. ``split``: the preflight's stage split (default:
    computed here, within the GPU's memory)."""
    parallel = cfg.parallel
    check_parallel(parallel)
    batch = batch_plan(cfg, distributed.world_size())
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    seq_len, micro_batch = int(cfg.data.seq_len), int(cfg.data.micro_batch_size)
    check_context(cfg, args, layout, trains_dspark(cfg))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if split is None:
        capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        split = split_stages(cfg, dtype, batch.microbatches, batch.data_parallel, capacity,
                             cuda=device.type == "cuda")
    plan = split.plan
    if distributed.rank() == 0:
        print(describe(args, layout, plan, micro_batch, seq_len, dtype, parallel.index_k, batch, split.costs,
                       split.unit, split.peaks), flush=True)
        if memory_line:
            print(memory_line, flush=True)
    context = int(parallel.context_parallel)
    check_experts(cfg, batch.data_parallel * context)
    run_dspark = trains_dspark(cfg)
    head_chunk = int(parallel.get("head_chunk", 0))
    loss = PipelineLoss(float(cfg.train.indexer_loss_coef), list(layout.index_source_layer_ids),
                        float(cfg.train.dspark_loss_coef), DRAFT_PARTS if run_dspark else (), head_chunk=head_chunk)
    with torch.device(device), prints_to_debug():  # DeepSpeed prints seeds, topology and stage split
        module = CSA2PipelineModule(args, layout, plan, loss, micro_batch, seq_len, dtype, parallel.index_k,
                                    int(cfg.train.seed), recomputed_layers_per_stage(parallel, layout.n_layers),
                                    kept_attention_layers_per_stage(parallel), engram_token_map(cfg, args),
                                    run_dspark, int(parallel.expert_parallel), bool(parallel.expert_overlap),
                                    context, lora_settings(cfg), offload_inputs(parallel), head_chunk)
    loss.context, loss.head = module.context, module.stage.head if head_chunk else None
    schedule = warmup_cosine(int(cfg.train.warmup_steps), int(cfg.train.max_steps), float(cfg.train.min_lr_ratio))
    groups = param_groups(list(module.optimized_named_parameters().items()), float(cfg.train.weight_decay))
    return build_pipeline_engine(module, deepspeed_config(cfg, batch.microbatches, fused_adam=device.type == "cuda"),
                                 model_parameters=groups,
                                 lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
                                 p2p=parallel.p2p)


@dataclass
class StepResult:
    metrics: dict[str, float]  # loss parts averaged over micro-batches and ranks, lr, grad_norm
    tokens: int  # input tokens of the step, all ranks
    applied: bool  # False when DeepSpeed skipped the update (non-finite gradients)

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
    return StepResult(metrics, tokens, not engine.last_step_skipped)
