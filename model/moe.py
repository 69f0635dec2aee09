"""The Mixture-of-Experts FFN of DeepSeek-V4.1-Flash (SPEC §5.1): a gate picks ``k`` of ``E`` routed experts per
token, every token also goes through one shared expert, and a bias outside the gradient balances the experts.

Why it is built this way:
- The routed experts are *stacked*: ``w1``, ``w2``, ``w3`` are one Parameter each, ``[E_local, out, in]``, so the
  tokens of all local experts go through one grouped GEMM per matrix (``torch.nn.functional.grouped_mm`` over the
  tokens sorted by expert, with the per-expert counts as offsets) instead of a launch per expert: 384 experts of
  a few hundred tokens each are too small for separate GEMMs. In bf16 on the H200 grouped_mm reads the counts on
  the device (no host sync; in fp32 it falls back to a loop over the groups that reads them on the host); it is not
  autocast-aware, so the operands are cast to the autocast dtype here. Expert parallelism later splits dim 0
  (``expert_ids``), and the checkpoint still names every expert on its own (``experts.{j}.w1.weight``, the
  reference's names) through state-dict hooks.
- Dispatch is a few small functions (``sort_by_expert``, the ``dispatch`` of the sorted rows to
  ``RoutedExperts.forward``, ``combine``) so that the expert-parallel all-to-all (``parallel/experts.py``) sits
  between them as the dispatch, unchanged otherwise.
- Where fp32 happens: the gate (scores, top-k, weights) always runs in fp32 whatever autocast says, since the
  selection and the weights are sensitive to rounding; each expert's SwiGLU (clamp, silu, the product, the routing
  weight) is fp32 on the GEMMs' outputs and is rounded to the compute dtype once, as W2's input; the k routed
  outputs and the shared expert's are summed in fp32, and the sum is rounded to the input's dtype once.
- The routing weight multiplies the hidden activation, before W2 (as the reference does), so a token's weight is
  already in its expert output and ``combine`` only adds rows.
- The balance bias selects experts and never weights them (``Gate``); it is a buffer, so no optimizer sees it, and
  ``update_bias`` moves it by the loads that ``MoE.load`` counts over training forwards.
"""
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from model.attention import linear
from model.config import MoEArgs
from model.lora import adapted
from model.weights import matmul_weights

GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what grouped_mm multiplies (no fp64)
ROUTED_WEIGHTS = ("w1", "w2", "w3")


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
        with torch.autocast(x.device.type, enabled=False):
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


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None = None):
    """``silu(min(gate, limit)) · clamp(up, ±limit) · weights`` (no clamp for ``limit`` 0): an expert's hidden
    activation, W2's input, in fp32 (fp64 in an fp64 model). The clamps are the reference's (they keep the fp8/fp4
    activations in range)."""
    dtype = torch.promote_types(gate.dtype, torch.float32)
    gate, up = gate.to(dtype), up.to(dtype)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    h = F.silu(gate) * up
    return h if weights is None else h * weights


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the GEMMs run in: autocast's where it is on, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Expert(nn.Module):
    """One SwiGLU expert with ``nn.Linear`` matrices (the shared expert): ``W2 · clamped_swiglu(W1 x, W3 x, w)``;
    W1 and W3 run as one GEMM on the stacked weights, as the dense FFN's do."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float = 0.0, kernel_backend: str = "auto"):
        super().__init__()
        self.swiglu_limit, self.kernel_backend = swiglu_limit, kernel_backend
        self.w1, self.w2, self.w3 = linear(dim, inter_dim), linear(inter_dim, dim), linear(dim, inter_dim)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., dim]; ``weights`` (broadcast against [..., inter], e.g. [N, 1]) scale the hidden activation."""
        w13, w2 = matmul_weights([(self.w1, self.w3), self.w2], self.kernel_backend)
        gate, up = F.linear(x, w13).chunk(2, dim=-1)
        h = clamped_swiglu(adapted(gate, self.w1, x), adapted(up, self.w3, x), self.swiglu_limit, weights)
        h = h.to(compute_dtype(x))
        return adapted(F.linear(h, w2), self.w2, h)


