"""The extended payload of a pipeline boundary: hidden state plus exactly the shared state a later stage needs.

The schema of each boundary is planned statically from the layout's producer -> last-consumer edges and the
stage split. On the wire it is two tensors, because DeepSpeed's pipeline engine runs one backward pass per
floating-point tensor it sends and requires each to carry a gradient:
- one float tensor with every differentiable field (hidden state, with hyper-connections its copies and the
  pending pre-mix, KV latents, index keys in ``payload`` mode, student index logits, finished indexer losses), so a stage runs exactly one backward traversal. Each field
  travels in its own dtype: a bf16 field (an m = 1 latent, index keys, under autocast) is carried as its bits,
  two per fp32 slot, and its gradient comes back the same way, so it costs half of an upcast and round trips
  exactly. Packing and unpacking are one autograd function each, whose backward only moves bits (no gradient
  of a packed slot ever goes through an addition, which could turn -0.0 into +0.0 or quiet a NaN);
- one uint8 tensor with everything else, bit-for-bit (selected entries as int32, candidate blocks as int16,
  the running indexer-loss targets as fp32 bits, document and token ids, the draft head's detached features),
  led by a fingerprint of the schema that the receiver checks on its first microbatch.
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
    wire_dtype: torch.dtype  # dtype of its bits on the wire (a differentiable field's is its own)
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


def latent_dtype(ratio: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a Full layer's compressed latent in a model computing in ``dtype``: fp32 for a ratio m > 1 (its
    gated pooling runs in fp32), else the compute dtype."""
    return torch.float32 if ratio > 1 else dtype


