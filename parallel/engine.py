"""DeepSpeed pipeline integration: the CSA2 ``PipelineModule`` and an engine that keeps shadow indexers exact.

Every training job runs through this engine, one stage or many, so that pipeline parallelism is a config
switch. On top of DeepSpeed's 1F1B schedule it adds, at the step boundary:
- shadow indexers: replica gradients are summed into the owner (and the replicas) before the data-parallel
  reduction, only the owner's copy is in the optimizer, and after the step the owner's values are broadcast
  to its replicas, so replicas stay bitwise equal to the owner;
- gradient clipping by the global norm over all stages (DeepSpeed's fp32 clipping, given a pipeline grid,
  counts only the first stage's gradients), the indexer's and the draft head's parameters each clipped by their
  own norm so that their losses never change how far the trunk moves (SPEC §2: the indexer learns only from its
  KL; §5.4: the draft head only from its own loss);
- a non-finite loss or gradient norm skips the whole step on every rank (no parameter, optimizer or schedule
  change; ``parallel/step_guard.py``);
- the MoE layers' auxiliary-loss-free balance: after every applied step each routing bias moves against its
  expert loads summed over the step's microbatches and the stage's data-parallel replicas, so every replica keeps
  the same bias (``Transformer.balance_experts``);
- ZeRO stage 1 (``zero_optimization.stage=1``): each data-parallel rank of a stage steps and keeps the optimizer
  state of its own run of the stage's rows and broadcasts them (``parallel/zero.py``: why not DeepSpeed's);
- with ``p2p="overlap"``, boundary transfers that overlap compute: asynchronous, batched, on process groups of
  their own, each send right after the pass that produced it (``parallel/p2p.py``); ``"deepspeed"`` keeps
  DeepSpeed's blocking transfers.
Checkpoints hold the model per transformer layer and the optimizer state per parameter name (and row range), so
they load under any split and data-parallel size.
"""
import contextlib
import glob
import os
from collections import OrderedDict
from functools import partial

import torch
import torch.distributed as dist
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule
from deepspeed.runtime.sparse_tensor import SparseTensor
from deepspeed.utils import groups as ds_groups

from model.config import P2P, ModelArgs
from model.groups import CLIP_GROUPS, GROUPS, clip_group, param_group
from model.layout import Layout
from parallel.context import context_shard
from parallel.p2p import EagerSends, StageLinks, boundary_groups
from parallel.experts import expert_groups
from parallel.partition import StagePlan
from parallel.rows import RowExchange, join_rows, rows_file, saved_rows
from parallel.stage import PipelineStage, owner_name, shadow_sources
from parallel.step_guard import StepGuard
from parallel.zero import OptimizerShards, Shard, rows_of_state

