"""The Mixture-of-Experts FFN of DeepSeek-V4.1-Flash (SPEC §5.1): a gate picks ``k`` of ``E`` routed experts per
token, every token also goes through one shared expert, and a bias outside the gradient balances the experts.

Why it is built this way:
- The routed experts are *stacked*: ``w1``, ``w2``, ``w3`` are one Parameter each, ``[E_local, out, in]``, so the
  tokens of all local experts go through one grouped GEMM per matrix (``torch.nn.functional.grouped_mm`` over the
  tokens sorted by expert, with the per-expert counts as offsets) instead of a launch per expert: 384 experts of
  a few hundred tokens each are too small for separate GEMMs. w1 and w3 read the same rows, so they are one GEMM:
  their stacks are cast (under autocast) and stacked expert by expert into one ``[E_local, 2·inter, dim]``
  operand in one launch (``model/weights.py``), whose output ``[gate | up]`` the SwiGLU kernel reads. In bf16 on
  the H200 grouped_mm reads the counts on the device (no host sync; in fp32 it falls back to a loop over the groups
  that reads them on the host); it is not autocast-aware, so the operands are cast to the autocast dtype here.
  Expert parallelism later splits dim 0 (``expert_ids``), and the checkpoint still names every expert on its own
  (``experts.{j}.w1.weight``, the reference's names) through state-dict hooks.
- Dispatch is a few small steps (``sort_by_expert``, the spread of the tokens to their slots, the ``dispatch`` of
  the sorted rows to ``RoutedExperts.forward``, the combine) so that the expert-parallel all-to-all
  (``parallel/experts.py``) sits between them as the dispatch, unchanged otherwise.
- Where fp32 happens: the gate (scores, top-k, weights) runs in fp32 whatever autocast says, since the selection
  and the weights are sensitive to rounding; under bf16 autocast on CUDA its GEMM runs as bf16 tensor-core GEMMs of
  split operands, 16 of fp32's 24 significant bits (``model/split_gemm.py``). Each expert's SwiGLU (clamp, silu, the product, the routing
  weight) is one kernel on the stacked w1/w3 GEMM's output (``kernels``' ``swiglu``), fp32 inside and rounded to
  the compute dtype once, as W2's input; the k routed outputs and the shared expert's are summed in fp32, and the
  sum is rounded to the input's dtype once.
- The routing weight multiplies the hidden activation, before W2 (as the reference does), so a token's weight is
  already in its expert output and the combine only adds rows.
- No atomics, no host syncs. The sort by expert gives each (token, choice) its slot ``slot[t, j]``; the tokens go
  to their slots and the slots' outputs come back by ``kernels``' ``permute_rows`` / ``unpermute_rows``, each
  driven by the token (a spread of its row, a sum of its k rows) and each the other's backward; a permutation's
  backward is the inverse permutation's gather (``reorder``). Nothing in the local step reads the device on the
  host (the loop over experts off CUDA and the subset ``LocalDispatch`` of the tests do; the expert-parallel
  all-to-all reads its split sizes, once per layer and direction).
- The balance bias selects experts and never weights them (``Gate``); it is a buffer, so no optimizer sees it, and
  ``update_bias`` moves it by the loads that ``MoE.load`` counts over training forwards.
"""
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from model.attention import linear
from model.config import MoEArgs
from model.projection import finish_stacked
from model.split_gemm import split_linear
from model.weights import cast_stacked, grouped_linear, linear as weight_linear, matmul_weights

GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what grouped_mm multiplies (no fp64)
ROUTED_WEIGHTS = ("w1", "w2", "w3")
# Where the gate runs its split bf16 GEMMs under bf16 autocast: on the CPU they are fp32 GEMMs of the parts, slower
# than the fp32 GEMM they stand for, so the CPU keeps that one.
SPLIT_GATE_DEVICES = ("cuda",)