class RoutedExperts(nn.Module):
    """The routed experts ``expert_ids`` (a range of global ids; default all), stacked: ``w1 [E_local, inter, dim]``,
    ``w2 [E_local, dim, inter]``, ``w3 [E_local, inter, dim]``.

    ``named_parameters()`` has the stacked names; ``state_dict()`` and ``load_state_dict`` use the reference's per-
    expert names ``{j}.w1.weight`` (j global), the entries being views of the stacked tensors (no copy: a writer that
    refuses shared storage, like safetensors, needs them cloned)."""

    def __init__(self, dim: int, args: MoEArgs, expert_ids: range | None = None):
        super().__init__()
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
        and the only way in fp64); the two compute the same function. Adapters (``lora``, ``model/lora.py``) run
        beside each matrix by the same path, their stacks being experts-first like the weights."""
        dtype = compute_dtype(x)
        x, weights = x.to(dtype), weights.unsqueeze(-1)
        adapters = getattr(self, "lora", None)
        stacks = {w: (getattr(self, w), *((adapters[w].A, adapters[w].B) if adapters else ())) for w in ROUTED_WEIGHTS}
        stacks = {w: [t.to(dtype) for t in ts] for w, ts in stacks.items()}  # a cast under autocast, else themselves
        if grouped is None:
            grouped = x.device.type == "cuda" and dtype in GROUPED_MM_DTYPES
        if not grouped:
            bounds = [0, *counts.cumsum(0).tolist()]
            return torch.cat([self._swiglu(x[lo:hi], weights[lo:hi], F.linear,
                                           {w: [t[i] for t in ts] for w, ts in stacks.items()})
                              for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))])
        rank = adapters["w1"].A.shape[1] if adapters else 0
        if self.dim % 8 or self.inter_dim % 8 or rank % 8:
            raise ValueError(f"grouped_mm needs 16-byte rows: model.dim={self.dim}, model.moe.inter_dim="
                             f"{self.inter_dim}" + (f" and train.lora.rank={rank}" if adapters else "")
                             + " must be multiples of 8")
        offsets = counts.cumsum(0, dtype=torch.int32)

        def grouped_linear(rows, weight):  # rows of expert e times weight[e]ᵀ, for every e at once
            return F.grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)

        return self._swiglu(x, weights, grouped_linear, stacks)

    def _swiglu(self, x, weights, matmul, stacks: dict[str, list[torch.Tensor]]):
        """``stacks``: each matrix's ``[weight]`` or ``[weight, A, B]`` (an expert's, or the stacks for ``matmul``)."""
        def project(rows, w):
            weight, *low_rank = stacks[w]
            y = matmul(rows, weight)
            return y + self.lora[w](rows, matmul, *low_rank) if low_rank else y

        h = clamped_swiglu(project(x, "w1"), project(x, "w3"), self.swiglu_limit, weights)
        return project(h.to(x.dtype), "w2")


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


class LocalDispatch:
    """Routed slots to the experts of this process: ``(experts, rows, counts, weights, meanwhile) -> (rows,
    meanwhile())`` with ``rows`` [M, dim] sorted by expert, ``counts`` [E] per global expert, ``weights`` [M]; each
    output row is its slot's expert output (weighted). ``meanwhile`` is the work an exchange may overlap (the shared
    expert); here it simply runs first. Held experts only (a subset of ``expert_ids``): the others' slots are zeros, so a partition
    of the experts over modules adds up to the whole routed part. The expert-parallel dispatch
    (``parallel/experts.py``) has the same signature and sends the slots to their experts' ranks and back."""

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


def combine(rows: torch.Tensor, token: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Expert output rows (already weighted) added into their tokens, in fp32 (at least): [n_tokens, dim]."""
    dtype = torch.promote_types(rows.dtype, torch.float32)
    return rows.new_zeros(n_tokens, rows.shape[-1], dtype=dtype).index_add_(0, token, rows.to(dtype))


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
        self.args = args
        self.dispatch = dispatch or LocalDispatch()
        self.gate = Gate(dim, args)
        self.experts = RoutedExperts(dim, args, expert_ids)
        if args.n_shared_experts:
            self.shared_experts = Expert(dim, args.inter_dim, args.swiglu_limit, kernel_backend)
        self.register_buffer("load", torch.zeros(args.n_routed_experts, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, self.args.n_activated_experts
        x = x.reshape(-1, shape[-1])
        weights, indices = self.gate(x)
        order, counts = sort_by_expert(indices, self.args.n_routed_experts)
        if self.training and not kernels.recomputing():
            self.load += counts
        xc = x.to(compute_dtype(x))  # the experts' operand, cast once before it is gathered k times
        token = order // k
        shared = (lambda: self.shared_experts(xc)) if self.args.n_shared_experts else None
        slots, slot_weights = xc.index_select(0, token), weights.flatten()[order]
        rows, y_shared = self.dispatch(self.experts, slots, counts, slot_weights, meanwhile=shared)
        y = combine(rows, token, x.shape[0])  # the gather's backward: an index_add
        if y_shared is not None:
            y = y + y_shared
        return y.to(x.dtype).view(shape)

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
    uniform, 0 when one expert takes everything), ``bias_min``, ``bias_max``. A load of no tokens gives NaN for
    the two load metrics."""
    load = load.double()
    share = load / load.sum()
    values = torch.stack([load.max() / load.mean(), -torch.special.xlogy(share, share).sum(),
                          bias.double().min(), bias.double().max()])
    return dict(zip(("load_max_over_mean", "load_entropy", "bias_min", "bias_max"), values.tolist()))
