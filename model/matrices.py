"""Which parameters are linear maps, and how each reads as a stack of independent matrices (for Muon).

Muon (``parallel/muon.py``) orthogonalises the update of each matrix that maps one vector space to another. Following
DeepSeek-V4's split, everything that is such a map trains with Muon, and AdamW keeps what is not: the token embedding
and the LM head (rows looked up or scored one per token, not a map), RMSNorm gains, attention sinks, the
hyper-connections' static biases and gating factors (``hc_*_base``, ``hc_*_scale``), Engram's tables and its
query/key gains, and the draft head's Markov embedding and output heads.

A parameter may hold several matrices that never mix:
- the routed experts, stacked ``[E, out, in]``: one matrix per expert;
- the grouped output projection ``wo_a``, ``[G x R, in]``: group ``g``'s heads map to its own ``R`` rows (SPEC §1.7,
  ``Attention._project_out``), so it is ``G`` matrices of ``[R, in]``.

``matrix_shape`` gives the ``(rows, columns)`` of one matrix; the parameter is then read as ``[-1, rows, columns]``.
Like ``model/groups.py`` it is a function of the full model's name alone, so every stage, expert-parallel rank and
ZeRO shard agrees on it.
"""
import math
import re

from model.config import ModelArgs
from model.lora import base_parameter

_NOT_MAPS = re.compile(  # names of 2-D or larger parameters that stay with AdamW
    r"embed\.weight|head\.weight"
    r"|layers\.\d+\.engram\.(embed\.weight|[qk]_weight)"
    r"|mtp\.\d+\.(markov_head\..+|confidence_head\..+)")
_GROUPED = re.compile(r"(layers|mtp)\.\d+\.attn\.wo_a\.weight")


def matrix_shape(name: str, shape: tuple[int, ...], args: ModelArgs) -> tuple[int, int] | None:
    """``(rows, columns)`` of each matrix parameter ``name`` (of ``shape``) holds, or None where AdamW trains it."""
    name = base_parameter(name)
    if len(shape) < 2 or _NOT_MAPS.fullmatch(name):
        return None
    if _GROUPED.fullmatch(name):
        return args.o_lora_rank, shape[-1]
    return shape[-2], shape[-1]


def rows_per_matrix(shape: tuple[int, ...], matrix: tuple[int, int]) -> int:
    """Rows (slices along dim 0) of a parameter of ``shape`` that make up one of its matrices: a shard of a parameter
    must begin and end at such a boundary, or a matrix would be orthogonalised in pieces."""
    rows, columns = matrix
    return rows * columns // math.prod(shape[1:])
