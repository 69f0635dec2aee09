"""LoRA (Hu et al., 2021): a frozen weight ``W [out, in]`` and a trained low-rank update of it,
``y = W x + (alpha / r) · B A x`` with ``A [r, in]``, ``B [out, r]``.

Why it is built this way:
- The update is applied factored, ``B (A x)``, beside the base GEMM, never as a merged ``W + s·B A``: the merged
  form would materialise every adapted matrix again each forward (the routed experts of one V4.1 layer are 13 GB
  in bf16) and its backward would compute the full ``dW`` that LoRA exists to avoid. With ``W`` frozen autograd
  skips that GEMM; the adapters' own cost is ``r (in + out)`` per row.
- ``A`` draws Kaiming-uniform (``U(±1/sqrt(in))``, what ``nn.Linear`` and PEFT draw), ``B`` starts at zero, so a
  run's first forward is the base's bit for bit. Each ``A`` draws from a generator seeded by (seed, its state-dict
  name), a routed expert's under its own per-expert name, so every pipeline split and expert-parallel size starts
  from the same adapters.
- Adapters live on the modules whose weights they adapt: ``<linear>.lora.A`` / ``.B`` for an ``nn.Linear``, and for
  the stacked routed experts ``experts.lora.w1.A [E_local, r, in]`` / ``.B [E_local, out, r]``, split over expert
  ranks with their experts and named per expert in the state dict (``experts.{j}.w1.lora.A``): in state-dict
  names an adapter ``X.lora.A`` always adapts ``X.weight``.
- ``attach`` is a converter of the built model: each adapted module takes a class with the adapter's term in
  front of its own (``AdaptedLinear``: ``Projection.finish``, ``model/projection.py``; ``AdaptedExperts``: the
  experts' ``operands`` / ``product``), so the blocks' forwards are the same text with and without LoRA, and the
  module, its parameters and its state-dict names stay what they were.
- ``attach`` freezes the whole base (requires_grad False: no gradient, no optimizer state, no reduction) and stops
  the routing biases' balance steps (they are part of the base); only the trunk's blocks (``layers.*``) are
  adapted, the draft head stays frozen. ``low_precision`` keeps the frozen matrices that only autocast's matmuls
  read in bf16 (half the memory of fp32 masters, and no cast per forward: autocast would round them the same way).

Targets (``train.lora.targets``): the attention projections by name (``wq_a``, ``wq_b``, ``wkv``, ``wo_a``,
``wo_b``; ``wo_a`` is the grouped projection, adapted as one ``[G·R, K]`` matrix), ``shared_experts`` (its w1, w2,
w3), ``experts`` (every routed expert's w1, w2, w3) and ``dense_ffn`` (a dense model's FFN).
"""
import functools
import math
import re
from itertools import chain

import torch
import torch.nn.functional as F
from torch import nn

from model.config import LORA_ATTENTION, LoRA
from model.seeding import seeded_generator
from model.weights import GroupedLowRank

FFN_MATRICES = ("w1", "w2", "w3")
STACKS = {"w13": ("w1", "w3"), "w2": ("w2",)}  # the routed experts' matmul operands and the matrices in each
LOW_PRECISION = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight|ffn\.(shared_experts\.)?w[123]"
                           r"(\.weight)?|ffn\.experts\.w[123])|head\.weight")


class Adapter(nn.Module):
    """``ΔW = scale · B A`` of a weight ``[*lead, out, in]`` (``lead``: the experts of a stack): ``A [*lead, r, in]``,
    ``B [*lead, out, r]``, fp32 (the trained master values; autocast runs their matmuls)."""

    def __init__(self, shape: torch.Size, rank: int, scale: float):
        super().__init__()
        *lead, out, fan_in = shape
        self.scale = scale
        self.A = nn.Parameter(torch.empty(*lead, rank, fan_in))
        self.B = nn.Parameter(torch.zeros(*lead, out, rank))

    def forward(self, x: torch.Tensor, matmul=F.linear, A: torch.Tensor | None = None,
                B: torch.Tensor | None = None) -> torch.Tensor:
        """``scale · B A x`` by ``matmul(rows, weight)`` (``F.linear``, or the experts' grouped GEMM with
        ``A``/``B`` the stacks, or one expert's slices of them)."""
        A, B = (self.A, self.B) if A is None else (A, B)
        return matmul(matmul(x, A), B) * self.scale

    def delta(self) -> torch.Tensor:
        """``scale · B A`` (stacked like the weight), for merging."""
        return self.scale * (self.B @ self.A)


