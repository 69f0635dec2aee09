"""A LoRA run's frozen base kept in DeepSeek's released low-precision form (SPEC §6): FP8 e4m3 in 32 x 32 e8m0
blocks for the attention projections and the shared experts, FP4 e2m1 with an e8m0 scale per 32 for the routed
experts; about 1.03 and 0.53 bytes a value with the scales, against 2 for the bf16 base ``model/lora.py`` keeps.

Why it is built this way:
- A converter, ``quantize_base``, applied to a built (and loaded) model whose base is frozen: each base
  ``nn.Linear`` becomes a ``QuantizedLinear`` (what a converter added to it, an adapter, handed on by
  ``Projection.rebased``), each stacked routed matrix a ``QuantizedMatrix``. ``hold_base`` makes the same modules
  with their buffers still to fill, for a stage built without its full-precision base (``model/quantized_build.py``):
  ``stored_slots`` names the bytes each expects, which a released source copies in as stored.
  The layers' forwards do not change: they take their matmul operands from ``matmul_weights``
  / ``cast_stacked`` (``model/weights.py``), which hand a quantised group over as ``QuantizedRows``, and multiply
  through ``model.weights.linear`` / ``grouped_linear``.
- The products run on the stored bytes: ``kernels/triton_quant_gemm.py`` decodes a tile of codes and scales in
  registers, in the forward (``x Wᵀ``) and in the backward to the input (``dy W``); a frozen base has no gradient of
  its own. For many rows a matrix (``DEQUANT_ROWS``), where that decode costs more than it saves, one matrix (one
  rank's stack of an expert matrix, w1 over w3 as one) is decoded into a transient copy for torch's GEMM and freed
  after it; no layer's bf16 copy is ever materialised. The PyTorch reference (``kernel_backend=torch``, and ``auto``
  off CUDA) dequantises one matrix (one expert) at a time and multiplies: the same values (a code times a power of
  two is exact in bf16), another summation order.
- Quantising the loaded weights (``model/quant.py``'s rule) gives back the released values exactly: the base loads
  as ``codes * scale`` and dequantise -> quantise is the identity on values. A weight that was not on the grid
  (a seeded init, a merged adapter) is rounded to it: that is what "the released form" means for it.
- Activations stay in the compute dtype (bf16 under autocast): no activation scaling, so the quantised base is
  the dequantise-then-bf16 path's function exactly, only the GEMM's summation order differs. ``torch._scaled_mm``
  would need FP8 activations and cuBLAS's 1 x 128 / 128 x 128 blocks, not the release's 32 x 32.
"""
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.projection import Projection
from model.quant import BLOCK_FP8, BLOCK_ROW, FORMATS, dequantize, quantize, scale_shape

# Bytes a value with its scales: an e8m0 byte per 32 x 32 FP8 block, per 32 packed FP4 values (two a byte).
STORED_BYTES = {"fp8": 1 + 1 / 1024, "fp4": 0.5 + 1 / 32}
TABLE_BLOCK = (1, 32)  # an Engram table's FP8 rows: an e8m0 scale per 32 values of a row
# What DeepSeek's release stores quantised (SPEC §6), by our state-dict names: FP8 in 32 x 32 blocks, FP4 in rows of
# 32 (the routed experts, the draft head's too), the Engram tables' FP8 rows of 32.
FP8_MATRICES = re.compile(r".*\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv"
                          r")\.weight|mtp\.\d+\.main_proj\.weight")
FP4_MATRICES = re.compile(r".*\.ffn\.experts\.\d+\.w[123]\.weight")


# Rows a matrix multiplies (on average over a stack of experts) from which its product goes through a transient
# dequantised copy (``kernels.triton_quant_gemm.dequantize_stack``) and torch's GEMMs (cuBLAS, CUTLASS's grouped
# GEMM) instead of the fused kernel. The fused kernel decodes in its main loop and runs at 170-230 TFLOP/s on an H100
# however many rows a decoded tile serves. The copy costs about 4.5 bytes a value more memory traffic (the stored
# bytes read, bf16 written, then read by the GEMM), 1.3 ps at 3.35 TB/s, and buys the bf16 GEMM's 600-700 TFLOP/s:
# 2 FLOPs / 200 TFLOP/s - 2 / 650 = 0.007 ps saved a value and row of x, so it pays from about 200 rows. Measured
# (`bench/results/finetune/quant_gemm.json`, one H100, 2026-12-07): the FP4 experts' crossover lies between 128 and
# 256 rows an expert; at 1,024 the transient path is 3.5x faster than the fused kernel (w1 | w3: 4.0 against 13.8
# ms forward, bf16 3.1); FP8 matrices gain already at 128 rows (wq_b: 0.14 against 0.34 ms). The copy is
# one matrix, or one rank's stack of an expert matrix (w1 over w3 in one), never a layer, and is freed when the
# product returns.
DEQUANT_ROWS = 256


