"""One pipeline stage: a slice of the CSA2 stack between two extended payloads, plus its shadow indexers.

DeepSpeed's ``PipelineModule`` holds exactly one of these per stage (built from a ``LayerSpec`` only on the
ranks of that stage). The first stage takes ``(input_ids, doc_ids)``; the last returns ``(logits,
indexer_losses)`` for the loss; the others exchange ``Payload`` tensors. The shared state of a microbatch exists
only inside one ``forward`` call (and in what autograd saved for its backward), never on the module.
"""
from functools import partial

import torch
from torch import nn

from model.attention import IndexKeys
from model.config import ModelArgs
from model.layout import Layout, Mode
from model.lora import LoRA, adapter_of, attach
from model.quantized_base import quantized_form
from model.quantized_build import quantized_transformer
from model.rope import Rotary
from model.transformer import Transformer, init_parameters
from parallel.ledger import Ledger
from parallel.partition import StagePlan
from parallel.payload import Payload, boundary_fields
from parallel.recompute import recompute_leading


def shadow_sources(layout: Layout, layers: range) -> list[int]:
    """Full layers outside ``layers`` whose index keys a Reindex layer inside ``layers`` reads."""
    return sorted({p.kv_source for p in layout.plan if p.layer_id in layers and p.mode is Mode.REINDEX
                   and p.kv_source not in layers})


def owner_name(source: int, shadow_param: str) -> str:
    """The owner's name of a shadow parameter (``wk.weight`` -> ``layers.<source>.attn.indexer.wk.weight``)."""
    return f"layers.{source}.attn.indexer.{shadow_param}"


