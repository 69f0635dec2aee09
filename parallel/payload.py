"""The extended payload of a pipeline boundary: hidden state plus exactly the shared state a later stage needs.

The schema of each boundary is planned statically from the layout's producer -> last-consumer edges and the
stage split. On the wire it is two tensors, because DeepSpeed's pipeline engine runs one backward pass per
floating-point tensor it sends and requires each to carry a gradient:
- one float tensor with every differentiable field (hidden state, KV latents, index keys in ``payload`` mode,
  student index logits, finished indexer losses), so a stage runs exactly one backward traversal;
- one uint8 tensor with everything else, bit-for-bit (selected entries as int32, candidate blocks as int16,
  the running indexer-loss targets as fp32 bits, document ids), led by a fingerprint of the schema that the
  receiver checks on its first microbatch.
"""
import zlib
from dataclasses import dataclass

import torch

from model.config import ModelArgs
from model.layout import Layout
from model.state import SharedState

ALIGN = 8  # bytes: every field starts aligned so that a byte slice can be viewed as its dtype


@dataclass(frozen=True)
class Field:
    name: str  # h | doc_ids | indexer_loss | one of model.state.FIELDS
    source: int | None  # producing layer
    shape: tuple[int, ...]
    dtype: torch.dtype  # dtype in the model
    wire_dtype: torch.dtype  # dtype on the wire
    differentiable: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.wire_dtype.itemsize

    @property
    def padded_bytes(self) -> int:
        return -(-self.nbytes // ALIGN) * ALIGN


def boundary_fields(args: ModelArgs, layout: Layout, last_layer: int, micro_batch: int, seq_len: int,
                    dtype: torch.dtype, index_k: str = "shadow") -> list[Field]:
    """Fields that cross the boundary after ``last_layer``: produced at or before it, last used after it.

    ``dtype`` is the compute dtype of projections (bf16 under autocast); the residual stream ``h`` stays fp32
    (fp32 master weights, the embedding's dtype)."""
    B, T, K = micro_batch, seq_len, args.index_topk
    ratio = layout.compress_ratios
    n_blocks = layout.candidate_topk_blocks
    block_id = torch.int16 if -(-T // layout.candidate_block_size) < 2 ** 15 else torch.int32
    specs = {  # name -> (shape, model dtype, wire dtype, differentiable)
        "kv": (lambda s: (B, T // ratio[s], args.head_dim), dtype, None, True),
        "index_k": (lambda s: (B, T // ratio[s], args.index_head_dim), dtype, None, True),
        "index_logits": (lambda s: (B, T, K), torch.float32, None, True),
        "topk": (lambda s: (B, T, K), torch.int64, torch.int32, False),
        "candidates": (lambda s: (B, T, min(n_blocks, -(-T // layout.candidate_block_size))), torch.int64,
                       block_id, False),
        "index_target": (lambda s: (B, T, K), torch.float32, torch.float32, False),
    }
    fields = [Field("h", None, (B, T, args.dim), torch.float32, None, True),
              Field("doc_ids", None, (B, T), torch.int64, torch.int32, False)]
    for (name, source), last in sorted(layout.last_use.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if source <= last_layer < last and not (name == "index_k" and index_k == "shadow"):
            shape, model_dtype, wire, diff = specs[name]
            fields.append(Field(name, source, shape(source), model_dtype, wire, diff))
    for source in layout.index_source_layer_ids:
        if max(layout.readers(source)) <= last_layer:
            fields.append(Field("indexer_loss", source, (), torch.float32, None, True))
    float_wire = torch.float32 if any(f.differentiable and f.dtype == torch.float32 for f in fields) else dtype
    return [f if f.wire_dtype is not None else Field(f.name, f.source, f.shape, f.dtype, float_wire, True)
            for f in fields]


class Payload:
    """Packs a stage's outputs into (float tensor, uint8 tensor) and unpacks them on the next stage."""

    def __init__(self, fields: list[Field]):
        self.fields = fields
        self.fingerprint = zlib.crc32(repr([(f.name, f.source, f.shape, str(f.wire_dtype)) for f in fields]).encode())
        self._checked = False

    @property
    def float_fields(self):
        return [f for f in self.fields if f.differentiable]

    @property
    def byte_fields(self):
        return [f for f in self.fields if not f.differentiable]

    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    def pack(self, h: torch.Tensor, state: SharedState) -> tuple[torch.Tensor, torch.Tensor]:
        values = {f: self._value(f, h, state) for f in self.fields}
        floats = torch.cat([values[f].to(f.wire_dtype).reshape(-1) for f in self.float_fields])
        header = torch.tensor([self.fingerprint], dtype=torch.int64, device=h.device).view(torch.uint8)
        chunks = [header]
        for f in self.byte_fields:
            raw = values[f].to(f.wire_dtype).contiguous().reshape(-1).view(torch.uint8)
            chunks.append(torch.nn.functional.pad(raw, (0, f.padded_bytes - f.nbytes)))
        return floats, torch.cat(chunks)

    def unpack(self, floats: torch.Tensor, raw: torch.Tensor, state_factory) -> tuple[torch.Tensor, SharedState]:
        """(hidden state, a SharedState holding the carried fields); ``state_factory(doc_ids)`` makes the state."""
        self._check(floats, raw)
        values, offset = {}, 0
        for f in self.float_fields:
            values[f] = floats[offset: offset + f.numel].view(f.shape).to(f.dtype)
            offset += f.numel
        offset = ALIGN
        for f in self.byte_fields:
            values[f] = raw[offset: offset + f.nbytes].view(f.wire_dtype).view(f.shape).to(f.dtype)
            offset += f.padded_bytes
        by_name = {(f.name, f.source): v for f, v in values.items()}
        state = state_factory(by_name.pop(("doc_ids", None)))
        h = by_name.pop(("h", None))
        for (name, source), value in by_name.items():
            target = state.indexer_losses if name == "indexer_loss" else getattr(state, name)
            target[source] = value
        return h, state

    def _value(self, f: Field, h: torch.Tensor, state: SharedState) -> torch.Tensor:
        if f.name == "h":
            return h
        if f.name == "doc_ids":
            return state.geometry.doc_ids
        if f.name == "indexer_loss":
            return state.indexer_losses[f.source]
        return getattr(state, f.name)[f.source]

    def _check(self, floats: torch.Tensor, raw: torch.Tensor) -> None:
        """Once per run: the sender packed the schema this stage expects (same layout, split and shapes)."""
        if self._checked:
            return
        want_floats = sum(f.numel for f in self.float_fields)
        want_bytes = ALIGN + sum(f.padded_bytes for f in self.byte_fields)
        got = int(raw[:ALIGN].view(torch.int64)[0]) if raw.numel() >= ALIGN else None
        if floats.numel() != want_floats or raw.numel() != want_bytes or got != self.fingerprint:
            raise RuntimeError(
                f"pipeline payload mismatch: expected {want_floats} floats + {want_bytes} bytes with schema "
                f"fingerprint {self.fingerprint}, received {floats.numel()} floats + {raw.numel()} bytes with "
                f"fingerprint {got}; all stages must be built from the same layout, split and seq_len")
        self._checked = True
