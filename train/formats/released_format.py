"""DeepSeek's released V4.1 weights (SPEC §6): its ``config.json`` and its FP8 / FP4 safetensors shards, read a
rank's share at a time and written back.

The tensor names are the reference inference code's, which are ours (``layers.3.attn.wq_a.weight``,
``layers.3.ffn.experts.17.w1.weight``, ``mtp.0.main_proj.weight``); a quantised matrix has its e8m0 scales beside
it as ``<name without .weight>.scale``. What is stored how (``storage``): FP8 e4m3 in 32 x 32 blocks for the
attention projections (``wq_a, wq_b, wkv, wo_a, wo_b``; the reference dequantises ``wo_a`` to bf16 when it
loads), ``indexer.wq_b``, the shared experts, ``engram.wkv`` and the draft head's ``main_proj``; FP4 e2m1 in rows
of 32 (two codes a byte, stored as int8) for the routed experts; FP8 in rows of 32 for the Engram tables; the rest
plain (fp32: ``attn_sink``, ``hc_*``, ``ffn.gate.bias``; bf16 otherwise). The multimodal model's tensors
(``vision.*``, ``aligner.*``, ``image_*``, the image routing bias ``ffn.gate.bias_vl``) are not part of this model:
they are listed as ignored, and an export with the released directory as its source copies them back unchanged.

``config.json`` is Hugging Face's (``text_config`` with its names: ``hidden_size``, ``num_experts_per_tok``,
``rope_scaling``, ...; ``quantization_config``; ``vision_config``), or the inference code's flat ``config.json``
(``dim``, ``n_activated_experts``, ``dtype: fp8``, ...), read and written by ``model/deepseek_config.py``.
"""
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.deepseek_config import CONFIG, INDEX, WEIGHTS, reference_fields
from model.quant import BLOCK_FP8, BLOCK_ROW, dequantize, quantize, scale_shape
from model.quantized_base import quantized_form
from train.formats.parallel_read import Span, read_in_order
from train.formats.reference_format import SHARD, _file_mode, write_json

log = logging.getLogger(__name__)

# The multimodal model's tensors: listed as ignored, copied back unchanged by an export over the release.
VISION = re.compile(r"(vision\.|aligner\.|image_)|.*\.bias_vl$")


# ------------------------------------------------------------------------------------------------ tensors

@dataclass(frozen=True)
class Storage:
    """How the release stores a tensor: ``fmt`` fp8 / fp4 with e8m0 scales in blocks of ``block``, or plain."""
    fmt: str | None
    block: tuple[int, int] | None
    dtype: torch.dtype  # of the stored values (plain); the codes' for fp8 / fp4


FP32_TENSORS = re.compile(r".*(\.attn_sink|\.hc_\w+|\.ffn\.gate\.bias)")


def storage(name: str) -> Storage:
    """The stored form of our tensor ``name`` in the release (the module docstring's table;
    ``model.quantized_base.quantized_form`` for the quantised ones)."""
    form = quantized_form(name)
    if form is not None:
        return Storage(*form, torch.float8_e4m3fn if form[0] == "fp8" else torch.int8)
    return Storage(None, None, torch.float32 if FP32_TENSORS.fullmatch(name) else torch.bfloat16)


def scale_name(name: str) -> str:
    return name.removesuffix(".weight") + ".scale"


def block_of(name: str, packed: bool) -> tuple[int, int]:
    """The scale blocks of a quantised tensor: rows of 32 for packed FP4 and the Engram tables, else 32 x 32."""
    return BLOCK_ROW if packed or name.endswith("engram.embed.weight") else BLOCK_FP8


DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "U8": torch.uint8, "F4": torch.float4_e2m1fn_x2}
PACKED = ("I8", "U8", "F4")  # fp4 codes, two a byte


@dataclass
class Entry:
    file: str
    dtype: str
    shape: list[int]
    offsets: tuple[int, int]  # of its bytes after the header, which ends at byte ``data_start`` of the file
    data_start: int


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file from its header (8-byte length, JSON), each checked to lie inside the
    file: a truncated shard is an error naming the first tensor it cut."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or length > size - 8:
            raise ValueError(f"{path} is not a safetensors file (its header is cut: {size} bytes)")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    entries = {name: Entry(path.name, h["dtype"], h["shape"], tuple(h["data_offsets"]), 8 + length)
               for name, h in header.items()}
    for name, entry in sorted(entries.items(), key=lambda item: item[1].offsets[1]):
        if 8 + length + entry.offsets[1] > size:
            raise ValueError(f"{path} is truncated: tensor {name} ends at byte {8 + length + entry.offsets[1]}, the "
                             f"file has {size} bytes — download that shard again")
    return entries


