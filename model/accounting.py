"""Parameter and KV-cache accounting, counted on the real modules built on the meta device.

``python -m model.accounting [overrides] [format=json]`` prints, for any model/layout config, the figures of
SPEC §5.5 (backbone parameters without the Engram tables and the draft head, the tables, the draft head, the
parameters active per token) and of SPEC §1.6: attention parameters common to every layer, what Reindex and Full layers add, all compression and
indexing parameters, compressed entries per token and inference KV-cache bytes per token; and, at a context of
``seq_len=`` tokens (default ``data.seq_len``), the lightning indexer's scoring FLOPs per token.
"""
import json
import sys
from dataclasses import dataclass

import torch

from model.attention import Attention
from model.config import ModelArgs
from model.layout import LayerPlan, Layout, Mode
from model.transformer import Transformer


@dataclass(frozen=True)
class CacheFormat:
    """Inference storage of one compressed entry (SPEC §1.6): FP4 (e2m1) values with one byte-sized scale per
    block, e4m3 per 16 values for the main KV, one per 32 for the index keys."""

    value_bits: int = 4
    main_scale_block: int = 16
    index_scale_block: int = 32

    def entry_bytes(self, width: int, scale_block: int) -> float:
        return width * self.value_bits / 8 + width / scale_block


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _attention(args: ModelArgs, mode: Mode, ratio: int) -> Attention:
    plan = LayerPlan(0, ratio, mode, kv_source=0, index_source=0)
    return Attention(args, plan, candidate_topk_blocks=1, candidate_block_size=1)


def mean_scored_entries(seq_len: int, ratio: int, cap: int | None = None) -> float:
    """Entries a query scores, averaged over the positions of one ``seq_len``-token document: the complete
    groups before it (``(t+1)//ratio``, about ``seq_len/ratio/2`` on average), at most ``cap`` when candidate
    blocks restrict the scoring (then the cost stops growing with the context)."""
    visible = torch.arange(1, seq_len + 1, dtype=torch.float64) // ratio
    if cap is not None:
        visible = visible.clamp(max=cap)
    return visible.mean().item() if seq_len else 0.0


def indexer_flops(attention: Attention, layout: Layout, seq_len: int) -> float:
    """Scoring FLOPs per token of one Full/Reindex layer: its index query projection (``wq_b`` from the shared
    ``qr``, and the head weights ``weights_proj``) plus one ``q·k`` product per index head on every scored
    entry. The index keys (once per entry, owned by the Full layer) and the top-k itself are not counted."""
    indexer, plan = attention.indexer, attention.plan
    projection = 2 * (indexer.wq_b.weight.numel() + indexer.weights_proj.weight.numel())
    cap = layout.candidate_topk_blocks * layout.candidate_block_size if plan.candidate_source is not None else None
    per_entry = 2 * indexer.n_heads * indexer.head_dim
    return projection + per_entry * mean_scored_entries(seq_len, plan.ratio, cap)


def account(args: ModelArgs, layout: Layout, seq_len: int, cache: CacheFormat = CacheFormat()) -> dict:
    with torch.device("meta"):
        model = Transformer(args, layout)
        common = _numel(_attention(args, Mode.REUSE, 1))
        extra = {(mode, m): _numel(_attention(args, mode, m)) - common
                 for mode, m in ((Mode.REINDEX, 1), (Mode.FULL, 2), (Mode.FULL, 1))}
    full_layers = [model.layers[str(p.layer_id)].attn for p in layout.plan if p.mode is Mode.FULL]
    entries = sum(1 / a.plan.ratio for a in full_layers)
    kv_bytes = sum((cache.entry_bytes(a.compressor.norm.weight.numel(), cache.main_scale_block)
                    + cache.entry_bytes(a.indexer.k_norm.weight.numel(), cache.index_scale_block)) / a.plan.ratio
                   for a in full_layers)
    selecting = [block.attn for block in model.layers.values() if block.attn.plan.selects]
    compress_index = sum(_numel(getattr(block.attn, part)) for block in model.layers.values()
                         for part in ("compressor", "indexer") if hasattr(block.attn, part))
    named = dict(model.named_parameters())
    tables = sum(p.numel() for n, p in named.items() if ".engram.embed." in n)
    dspark = sum(p.numel() for n, p in named.items() if n.startswith("mtp."))
    backbone = _numel(model) - tables - dspark
    routed = sum(p.numel() for n, p in named.items() if ".ffn.experts." in n and not n.startswith("mtp."))
    idle = routed - routed * args.moe.n_activated_experts // args.moe.n_routed_experts if routed else 0
    return {
        "params_backbone": backbone,
        "params_engram_tables": tables,
        "params_dspark": dspark,
        # what one token's forward multiplies by: the backbone less the embedding (a lookup) and the routed experts
        # it does not activate
        "params_active_per_token": backbone - named["embed.weight"].numel() - idle,
        "params_common_per_layer": common,
        "params_reindex_extra": extra[(Mode.REINDEX, 1)],
        "params_full_extra_m2": extra[(Mode.FULL, 2)],
        "params_full_extra_m1": extra[(Mode.FULL, 1)],
        "params_compress_index_total": compress_index,
        "entries_per_token": entries,
        "kv_bytes_per_token": kv_bytes,
        "params_total": _numel(model),
        "seq_len": seq_len,
        "indexer_flops_per_token": sum(indexer_flops(a, layout, seq_len) for a in selecting),
        "layers": {mode.value: n for mode, n in layout.counts().items()},
    }


def render(figures: dict) -> str:
    lines = []
    for key, value in figures.items():
        if isinstance(value, dict):
            value = ", ".join(f"{v} {k}" for k, v in value.items())
        elif isinstance(value, int):
            value = f"{value:,}  ({value / 1e6:.2f}M)" if key.startswith("params_") else f"{value:,}"
        else:
            value = f"{value:g}"
        lines.append(f"{key:<30} {value}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from model.cli import job_config, run_cli
    from model.layout import layout_from_config

    own = {"format": "table", "seq_len": None}  # this tool's arguments; every other one is a config override
    overrides = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in own:
            own[key] = value
        else:
            overrides.append(arg)
    fmt = own["format"]
    if fmt not in ("table", "json"):
        raise SystemExit(f"error: format={fmt!r}: use format=json or leave it out for a table")
    if own["seq_len"] is not None and not own["seq_len"].isdigit():
        raise SystemExit(f"error: seq_len={own['seq_len']!r}: give a number of tokens, or leave it out for data.seq_len")

    def report():
        config = job_config(overrides)
        seq_len = int(own["seq_len"] or config.data.seq_len)
        figures = account(config.model.args, layout_from_config(config.layout), seq_len)
        print(json.dumps(figures) if fmt == "json" else render(figures))

    run_cli(report)


if __name__ == "__main__":
    main(sys.argv[1:])
