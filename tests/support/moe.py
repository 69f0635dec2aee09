"""What test_moe.py shares with other tests (ARGS, DIM, make_moe, ref_moe, ref_params, tokens), here so that no test
module imports another."""
import torch

from model.config import MoEArgs
from model.moe import MoE


DIM, INTER = 16, 8  # multiples of 8: grouped_mm's 16-byte rows in bf16
ARGS = MoEArgs(n_routed_experts=6, n_activated_experts=2, inter_dim=INTER, gate_temp=0.7, route_scale=1.5,
               swiglu_limit=0.5)


def ref_scores(x_t, gate_weight, args):
    z = (gate_weight @ x_t) / args.gate_temp
    if args.score_func == "softmax":
        return torch.exp(z) / torch.exp(z).sum()
    if args.score_func == "sigmoid":
        return 1 / (1 + torch.exp(-z))
    return torch.sqrt(torch.log1p(torch.exp(z)))


def ref_route(x_t, gate_weight, bias, args):
    """(experts, weights) of one token: the k best of score + bias, weighted by their unbiased scores."""
    s = ref_scores(x_t, gate_weight, args)
    chosen = sorted(range(len(s)), key=lambda e: -(s[e] + bias[e]).item())[:args.n_activated_experts]
    weights = [s[e] for e in chosen]
    if args.norm_topk_prob and len(chosen) > 1:
        total = sum(weights)
        weights = [w / (total + 1e-20) for w in weights]
    return chosen, [w * args.route_scale for w in weights]


def ref_expert(x_t, w1, w2, w3, weight, limit):
    """(W2 h, h) with h = silu(min(W1 x, L)) * clamp(W3 x, ±L) * weight."""
    g, u = w1 @ x_t, w3 @ x_t
    if limit > 0:
        g, u = torch.minimum(g, torch.tensor(limit, dtype=g.dtype)), u.clamp(-limit, limit)
    h = g / (1 + torch.exp(-g)) * u * weight
    return w2 @ h, h


def ref_moe(x, p, args):
    """The MoE of SPEC §5.1 on tokens x [N, dim], weights p by reference name."""
    rows = []
    for x_t in x:
        chosen, weights = ref_route(x_t, p["gate.weight"], p["gate.bias"], args)
        y = sum(ref_expert(x_t, *(p[f"experts.{e}.{n}.weight"] for n in ("w1", "w2", "w3")), w, args.swiglu_limit)[0]
                for e, w in zip(chosen, weights))
        if args.n_shared_experts:
            y = y + ref_expert(x_t, *(p[f"shared_experts.{n}.weight"] for n in ("w1", "w2", "w3")), 1.0,
                               args.swiglu_limit)[0]
        rows.append(y)
    return torch.stack(rows)


def ref_params(module):
    """The module's state as fp64 leaves of their own (the reference's weights)."""
    return {k: v.detach().double().clone().requires_grad_(k != "gate.bias") for k, v in module.state_dict().items()}


def make_moe(args=ARGS, seed=0, bias_scale=0.3, dtype=torch.float64, **kwargs):
    """A MoE with random weights (large enough that the clamps act) and a random bias that changes the picks."""
    torch.manual_seed(seed)
    moe = MoE(DIM, args, **kwargs)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.5)
        moe.gate.bias.normal_(std=bias_scale)
    return moe.to(dtype)


def tokens(n=10, seed=1, dtype=torch.float64):
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed), dtype=dtype)