class GroupedAdapter(Adapter):
    """The adapter of the grouped output projection ``wo_a [G·R, K]``, adapted as one matrix: on x ``[N, G, K]``
    group g's update is ``B[g] (A x_g)``, ``[G, R, N]`` like ``GroupedLowRank``'s product (B's rows cut as
    wo_a's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * GroupedLowRank.apply(F.linear(x, self.A), self.B, self.B.shape[0] // x.shape[1])


class AdaptedLinear:
    """A projection (``model/projection.py``) plus its adapter ``lora``: ``y + lora(x)`` finishes its product."""

    adds_term = True

    def finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y + self.lora(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (the grouped wo_a is read through finish only)
        return self.finish(super().forward(x), x)

    def rebased(self, replacement: nn.Module) -> nn.Module:
        """``replacement`` (``quantize_base``'s form of this layer) with this adapter."""
        return _convert(replacement, AdaptedLinear, self.lora)


class AdaptedExperts:
    """Routed experts plus their adapters ``lora`` (one ``Adapter`` of stacks per matrix): each operand's product
    plus the update of its matrices, by the same matmul (the grouped GEMM, or one expert's slices)."""

    def operands(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return super().operands(dtype) | {f"{w}.{half}": getattr(self.lora[w], half).to(dtype)
                                          for w in FFN_MATRICES for half in "AB"}

    def grouped_widths(self) -> dict[str, int]:
        return super().grouped_widths() | {"train.lora.rank": self.lora["w1"].A.shape[1]}

    def product(self, name: str, rows: torch.Tensor, matmul, operands: dict) -> torch.Tensor:
        y = super().product(name, rows, matmul, operands)
        updates = [self.lora[w](rows, matmul, operands[f"{w}.A"], operands[f"{w}.B"]) for w in STACKS[name]]
        return y + (updates[0] if len(updates) == 1 else torch.cat(updates, dim=-1))


def _convert(module: nn.Module, mixin: type, adapters: nn.Module) -> nn.Module:
    """``module`` itself (converted in place: whatever holds it or its parameters still does), its class now
    ``mixin`` in front of its own, holding ``adapters`` as ``lora``."""
    module.__class__ = _adapted_class(type(module), mixin)
    module.lora = adapters
    return module


@functools.cache
def _adapted_class(base: type, mixin: type) -> type:
    """One class per adapted kind of module (``Linear``, ``QuantizedLinear``, ``RoutedExperts``), made here rather
    than written out: this module sits below the modules it adapts (pyproject.toml's import contracts)."""
    return type(f"LoRA{base.__name__}", (mixin, base), {"__module__": __name__})


def targeted_modules(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every ``nn.Linear`` and stack of routed experts the targets name, in the trunk."""
    found = []
    for layer_name, block in model.layers.items():
        prefix = f"layers.{layer_name}"
        for target in targets:
            if target in LORA_ATTENTION:
                found.append((f"{prefix}.attn.{target}", getattr(block.attn, target)))
            elif target == "experts":
                found.append((f"{prefix}.ffn.experts", block.ffn.experts))
            else:
                owner = block.ffn.shared_experts if target == "shared_experts" else block.ffn
                found += [(f"{prefix}.ffn.{'shared_experts.' * (target == 'shared_experts')}{w}", getattr(owner, w))
                          for w in FFN_MATRICES]
    return found


def attach(model: nn.Module, lora: LoRA, seed: int, low_precision: torch.dtype | None = None) -> None:
    """Freeze every parameter of ``model`` (a ``Transformer`` or a slice of one) and its routing biases, then give
    the targeted matrices of its blocks adapters (``A`` drawn by name, ``B`` zero). ``low_precision``: the dtype to
    keep the frozen autocast-only matrices in (bf16 under bf16 autocast; None keeps them as they are)."""
    lora.check(model.args)
    for name, p in model.named_parameters():
        p.requires_grad_(False)
        if low_precision is not None and LOW_PRECISION.fullmatch(name):
            p.data = p.data.to(low_precision)
    model.moves_biases = False
    for name, module in targeted_modules(model, lora.targets):
        device = next(chain(module.parameters(), module.buffers())).device  # a base held quantised: buffers only
        if hasattr(module, "expert_ids"):  # stacked routed experts: one adapter per matrix, per-expert draws
            adapters = nn.ModuleDict({w: Adapter(getattr(module, w).shape, lora.rank, lora.scale)
                                      for w in FFN_MATRICES}).to(device)
            for w, adapter in adapters.items():
                for i, j in enumerate(module.expert_ids):
                    _kaiming_uniform(adapter.A[i], seed, f"{name}.{j}.{w}.lora.A")
            _convert(module, AdaptedExperts, adapters)
        else:
            kind = GroupedAdapter if name.endswith(".wo_a") else Adapter
            adapter = kind(module.weight.shape, lora.rank, lora.scale).to(device)
            _kaiming_uniform(adapter.A, seed, f"{name}.lora.A")
            _convert(module, AdaptedLinear, adapter)


def _kaiming_uniform(a: torch.Tensor, seed: int, name: str) -> None:
    """``U(-1/sqrt(in), 1/sqrt(in))`` (Kaiming-uniform with a = sqrt(5), nn.Linear's draw) from (seed, name)."""
    bound = 1 / math.sqrt(a.shape[-1])
    cpu = torch.device("cpu")  # drawn on the CPU (the same values on any device), also under a CUDA default device
    values = torch.empty(a.shape, device=cpu).uniform_(-bound, bound, generator=seeded_generator(seed, name, cpu))
    with torch.no_grad():
        a.copy_(values)


ADAPTER = re.compile(r"(.+)\.lora\.([AB])")


def adapter_of(name: str) -> tuple[str, str] | None:
    """``(adapted weight, "A" or "B")`` of an adapter's state-dict name (``layers.0.attn.wq_a.lora.A`` ->
    ``layers.0.attn.wq_a.weight``; a routed expert's ``...experts.3.w1.lora.B`` -> ``...experts.3.w1.weight``),
    None for any other name."""
    found = ADAPTER.fullmatch(name)
    return (f"{found.group(1)}.weight", found.group(2)) if found else None


def base_parameter(name: str) -> str:
    """The base parameter an adapter parameter adapts (``named_parameters`` names: a routed stack's
    ``...experts.lora.w1.A`` -> ``...experts.w1``); any other name is itself."""
    stacked = re.fullmatch(r"(.+\.experts)\.lora\.(w[123])\.[AB]", name)
    if stacked:
        return f"{stacked.group(1)}.{stacked.group(2)}"
    found = adapter_of(name)
    return found[0] if found else name


def merge(weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``weights`` (state-dict names) with every adapted one replaced by ``W + scale · B A``, in fp32 at least (a
    bf16 base keeps an update smaller than its rounding until the writer picks the dtype); ``adapters`` holds the ``.lora.A`` / ``.lora.B`` entries. An adapter without its weight or its
    other half is an error naming it."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        target, half = adapter_of(name) or (None, None)
        if target is None:
            raise ValueError(f"{name} is not an adapter tensor (X.lora.A / X.lora.B)")
        pairs.setdefault(target, {})[half] = tensor
    merged = dict(weights)
    for target, pair in pairs.items():
        if target not in weights or set(pair) != {"A", "B"}:
            raise ValueError(f"adapter of {target}: {'its base weight is missing' if target not in weights else 'A or B is missing'}")
        w = weights[target]
        dtype = torch.promote_types(w.dtype, torch.float32)
        merged[target] = w.to(dtype) + scale * (pair["B"].to(dtype) @ pair["A"].to(dtype))
    return merged
