"""DeepSpeed pipeline integration: the CSA2 ``PipelineModule`` and the engine adapter every job runs on.

Every training job runs through this engine, one stage or many, so that pipeline parallelism is a config switch.
``CSA2PipelineEngine`` fills the hooks of ``parallel.deepspeed_private.PipelineAdapter`` (the one module that
touches DeepSpeed's private names) and holds no step logic of its own:
- the reductions the schedule runs: shadow-indexer gradients into their owners (``parallel/shadows.py``), then
  DeepSpeed's data-parallel all-reduce without the row-sharded tables and expert ranges, whose means are taken
  over their own groups (``parallel/tables.py``, ``parallel/experts.py``);
- the optimizer step: ``parallel.step.optimizer_step``, its components in a fixed order (clipping by the global
  norm over all stages, the non-finite skip, the MoE bias balance, the tables' sparse Adam, the dense optimizer on
  this rank's ZeRO-1 rows, the replicas' sync);
- with ``p2p="overlap"``, boundary transfers that overlap compute: asynchronous, batched, on process groups of
  their own, each send right after the pass that produced it (``parallel/p2p.py``); ``"deepspeed"`` keeps
  DeepSpeed's blocking transfers.
The stage's checkpoint files are its ``checkpoint`` component's (``parallel/stage_checkpoint.py``): the model per
transformer layer and the optimizer state per parameter name (and row range), so they load under any split and
data-parallel size.
"""
import os
from collections import OrderedDict

import torch
import torch.distributed as dist
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule
from deepspeed.runtime.sparse_tensor import SparseTensor

from model.config import P2P, ModelArgs
from model.layout import Layout
from model.matrices import rows_per_matrix
from parallel.bias_balance import BiasBalance
from parallel.clipping import GradientClipper
from parallel.context import context_shard
from parallel.deepspeed_private import PipelineAdapter
from parallel.experts import average_expert_gradients, expert_groups
from parallel.p2p import EagerSends, StageLinks, boundary_groups
from parallel.partition import StagePlan
from parallel.rows import RowExchange
from parallel.shadows import Replicas
from parallel.stage import PipelineStage
from parallel.stage_checkpoint import StageCheckpoint
from parallel.step import StepParts, optimizer_step
from parallel.step_guard import StepGuard
from parallel.tables import TableOptimizer, table_optimizer
from parallel.zero import OptimizerShards