class Gate(nn.Module):
    """Scores ``f(x·Wᵀ / gate_temp)`` in fp32; the top-k of ``scores + bias`` pick the experts, the unbiased scores
    of the picked experts are their weights (normalised over the k when ``norm_topk_prob``, times ``route_scale``).
    The gate's weight learns through those weights; ``bias`` is the auxiliary-loss-free balance, a persistent
    buffer (in the checkpoint as ``gate.bias``, outside the gradient and the optimizer), moved by ``update_bias``."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, dim))
        self.register_buffer("bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (weights [N, k] fp32 (fp64 in an fp64 model), expert ids [N, k] int64)."""
        args, dtype = self.args, torch.promote_types(x.dtype, torch.float32)
        split = self.on_tensor_cores(x)
        with torch.autocast(x.device.type, enabled=False):
            if split:
                scores = split_linear(x, self.weight) / args.gate_temp
            else:
                scores = F.linear(x.to(dtype), self.weight.to(dtype)) / args.gate_temp
        if args.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif args.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        indices = (scores + self.bias).topk(args.n_activated_experts, dim=-1).indices
        weights = scores.gather(1, indices)
        if args.norm_topk_prob and args.n_activated_experts > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # the reference's constant, not norm_eps
        return weights * args.route_scale, indices

    def on_tensor_cores(self, x: torch.Tensor) -> bool:
        """Whether the scores come from split bf16 GEMMs (``split_linear``): under bf16 autocast, fp32 weight, x in
        fp32 or bf16, on a device of ``SPLIT_GATE_DEVICES``."""
        device = x.device.type
        return (device in SPLIT_GATE_DEVICES and torch.is_autocast_enabled(device)
                and torch.get_autocast_dtype(device) == torch.bfloat16 and self.weight.dtype == torch.float32
                and x.dtype in (torch.float32, torch.bfloat16))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the GEMMs run in: autocast's where it is on, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Expert(nn.Module):
    """One SwiGLU FFN with ``nn.Linear`` matrices (the shared expert; with no clamp, the dense FFN):
    ``W2 · swiglu(W1 x, W3 x)`` with ``swiglu(g, u) = silu(min(g, L)) · clamp(u, ±L) · w`` (``kernels``'
    ``swiglu``: one kernel on the GEMM's output); W1 and W3 run as one GEMM on the stacked weights."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float = 0.0, kernel_backend: str = "auto"):
        super().__init__()
        self.swiglu_limit, self.kernel_backend = swiglu_limit, kernel_backend
        self.w1, self.w2, self.w3 = linear(dim, inter_dim), linear(inter_dim, dim), linear(dim, inter_dim)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., dim]; ``weights`` (one per row of x, e.g. [N] or [N, 1]) scale the hidden activation."""
        w13, w2 = matmul_weights([(self.w1, self.w3), self.w2], self.kernel_backend)
        h = finish_stacked((self.w1, self.w3), weight_linear(x, w13), x)  # [gate | up]
        h = kernels.ops(self.kernel_backend, x.device).swiglu(h, self.swiglu_limit, weights)
        return self.w2.finish(weight_linear(h, w2), h)