def dequantizes(rows: int, matrices: int, shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether ``rows`` rows over ``matrices`` matrices of ``shape`` take the transient dequantised product: at least
    ``DEQUANT_ROWS`` a matrix, and rows of N and K values that torch's grouped GEMM can stride (16-byte multiples)."""
    aligned = all(side * dtype.itemsize % 16 == 0 for side in shape)
    return rows >= DEQUANT_ROWS * matrices and aligned


def quantized_form(name: str) -> tuple[str, tuple[int, int]] | None:
    """``(fmt, block)`` of a tensor the release stores quantised, None for a plain one: the ``formats`` of
    ``quantize_base`` and ``hold_base``."""
    if name.endswith("engram.embed.weight"):
        return "fp8", TABLE_BLOCK
    if FP8_MATRICES.fullmatch(name):
        return "fp8", BLOCK_FP8
    if FP4_MATRICES.fullmatch(name):
        return "fp4", BLOCK_ROW
    return None


def table_bytes(width: int) -> float:
    """Bytes a value of an Engram table held as released, rows of ``width``: a code, and a scale per 32 (1.03 at
    V4.1's 256)."""
    return 1 + -(-width // TABLE_BLOCK[1]) / width


class QuantizedMatrix(nn.Module):
    """A frozen ``W [out, in]`` or stack ``[E, out, in]`` as buffers: ``codes`` (fp8 ``[E, out, in]``, fp4 packed
    uint8 ``[E, out, in/2]``) and e8m0 ``scale [E, ⌈out/r⌉, ⌈in/c⌉]`` (E = 1 for a single matrix)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, fmt: str, block: tuple[int, int],
                 shape: torch.Size, kernel_backend: str = "auto"):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"QuantizedMatrix: format {fmt!r}, use one of {FORMATS}")
        self.fmt, self.block, self.shape = fmt, tuple(block), torch.Size(shape)
        self.kernel_backend = kernel_backend
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)

    @classmethod
    def empty(cls, shape: torch.Size, fmt: str, block: tuple[int, int], kernel_backend: str = "auto",
              device: torch.device | None = None) -> "QuantizedMatrix":
        """Buffers for ``shape`` (``[out, in]`` or ``[E, out, in]``), their values still to be filled
        (``stored_slots``)."""
        *lead, out, fan_in = shape
        stack = lead[0] if lead else 1
        codes = torch.empty(stack, out, fan_in // 2 if fmt == "fp4" else fan_in, device=device,
                            dtype=torch.uint8 if fmt == "fp4" else torch.float8_e4m3fn)
        scale = torch.empty(stack, *scale_shape((out, fan_in), block), dtype=torch.float8_e8m0fnu, device=device)
        return cls(codes, scale, fmt, block, shape, kernel_backend)

    @classmethod
    def of(cls, weight: torch.Tensor, fmt: str, block: tuple[int, int],
           kernel_backend: str = "auto") -> "QuantizedMatrix":
        """``weight`` (``[out, in]`` or a stack ``[E, out, in]``) quantised matrix by matrix; ``kernel_backend``
        picks the GEMM (``kernels.ops``' rule: Triton for ``triton``, and for ``auto`` on CUDA)."""
        stack = weight.detach().reshape(-1, *weight.shape[-2:])
        parts = [quantize(w, fmt, block) for w in stack]
        return cls(torch.stack([c for c, _ in parts]), torch.stack([s for _, s in parts]), fmt, block, weight.shape,
                   kernel_backend)

    def like(self, codes: torch.Tensor, scale: torch.Tensor, shape) -> "QuantizedMatrix":
        """Other codes and scales (a view of these) in this one's format and backend."""
        return QuantizedMatrix(codes, scale, self.fmt, self.block, shape, self.kernel_backend)

    @property
    def experts(self) -> int:
        return self.codes.shape[0]

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``codes * scale`` in ``dtype``, shaped as the weight was (the whole matrix: for references and merges)."""
        return torch.stack([dequantize(c, s, self.fmt, self.block, dtype)
                            for c, s in zip(self.codes, self.scale)]).view(self.shape)

    def expert(self, i: int) -> "QuantizedMatrix":
        """Matrix ``i`` of the stack (views of its codes and scales)."""
        return self.like(self.codes[i:i + 1], self.scale[i:i + 1], self.shape[-2:])

    def linear(self, x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` in the compute dtype: every row times ``Wᵀ`` (E = 1), or for a stack the
        rows of expert e (sorted by expert, ``counts[e]`` of them) times ``W[e]ᵀ``."""
        dtype = compute_dtype(x)
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        if self.experts > 1 and counts is None:
            raise ValueError(f"a stack of {self.experts} quantised experts multiplies rows sorted by expert: pass "
                             "their counts")
        if uses_triton(self.kernel_backend, x.device):
            from kernels.triton_quant_gemm import quant_matmul  # lazily: Triton is only needed where it runs

            out = quant_matmul(rows, self.codes, self.scale, counts, self.fmt == "fp4", self.block, self.shape[-2:],
                               dequantizes(rows.shape[0], self.experts, self.shape[-2:], dtype))
        else:
            out = self._reference(rows, counts)
        return out.view(*x.shape[:-1], self.shape[-2])

    def _reference(self, rows: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        """Dequantise one matrix at a time and multiply: the kernel's reference."""
        sizes = [rows.shape[0]] if counts is None else counts.tolist()
        return torch.cat([F.linear(part, self.expert(i).dequantized(rows.dtype))
                          for i, part in enumerate(rows.split(sizes))])


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def uses_triton(kernel_backend: str, device: torch.device) -> bool:
    """``kernels.ops``' choice: Triton for ``triton``, and for ``auto`` on CUDA."""
    return kernel_backend == "triton" or (kernel_backend == "auto" and device.type == "cuda")


class QuantizedRows:
    """One matmul operand of quantised matrices stacked by rows (``matmul_weights``' groups: wq_a over wkv, w1
    over w3): each part multiplied on its own and the outputs joined by columns, which is the stacked GEMM's
    output. Indexing picks expert ``i`` of every part."""

    def __init__(self, parts: list):
        if not all(isinstance(p, QuantizedMatrix) for p in parts):
            raise TypeError("a matmul operand mixes quantised and plain matrices: quantize_base converts a module's "
                            "base matrices together")
        self.parts = list(parts)

    def linear(self, x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.parts) > 1 and self._one_transient(x):
            from kernels.triton_quant_gemm import stacked_transient_matmul  # lazily, as QuantizedMatrix.linear

            first, rows = self.parts[0], x.reshape(-1, x.shape[-1]).to(compute_dtype(x))
            out = stacked_transient_matmul(rows, [(p.codes, p.scale, p.shape[-2]) for p in self.parts], counts,
                                           first.fmt == "fp4", first.block, first.shape[-1])
            return out.view(*x.shape[:-1], out.shape[-1])
        outs = [p.linear(x, counts) for p in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _one_transient(self, x: torch.Tensor) -> bool:
        """Whether every part would take the transient product (``dequantizes``) of one format, so that one buffer
        stacks them all: one GEMM instead of a GEMM each, no join of the outputs and no sum of the gradients."""
        first, rows, dtype = self.parts[0], x.numel() // x.shape[-1], compute_dtype(x)
        return (uses_triton(first.kernel_backend, x.device)
                and all((p.fmt, p.block, p.experts, p.shape[-1]) == (first.fmt, first.block, first.experts,
                                                                      first.shape[-1])
                        and dequantizes(rows, p.experts, p.shape[-2:], dtype) for p in self.parts))

    def __getitem__(self, i: int) -> "QuantizedRows":
        return QuantizedRows([p.expert(i) for p in self.parts])

    def grouped(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """``attention.GroupedLowRank``'s product on a quantised ``wo_a [G·rank, K]``: ``[G, rank, N]`` for x
        ``[N, G, K]``, as a grouped GEMM of the G row blocks (each group's tokens its own rows)."""
        (matrix,), (N, G, K) = self.parts, x.shape
        if matrix.shape[0] % G or rank % matrix.block[0]:
            raise ValueError(f"wo_a's {G} groups of {rank} rows do not split its {matrix.block} scale blocks")
        stacked = matrix.like(matrix.codes.view(G, rank, -1), matrix.scale.view(G, rank // matrix.block[0], -1),
                              (G, rank, K))
        counts = torch.full((G,), N, dtype=torch.int64, device=x.device)
        out = stacked.linear(x.transpose(0, 1).reshape(G * N, K), counts)
        return out.view(G, N, rank).transpose(1, 2)


class QuantizedLinear(Projection, nn.Module):
    """A frozen ``nn.Linear`` (no bias) whose ``weight`` is a ``QuantizedMatrix``."""

    def __init__(self, weight: QuantizedMatrix):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.linear(x)


class QuantizedTable(nn.Module):
    """A frozen Engram table's rows of this rank (``EngramTable``'s range) as the release stores them: FP8 codes with
    an e8m0 scale per 32 values, about 1.03 bytes a value against fp32's 4 (the two V4.1 tables: 196.6 G values).
    Codes and scales are the bytes of one ``packed`` row (``[part_rows, dim + dim / 32]`` uint8), so that the lookup's
    exchange (``EngramTable.exchange``: local, or the rows' owners over a process group) moves a row whole; the rows
    looked up are decoded into the table's dtype (fp32): the values the table held, exactly. ``start`` and ``rows``
    (the first row held, the whole table's rows) say which rows of the release fill it. (Found by its ``part_rows``,
    as a stack of experts by its ``expert_ids``: the converters sit below the layers they adapt.)"""

    def __init__(self, table: nn.Module, packed: torch.Tensor):
        super().__init__()
        self.exchange, self.dim, self.dtype = table.exchange, table.weight.shape[1], table.weight.dtype
        self.start, self.rows = table.start, table.rows
        self.register_buffer("packed", packed)

    @classmethod
    def of(cls, table: nn.Module) -> "QuantizedTable":
        """``table``'s values quantised."""
        codes, scale = quantize(_frozen(table.weight, "an Engram table").detach(), "fp8", TABLE_BLOCK)
        return cls(table, torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], 1))

    @classmethod
    def empty(cls, table: nn.Module, device: torch.device | None = None) -> "QuantizedTable":
        """Zero bytes (rows of value 0 at the smallest scale: what ``of`` makes of the last shard's zero padding rows),
        the rows of the table still to be filled (``stored_slots``)."""
        part_rows, dim = _frozen(table.weight, "an Engram table").shape
        return cls(table, torch.zeros(part_rows, dim + -(-dim // TABLE_BLOCK[1]), dtype=torch.uint8, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.exchange.lookup(self.packed, ids).reshape(-1, self.packed.shape[1])
        codes, scale = rows[:, :self.dim].view(torch.float8_e4m3fn), rows[:, self.dim:].view(torch.float8_e8m0fnu)
        return dequantize(codes, scale, "fp8", TABLE_BLOCK, self.dtype).view(*ids.shape, self.dim)


def base_targets(model: nn.Module, formats) -> list[tuple[nn.Module, str, str, tuple]]:
    """``(owner, attribute, name, form)`` of every frozen base matrix or table of ``model``'s blocks (``layers.*``)
    and of its draft head's routed experts (``mtp.*``: 6.3 GiB a GPU of V4.1-Flash in fp32 on 8 expert ranks; the
    rest of the draft head is small and stays as it is) that ``formats(name) -> (fmt, block) | None`` gives a
    quantised form: the plain ``nn.Linear``s (no bias) under their module name, the stacked routed matrices
    (``...experts.w1``, asked of ``formats`` as their first expert's ``...experts.{j}.w1.weight``) and the Engram
    tables (``...engram.embed``)."""
    draft = getattr(model, "mtp", None)
    found = []
    for name, module in [(f"layers.{n}.{m}".rstrip("."), sub) for n, block in model.layers.items()
                         for m, sub in block.named_modules()] + [
            (f"mtp.{n}", sub) for n, sub in (draft.named_modules() if draft is not None else ())
            if hasattr(sub, "expert_ids")]:
        if hasattr(module, "expert_ids"):  # a stack of routed experts
            found += [(module, w, f"{name}.{w}", form) for w in ("w1", "w2", "w3")
                      if (form := formats(f"{name}.{module.expert_ids.start}.{w}.weight")) is not None]
            continue
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}"
            if hasattr(child, "part_rows") or isinstance(child, nn.Linear) and child.bias is None:
                form = formats(f"{full}.weight")
                if form is not None:
                    found.append((module, child_name, full, form))
    return found


def quantize_base(model: nn.Module, formats, kernel_backend: str) -> int:
    """Convert ``base_targets`` into ``QuantizedLinear`` / ``QuantizedMatrix`` and the Engram tables into
    ``QuantizedTable`` (FP8 rows of 32, the release's form whatever ``formats`` says of the block), their values
    quantised; returns how many matrices and tables were converted. A base matrix that still trains is an error:
    only a frozen base may be rounded to the released grid."""
    return _convert(model, formats, lambda weight, name, form: QuantizedMatrix.of(_frozen(weight, name), *form,
                                                                                 kernel_backend), QuantizedTable.of)


def hold_base(model: nn.Module, formats, kernel_backend: str, device: torch.device | None = None) -> int:
    """``quantize_base``'s modules for ``base_targets`` with their buffers on ``device`` still to be filled
    (``stored_slots``), whatever the weights hold (typically nothing: meta tensors, ``model/quantized_build.py``);
    returns how many matrices and tables were converted."""
    return _convert(model, formats, lambda weight, name, form: QuantizedMatrix.empty(
        _frozen(weight, name).shape, *form, kernel_backend, device), lambda table: QuantizedTable.empty(table, device))


def _convert(model: nn.Module, formats, matrix, table) -> int:
    """Each target replaced by ``matrix(weight, name, form)`` (in a ``QuantizedLinear`` for a linear, whose adapter
    ``Projection.rebased`` hands on) or ``table(table)``."""
    targets = base_targets(model, formats)
    for owner, attribute, name, form in targets:
        child = getattr(owner, attribute)
        if hasattr(child, "part_rows"):
            setattr(owner, attribute, table(child))
        elif isinstance(child, nn.Linear):
            quantized = QuantizedLinear(matrix(child.weight, name, form))
            setattr(owner, attribute, child.rebased(quantized) if isinstance(child, Projection) else quantized)
        else:  # a stacked parameter
            delattr(owner, attribute)
            setattr(owner, attribute, matrix(child, name, form))
    return len(targets)


def _frozen(weight: torch.Tensor, name: str) -> torch.Tensor:
    if weight.requires_grad:
        raise ValueError(f"{name} trains: only a frozen base (train.lora.rank > 0) is kept quantised")
    return weight


@dataclass(frozen=True)
class Slot:
    """Where one stored tensor of the release goes: views of a quantised module's ``codes`` and ``scale`` as bytes
    (uint8), and the stored rows ``[start, stop)`` of an Engram table (None: the whole matrix)."""
    codes: torch.Tensor
    scale: torch.Tensor
    fmt: str
    block: tuple[int, int]
    rows: tuple[int, int] | None = None


def stored_slots(model: nn.Module) -> dict[str, Slot]:
    """The released tensors (state-dict names: ``...wq_a.weight``, a routed expert's ``...experts.{j}.w1.weight``,
    ``...engram.embed.weight``) that ``model``'s quantised modules hold, and where their bytes go."""
    slots = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            m = module.weight
            slots[f"{name}.weight"] = Slot(_bytes(m.codes[0]), _bytes(m.scale[0]), m.fmt, m.block)
        elif hasattr(module, "expert_ids"):
            for w, m in module.named_children():
                if isinstance(m, QuantizedMatrix):
                    slots.update({f"{name}.{j}.{w}.weight": Slot(_bytes(m.codes[i]), _bytes(m.scale[i]), m.fmt,
                                                                  m.block) for i, j in enumerate(module.expert_ids)})
        elif isinstance(module, QuantizedTable):
            stop = min(module.start + module.packed.shape[0], module.rows)
            held = module.packed[:max(stop - module.start, 0)]
            slots[f"{name}.weight"] = Slot(held[:, :module.dim], held[:, module.dim:], "fp8", TABLE_BLOCK,
                                           (module.start, max(stop, module.start)))
    return slots


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)