class CSA2PipelineModule(PipelineModule):
    """One ``PipelineStage`` per pipeline stage. ``loss_fn(outputs, labels)`` runs on the last stage; it names
    its reported parts (``part_names()``) and keeps those of its latest microbatch in ``parts`` (scalars),
    which DeepSpeed averages over microbatches and data-parallel ranks (``engine.get_additional_losses()``).
    It is built here, by ``make_loss(context, head)``, once what it needs exists: the rank's context shard (None
    without context parallelism) and, with ``head_chunk``, the stage's LM head (None otherwise)."""

    def __init__(self, args: ModelArgs, layout: Layout, plan: StagePlan, make_loss,
                 micro_batch: int, seq_len: int, dtype: torch.dtype, index_k: str, seed: int,
                 recompute_layers: int, keep_attention_layers: tuple[int, ...] | None = None, token_map=None,
                 run_dspark: bool = False, expert_parallel: int = 1, expert_overlap: bool = True,
                 context_parallel: int = 1, lora=None, offload_inputs: bool = False, head_chunk: int = 0):
        """``keep_attention_layers``: per stage, how many of its leading recomputed layers keep their attention
        outputs (none when not given); ``token_map`` and ``run_dspark``: ``PipelineStage``'s; ``expert_parallel``:
        ranks of a stage's data-parallel group that split the routed experts (``parallel/experts.py``), with the
        shared expert overlapping the all-to-all when ``expert_overlap``; ``context_parallel``: ranks of a stage's
        data-parallel group that split each row (``parallel/context.py``: consecutive ranks, sharing the rows);
        ``lora``: ``PipelineStage``'s (only the adapters train: the frozen base is in no optimizer, reduction or
        checkpoint); ``offload_inputs``, ``head_chunk``: ``PipelineStage``'s."""
        os.environ.setdefault("LOCAL_RANK", "0")  # PipelineModule reads it; a plain `python -m train` has none
        keep = keep_attention_layers or (0,) * len(plan.stages)
        stages, replicas = len(plan.stages), dist.get_world_size() // len(plan.stages)
        tables = self._table_rows(stages, replicas) if args.engram.layers else None
        self.expert_groups = (expert_groups(stages, replicas, expert_parallel, expert_overlap)
                              if expert_parallel > 1 else None)
        dispatch = self.expert_groups.dispatch if self.expert_groups else None
        self.context = context_shard(stages, replicas, context_parallel, seq_len)
        specs = [LayerSpec(PipelineStage, args, layout, plan, s, micro_batch, seq_len, dtype, index_k, seed,
                           recompute_layers, keep[s], token_map, run_dspark, tables, dispatch, self.context,
                           lora, offload_inputs, head_chunk)
                 for s in range(stages)]
        super().__init__(layers=specs, num_stages=stages, partition_method="uniform")
        self.loss_fn = make_loss(self.context, self.stage.head if head_chunk else None)
        laid = set(tables[0].ranks if tables else ()) | set(
            dispatch.ranks + self.expert_groups.data_ranks if dispatch else ()) | set(
            self.context.ranks if self.context else ())
        if not laid <= set(self.mpu().get_data_parallel_group_ranks()):  # the topology's rank order, as assumed
            raise RuntimeError(f"groups laid over ranks {sorted(laid)} are not inside DeepSpeed's data-parallel "
                               f"group of this stage, {self.mpu().get_data_parallel_group_ranks()}")
        self.layout, self.plan, self.index_k, self.run_dspark = layout, plan, index_k, run_dspark
        self.row_shards = self.stage.model.row_shards()
        if dispatch:  # ExpertOverload names the MoE
            dispatch.names.update({moe.experts: name for name, moe in self.stage.model.experts().items()})
        self.expert_shards = self.stage.model.expert_shards()

    @staticmethod
    def _table_rows(stages: int, replicas: int):
        """``(exchange, rank, world)`` of this rank's Engram table shards: the rows of every table are split over
        the stage's data-parallel ranks (196.6 B parameters cannot be replicated). The groups are made here, by
        every rank in the same order, before the stages exist: DeepSpeed's topology puts rank ``stage * replicas +
        replica`` (checked against its data-parallel group once it is built)."""
        mine = None
        for stage in range(stages):
            ranks = [stage * replicas + r for r in range(replicas)]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = RowExchange(group, ranks)
        return mine, mine.rank, mine.world

    @property
    def stage(self) -> PipelineStage:
        return self.forward_funcs[0]

    def owned_parameters(self) -> list[torch.nn.Parameter]:
        """What the (dense) optimizer updates: everything but shadow replicas and the row-sharded tables."""
        return list(self.optimized_named_parameters().values())

    def optimized_named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """``owned_parameters`` by full-model name: the dense parameters and this rank's experts."""
        return {**self.dense_named_parameters(), **self.expert_named_parameters()}

    def dense_named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The stage's own trained parameters but its row-sharded tables and expert-parallel experts (under the full
        model's names): what the data-parallel reduction sums and ZeRO partitions over the whole data-parallel
        group."""
        return {n: p for n, p in self.stage.model.named_parameters()
                if p.requires_grad and n not in self.row_shards and n not in self.expert_shards}

    def expert_named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's routed experts under expert parallelism (stacked): reduced and partitioned over the ranks
        that hold the same experts. A frozen stack held quantised (``train.lora.quantized_base``) is no parameter
        any more: it has nothing to reduce."""
        named = dict(self.stage.model.named_parameters())
        return {n: named[n] for n in self.expert_shards if n in named and named[n].requires_grad}

    def table_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The row-sharded tables that train (sparse gradients, ``torch.optim.SparseAdam``)."""
        named = dict(self.stage.model.named_parameters())
        return {n: named[n] for n in self.row_shards if named[n].requires_grad}

    def get_additional_losses(self):
        parts = self.loss_fn.parts
        if parts is None:  # not the last stage: only the names matter (the engine broadcasts the values)
            parts = OrderedDict((name, torch.zeros(())) for name in self.loss_fn.part_names())
        return parts

    def expert_data_rank(self) -> int:
        """My rank among the replicas holding the same experts (the data-parallel rank without expert parallelism)."""
        if self.expert_groups is None:
            return self.mpu().data_parallel_id
        return self.expert_groups.data_ranks.index(dist.get_rank())


class CSA2PipelineEngine(PipelineAdapter):
    """The DeepSpeed adapter of a CSA2 stage: its hooks run our reductions and ``parallel.step.optimizer_step``, and
    with ``p2p="overlap"`` the boundary transfers of ``parallel/p2p.py``. The step's state is in its components:
    ``clipper``, ``guard``, ``balance``, ``tables`` (None without trained Engram tables), ``shards``,
    ``shadow_links``; its checkpoint files are ``checkpoint``'s (``parallel/stage_checkpoint.py``)."""

    def __init__(self, *args, shards: list[OptimizerShards], max_grad_norm: float = 0.0, p2p: str = "overlap",
                 table_optimizer: TableOptimizer | None = None, **kwargs):
        if p2p not in P2P:
            raise ValueError(f"parallel.p2p={p2p!r}: use one of {P2P}")
        super().__init__(*args, **kwargs)
        module: CSA2PipelineModule = self.module
        self.tables = table_optimizer  # row-sharded tables, sparse gradients
        self.links = self._link_stages() if p2p == "overlap" and self.num_stages > 1 else None
        self.shards = shards  # what this rank's optimizer steps (all of the stage without ZeRO): dense, experts
        self.experts = module.expert_named_parameters()  # this rank's range of the routed experts (EP > 1)
        self.clipper = GradientClipper(max_grad_norm, self.device, [
            (set(module.table_parameters()), self.grid.get_data_parallel_group()),
            (set(self.experts), module.expert_groups and module.expert_groups.dispatch.group)],
            self.grid.get_pipe_parallel_group(), self.num_stages)
        self.guard = StepGuard()  # whether the last step was applied (parallel/step_guard.py)
        self.balance = BiasBalance(module.stage.model, self.grid.get_data_parallel_group())
        self.shadow_links = Replicas(module.topology(), module.layout, module.plan, module.stage, self.stage_id,
                                     module.index_k, module.run_dspark, self.device)
        self.step_parts = StepParts(
            clip=lambda: self._clip_gradients(), clipper=self.clipper, guard=self.guard, balance=self.balance,
            tables=self.tables, shards=shards, dense_step=super().step_optimizer, drop=self._drop_step,
            lr=lambda: self.optimizer.param_groups[0]["lr"], replicas=self.shadow_links, device=self.device)
        self.checkpoint = StageCheckpoint(module.stage, module.row_shards, module.expert_shards,
                                          self.grid.data_parallel_id == 0, module.expert_data_rank() == 0, shards,
                                          self.tables, self.optimizer)

    @property
    def last_step_skipped(self) -> bool:
        return self.guard.skipped

    @property
    def max_grad_norm(self) -> float:
        return self.clipper.max_norm

    @property
    def table_optimizer(self) -> torch.optim.Optimizer | None:
        return self.tables.optimizer if self.tables is not None else None

    @property
    def clip_norms(self) -> dict[str, torch.Tensor]:
        """Each clipping group's norm of the last step (``model.groups.CLIP_GROUPS``), before clipping."""
        return self.clipper.clip_norms

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The trunk's global gradient norm of the last step, before clipping (None before the first)."""
        return self.clip_norms.get("trunk")

    @property
    def indexer_grad_norm(self) -> torch.Tensor | None:
        return self.clip_norms.get("indexer")

    @property
    def group_grad_norms(self) -> dict[str, torch.Tensor]:
        """The same squares as ``clip_norms`` per parameter group (``model/groups.py``)."""
        return self.clipper.group_norms

    @property
    def expert_loads(self) -> dict[str, torch.Tensor]:
        """MoE layer -> expert loads of the last step, summed over the replicas."""
        return self.balance.loads

    @property
    def context_parallel(self) -> int:
        """Ranks that split each row (``parallel.context_parallel``), consecutive in the data-parallel group."""
        return self.module.context.size if self.module.context is not None else 1

    @property
    def replicas(self) -> int:
        """Data-parallel replicas D of the pipeline (the data-parallel group's C x D ranks / C): rows are theirs."""
        return self.dp_world_size // self.context_parallel

    @property
    def replica_id(self) -> int:
        """Which replica's rows this rank reads (the C ranks of a context group read the same)."""
        return self.grid.data_parallel_id // self.context_parallel

    def _link_stages(self) -> StageLinks:
        module: CSA2PipelineModule = self.module
        groups = boundary_groups(module.topology())
        return StageLinks.for_stage(groups, self.stage_id, self.grid.data_parallel_id, module.topology(),
                                    module.stage.incoming, module.stage.outgoing, self.device)

    def owned_named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This stage's optimised parameters under the full model's names."""
        return dict(self.module.stage.model.named_parameters())

    def sync_shadows(self) -> None:
        """Copy every owner's index-key projection, and the first stage's embedding to the draft head's replica,
        to the replicas (after a step, and after loading weights)."""
        self.shadow_links.sync()

    def eval_batch(self, *args, **kwargs):
        """DeepSpeed's, starting from no running loss: it sums ``total_loss`` over the forwards of a batch and
        resets it in ``train_batch`` only, so an evaluation that returns logits (``compute_loss=False``) would
        leave them there for the next evaluation's losses to be added to."""
        self.total_loss = None
        return super().eval_batch(*args, **kwargs)

    # The hooks of PipelineAdapter (parallel/deepspeed_private.py)

    def reduce_tied_gradients(self) -> None:
        super().reduce_tied_gradients()
        self.shadow_links.reduce_gradients()

    def reduce_gradients(self) -> None:
        """DeepSpeed's data-parallel all-reduce of the replicated gradients, then the tables' and the experts'
        reductions over their own groups."""
        self.buffered_allreduce_fallback(grads=self._replicated_gradients(),
                                         elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE)
        replicas = self.grid.get_data_parallel_world_size()
        if self.tables is not None:
            self.tables.average(replicas)
        if self.experts:
            average_expert_gradients(self.experts, self.module.expert_groups.data, replicas)

    def _replicated_gradients(self) -> list:
        """The gradients DeepSpeed's data-parallel all-reduce sums: all but the row-sharded tables' and the
        expert-parallel experts' (their shards hold other rows on every replica: summing them would mix rows; the
        experts are reduced over their own group in ``reduce_gradients``)."""
        sharded = {id(p) for p in self._sharded_tensors()}
        grads = []
        for p in self.module.parameters():
            if not p.requires_grad or p.numel() == 0 or id(p) in sharded:
                continue
            if p.grad is None:  # every replica reduces the same tensors
                p.grad = torch.zeros_like(p)
            grads.append(SparseTensor(p.grad) if p.grad.is_sparse else p.grad.data)
        return grads

    def broadcast_model(self) -> None:
        """DeepSpeed's start-up broadcast of the weights from the first data-parallel rank, but the row-sharded
        tables and the expert ranges: each replica holds other rows of them (DeepSpeed would give every replica the
        first one's), drawn alike wherever held (``model.transformer.init_parameters``)."""
        sharded = {id(p) for p in self._sharded_tensors()}
        first = dist.get_global_rank(self.seq_data_parallel_group, 0)
        for p in self.module.parameters():
            if id(p) not in sharded:
                dist.broadcast(p.data.view(torch.uint8), first, group=self.seq_data_parallel_group)

    def _sharded_tensors(self) -> list[torch.nn.Parameter]:
        """The parameters that hold other rows on every replica: the tables' shards and the experts' ranges (a table
        held as released under LoRA, ``model.quantized_base.QuantizedTable``, is a buffer, no parameter)."""
        named = dict(self.module.stage.model.named_parameters())
        return [named[n] for n in (*self.module.row_shards, *self.module.expert_shards) if n in named]

    def step_optimizer(self, lr_kwargs=None) -> None:
        optimizer_step(self.step_parts, self.total_loss if self.is_last_stage() else None, lr_kwargs)

    def _drop_step(self) -> None:
        """A skipped step: every gradient dropped, the step counted as skipped (``optimizer_step``)."""
        self.optimizer.zero_grad()
        self.zero_grad()
        self.count_skipped_step()

    def _clip_gradients(self) -> None:
        """Clip the trunk's, the indexer's and the draft head's gradients (``parallel/clipping.py``); the tables
        are listed without a gradient too, as on every replica. A method of the engine so that tests and benchmarks
        can wrap it to read the reduced gradients before they are clipped."""
        tables = self.tables.tables if self.tables is not None else {}
        self.clipper([(n, p.grad) for n, p in self.owned_named_parameters().items()
                      if p.grad is not None or n in tables])

    def wrap_schedule(self, pipe_schedule):
        return pipe_schedule if self.links is None else EagerSends(pipe_schedule)

    def after_schedule(self) -> None:
        if self.links is not None:
            self.links.drain()

    def send_activations(self, buffer_id: int) -> None:
        if self.links is None:
            return super().send_activations(buffer_id)
        self.links.send_activations(self.pipe_buffers["outputs"][buffer_id])

    def recv_activations(self, buffer_id: int) -> None:
        if self.links is None:
            return super().recv_activations(buffer_id)
        received = self.links.recv_activations()
        for tensor in received:
            tensor.requires_grad = tensor.is_floating_point()
        self.pipe_buffers["inputs"][buffer_id] = received

    def send_gradients(self, buffer_id: int) -> None:
        if self.links is None:
            return super().send_gradients(buffer_id)
        floats, _ = self.pipe_buffers["inputs"][buffer_id]
        self.links.send_gradient(floats.grad)
        self.pipe_buffers["inputs"][buffer_id] = None

    def recv_gradients(self, buffer_id: int) -> None:
        if self.links is None:
            return super().recv_gradients(buffer_id)
        self.grad_layer = [self.links.recv_gradient()]