class RoutedExperts(nn.Module):
    """The routed experts ``expert_ids`` (a range of global ids; default all), stacked: ``w1 [E_local, inter, dim]``,
    ``w2 [E_local, dim, inter]``, ``w3 [E_local, inter, dim]``.

    ``named_parameters()`` has the stacked names; ``state_dict()`` and ``load_state_dict`` use the reference's per-
    expert names ``{j}.w1.weight`` (j global), the entries being views of the stacked tensors (no copy: a writer that
    refuses shared storage, like safetensors, needs them cloned)."""

    def __init__(self, dim: int, args: MoEArgs, expert_ids: range | None = None, kernel_backend: str = "auto"):
        super().__init__()
        self.kernel_backend = kernel_backend
        self.expert_ids = range(args.n_routed_experts) if expert_ids is None else expert_ids
        if not (isinstance(self.expert_ids, range) and self.expert_ids.step == 1 and len(self.expert_ids)
                and 0 <= self.expert_ids.start and self.expert_ids.stop <= args.n_routed_experts):
            raise ValueError(f"expert_ids={expert_ids!r}: use a non-empty range(start, stop) of step 1 inside "
                             f"0..model.moe.n_routed_experts={args.n_routed_experts}")
        n, inter = len(self.expert_ids), args.inter_dim
        self.dim, self.inter_dim, self.swiglu_limit = dim, inter, args.swiglu_limit
        self.w1 = nn.Parameter(torch.empty(n, inter, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, inter))
        self.w3 = nn.Parameter(torch.empty(n, inter, dim))
        self.register_state_dict_post_hook(_per_expert_state)
        self.register_load_state_dict_pre_hook(_stack_expert_state)

    def reference_slices(self):
        """``(f"{j}.w1.weight", view)`` for every held expert j and matrix: views into the stacked Parameters (write
        them under ``torch.no_grad()``), named as in the checkpoint."""
        for i, j in enumerate(self.expert_ids):
            for name in ROUTED_WEIGHTS:
                yield f"{j}.{name}.weight", getattr(self, name)[i]

    def forward(self, x: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, grouped: bool | None = None):
        """The held experts on rows sorted by expert: x [M, dim], ``counts`` [E_local] rows of each expert in order
        (summing to M), ``weights`` [M] the rows' routing weights -> [M, dim] in the compute dtype.

        ``grouped``: one grouped_mm per matrix (default on CUDA), else a loop over the experts (default elsewhere,
        and the only way in fp64); the two compute the same function."""
        dtype = compute_dtype(x)
        x = x.to(dtype)
        operands = self.operands(dtype)
        if grouped is None:
            grouped = x.device.type == "cuda" and dtype in GROUPED_MM_DTYPES
        if not grouped:
            bounds = [0, *counts.cumsum(0).tolist()]
            return torch.cat([self._swiglu(x[lo:hi], weights[lo:hi], weight_linear,
                                           {name: stack[i] for name, stack in operands.items()})
                              for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))])
        widths = self.grouped_widths()
        if any(width % 8 for width in widths.values()):
            raise ValueError("grouped_mm needs 16-byte rows: " + " and ".join(f"{k}={v}" for k, v in widths.items())
                             + " must be multiples of 8")
        def grouped(rows, weight):  # rows of expert e times weight[e]ᵀ, for every e at once
            return grouped_linear(rows, weight, counts)

        return self._swiglu(x, weights, grouped, operands)

    def operands(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The stacks the experts multiply by, experts first, in ``dtype``: ``w13`` (w1 over w3) and ``w2``."""
        return dict(zip(("w13", "w2"), cast_stacked([[self.w1, self.w3], [self.w2]], dtype, self.kernel_backend)))

    def grouped_widths(self) -> dict[str, int]:
        """The row widths the grouped GEMM reads, by the setting that sizes them."""
        return {"model.dim": self.dim, "model.moe.inter_dim": self.inter_dim}

    def product(self, name: str, rows: torch.Tensor, matmul, operands: dict) -> torch.Tensor:
        """``rows`` times stack ``name`` (``w13`` or ``w2``) of ``operands`` by ``matmul(rows, weight)``."""
        return matmul(rows, operands[name])

    def _swiglu(self, x, weights, matmul, operands: dict):
        """``W2 · swiglu(W13 x)`` by ``matmul(rows, weight)`` (``F.linear`` on one expert's matrices, or the grouped
        GEMM on the stacks); ``operands``: ``operands()``, or one expert's slices of it."""
        h = self.product("w13", x, matmul, operands)  # [gate | up]
        h = kernels.ops(self.kernel_backend, x.device).swiglu(h, self.swiglu_limit, weights)
        return self.product("w2", h, matmul, operands)


def expert_key(j: int, name: str) -> str:
    """The state-dict name of expert ``j``'s slice of stacked parameter ``name``: ``w1`` -> ``{j}.w1.weight``, its
    adapter's ``lora.w1.A`` -> ``{j}.w1.lora.A`` (``model/lora.py``)."""
    if name.startswith("lora."):
        _, matrix, half = name.split(".")
        return f"{j}.{matrix}.lora.{half}"
    return f"{j}.{name}.weight"


def _per_expert_state(module: RoutedExperts, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: each stacked matrix (and adapter) replaced by its experts' slices under the reference
    names."""
    names = [n for n, _ in module.named_parameters()]
    stacked = {name: state_dict.pop(prefix + name) for name in names}
    for i, j in enumerate(module.expert_ids):
        for name in names:
            state_dict[prefix + expert_key(j, name)] = stacked[name][i]


def _stack_expert_state(module: RoutedExperts, state_dict, prefix, local_metadata, strict, missing_keys,
                        unexpected_keys, error_msgs) -> None:
    """load_state_dict pre-hook: the held experts' per-expert entries stacked under the Parameters' names. A missing
    or misshapen expert is reported under its own name and keeps its current values."""
    for name, param in module.named_parameters():
        found = {}
        for i, j in enumerate(module.expert_ids):
            key = prefix + expert_key(j, name)
            if key not in state_dict:
                missing_keys.append(key)
            elif state_dict[key].shape != param.shape[1:]:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)}"
                                  f" from checkpoint, the shape in current model is {tuple(param.shape[1:])}.")
            else:
                found[i] = state_dict[key]
            state_dict.pop(key, None)
        if not found:  # nothing of this matrix to load: it keeps its values
            state_dict[prefix + name] = param.detach()
            continue
        like = next(iter(found.values()))
        state_dict[prefix + name] = torch.stack([found[i] if i in found else param.detach()[i].to(like)
                                                 for i in range(len(module.expert_ids))])


def sort_by_expert(indices: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing slots (token, choice), flattened token-major, ordered by expert (stable: by token within one) and
    the count of slots per expert: ``(order [N·k], counts [n_experts])``. The token of slot ``s`` is ``s // k``.
    Counted by a scatter rather than ``bincount``, which reads its input's maximum on the host."""
    flat = indices.flatten()
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return flat.argsort(stable=True), counts


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``inverse[order[i]] = i``: where each element of a permutation's input went."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class _Reorder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def reorder(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[order]`` for a permutation ``order`` of x's rows (``inverse``: ``inverse_permutation(order)``), whose
    backward is the gather ``grad[inverse]``: ``index_select``'s own backward adds the rows back atomically."""
    return _Reorder.apply(x, order, inverse)


class LocalDispatch:
    """Routed slots to the experts of this process: ``(experts, rows, counts, weights, meanwhile) -> (rows,
    meanwhile())`` with ``rows`` [M, dim] sorted by expert, ``counts`` [E] per global expert, ``weights`` [M]; each
    output row is its slot's expert output (weighted). ``meanwhile`` is the work an exchange may overlap (the shared
    expert); here it simply runs first. Held experts only (a subset of ``expert_ids``, as the tests split them): the
    others' slots are zeros, so a partition of the experts over modules adds up to the whole routed part; that case
    reads the held rows' bounds on the host. The expert-parallel dispatch (``parallel/experts.py``) has the same
    signature and sends the slots to their experts' ranks and back."""

    def __call__(self, experts: RoutedExperts, rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor,
                 meanwhile=None) -> tuple[torch.Tensor, object]:
        during = meanwhile() if meanwhile is not None else None
        held = experts.expert_ids
        if len(held) == counts.numel():
            return experts(rows, counts, weights), during
        lo, hi = F.pad(counts.cumsum(0), (1, 0))[[held.start, held.stop]].tolist()  # a host sync
        out = rows.new_zeros(rows.shape[0], rows.shape[1], dtype=compute_dtype(rows))
        out[lo:hi] = experts(rows[lo:hi], counts[held.start:held.stop], weights[lo:hi])
        return out, during


class MoE(nn.Module):
    """``y = Σ_{e in top-k} expert_e(x, w_e) + shared(x)``, summed in fp32, every routed slot computed (no capacity
    factor, no dropped tokens). The slots reach their experts through ``dispatch``: this process's experts
    (``LocalDispatch``; with a subset of ``expert_ids`` the routed part is only those experts' share, plus the whole
    shared expert), or the expert-parallel all-to-all of ``parallel/experts.py``, where each rank holds a range of
    the experts and the routed part is whole.

    ``load`` (non-persistent, fp32 [E]) accumulates the tokens routed to each expert in every training forward, not
    in the recomputation of a checkpointed layer for its backward; ``take_load()`` returns and zeroes it."""

    def __init__(self, dim: int, args: MoEArgs, kernel_backend: str = "auto", expert_ids: range | None = None,
                 dispatch=None):
        super().__init__()
        args.check()
        self.args, self.kernel_backend = args, kernel_backend
        self.dispatch = dispatch or LocalDispatch()
        self.gate = Gate(dim, args)
        self.experts = RoutedExperts(dim, args, expert_ids, kernel_backend)
        if args.n_shared_experts:
            self.shared_experts = Expert(dim, args.inter_dim, args.swiglu_limit, kernel_backend)
        self.register_buffer("load", torch.zeros(args.n_routed_experts, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k, ops = x.shape, self.args.n_activated_experts, kernels.ops(self.kernel_backend, x.device)
        x = x.reshape(-1, shape[-1])
        weights, indices = self.gate(x)
        order, counts = sort_by_expert(indices, self.args.n_routed_experts)
        if self.training and not kernels.recomputing():
            self.load += counts
        slot = inverse_permutation(order)  # slot[t·k + j]: where choice j of token t sits in expert order
        has_shared = self.args.n_shared_experts > 0
        # x[t] to its k slots in the experts' dtype, and (for the shared expert) x itself in that dtype, one pass
        rows, xc = ops.permute_rows(x, slot.view(-1, k), compute_dtype(x), copy=has_shared)
        shared = (lambda: self.shared_experts(xc)) if has_shared else None
        rows, y_shared = self.dispatch(self.experts, rows, counts, reorder(weights.flatten(), order, slot),
                                       meanwhile=shared)
        # y[t] = shared(x)[t] + Σ_j rows[slot[t, j]] in fp32, rounded to x's dtype once
        return ops.unpermute_rows(rows, slot.view(-1, k), y_shared, x.dtype).view(shape)

    def take_load(self) -> torch.Tensor:
        """The tokens per expert counted since the last call (fp32 [E]); the count restarts at zero."""
        load = self.load.clone()
        self.load.zero_()
        return load


@torch.no_grad()
def update_bias(gate: Gate, load: torch.Tensor, rate: float) -> None:
    """The auxiliary-loss-free balance step (DeepSeek-V3): ``bias_e += rate · sign(mean(load) − load_e)``, so an
    overloaded expert is picked less often and an idle one more. ``load`` is summed by the caller over the step's
    microbatches and data-parallel replicas."""
    load = load.to(gate.bias)
    gate.bias += rate * torch.sign(load.mean() - load)


def routing_stats(load: torch.Tensor, bias: torch.Tensor) -> dict[str, float]:
    """Balance metrics of a load [E] (tokens per expert) and the gate's bias: ``load_max_over_mean`` (1 when
    balanced, E when every token goes to one expert), ``load_entropy`` of the normalised load in nats (ln E when
    uniform, 0 when one expert takes everything), ``idle_experts`` (experts that received no token), ``bias_min``,
    ``bias_max``. A load of no tokens gives NaN for the two load metrics."""
    load = load.double()
    share = load / load.sum()
    values = torch.stack([load.max() / load.mean(), -torch.special.xlogy(share, share).sum(),
                          (load == 0).sum().double(), bias.double().min(), bias.double().max()])
    return dict(zip(("load_max_over_mean", "load_entropy", "idle_experts", "bias_min", "bias_max"), values.tolist()))