class ReleasedWeights:
    """The tensors of a released directory, read lazily: shapes (the dequantised ones) from the headers, a rank's
    tensors and row ranges when asked, dequantised into the asked dtype. ``bytes_read`` counts the stored bytes
    read (codes and scales), so a test can see that a rank read only its share."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.description = f"released weights {directory}"
        self.source_config = json.loads((directory / CONFIG).read_text())
        self.config, self.ignored_fields = reference_fields(self.source_config)
        index = directory / INDEX
        mapping = json.loads(index.read_text())["weight_map"] if index.is_file() else None
        self.entries: dict[str, Entry] = {}
        for file in sorted(set(mapping.values())) if mapping else [WEIGHTS]:
            if not (directory / file).is_file():
                raise ValueError(f"{index} names {file}, which is not in {directory}")
            self.entries.update(read_header(directory / file))
        if mapping is not None:
            for name, file in mapping.items():
                if name not in self.entries or self.entries[name].file != file:
                    where = self.entries[name].file if name in self.entries else "no shard"
                    raise ValueError(f"{index} puts tensor {name} in {file}, but {where} holds it — the index and "
                                     "the shards are of different downloads")
            extra = sorted(set(self.entries) - set(mapping))
            if extra:
                raise ValueError(f"shard {self.entries[extra[0]].file} holds tensor {extra[0]}, which {index} does "
                                 f"not list ({len(extra)} such) — the index and the shards are of different "
                                 "downloads")
        self.ignored = sorted(n for n in self.entries if VISION.match(n))
        self.weight_map = {name: entry.file for name, entry in self.entries.items()}
        self.bytes_read = 0

    def names(self) -> list[str]:
        """Our tensor names in the directory (scales are part of their matrix; the vision tensors left out)."""
        return [n for n in self.entries if not n.endswith(".scale") and n not in self.ignored]

    def shapes(self) -> dict[str, torch.Size]:
        return {name: self._shape(name) for name in self.names()}

    def _shape(self, name: str) -> torch.Size:
        """The dequantised shape of ``name``; its scale's shape checked against it."""
        entry = self.entries[name]
        scale = self.entries.get(scale_name(name))
        if scale is None:
            return torch.Size(entry.shape)
        packed = entry.dtype in PACKED
        if not packed and entry.dtype != "F8_E4M3" or scale.dtype != "F8_E8M0":
            raise ValueError(f"tensor {name} in {entry.file} is {entry.dtype} with a {scale.dtype} scale: the release "
                             "stores F8_E4M3 or packed FP4 (I8) codes with F8_E8M0 scales")
        shape = torch.Size([entry.shape[0], entry.shape[1] * (2 if packed else 1)])
        expected = scale_shape(shape, block_of(name, packed))
        if tuple(scale.shape) != expected:
            raise ValueError(f"tensor {scale_name(name)} in {scale.file} has shape {scale.shape}; {name} "
                             f"{list(shape)} needs {list(expected)} — the shard does not match its index")
        return shape

    def stored_bytes(self, name: str, rows: tuple[int, int] | None = None) -> int:
        """Bytes of codes and scales ``load`` reads for ``name`` (only rows ``[start, stop)`` of it)."""
        total = 0
        for part in (name, scale_name(name)):
            entry = self.entries.get(part)
            if entry is not None:
                size = entry.offsets[1] - entry.offsets[0]
                total += size if rows is None else size // max(entry.shape[0], 1) * (rows[1] - rows[0])
        return total

    def load(self, names, dtype: torch.dtype = torch.float32, rows: dict[str, tuple[int, int]] | None = None,
             device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """``names`` dequantised into ``dtype``; ``rows[name] = (start, stop)`` reads only those rows of it (an
        Engram table's shard). Only the asked bytes are read, by several threads at once
        (``train/formats/parallel_read.py``). ``device``: where the stored bytes go before they are decoded (a GPU
        decodes them at memory speed; the host took 13.8 of a V4.1 slice's 27 s import on the FP4 experts alone);
        default the host."""
        return {name: codes.to(dtype) if scale is None else dequantize(codes, scale, fmt, block, dtype)
                for name, (codes, scale, fmt, block) in self.load_stored(names, rows, device).items()}

    def load_stored(self, names, rows: dict[str, tuple[int, int]] | None = None,
                    device: torch.device | None = None) -> dict[str, tuple]:
        """``names`` as stored, onto ``device``: ``(codes, scale, fmt, block)`` of a quantised tensor (fp8 codes;
        fp4 codes packed two a byte, as stored), ``(values, None, None, None)`` of a plain one; ``rows`` as
        ``load``'s. Nothing is decoded (a base held quantised, ``train.lora.quantized_base``)."""
        rows, names = rows or {}, list(names)
        in_file_order = sorted(names, key=lambda name: (self.entries[name].file, self.entries[name].offsets))
        parts = [[name] + ([scale_name(name)] if scale_name(name) in self.entries else []) for name in in_file_order]
        for part in parts:
            if len(part) == 2 and rows.get(part[0]) is not None and block_of(part[0], self._packed(part[0]))[0] != 1:
                raise ValueError(f"tensor {part[0]}: rows of a matrix in 32 x 32 blocks are not read apart")
        out = {}
        requests = ([self._span(p, rows.get(part[0])) for p in part] for part in parts)
        for part, buffers in zip(parts, read_in_order(requests)):
            codes, *scale = [self._typed(p, b, rows.get(part[0])).to(device) for p, b in zip(part, buffers)]
            self.bytes_read += sum(b.numel() for b in buffers)
            if not scale:
                out[part[0]] = (codes, None, None, None)
            else:
                packed = self._packed(part[0])
                out[part[0]] = (codes, scale[0], "fp4" if packed else "fp8", block_of(part[0], packed))
        return {name: out[name] for name in names}

    def _packed(self, name: str) -> bool:
        return self.entries[name].dtype in PACKED

    def _span(self, name: str, rows: tuple[int, int] | None) -> Span:
        """Where ``name``'s bytes (only rows ``[start, stop)`` of them) lie in its file."""
        entry = self.entries[name]
        start, stop = entry.offsets
        if rows is not None:
            row = (stop - start) // max(entry.shape[0], 1)
            start, stop = start + rows[0] * row, start + rows[1] * row
        return Span(self.directory / entry.file, entry.data_start + start, stop - start)

    def _typed(self, name: str, data: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
        """The bytes read of ``name`` as its stored dtype and shape (its rows ``[start, stop)`` only)."""
        entry = self.entries[name]
        shape = [rows[1] - rows[0], *entry.shape[1:]] if rows is not None else entry.shape
        return data.view(DTYPES[entry.dtype]).view(shape)

    def stored(self, names) -> dict[str, torch.Tensor]:
        """The stored tensors themselves (codes, scales, vision tensors), for an export to keep or copy them."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.entries[name].file, []).append(name)
        out = {}
        for file, wanted in by_file.items():
            with safe_open(str(self.directory / file), framework="pt") as handle:
                out.update({name: handle.get_tensor(name) for name in wanted})
        return out


# ------------------------------------------------------------------------------------------------ writing

def released_tensors(name: str, value: torch.Tensor, source: ReleasedWeights | None) -> tuple[dict, dict | None]:
    """Our tensor ``name`` in the released form: ``{name: codes or value, scale name: scale}``, and the
    quantisation report of a quantised one (``None`` for plain tensors). A source holding ``name`` gives the stored
    form (plain or quantised, its dtype) and the scales to keep: every block they still represent exactly (an
    untrained block) is written byte for byte as it was."""
    form, stored = storage(name), source.entries.get(name) if source is not None else None
    if stored is not None and source._shape(name) != value.shape:  # another model's tensor: written afresh
        stored = None
    scale = source.entries.get(scale_name(name)) if stored is not None else None
    dtype = DTYPES[stored.dtype] if stored is not None else form.dtype
    if (form.fmt is None and stored is None) or (stored is not None and scale is None):
        return {name: value.to(dtype)}, None
    packed = stored.dtype in PACKED if stored is not None else form.fmt == "fp4"
    fmt, block = "fp4" if packed else "fp8", block_of(name, packed)
    keep = source.stored([scale_name(name)])[scale_name(name)] if scale is not None else None
    codes, scales = quantize(value, fmt, block, keep)
    back, ref = dequantize(codes, scales, fmt, block), value.float()
    error = back - ref
    report = {"format": fmt, "exact": bool(torch.equal(back, ref)),
              "rel_rms_error": (error.norm() / ref.norm().clamp_min(1e-30)).item(),
              "max_abs_error": error.abs().max().item() if error.numel() else 0.0,
              "blocks_rescaled": None if keep is None else
              int((scales.view(torch.uint8) != keep.view(torch.uint8)).sum())}
    return {name: codes.view(dtype) if packed else codes, scale_name(name): scales}, report


def shard_plan(state: dict[str, torch.Tensor], source: ReleasedWeights | None,
               max_shard_bytes: int) -> dict[str, list[str]]:
    """file -> the tensors (our names; the source's vision tensors) written to it: the source's shard of every
    tensor it has; the others in shards of at most ``max_shard_bytes`` (stored size), ``model-0000i-of-0000N``
    (``model-extra-0000i`` beside a source's shards)."""
    plan, rest = {}, []
    for name in [*state, *(source.ignored if source is not None else ())]:
        file = source.weight_map.get(name) if source is not None else None
        if file is None:
            rest.append(name)
        else:
            plan.setdefault(file, []).append(name)
    chunks, size = [], 0
    for name in rest:
        form = storage(name)
        nbytes = state[name].numel() * (1 if form.fmt == "fp8" else 0.5 if form.fmt == "fp4" else form.dtype.itemsize)
        if not chunks or size + nbytes > max_shard_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(name)
        size += nbytes
    for i, chunk in enumerate(chunks):
        file = f"model-extra-{i + 1:05d}.safetensors" if source is not None else SHARD.format(index=i + 1,
                                                                                              count=len(chunks))
        plan[file] = chunk
    return plan


def write_released(state: dict[str, torch.Tensor], out_dir: Path, source: ReleasedWeights | None = None,
                   max_shard_bytes: int = 5 * 10**9) -> tuple[list[str], dict]:
    """Write ``state`` (our names) in the released format with its index; returns (files written, per-tensor
    quantisation report). With ``source`` (the released directory the run started from): its shards, dtypes and
    scales, and its tensors this model does not have (vision) copied unchanged. One shard is held at a time."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report, weight_map, mode, total = {}, {}, _file_mode(), 0
    plan = shard_plan(state, source, max_shard_bytes)
    for stale in [*out_dir.glob("model-*.safetensors"), out_dir / WEIGHTS]:
        if stale.name not in plan and stale.exists():
            stale.unlink()  # an earlier export's: the directory never mixes two exports' shards
    for file, members in plan.items():
        tensors = source.stored([n for n in members if n not in state]) if source is not None else {}
        for name in (n for n in members if n in state):
            written, quality = released_tensors(name, state[name], source)
            tensors.update(written)
            if quality is not None:
                report[name] = quality
        tmp = out_dir / f".{file}.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, mode)  # safetensors creates its files private (0600); these are for other tools to read
        os.replace(tmp, out_dir / file)
        weight_map.update({name: file for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(out_dir / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    return [*plan, INDEX], report


def quantisation_table(report: dict, limit: int = 20) -> str:
    """The export's report as lines: how many tensors came out exact (untrained), and the largest errors."""
    inexact = sorted(((v["rel_rms_error"], n) for n, v in report.items() if not v["exact"]), reverse=True)
    lines = [f"quantised tensors: {len(report)}, exact (every block as the source, or on the grid): "
             f"{len(report) - len(inexact)}, requantised: {len(inexact)}"]
    if inexact:
        lines.append(f"  {'tensor':<48} {'fmt':>4} {'rel rms err':>12} {'max abs err':>12} {'blocks rescaled':>16}")
        for _, name in inexact[:limit]:
            v = report[name]
            lines.append(f"  {name:<48} {v['format']:>4} {v['rel_rms_error']:>12.3e} {v['max_abs_error']:>12.3e} "
                         f"{'-' if v['blocks_rescaled'] is None else v['blocks_rescaled']:>16}")
        if len(inexact) > limit:
            lines.append(f"  ... {len(inexact) - limit} more in the JSON report")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ export
