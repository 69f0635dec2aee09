"""CSA2 attention: window-only, Full, Reindex and Reuse layers (SPEC §1).

Every layer owns its query (low-rank), its sliding-window KV, its sink and its grouped output projection. A Full
layer also owns the compressor (main KV) and the whole indexer; a Reindex layer only the indexer's query side.
Shared tensors come in and go out as explicit arguments (the block moves them to and from the forward's
``SharedState``), never through module attributes.
"""
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from model.config import ModelArgs
from model.context import gather_entries, with_window_halo
from model.geometry import EntryGeometry, Geometry, Groups, TokenGeometry
from model.layout import LayerPlan, Mode
from model.norm import RMSNorm
from model.projection import Linear, finish_parts
from model.rope import Rotary
from model.weights import grouped_low_rank, linear as weight_linear, matmul_weights
from model.weights import GroupedLowRank  # noqa: F401 (the grouped output projection's op, named here as before)


def linear(dim_in: int, dim_out: int) -> Linear:
    return Linear(dim_in, dim_out)


class Compressor(nn.Module):
    """Main KV of a Full layer: softmax-gated pooling of each complete group of m tokens, then RMSNorm.

    Returns the pre-RoPE latent (the index keys are projected from it); RoPE is applied by the readers."""

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = linear(args.dim, args.head_dim)
        self.wgate = linear(args.dim, args.head_dim) if ratio > 1 else None
        self.norm = RMSNorm(args.head_dim, args.norm_eps, args.kernel_backend)

    def forward(self, x: torch.Tensor, entries: EntryGeometry | Groups) -> torch.Tensor:
        """The entries of the groups ``entries`` names (``first_token`` into x, ``valid``), [B, n, head_dim]."""
        if self.ratio == 1:  # one entry per token, stored in token order
            return self.norm(self.wkv(x))
        dtype = torch.promote_types(x.dtype, torch.float32)  # the gated pooling runs in (at least) fp32
        group = entries.first_token.unsqueeze(-1) + torch.arange(self.ratio, device=x.device)  # [B,S,m]
        rows = group.flatten(1).unsqueeze(-1).expand(-1, -1, x.shape[-1])
        xg = x.to(dtype).gather(1, rows).view(*group.shape, x.shape[-1])  # [B,S,m,dim]
        content = F.linear(xg, self.wkv.weight.to(dtype))
        gate = F.linear(xg, self.wgate.weight.to(dtype))
        pooled = (gate.softmax(dim=2) * content).sum(2) * entries.valid.unsqueeze(-1)
        return self.norm(pooled).to(x.dtype)


