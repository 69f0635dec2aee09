"""Parameters by role, for the per-group gradient norms of the training-health diagnostics.

A group is a function of the full model's parameter name alone (``layers.<id>.attn.wq_b.weight``), so every
pipeline stage, a shadow replica under its owner's name and a checkpoint agree on it. An unknown name is an error:
a new parameter must be given a group, not fall silently into one.
"""
import re

GROUPS = ("embedding", "attn_q", "attn_kv", "indexer", "attn_out", "ffn", "norms_sinks", "head")

_RULES = (  # first match wins; the indexer's k_norm is the indexer's, not a norm's
    ("embedding", r"embed\.weight"),
    ("head", r"head\.weight"),
    ("indexer", r"layers\.\d+\.attn\.indexer\..+"),
    ("norms_sinks", r"(layers\.\d+\.(attn_norm|ffn_norm|attn\.(q_norm|kv_norm|compressor\.norm))\.weight"
                    r"|layers\.\d+\.attn\.attn_sink|norm\.weight)"),
    ("attn_q", r"layers\.\d+\.attn\.wq_[ab]\.weight"),
    ("attn_kv", r"layers\.\d+\.attn\.(wkv|compressor\.wkv|compressor\.wgate|wqkv)\.weight"),  # wqkv: dense baseline
    ("attn_out", r"layers\.\d+\.attn\.(wo_[ab]|wo)\.weight"),
    ("ffn", r"layers\.\d+\.ffn\.w[123]\.weight"),
)


def param_group(name: str) -> str:
    """The role of parameter ``name`` (one of ``GROUPS``)."""
    for group, pattern in _RULES:
        if re.fullmatch(pattern, name):
            return group
    raise KeyError(f"parameter {name!r} has no group in model/groups.py")
