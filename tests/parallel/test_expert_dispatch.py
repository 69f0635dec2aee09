"""The expert-parallel all-to-all (parallel/experts.py) against every expert in one process, on 2 gloo processes.

Each rank routes its own slots (rows sorted by expert, with their routing weights) to the rank holding their experts
and gets the weighted outputs back; the reference runs the same slots through a module holding all experts. The
outputs, the gradients of the rows and of the routing weights (the gate learns through them) and every expert's
weight gradient (its owner's, summed over both ranks' slots) must be equal to float rounding. Cases: a random
routing, every slot to one expert (the other rank receives nothing), and a rank that routes nothing at all to the
other's experts, with empty experts on both sides; each with the shared expert's stand-in overlapping the exchange
(``overlap``, the default) and after it. A backward that does not send the gradients back (either direction), or an
overlapped exchange read before it is waited on, fails it.
"""
import pytest
import torch

from model.config import MoEArgs
from model.moe import LocalDispatch, RoutedExperts
from parallel.local import spawn

ARGS = MoEArgs(n_routed_experts=4, n_activated_experts=2, inter_dim=8, swiglu_limit=10.0)
DIM, WORLD = 8, 2
CASES = ("random", "one_expert", "only_local")


def _slots(rank: int, case: str):
    """This rank's slots: expert ids, rows [M, DIM] and weights [M], sorted by expert."""
    g = torch.Generator().manual_seed(10 + rank)
    n = 6 + 3 * rank
    experts = {"random": torch.randint(0, 4, (n,), generator=g),
               "one_expert": torch.zeros(n, dtype=torch.long),
               "only_local": torch.randint(0, 2, (n,), generator=g) + 2 * rank}[case]
    experts = experts.sort().values
    return experts, torch.randn(n, DIM, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)


def _full():
    torch.manual_seed(0)
    experts = RoutedExperts(DIM, ARGS).double()
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.5)
    return experts


def _run(experts, dispatch, ids, rows, weights):
    rows, weights = rows.clone().requires_grad_(), weights.clone().requires_grad_()
    counts = torch.bincount(ids, minlength=ARGS.n_routed_experts)
    out, during = dispatch(experts, rows, counts, weights, meanwhile=lambda: "shared")
    assert during == "shared"
    (out * torch.arange(1, out.numel() + 1, dtype=out.dtype).view_as(out)).sum().backward()
    grads = {n: p.grad.clone() for n, p in experts.named_parameters()}
    return out.detach(), rows.grad, weights.grad, grads


def _worker(rank, out):
    """Every case, with and without overlap, each through a dispatch of its own (one spawn for all: a spawn's
    start-up cost more than its exchanges)."""
    import torch.distributed as dist

    from parallel.experts import ExpertAllToAll

    group, results = dist.new_group([0, 1]), {case: {} for case in CASES}
    for case in CASES:
        for overlap in (True, False):
            dispatch = ExpertAllToAll(group, [0, 1], overlap)
            full = _full()
            mine = RoutedExperts(DIM, ARGS, dispatch.experts_of(ARGS.n_routed_experts)).double()
            with torch.no_grad():
                for name in ("w1", "w2", "w3"):
                    getattr(mine, name).copy_(getattr(full, name)[mine.expert_ids.start:mine.expert_ids.stop])
            results[case][overlap] = _run(mine, dispatch, *_slots(rank, case))
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dispatch")
    spawn(_worker, WORLD, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(params=CASES)
def exchanged(request, runs):
    return request.param, [ranks[request.param] for ranks in runs]


def test_the_all_to_all_equals_every_expert_in_one_process(exchanged):
    case, ranks = exchanged
    reference = [_run(_full(), LocalDispatch(), *_slots(r, case)) for r in range(WORLD)]
    for overlap in (True, False):
        for r in range(WORLD):
            out, grad_rows, grad_weights, _ = ranks[r][overlap]
            want_out, want_rows, want_weights, _ = reference[r]
            assert torch.allclose(out, want_out, rtol=1e-12, atol=1e-12), (case, overlap, r)
            assert torch.allclose(grad_rows, want_rows, rtol=1e-12, atol=1e-12), (case, overlap, r)
            assert torch.allclose(grad_weights, want_weights, rtol=1e-12, atol=1e-12), (case, overlap, r)
        # an expert's weight gradient lives on its owner and sums both ranks' slots (the reference sums per rank)
        for name in ("w1", "w2", "w3"):
            want = reference[0][3][name] + reference[1][3][name]
            got = torch.cat([ranks[r][overlap][3][name] for r in range(WORLD)])
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (case, overlap, name)


def test_the_cases_are_what_they_say(exchanged):
    case, _ = exchanged
    ids = [_slots(r, case)[0] for r in range(WORLD)]
    if case == "one_expert":  # rank 1 (experts 2, 3) receives nothing; experts 1..3 are empty
        assert all((i == 0).all() for i in ids)
    if case == "only_local":  # nothing crosses: each rank's slots go to its own experts
        assert all(((i >= 2 * r) & (i < 2 * r + 2)).all() for r, i in enumerate(ids))