def build_engine(module: CSA2PipelineModule, config: dict, lr_scheduler=None,
                 model_parameters: list[dict] | None = None, p2p: str = "overlap",
                 optimizer=None) -> CSA2PipelineEngine:
    """What ``deepspeed.initialize`` does for a PipelineModule, with our engine class, only owned parameters
    handed to the optimizer (``model_parameters``: param groups of them; default one group of all owned),
    ``gradient_clipping`` and ``zero_optimization.stage`` (0 or 1) done by the engine, not by DeepSpeed, and the
    boundary transfers of ``p2p`` (``P2P``). ``optimizer``: a function of the param groups that builds the optimizer
    (``parallel/muon.py``'s), in place of the one ``config`` names. A group with a ``matrix`` (Muon's ``(rows,
    columns)``) keeps its matrices whole under ZeRO-1: its parameters are cut only between matrices."""
    config = dict(config)
    max_grad_norm = config.get("gradient_clipping", 0.0)
    config["gradient_clipping"] = 0.0  # DeepSpeed's own clipping is off (its default is not 0)
    zero_stage = config.pop("zero_optimization", {}).get("stage", 0)
    if zero_stage not in (0, 1):
        raise ValueError(f"zero_optimization.stage={zero_stage} (parallel.zero_stage): use 0 or 1; DeepSpeed's "
                         "pipeline engine refuses stages 2 and 3, which partition gradients or weights")
    wanted = model_parameters or [{"params": module.owned_parameters()}]
    units = {id(p): rows_per_matrix(tuple(p.shape), group["matrix"])
             for group in wanted if group.get("matrix") for p in group["params"]}

    def rows(named: dict[str, torch.nn.Parameter]) -> dict[str, int]:
        return {n: units.get(id(p), 1) for n, p in named.items()}
    grid = module.mpu()
    dense = module.dense_named_parameters()
    shards = [OptimizerShards(dense, grid.get_data_parallel_group(), grid.get_data_parallel_group_ranks(),
                              grid.get_data_parallel_rank(), zero_stage == 1, units=rows(dense))]
    if module.expert_groups is not None:  # partitioned over the replicas that hold the same experts
        experts, named = module.expert_groups, module.expert_named_parameters()
        shards.append(OptimizerShards(named, experts.data, experts.data_ranks, module.expert_data_rank(),
                                      zero_stage == 1, {n: first for n, (first, _) in module.expert_shards.items()},
                                      units=rows(named)))
    groups = [{**group, "params": [p for part in parts for p in part["params"]]}
              for group, *parts in zip(wanted, *(s.param_groups(wanted) for s in shards))]
    config_class = DeepSpeedConfig(config, module.mpu())
    return CSA2PipelineEngine(args=None, model=module, optimizer=optimizer, model_parameters=groups,
                              training_data=None, lr_scheduler=lr_scheduler, mpu=module.mpu(), dist_init_required=False,
                              collate_fn=None, config=config, config_class=config_class, shards=shards,
                              max_grad_norm=max_grad_norm, p2p=p2p,
                              table_optimizer=table_optimizer(module.table_parameters(), module.row_shards, config))