def boundary_fields(args: ModelArgs, layout: Layout, last_layer: int, micro_batch: int, seq_len: int,
                    dtype: torch.dtype, index_k: str = "shadow", dspark: bool = False,
                    context: int = 1) -> list[Field]:
    """Fields that cross the boundary after ``last_layer``: produced at or before it, last used after it.

    ``dtype`` is the compute dtype of projections (bf16 under autocast); the plain residual stream ``h`` stays fp32
    (fp32 master weights, the embedding's dtype), and so does the latent of an m > 1 Full layer (its gated
    pooling runs in fp32). With hyper-connections ``h`` holds the copies [B,T,hc,D] in the compute dtype
    (``model.hyper.stream_dtype``) and ``pre_mix`` the pending pre-mix of the next block's attention (fp32). The token ids cross when a later layer hashes n-grams or the draft
    head trains (``dspark``: it also needs the features of its target layers up to here).

    With ``context`` > 1 ranks per row (``parallel/context.py``) a rank sends its chunk: the per-token fields hold
    ``seq_len / context`` tokens, while the ids (positions, documents and n-gram look-back are the row's) and the
    row's gathered compressed entries (every chunk's queries read them) stay whole; each rank's gradient of the
    entries comes back and the earlier stage's all-gather sums them over the chunks."""
    B, T, K = micro_batch, seq_len // context, args.index_topk
    row = seq_len
    ratio = layout.compress_ratios
    n_blocks = layout.candidate_topk_blocks
    block_id = torch.int16 if -(-row // layout.candidate_block_size) < 2 ** 15 else torch.int32
    specs = {  # name -> (shape, model dtype, wire dtype, differentiable)
        "kv": (lambda s: (B, row // ratio[s], args.head_dim), None, None, True),
        "index_k": (lambda s: (B, row // ratio[s], args.index_head_dim), dtype, None, True),
        "index_logits": (lambda s: (B, T, K), torch.float32, None, True),
        "topk": (lambda s: (B, T, K), torch.int64, torch.int32, False),
        "candidates": (lambda s: (B, T, min(n_blocks, -(-row // layout.candidate_block_size))), torch.int64,
                       block_id, False),
        "index_target": (lambda s: (B, T, K), torch.float32, torch.float32, False),
    }
    if args.hc_mult == 1:
        fields = [Field("h", None, (B, T, args.dim), torch.float32, torch.float32, True)]
    else:
        fields = [Field("h", None, (B, T, args.hc_mult, args.dim), dtype, dtype, True)]
    if args.hc_mult > 1:
        fields.append(Field("pre_mix", None, (B, T, args.hc_mult), torch.float32, torch.float32, True))
    fields.append(Field("doc_ids", None, (B, row), torch.int64, torch.int32, False))
    if dspark or any(layer > last_layer for layer in args.engram.layers):
        fields.append(Field("input_ids", None, (B, row), torch.int64, torch.int32, False))
    for (name, source), last in sorted(layout.last_use.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if source <= last_layer < last and not (name == "index_k" and index_k == "shadow"):
            shape, model_dtype, wire, diff = specs[name]
            if name == "kv":
                model_dtype = latent_dtype(ratio[source], dtype)
            fields.append(Field(name, source, shape(source), model_dtype, wire or model_dtype, diff))
    for source in layout.index_source_layer_ids:
        if max(layout.readers(source)) <= last_layer:
            fields.append(Field("indexer_loss", source, (), torch.float32, torch.float32, True))
    for layer in args.dspark.target_layers if dspark else ():
        if layer <= last_layer:  # detached: its bits, no gradient
            fields.append(Field("dspark_feature", layer, (B, T, args.dim), torch.float32, torch.float32, False))
    return fields


def _to_slots(value: torch.Tensor, dtype: torch.dtype, slots: int) -> torch.Tensor:
    """A field's values as ``slots`` elements of the float tensor's ``dtype``: itself, or its bits packed."""
    flat = value.contiguous().reshape(-1)
    if value.dtype == dtype:
        return flat
    per_slot = dtype.itemsize // value.dtype.itemsize
    return torch.nn.functional.pad(flat, (0, slots * per_slot - flat.numel())).view(dtype)


def _from_slots(slots: torch.Tensor, f: Field) -> torch.Tensor:
    """Inverse of ``_to_slots``."""
    if slots.dtype == f.wire_dtype:
        return slots.view(f.shape)
    return slots.view(f.wire_dtype)[:f.numel].view(f.shape)


class _PackFloats(torch.autograd.Function):
    """Differentiable fields -> one float tensor (bf16 fields as bits); the gradient goes back the same way."""

    @staticmethod
    def forward(ctx, payload, *values):
        ctx.payload = payload
        return torch.cat([_to_slots(v, payload.float_dtype, payload.slots(f))
                          for f, v in zip(payload.float_fields, values)])

    @staticmethod
    def backward(ctx, grad):
        payload = ctx.payload
        return None, *(_from_slots(g, f) for f, g in zip(payload.float_fields,
                                                          grad.split([payload.slots(f) for f in payload.float_fields])))


class _UnpackFloats(torch.autograd.Function):
    """One float tensor -> the differentiable fields; the gradients (zeros for unused fields) go back packed."""

    @staticmethod
    def forward(ctx, payload, floats):
        ctx.payload = payload
        return tuple(_from_slots(part, f) for f, part in
                     zip(payload.float_fields, floats.split([payload.slots(f) for f in payload.float_fields])))

    @staticmethod
    def backward(ctx, *grads):
        payload = ctx.payload
        grads = [torch.zeros(f.shape, dtype=f.wire_dtype, device=payload.device) if g is None else g
                 for f, g in zip(payload.float_fields, grads)]
        return None, torch.cat([_to_slots(g, payload.float_dtype, payload.slots(f))
                                for f, g in zip(payload.float_fields, grads)])


class Payload:
    """Packs a stage's outputs into (float tensor, uint8 tensor) and unpacks them on the next stage."""

    def __init__(self, fields: list[Field]):
        self.fields = fields
        self.fingerprint = zlib.crc32(repr([(f.name, f.source, f.shape, str(f.wire_dtype)) for f in fields]).encode())
        wire = {f.wire_dtype for f in self.float_fields}
        self.float_dtype = torch.float32 if torch.float32 in wire or len(wire) > 1 else wire.pop()
        self.device = None  # of the last unpacked payload (zero gradients of unused fields are made there)
        self._checked = False

    @property
    def float_fields(self):
        return [f for f in self.fields if f.differentiable]

    @property
    def byte_fields(self):
        return [f for f in self.fields if not f.differentiable]

    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    def slots(self, f: Field) -> int:
        """Elements of the float tensor that field ``f`` occupies."""
        return -(-f.nbytes // self.float_dtype.itemsize)

    def wire_sizes(self) -> tuple[int, int]:
        """Elements of the float tensor (``float_dtype``) and bytes of the uint8 tensor that ``pack`` makes."""
        return sum(self.slots(f) for f in self.float_fields), ALIGN + sum(f.padded_bytes for f in self.byte_fields)

    def pack(self, h: torch.Tensor, pre: torch.Tensor | None, state: SharedState) -> tuple[torch.Tensor, torch.Tensor]:
        values = {f: self._value(f, h, pre, state) for f in self.fields}
        for f in self.float_fields:
            if values[f].dtype != f.wire_dtype:
                raise RuntimeError(f"pipeline payload: field {f.name}[{f.source}] is {values[f].dtype} in the model "
                                   f"but the boundary schema carries {f.wire_dtype}")
        floats = _PackFloats.apply(self, *(values[f] for f in self.float_fields))
        header = torch.tensor([self.fingerprint], dtype=torch.int64, device=h.device).view(torch.uint8)
        chunks = [header]
        for f in self.byte_fields:
            raw = values[f].to(f.wire_dtype).contiguous().reshape(-1).view(torch.uint8)
            chunks.append(torch.nn.functional.pad(raw, (0, f.padded_bytes - f.nbytes)))
        return floats, torch.cat(chunks)

    def unpack(self, floats: torch.Tensor, raw: torch.Tensor, state_factory):
        """(stream ``h``, its pending pre-mix or None, a SharedState holding the carried fields);
        ``state_factory(doc_ids, input_ids)`` makes the state (``input_ids`` None when they do not cross)."""
        self._check(floats, raw)
        self.device = floats.device
        values = dict(zip(self.float_fields, _UnpackFloats.apply(self, floats)))
        offset = ALIGN
        for f in self.byte_fields:
            values[f] = raw[offset: offset + f.nbytes].view(f.wire_dtype).view(f.shape).to(f.dtype)
            offset += f.padded_bytes
        by_name = {(f.name, f.source): v for f, v in values.items()}
        state = state_factory(by_name.pop(("doc_ids", None)), by_name.pop(("input_ids", None), None))
        h, pre = by_name.pop(("h", None)), by_name.pop(("pre_mix", None), None)
        for (name, source), value in by_name.items():
            target = {"indexer_loss": state.indexer_losses, "dspark_feature": state.dspark_features}.get(name)
            (getattr(state, name) if target is None else target)[source] = value
        return h, pre, state

    def _value(self, f: Field, h: torch.Tensor, pre: torch.Tensor | None, state: SharedState) -> torch.Tensor:
        if f.name == "h":
            return h
        if f.name == "pre_mix":
            return pre
        if f.name == "doc_ids":
            return state.geometry.doc_ids
        if f.name == "input_ids":
            return state.input_ids
        if f.name == "dspark_feature":
            return state.dspark_features[f.source]
        if f.name == "indexer_loss":
            return state.indexer_losses[f.source]
        return getattr(state, f.name)[f.source]

    def _check(self, floats: torch.Tensor, raw: torch.Tensor) -> None:
        """Once per run: the sender packed the schema this stage expects (same layout, split and shapes)."""
        if self._checked:
            return
        want_floats, want_bytes = self.wire_sizes()
        got = int(raw[:ALIGN].view(torch.int64)[0]) if raw.numel() >= ALIGN else None
        if floats.numel() != want_floats or raw.numel() != want_bytes or got != self.fingerprint:
            raise RuntimeError(
                f"pipeline payload mismatch: expected {want_floats} floats + {want_bytes} bytes with schema "
                f"fingerprint {self.fingerprint}, received {floats.numel()} floats + {raw.numel()} bytes with "
                f"fingerprint {got}; all stages must be built from the same layout, split and seq_len")
        self._checked = True