class IndexKeys(nn.Module):
    """Index-key projection of a Full layer's KV: ``RoPE(k_norm(wk(latent)))`` from the detached pre-RoPE latent.

    Owned by the Full layer's indexer; a pipeline stage that needs the keys of a Full layer living on another
    stage holds a replica of this module (a shadow indexer) and recomputes them from the carried latent."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.wk = linear(args.head_dim, args.index_head_dim)
        self.k_norm = RMSNorm(args.index_head_dim, args.norm_eps, args.kernel_backend)

    def forward(self, latent: torch.Tensor, rotary: Rotary, entries: EntryGeometry) -> torch.Tensor:
        return index_keys(self, latent, rotary, entries)


def index_keys(owner: nn.Module, latent: torch.Tensor, rotary: Rotary, entries: EntryGeometry) -> torch.Tensor:
    """``RoPE(k_norm(wk(latent)))`` with the ``wk``/``k_norm`` of ``owner`` (an Indexer or its IndexKeys replica)."""
    return owner.k_norm(owner.wk(latent.detach()), rotary, entries)


class Indexer(nn.Module):
    """Lightning indexer. Its inputs are detached: it learns only from the indexer KL (SPEC §2).

    A Full layer's indexer also owns the index-key projection (``wk``, ``k_norm``) of its KV."""

    def __init__(self, args: ModelArgs, owns_keys: bool):
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.wq_b = linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim)
        self.weights_proj = linear(args.dim, args.index_n_heads)
        if owns_keys:  # registered as wk / k_norm directly so that names read like the reference weights
            keys = IndexKeys(args)
            self.wk, self.k_norm = keys.wk, keys.k_norm

    def keys(self, latent: torch.Tensor, rotary: Rotary, entries: EntryGeometry) -> torch.Tensor:
        return index_keys(self, latent, rotary, entries)

    def queries(self, x, qr, rotary: Rotary, tokens: TokenGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        q = rotary(self.wq_b(qr.detach()).view(B, T, self.n_heads, self.head_dim), tokens)
        weights = self.weights_proj(x.detach()) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return q, weights


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, plan: LayerPlan, candidate_topk_blocks: int, candidate_block_size: int):
        super().__init__()
        self.plan, self.args = plan, args
        self.candidate_topk_blocks, self.candidate_block_size = candidate_topk_blocks, candidate_block_size
        H, D = args.n_heads, args.head_dim
        self.wq_a = linear(args.dim, args.q_lora_rank)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps, args.kernel_backend)
        self.wq_b = linear(args.q_lora_rank, H * D)
        self.wkv = linear(args.dim, D)
        self.kv_norm = RMSNorm(D, args.norm_eps, args.kernel_backend)
        self.wo_a = linear(H * D // args.o_groups, args.o_groups * args.o_lora_rank)
        self.wo_b = linear(args.o_groups * args.o_lora_rank, args.dim)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        if plan.mode is Mode.FULL:
            self.compressor = Compressor(args, plan.ratio)
        if plan.selects:
            self.indexer = Indexer(args, owns_keys=plan.mode is Mode.FULL)
        self.rotary = Rotary.for_layer(args, compressed=plan.mode is not Mode.WINDOW)
        # The activations the served model quantises (SPEC §6), read through modules named for them: the identity
        # here, their served grid once model/qat.py's converter has replaced them (model.qat).
        self.served_window_kv, self.served_compressed_kv, self.served_index = (nn.Identity() for _ in range(3))

    def forward(self, x: torch.Tensor, geometry: Geometry,
                reads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Pure function of its inputs (so activation recomputation may re-run it): ``reads`` holds the shared
        tensors this layer consumes (``SharedState.reads``), the returned dict those it produces."""
        B, T, _ = x.shape
        args, tokens = self.args, geometry.tokens
        w_in, wq_b, wo_a, wo_b = matmul_weights([(self.wq_a, self.wkv), self.wq_b, self.wo_a, self.wo_b],
                                                args.kernel_backend)
        q_low, kv = finish_parts((self.wq_a, self.wkv), weight_linear(x, w_in), x)  # wq_a and wkv: one GEMM
        qr = self.q_norm(q_low)
        # q's RoPE is applied in the attention
        q = self.wq_b.finish(weight_linear(qr, wq_b), qr).view(B, T, args.n_heads, args.head_dim)
        kv_window = self.served_window_kv(self.kv_norm(kv, self.rotary, tokens))
        kv_comp, topk, produced = None, None, {}
        if self.plan.mode is not Mode.WINDOW:
            kv_comp, topk, produced = self._compressed(x, qr, geometry, reads, q.dtype)
        out, selected_mass = self.attend(q, kv_window, kv_comp, topk, geometry)
        if topk is not None:
            produced["selected_mass"] = selected_mass
        return self._project_out(out, wo_a, wo_b), produced

    def _compressed(self, x: torch.Tensor, qr: torch.Tensor, geometry: Geometry, reads: dict[str, torch.Tensor],
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(kv_comp, topk, produced)``: the compressed entries this layer reads (RoPE'd, in the queries' ``dtype``,
        on their served grid), the selection they are read through, and what the layer produces: a Full layer's KV
        and index keys, a selecting layer's selection."""
        plan, entries, produced = self.plan, geometry.entries(self.plan.ratio), {}
        if plan.mode is Mode.FULL:
            latent = produced["kv"] = self.compressor(x, entries) if geometry.context is None else \
                self._chunk_entries(x, entries, geometry.context)
            index_k = produced["index_k"] = self.indexer.keys(latent, self.rotary, entries)
        else:
            latent, index_k = reads["kv"], reads.get("index_k")
        if plan.selects:
            produced.update(self._select(x, qr, geometry.tokens, entries, index_k, reads.get("candidates")))
        topk = produced["topk"] if plan.selects else reads["topk"]
        # one dtype for the kernels: under bf16 autocast an m > 1 compressor's latent is fp32 (fp32 pooling)
        return self.served_compressed_kv(self.rotary(latent, entries, out_dtype=dtype)), topk, produced

    def attend(self, q: torch.Tensor, kv_window: torch.Tensor, kv_comp: torch.Tensor | None,
               topk: torch.Tensor | None, geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, selected_mass)``: the sink-softmax attention of the queries (RoPE applied here) over their window
        and their ``topk`` compressed entries, and the head-summed probability of each selected entry (None
        without a selection, or while recomputing). Evaluation diagnostics wrap it (``model/diagnostics.py``)."""
        args, context, T = self.args, geometry.context, q.shape[1]
        rotation = self.rotary.rotation(geometry.tokens, torch.promote_types(q.dtype, torch.float32))
        operands = q, kv_window, geometry.window_lo, topk, rotation
        if context is not None:
            operands = with_window_halo(context, args.window_size, *operands, geometry.start)
        q, kv_window, win_lo, topk, rotation = operands
        out, selected_mass = kernels.ops(args.kernel_backend, q.device).sparse_attention(
            q, kv_window, win_lo, kv_comp, topk, self.attn_sink, args.head_dim ** -0.5, args.window_size, rotation,
            with_mass=not kernels.recomputing())
        if context is not None:  # drop the halo's placeholder queries
            out = out[:, -T:]
            selected_mass = selected_mass[:, -T:] if selected_mass is not None else None
        return out, selected_mass

    def _chunk_entries(self, x: torch.Tensor, entries: EntryGeometry, context) -> torch.Tensor:
        """The row's entries under context parallelism: this chunk pools the groups completing in it (with the
        previous chunk's last m - 1 input rows in front, for a group that straddles the border), then every
        chunk's are gathered."""
        m = self.plan.ratio
        x_groups = x if m == 1 else torch.cat([context.halo(x, m - 1), x], dim=1)
        return gather_entries(context, self.compressor(x_groups, entries.own), entries)

    def _select(self, x, qr, tokens: TokenGeometry, entries: EntryGeometry, index_k,
                candidates) -> dict[str, torch.Tensor]:
        """Top-k selection of this Full/Reindex layer (and candidate blocks if it is the candidate source)."""
        ops = kernels.ops(self.args.kernel_backend, x.device)
        q_index, weights = self.indexer.queries(x, qr, self.rotary, tokens)
        q_index, index_k = self.served_index(q_index), self.served_index(index_k)
        topk, blocks = ops.indexer_select(
            q_index, weights, index_k, entries.vis_lo, entries.vis_hi, self.args.index_topk,
            cand_blocks=candidates, block_size=self.candidate_block_size,
            keep_blocks=self.candidate_topk_blocks if self.plan.makes_candidates else 0)
        selection = {"topk": topk, "index_logits": ops.index_logits(q_index, weights, index_k, topk)}
        if blocks is not None:
            selection["candidates"] = blocks
        return selection

    def _project_out(self, out: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output: each group of heads -> o_lora_rank by its own slice of wo_a, then wo_b; each
        product finished by its layer (wo_a's, [G, R, N], on the grouped rows)."""
        B, T = out.shape[:2]
        grouped = out.reshape(B * T, self.args.o_groups, -1)
        low_t = self.wo_a.finish(grouped_low_rank(grouped, wo_a, self.args.o_lora_rank), grouped)
        low = low_t.reshape(-1, B * T).t()
        return self.wo_b.finish(weight_linear(low, wo_b), low).view(B, T, -1)