class CSA2PipelineModule(PipelineModule):
    """One ``PipelineStage`` per pipeline stage. ``loss_fn(outputs, labels)`` runs on the last stage; it names
    its reported parts (``part_names()``) and keeps those of its latest microbatch in ``parts`` (scalars),
    which DeepSpeed averages over microbatches and data-parallel ranks (``engine.get_additional_losses()``)."""

    def __init__(self, args: ModelArgs, layout: Layout, plan: StagePlan, loss_fn,
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
        super().__init__(layers=specs, num_stages=stages, loss_fn=loss_fn, partition_method="uniform")
        laid = set(tables[0].ranks if tables else ()) | set(
            dispatch.ranks + self.expert_groups.data_ranks if dispatch else ()) | set(
            self.context.ranks if self.context else ())
        if not laid <= set(self._grid.get_data_parallel_group_ranks()):  # the topology's rank order, as assumed
            raise RuntimeError(f"groups laid over ranks {sorted(laid)} are not inside DeepSpeed's data-parallel "
                               f"group of this stage, {self._grid.get_data_parallel_group_ranks()}")
        self.layout, self.plan, self.index_k, self.run_dspark = layout, plan, index_k, run_dspark
        self.row_shards = self.stage.model.row_shards()
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

    def weight_files(self) -> dict[str, dict]:
        """What this rank writes of a checkpoint's weights, file name: contents (views of the live tensors; the
        writer copies them). One file per transformer layer (plus embedding and head), named by the full model's
        layer ids, from the first data-parallel rank of each stage (the others hold the same weights); a row-sharded
        table's rows from every rank that holds some, one file per rank (``rows_file``); each range of experts from
        the first of the ranks that hold it."""
        files = {}
        state = self.stage.owned_state_dict()
        for name, (start, rows) in self.row_shards.items():
            if name not in state:  # a frozen table under LoRA: not checkpointed
                continue
            stop = min(start + state[name].shape[0], rows)  # the last shard's padding is not part of the table
            if stop > start:
                files[rows_file(name, start)] = {"name": name, "rows": (start, stop),
                                                 "values": state[name][:stop - start]}
        experts = {k: v for k, v in state.items() if is_expert(k)}
        if experts and self.expert_data_rank() == 0:  # one copy of each range of experts
            for part, tensors in split_by_layer(experts).items():
                first = min(int(k.split(".experts.")[1].split(".")[0]) for k in tensors)
                files[experts_file(part, first)] = tensors
        if self._grid.data_parallel_id == 0:
            dense = {k: v for k, v in state.items() if k not in self.row_shards and not is_expert(k)}
            files.update(split_by_layer(dense))
        return files

    def expert_data_rank(self) -> int:
        """My rank among the replicas holding the same experts (the data-parallel rank without expert parallelism)."""
        if self.expert_groups is None:
            return self._grid.data_parallel_id
        return self.expert_groups.data_ranks.index(dist.get_rank())

    def load_weights(self, load_dir: str) -> None:
        """This stage's layers from the per-layer files of ``weight_files``, whatever split wrote them, and the rows
        of its table shards from the row files of whatever data-parallel size wrote them."""
        own = self.stage.owned_state_dict()
        wanted = split_by_layer({k: v for k, v in own.items() if k not in self.row_shards and not is_expert(k)})
        state = {}
        for part in wanted:
            path = os.path.join(load_dir, part)
            if not os.path.exists(path):
                raise FileNotFoundError(f"checkpoint {load_dir} has no {part}: it was written by another model")
            state.update(torch.load(path, map_location="cpu", weights_only=True))
        for part, names in split_by_layer({k: v for k, v in own.items() if is_expert(k)}).items():
            found = {}
            for path in sorted(glob.glob(os.path.join(load_dir, experts_file(part, "*")))):
                saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                found.update({k: saved[k].clone() for k in names if k in saved})
            missing = sorted(set(names) - set(found))
            if missing:
                raise FileNotFoundError(f"checkpoint {load_dir} does not hold every expert of this model: "
                                        f"{len(missing)} missing, e.g. {missing[0]} — it was written for another "
                                        "model (the expert counts differ), or an experts_*.pt file is missing")
            state.update(found)
        pieces = saved_rows(load_dir)
        for name, (start, rows) in self.row_shards.items():
            if name not in own:  # a frozen table under LoRA: not checkpointed
                continue
            shard = own[name].detach().clone()
            stop = min(start + shard.shape[0], rows)
            shard[:stop - start] = join_rows(name, start, stop, pieces.get(name, []))
            state[name] = shard
        self.stage.load_owned_state_dict(state)


def _squares(grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The squared norms of gradients, dense or sparse, as an fp32 vector on the device (0 for none): the dense ones
    in one pass (torch's foreach norm), no host sync. A tensor's value depends on it alone, not on the others."""
    dense = iter(torch._foreach_norm([g for g in grads if g is not None and not g.is_sparse]) if grads else ())
    zero = torch.zeros((), device=device)
    return torch.stack([zero if g is None else
                        g.coalesce().values().float().pow(2).sum() if g.is_sparse else next(dense).float().square()
                        for g in grads]) if grads else torch.zeros(0, device=device)


def is_expert(name: str) -> bool:
    """A routed expert's matrix under its reference name (``layers.3.ffn.experts.17.w1.weight``)."""
    return ".ffn.experts." in name


def experts_file(part: str, first) -> str:
    """The file of a range of routed experts of weight file ``part`` (``layer_003.pt`` -> ``experts_layer_003_
    00024.pt``, from expert 24), one per range of experts a rank held; ``first="*"``: the glob of them."""
    stem = part.removesuffix(".pt")
    return f"experts_{stem}_{first}.pt" if first == "*" else f"experts_{stem}_{first:05d}.pt"


def split_by_layer(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Group a (stage) state dict into checkpoint files: ``layer_<id>.pt``, ``embed.pt``, ``head.pt``."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name.startswith("layers."):
            part = f"layer_{int(name.split('.')[1]):03d}.pt"
        else:
            part = "embed.pt" if name.startswith("embed.") else "head.pt"
        parts.setdefault(part, {})[name] = tensor
    return parts


class CSA2PipelineEngine(PipelineEngine):
    def __init__(self, *args, shards: list[OptimizerShards], max_grad_norm: float = 0.0, p2p: str = "overlap",
                 table_optimizer: torch.optim.Optimizer | None = None, **kwargs):
        if p2p not in P2P:
            raise ValueError(f"parallel.p2p={p2p!r}: use one of {P2P}")
        super().__init__(*args, **kwargs)
        self.tables = self.module.table_parameters()  # row-sharded, sparse gradients: stepped by table_optimizer
        self.table_optimizer = table_optimizer
        self.links = self._link_stages() if p2p == "overlap" and self.num_stages > 1 else None
        self.shards = shards  # what this rank's optimizer steps (all of the stage without ZeRO): dense, experts
        self.experts = self.module.expert_named_parameters()  # this rank's range of the routed experts (EP > 1)
        self.max_grad_norm = max_grad_norm
        self.grad_norm = self.indexer_grad_norm = None  # global norms of the last step, before clipping
        self.group_grad_norms: dict[str, torch.Tensor] = {}  # the same per parameter group (model/groups.py)
        self.clip_norms: dict[str, torch.Tensor] = {}  # each clipping group's norm of the last step (CLIP_GROUPS)
        self.expert_loads: dict[str, torch.Tensor] = {}  # MoE layer -> expert loads of the last step, all replicas
        self.guard = StepGuard()  # whether the last step was applied (parallel/step_guard.py)
        self._shadow_links = self._link_shadows()
        self._replica_links = self._link_draft_embedding()

    @property
    def last_step_skipped(self) -> bool:
        return self.guard.skipped

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
        groups = boundary_groups(module._topo)
        return StageLinks.for_stage(groups, self.stage_id, self.grid.data_parallel_id, module._topo,
                                    module.stage.incoming, module.stage.outgoing, self.device)

    def _link_shadows(self) -> list[tuple[object, int, list[torch.nn.Parameter]]]:
        """(process group, owner rank, my tensors) for every shadowed Full layer that my stage owns or mirrors.

        Groups are created in the same order on every rank, as torch.distributed requires."""
        module: CSA2PipelineModule = self.module
        layout, plan, topo = module.layout, module.plan, module._topo
        holders: dict[int, list[int]] = {}
        if module.index_k == "shadow":
            for stage, layers in enumerate(plan.stages):
                for source in shadow_sources(layout, layers):
                    holders.setdefault(source, [plan.stage_of(source)]).append(stage)
        me = module.stage
        links = []
        for source in sorted(holders):
            for data in range(topo.get_dim("data")):
                ranks = [topo.get_rank(pipe=s, data=data) for s in holders[source]]
                group = dist.new_group(ranks)
                if self.global_rank not in ranks:
                    continue
                if self.stage_id == holders[source][0]:
                    named = dict(me.model.named_parameters())
                    tensors = [named[owner_name(source, n)] for n in ("wk.weight", "k_norm.weight")]
                else:
                    tensors = list(me.shadows[str(source)].parameters())
                links.append((group, ranks[0], tensors))
        return links

    def _link_draft_embedding(self) -> list[tuple[object, int, list[torch.Tensor]]]:
        """(process group, owner rank, my tensors) of the draft head's embedding replica on the last stage, when
        the first stage holds the embedding (groups made in the same order on every rank)."""
        module: CSA2PipelineModule = self.module
        topo, last = module._topo, self.num_stages - 1
        if last == 0 or not module.run_dspark:
            return []
        links = []
        for data in range(topo.get_dim("data")):
            ranks = [topo.get_rank(pipe=0, data=data), topo.get_rank(pipe=last, data=data)]
            group = dist.new_group(ranks)
            if self.global_rank in ranks:
                stage = module.stage
                links.append((group, ranks[0], [stage.model.embed.weight if self.stage_id == 0 else stage.draft_embed]))
        return links

    def owned_named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This stage's optimised parameters under the full model's names."""
        return dict(self.module.stage.model.named_parameters())

    @property
    def writes_optimizer_state(self) -> bool:
        """Whether this rank's optimizer state belongs in a checkpoint: rows it owns of the dense or the expert
        parameters (``OptimizerShards``), or of a table shard, which only this rank holds."""
        return any(shards.writes_state for shards in self.shards) or bool(self.tables)

    def optimizer_state_by_name(self, saving: bool = False) -> dict[str, dict]:
        """This rank's optimizer state keyed by full-model parameter name and row range (experts and table rows in
        the whole tensor's terms), so that it can be loaded under another stage split, data-parallel and
        expert-parallel size (DeepSpeed's own files are keyed by stage and rank). ``saving``: only what this rank
        writes (a replica's copy of state that another rank writes is left out)."""
        state = {}
        for shards in self.shards:
            if shards.writes_state or not saving:
                state.update(shards.state_by_name(self.optimizer))
        for name, p in self.tables.items():
            start, rows = self.module.row_shards[name]
            stop = min(start + p.shape[0], rows)
            if p in self.table_optimizer.state and stop > start:
                state[name] = {"rows": (start, stop), "state": {
                    k: v[:stop - start].detach().cpu() if torch.is_tensor(v) and v.dim() else v
                    for k, v in self.table_optimizer.state[p].items()}}
        return state

    def load_optimizer_state_by_name(self, pieces: dict[str, list[dict]]) -> None:
        """Load my rows of the state that every saving rank wrote (``optimizer_state_by_name``), grouped by name;
        a table shard's padding rows (past the table) start from zero moments."""
        for shards in self.shards:
            shards.load_state_by_name(self.optimizer, pieces)
        for name, p in self.tables.items():
            start, rows = self.module.row_shards[name]
            stop = min(start + p.shape[0], rows)
            if name in pieces and stop > start:
                state = rows_of_state(Shard(name, start, stop, 0), pieces[name], p.device)
                self.table_optimizer.state[p] = {k: torch.nn.functional.pad(v, (0, 0, 0, p.shape[0] - v.shape[0]))
                                                 if torch.is_tensor(v) and v.dim() else v for k, v in state.items()}

    def _reduce_grads(self):
        """DeepSpeed's data-parallel reduction, then the tables' gradients over the replicas: each shard's already
        sums every replica's lookups of its rows (the row exchange's backward), so it is divided by the replicas,
        as the reduction averages every other gradient."""
        PipelineEngine._exec_reduce_grads(self)
        replicas = self.grid.get_data_parallel_world_size()
        for p in self.tables.values():
            if p.grad is not None and replicas > 1:
                p.grad.mul_(1.0 / replicas)
        if self.experts:  # each holds what the tokens of its expert-parallel group gave: summed over the replicas
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.experts.values()]
            flat = torch.cat([g.reshape(-1) for g in grads])  # of the same experts, averaged as every gradient
            dist.all_reduce(flat, group=self.module.expert_groups.data)
            flat.mul_(1.0 / replicas)
            for p, part in zip(self.experts.values(), flat.split([g.numel() for g in grads])):
                p.grad = part.view_as(p).to(p.dtype)

    def _get_gradients_for_reduction(self):
        """DeepSpeed's list of gradients to all-reduce, without the row-sharded tables and the expert-parallel
        experts (their shards hold other rows on every replica: summing them would mix rows; the experts are reduced
        over their own group in ``_reduce_grads``), and with no DeepSpeed MoE groups."""
        sharded = {id(p) for p in self._sharded_tensors()}
        grads = []
        for p in self.module.parameters():
            if not p.requires_grad or p.numel() == 0 or id(p) in sharded:
                continue
            if p.grad is None:  # every replica reduces the same tensors
                p.grad = torch.zeros_like(p)
            grads.append(SparseTensor(p.grad) if p.grad.is_sparse else p.grad.data)
        return grads, {}

    def _broadcast_model(self):
        """DeepSpeed's start-up broadcast of the weights from the first data-parallel rank, but the row-sharded
        tables and the expert ranges: each replica holds other rows of them (DeepSpeed would give every replica the
        first one's), drawn alike wherever held (``model.transformer.init_parameters``)."""
        sharded = {id(p) for p in self._sharded_tensors()}
        for p in self.module.parameters():
            if id(p) not in sharded:
                dist.broadcast(p.data.view(torch.uint8), ds_groups._get_broadcast_src_rank(),
                               group=self.seq_data_parallel_group)

    def _sharded_tensors(self) -> list[torch.nn.Parameter]:
        """The parameters that hold other rows on every replica: the tables' shards and the experts' ranges."""
        named = dict(self.module.stage.model.named_parameters())
        return [named[n] for n in (*self.module.row_shards, *self.module.expert_shards)]

    def _reduce_tied_and_shadow_grads(self):
        PipelineEngine._exec_reduce_tied_grads(self)
        for group, _, tensors in self._shadow_links:
            has = torch.tensor([float(any(t.grad is not None for t in tensors))], device=self.device)
            flat = torch.cat([has] + [(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1).float()
                                      for t in tensors])
            dist.all_reduce(flat, group=group)
            if flat[0] == 0:
                continue
            offset = 1
            for t in tensors:
                t.grad = flat[offset: offset + t.numel()].view_as(t).to(t.dtype)
                offset += t.numel()

    def _guarded_optimizer_step(self, lr_kwargs=None):
        """The step, or on a non-finite loss or gradient norm (``StepGuard``) nothing on any rank: no parameter,
        optimizer, routing-bias or schedule change, the gradients dropped and the step counted as skipped."""
        self._clip_gradients()  # the norms (equal on every rank), then the scaling (dropped by a skip)
        skip = self.guard.check(self.total_loss if self.is_last_stage() else None, self.clip_norms.values(),
                                self.device)
        self.expert_loads = self.module.stage.model.balance_experts(
            partial(dist.all_reduce, group=self.grid.get_data_parallel_group()), apply=not skip)
        if skip:
            self.optimizer.zero_grad()
            self.zero_grad()
            self._clear_table_grads()
            self.skipped_steps += 1
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            return
        if self.table_optimizer is not None:  # first: DeepSpeed's step below clears every module gradient
            for group in self.table_optimizer.param_groups:
                group["lr"] = self.optimizer.param_groups[0]["lr"]  # this step's, as the dense one's
            self.table_optimizer.step()
        self._clear_table_grads()
        with contextlib.ExitStack() as views:
            for shards in self.shards:
                views.enter_context(shards.gradients())
            PipelineEngine._exec_optimizer_step(self, lr_kwargs)
        for shards in self.shards:
            shards.broadcast()
        self.sync_shadows()

    def _clear_table_grads(self) -> None:
        for p in self.tables.values():
            p.grad = None

    def eval_batch(self, *args, **kwargs):
        """DeepSpeed's, starting from no running loss: it sums ``total_loss`` over the forwards of a batch and
        resets it in ``train_batch`` only, so an evaluation that returns logits (``compute_loss=False``) would
        leave them there for the next evaluation's losses to be added to."""
        self.total_loss = None
        return super().eval_batch(*args, **kwargs)

    def sync_shadows(self) -> None:
        """Copy every owner's index-key projection, and the first stage's embedding to the draft head's replica,
        to the replicas (after a step, and after loading weights)."""
        for group, owner, tensors in self._shadow_links + self._replica_links:
            for t in tensors:
                dist.broadcast(t.data, src=owner, group=group)

    def _clip_gradients(self) -> None:
        """Clip the trunk's, the indexer's and the draft head's gradients, each clipping group
        (``model.groups.CLIP_GROUPS``) by its own norm over the whole pipeline.

        The per-tensor squared norms of all stages are gathered and summed in the full model's parameter order,
        so each norm (and every clipped gradient) is bitwise the single-stage one. Runs after the data-parallel
        reduction, so every replica of a stage sees the same norms. ``grad_norm`` is the trunk's;
        ``group_grad_norms`` splits the same squares by parameter role (training-health diagnostics). The norms
        stay on the device and the gradients are scaled by group (foreach): no host sync on one stage; several
        stages gather their squares on the host once."""
        owned = self.owned_named_parameters()
        named = [(n, p.grad) for n, p in owned.items() if p.grad is not None or n in self.tables]  # tables: on
        group_ids = [GROUPS.index(param_group(n)) for n, _ in named]  # every rank
        local = _squares([g for _, g in named], self.device)
        # A table's shards hold other rows on every data-parallel replica, an expert range other experts on every
        # member of its expert-parallel group: their squares are the sums of theirs
        for sharded, group in ((self.tables, self.grid.get_data_parallel_group()),
                               (self.experts, self.module.expert_groups and self.module.expert_groups.dispatch.group)):
            if sharded and dist.get_world_size(group) > 1:
                at = torch.tensor([i for i, (n, _) in enumerate(named) if n in sharded])
                at = at.to(self.device, non_blocking=True)
                summed = local[at]
                dist.all_reduce(summed, group=group)
                local[at] = summed
        if self.num_stages > 1:
            per_stage = [None] * self.num_stages
            dist.all_gather_object(per_stage, (local.cpu(), group_ids), group=self.grid.get_pipe_parallel_group())
            squares = torch.cat([part for part, _ in per_stage]).to(self.device)
            all_group_ids = [i for _, ids in per_stage for i in ids]
        else:
            squares, all_group_ids = local, group_ids
        ids = torch.tensor(all_group_ids, dtype=torch.long).to(self.device, non_blocking=True)
        clip_of = torch.tensor([CLIP_GROUPS.index(clip_group(group)) for group in GROUPS]).to(
            self.device, non_blocking=True)[ids]

        def norm_where(mask):  # a fixed-length sum in parameter order: bitwise the same on every split
            return torch.where(mask, squares, 0.0).sum().sqrt()

        self.group_grad_norms = {group: norm_where(ids == i) for i, group in enumerate(GROUPS)
                                 if i in all_group_ids}
        self.clip_norms = norms = {group: norm_where(clip_of == i) for i, group in enumerate(CLIP_GROUPS)}
        self.grad_norm, self.indexer_grad_norm = norms["trunk"], norms["indexer"]
        if self.max_grad_norm <= 0:
            return
        for clip in CLIP_GROUPS:
            grads = [g for (_, g), i in zip(named, group_ids) if g is not None and clip_group(GROUPS[i]) == clip]
            scale = torch.clamp(self.max_grad_norm / (norms[clip] + 1e-6), max=1.0)
            dense = [g for g in grads if not g.is_sparse]
            if dense:
                torch._foreach_mul_(dense, scale)
            for g in grads:
                if g.is_sparse:
                    g.mul_(scale)

    def _train_schedule(self):
        inner = super()._train_schedule()
        return inner if self.links is None else EagerSends(inner)

    def _inference_schedule(self, micro_batches):
        inner = super()._inference_schedule(micro_batches)
        return inner if self.links is None else EagerSends(inner)

    def _exec_schedule(self, pipe_schedule):
        super()._exec_schedule(pipe_schedule)
        if self.links is not None:
            self.links.drain()

    def _send_activations(self, buffer_id):
        if self.links is None:
            return PipelineEngine._exec_send_activations(self, buffer_id)
        self.links.send_activations(self.pipe_buffers["outputs"][buffer_id])

    def _recv_activations(self, buffer_id):
        if self.links is None:
            return PipelineEngine._exec_recv_activations(self, buffer_id)
        received = self.links.recv_activations()
        for tensor in received:
            tensor.requires_grad = tensor.is_floating_point()
        self.pipe_buffers["inputs"][buffer_id] = received

    def _send_grads(self, buffer_id):
        if self.links is None:
            return PipelineEngine._exec_send_grads(self, buffer_id)
        floats, _ = self.pipe_buffers["inputs"][buffer_id]
        self.links.send_gradient(floats.grad)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _recv_grads(self, buffer_id):
        if self.links is None:
            return PipelineEngine._exec_recv_grads(self, buffer_id)
        self.grad_layer = [self.links.recv_gradient()]

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.ReduceTiedGrads: _reduce_tied_and_shadow_grads,
        schedule.ReduceGrads: _reduce_grads,
        schedule.OptimizerStep: _guarded_optimizer_step,
        schedule.SendActivation: _send_activations,
        schedule.RecvActivation: _recv_activations,
        schedule.SendGrad: _send_grads,
        schedule.RecvGrad: _recv_grads,
    }


def build_engine(module: CSA2PipelineModule, config: dict, lr_scheduler=None,
                 model_parameters: list[dict] | None = None, p2p: str = "overlap") -> CSA2PipelineEngine:
    """What ``deepspeed.initialize`` does for a PipelineModule, with our engine class, only owned parameters
    handed to the optimizer (``model_parameters``: param groups of them; default one group of all owned),
    ``gradient_clipping`` and ``zero_optimization.stage`` (0 or 1) done by the engine, not by DeepSpeed, and the
    boundary transfers of ``p2p`` (``P2P``)."""
    config = dict(config)
    max_grad_norm = config.get("gradient_clipping", 0.0)
    config["gradient_clipping"] = 0.0  # DeepSpeed's own clipping is off (its default is not 0)
    zero_stage = config.pop("zero_optimization", {}).get("stage", 0)
    if zero_stage not in (0, 1):
        raise ValueError(f"zero_optimization.stage={zero_stage} (parallel.zero_stage): use 0 or 1; DeepSpeed's "
                         "pipeline engine refuses stages 2 and 3, which partition gradients or weights")
    grid = module.mpu()
    shards = [OptimizerShards(module.dense_named_parameters(), grid.get_data_parallel_group(),
                              grid.get_data_parallel_group_ranks(), grid.get_data_parallel_rank(), zero_stage == 1)]
    if module.expert_groups is not None:  # partitioned over the replicas that hold the same experts
        experts = module.expert_groups
        shards.append(OptimizerShards(module.expert_named_parameters(), experts.data, experts.data_ranks,
                                      module.expert_data_rank(), zero_stage == 1,
                                      {n: first for n, (first, _) in module.expert_shards.items()}))
    wanted = model_parameters or [{"params": module.owned_parameters()}]
    groups = [{**group, "params": [p for part in parts for p in part["params"]]}
              for group, *parts in zip(wanted, *(s.param_groups(wanted) for s in shards))]
    config_class = DeepSpeedConfig(config, module.mpu())
    return CSA2PipelineEngine(args=None, model=module, optimizer=None, model_parameters=groups, training_data=None,
                              lr_scheduler=lr_scheduler, mpu=module.mpu(), dist_init_required=False, collate_fn=None,
                              config=config, config_class=config_class, shards=shards, max_grad_norm=max_grad_norm,
                              p2p=p2p, table_optimizer=table_optimizer(module, config))


def table_optimizer(module: CSA2PipelineModule, config: dict) -> torch.optim.Optimizer | None:
    """Adam for the row-sharded tables, whose gradients are sparse: ``torch.optim.SparseAdam`` (lazy: a row's
    moments move only in the steps that looked it up), with the dense optimizer's betas and epsilon and its
    learning rate at every step; no weight decay (the tables are embeddings)."""
    tables = list(module.table_parameters().values())
    if not tables:
        return None
    params = config["optimizer"]["params"]
    return torch.optim.SparseAdam(tables, lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"])
