"""A LoRA run's frozen base kept in DeepSeek's released low-precision form (SPEC §6): FP8 e4m3 in 32 x 32 e8m0
blocks for the attention projections and the shared experts, FP4 e2m1 with an e8m0 scale per 32 for the routed
experts; about 1.03 and 0.53 bytes a value with the scales, against 2 for the bf16 base ``model/lora.py`` keeps.

Why it is built this way:
- A converter, ``quantize_base``, applied to a built (and loaded) model whose base is frozen: each base
  ``nn.Linear`` becomes a ``QuantizedLinear`` (what a converter added to it, an adapter, handed on by
  ``Projection.rebased``), each stacked routed matrix a ``QuantizedMatrix``. The layers' forwards do not change: they take their matmul operands from ``matmul_weights``
  / ``cast_stacked`` (``model/weights.py``), which hand a quantised group over as ``QuantizedRows``, and multiply
  through ``model.weights.linear`` / ``grouped_linear``.
- The products run on the stored bytes: ``kernels/triton_quant_gemm.py`` decodes a tile of codes and scales in
  registers, in the forward (``x Wᵀ``) and in the backward to the input (``dy W``); a frozen base has no gradient of
  its own. No layer's bf16 copy is ever materialised. The PyTorch reference (``kernel_backend=torch``, and ``auto``
  off CUDA) dequantises one matrix (one expert) at a time and multiplies: the same values (a code times a power of
  two is exact in bf16), another summation order.
- Quantising the loaded weights (``model/quant.py``'s rule) gives back the released values exactly: the base loads
  as ``codes * scale`` and dequantise -> quantise is the identity on values. A weight that was not on the grid
  (a seeded init, a merged adapter) is rounded to it: that is what "the released form" means for it.
- Activations stay in the compute dtype (bf16 under autocast): no activation scaling, so the quantised base is
  the dequantise-then-bf16 path's function exactly, only the GEMM's summation order differs. ``torch._scaled_mm``
  would need FP8 activations and cuBLAS's 1 x 128 / 128 x 128 blocks, not the release's 32 x 32.
"""
import torch
import torch.nn.functional as F
from torch import nn

from model.projection import Projection
from model.quant import FORMATS, dequantize, quantize

# Bytes a value with its scales: an e8m0 byte per 32 x 32 FP8 block, per 32 packed FP4 values (two a byte).
STORED_BYTES = {"fp8": 1 + 1 / 1024, "fp4": 0.5 + 1 / 32}
TABLE_BLOCK = (1, 32)  # an Engram table's FP8 rows: an e8m0 scale per 32 values of a row


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

            out = quant_matmul(rows, self.codes, self.scale, counts, self.fmt == "fp4", self.block, self.shape[-2:])
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
        outs = [p.linear(x, counts) for p in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

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
    looked up are decoded into the table's dtype (fp32): the values the table held, exactly. (Found by its
    ``part_rows``, as a stack of experts by its ``expert_ids``: the converters sit below the layers they adapt.)"""

    def __init__(self, table: nn.Module):
        super().__init__()
        weight = _frozen(table.weight, "an Engram table").detach()
        codes, scale = quantize(weight, "fp8", TABLE_BLOCK)
        self.exchange, self.dim, self.dtype = table.exchange, weight.shape[1], weight.dtype
        self.register_buffer("packed", torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.exchange.lookup(self.packed, ids).reshape(-1, self.packed.shape[1])
        codes, scale = rows[:, :self.dim].view(torch.float8_e4m3fn), rows[:, self.dim:].view(torch.float8_e8m0fnu)
        return dequantize(codes, scale, "fp8", TABLE_BLOCK, self.dtype).view(*ids.shape, self.dim)


def quantize_base(model: nn.Module, formats, kernel_backend: str) -> int:
    """Convert the frozen base matrices of ``model``'s blocks (``layers.*``: the draft head keeps its own) that
    ``formats(name) -> (fmt, block) | None`` gives a quantised form (``name``: the state-dict name, a stack of routed
    experts' as its first expert's ``...experts.{j}.w1.weight``) into ``QuantizedLinear`` / ``QuantizedMatrix``, and
    their Engram tables into ``QuantizedTable`` (FP8 rows of 32, the release's form whatever ``formats`` says of the
    block); returns how many matrices and tables were converted. A base matrix that still trains is an error: only a frozen base may be
    rounded to the released grid."""
    converted = 0
    for name, module in [(f"layers.{n}.{m}".rstrip("."), sub) for n, block in model.layers.items()
                         for m, sub in block.named_modules()]:
        if hasattr(module, "expert_ids"):  # a stack of routed experts
            for w in ("w1", "w2", "w3"):
                form = formats(f"{name}.{module.expert_ids.start}.{w}.weight")
                if form is not None:
                    weight = _frozen(getattr(module, w), f"{name}.{w}")
                    delattr(module, w)
                    setattr(module, w, QuantizedMatrix.of(weight, *form, kernel_backend))
                    converted += 1
            continue
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}"
            if hasattr(child, "part_rows") and formats(f"{full}.weight") is not None:  # an Engram table
                setattr(module, child_name, QuantizedTable(child))
                converted += 1
                continue
            form = formats(f"{full}.weight") if isinstance(child, nn.Linear) and child.bias is None else None
            if form is None:
                continue
            quantized = QuantizedLinear(QuantizedMatrix.of(_frozen(child.weight, full), *form, kernel_backend))
            setattr(module, child_name, child.rebased(quantized) if isinstance(child, Projection) else quantized)
            converted += 1
    return converted


def _frozen(weight: torch.Tensor, name: str) -> torch.Tensor:
    if weight.requires_grad:
        raise ValueError(f"{name} trains: only a frozen base (train.lora.rank > 0) is kept quantised")
    return weight
