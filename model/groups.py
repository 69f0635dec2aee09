"""Parameters by role, for the per-group gradient norms of the training-health diagnostics and for clipping.

A group is a function of the full model's parameter name alone (``layers.<id>.attn.wq_b.weight``), so every
pipeline stage, a shadow replica under its owner's name and a checkpoint agree on it. An unknown name is an error:
a new parameter must be given a group, not fall silently into one.

Clipping (``clip_group``): the indexer and the draft head learn only from their own losses on detached inputs
(SPEC §2, §5.4), so each is clipped by its own norm and neither loss changes how far the trunk moves.
"""
import re

from model.lora import base_parameter

GROUPS = ("embedding", "attn_q", "attn_kv", "indexer", "attn_out", "ffn", "gate", "experts", "hc", "engram",
          "norms_sinks", "head", "dspark")
CLIP_GROUPS = ("trunk", "indexer", "dspark")

_RULES = (  # first match wins; the indexer's k_norm is the indexer's, not a norm's
    ("embedding", r"embed\.weight"),
    ("head", r"head\.weight"),
    ("dspark", r"mtp\.\d+\..+"),
    ("indexer", r"layers\.\d+\.attn\.indexer\..+"),
    ("norms_sinks", r"(layers\.\d+\.(attn_norm|ffn_norm|attn\.(q_norm|kv_norm|compressor\.norm))\.weight"
                    r"|layers\.\d+\.attn\.attn_sink|norm\.weight)"),
    ("attn_q", r"layers\.\d+\.attn\.wq_[ab]\.weight"),
    ("attn_kv", r"layers\.\d+\.attn\.(wkv|compressor\.wkv|compressor\.wgate|wqkv)\.weight"),  # wqkv: dense baseline
    ("attn_out", r"layers\.\d+\.attn\.(wo_[ab]|wo)\.weight"),
    ("ffn", r"layers\.\d+\.ffn\.(shared_experts\.)?w[123]\.weight"),  # the dense FFN, and MoE's shared expert
    ("gate", r"layers\.\d+\.ffn\.gate\.weight"),
    ("experts", r"layers\.\d+\.ffn\.experts\.w[123]"),  # the routed experts, stacked
    ("hc", r"layers\.\d+\.hc_(attn|ffn)_(fn|base|scale)"),
    ("engram", r"layers\.\d+\.engram\..+"),
)


def param_group(name: str) -> str:
    """The role of parameter ``name`` (one of ``GROUPS``); a LoRA adapter's is the role of the weight it adapts."""
    name = base_parameter(name)
    for group, pattern in _RULES:
        if re.fullmatch(pattern, name):
            return group
    raise KeyError(f"parameter {name!r} has no group in model/groups.py")


def clip_group(group: str) -> str:
    """The clipping group (one of ``CLIP_GROUPS``) of a parameter group."""
    return group if group in CLIP_GROUPS else "trunk"