class PipelineStage(nn.Module):
    def __init__(self, args: ModelArgs, layout: Layout, plan: StagePlan, stage_id: int, micro_batch: int,
                 seq_len: int, dtype: torch.dtype = torch.float32, index_k: str = "shadow", seed: int = 0,
                 recompute_layers: int = 0, keep_attention_layers: int = 0, token_map=None,
                 run_dspark: bool = False, engram_rows=None, experts=None, context=None,
                 lora: LoRA | None = None, offload_inputs: bool = False, head_chunk: int = 0):
        """``dtype`` is the compute dtype: bf16 runs the stage under autocast over fp32 master weights.
        The first ``recompute_layers`` layers of the stage run as non-reentrant activation checkpoints; the first
        ``keep_attention_layers`` of those keep their sparse-attention outputs instead of re-running attention;
        ``offload_inputs``: the recomputed layers' inputs wait in host memory (``model/offload.py``).
        ``head_chunk`` > 0: the last stage returns the head's input features instead of logits, and the loss runs
        the head ``head_chunk`` tokens at a time (``train.loss.chunked_lm_loss``, through ``head``).
        ``token_map`` feeds the Engram hashes, ``engram_rows`` shards their tables, ``run_dspark`` trains the draft
        head, ``experts`` is the expert-parallel dispatch (``model.transformer``), ``context`` this rank's chunk of
        every row (``parallel.context.ContextShard``; None: whole rows). ``lora``: the base is frozen (its
        autocast-only matrices kept in bf16 under bf16) and only adapters train and are checkpointed
        (``model/lora.py``); with ``lora.quantized_base`` the base is held as the release stores it, its bytes filled
        by ``train.init_from`` (``model/quantized_build.py``)."""
        super().__init__()
        if index_k not in ("shadow", "payload"):
            raise ValueError(f"parallel.index_k={index_k!r}: use 'shadow' or 'payload'")
        layers = plan.stages[stage_id]
        self.stage_id, self.layout, self.compute_dtype, self.context = stage_id, layout, dtype, context
        self.head_chunk = head_chunk
        build = (partial(quantized_transformer, quantized_form) if lora is not None and lora.quantized_base
                 else Transformer)  # the frozen base held as released, never built in full precision
        self.model = build(args, layout, layers, seed, token_map=token_map, engram_rows=engram_rows,
                           run_dspark=run_dspark, experts=experts)
        recompute_leading(self.model.layers.values(), recompute_layers, keep_attention_layers, offload_inputs)
        sources = shadow_sources(layout, layers) if index_k == "shadow" else []
        self.shadows = nn.ModuleDict({str(s): IndexKeys(args) for s in sources})
        for s, shadow in self.shadows.items():
            init_parameters(shadow.named_parameters(), args, layout.n_layers, seed,
                            rename=lambda n, s=s: owner_name(s, n))
            for p in shadow.parameters():
                p.ds_pipe_replicated = True  # DeepSpeed leaves replicas out of the gradient norm
        self.shadow_rotary = Rotary.for_layer(args, compressed=True)
        # The draft head reads the input embedding (frozen for it): a last stage without the embedding holds a
        # replica, kept equal to the first stage's by the engine after every step (not trained, not saved).
        if self.model.run_dspark and not self.model.has_embed:
            self.draft_embed = torch.nn.Parameter(torch.empty(args.vocab_size, args.dim), requires_grad=False)
            self.draft_embed.ds_pipe_replicated = True
            init_parameters([("embed.weight", self.draft_embed)], args, layout.n_layers, seed)  # the owner's draw
        self.lora = lora
        if lora is not None:
            attach(self.model, lora, seed, torch.bfloat16 if dtype == torch.bfloat16 else None)
            for p in self.shadows.parameters():  # replicas of frozen owners
                p.requires_grad_(False)

        def payload(last_layer):
            return Payload(boundary_fields(args, layout, last_layer, micro_batch, seq_len, dtype, index_k,
                                           run_dspark, context.size if context is not None else 1))

        self.incoming = payload(layers.start - 1) if layers.start > 0 else None
        self.outgoing = payload(layers.stop - 1) if layers.stop < layout.n_layers else None
        self.ledger = Ledger(stage_id)
        self.backward_traversals = 0  # backward passes that reached this stage's input (one per microbatch)

    def forward(self, inputs):
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.compute_dtype == torch.bfloat16):
            return self._forward(inputs)

    @property
    def device_type(self) -> str:
        return next(self.parameters()).device.type

    def _forward(self, inputs):
        if self.incoming is None:
            input_ids, doc_ids = inputs
            state = self.model.new_state(doc_ids, input_ids, context=self.context)
            h, pre = self.model.embed_tokens(state.geometry.chunk_of(input_ids))
        else:
            h, pre, state = self.incoming.unpack(*inputs, lambda doc_ids, input_ids: self.model.new_state(
                doc_ids, input_ids, context=self.context))
            self._recompute_index_keys(state)
        self.ledger.watch(state)
        if h.requires_grad:
            h.register_hook(self._count_traversal)
        h, pre = self.model.run_layers(h, pre, state)
        if self.outgoing is not None:
            return self.outgoing.pack(h, pre, state)
        features = self.model.features(h, pre)
        logits = features if self.head_chunk else self.model.head_logits(features)
        losses = [state.indexer_losses[s] for s in sorted(state.indexer_losses)]
        draft = self.model.draft(state, logits, getattr(self, "draft_embed", None))  # never under head_chunk
        if draft is not None:
            losses += list(draft.losses.values())
        return logits, torch.stack(losses) if losses else h.new_zeros(0, dtype=torch.float32)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of ``features`` (``head_chunk``'s outputs) in the stage's compute dtype."""
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.compute_dtype == torch.bfloat16):
            return self.model.head_logits(features)

    def whole_model(self, input_ids: torch.Tensor, doc_ids: torch.Tensor):
        """The full model's forward (``ModelOutput``) when this single stage holds every layer: evaluation."""
        if self.incoming is not None or self.outgoing is not None:
            raise RuntimeError("whole_model needs the whole model on one stage (parallel.pipeline_stages=1)")
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.compute_dtype == torch.bfloat16):
            return self.model(input_ids, doc_ids)

    def _count_traversal(self, grad: torch.Tensor) -> None:
        self.backward_traversals += 1

    def _recompute_index_keys(self, state) -> None:
        """Shadow indexers: this stage's Reindex layers need index keys of Full layers on earlier stages."""
        for source, shadow in self.shadows.items():
            source = int(source)
            entries = state.geometry.entries(self.layout.compress_ratios[source])
            state.index_k[source] = shadow(state.kv[source], self.shadow_rotary, entries)

    def owned_state_dict(self) -> dict[str, torch.Tensor]:
        """What this stage writes to checkpoints, under the full model's names: its parameters and buffers, or
        under LoRA its adapters alone (the base is ``train.init_from``'s)."""
        state = self.model.state_dict()
        return state if self.lora is None else {k: v for k, v in state.items() if adapter_of(k)}

    def load_owned_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """``owned_state_dict``'s inverse: every entry of it must be in ``state``, and nothing else."""
        if self.lora is None:
            self.model.load_state_dict(state)
            return
        result = self.model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if adapter_of(k)]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"the adapters of this stage do not match the checkpoint's: {len(missing)} missing "
                               f"(e.g. {missing[:1]}), {len(result.unexpected_keys)} unexpected (e.g. "
                               f"{result.unexpected_keys[:1]}) — it was trained with other train.lora.targets")
