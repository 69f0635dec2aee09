"""The Engram table's rows split over 2 gloo processes (parallel/rows.py's RowExchange) against one process.

One spawn runs every case; each rank saves what it looked up and its gradients, and the test compares them with
plain indexing of the whole table (rows; the gradient: every rank's row gradients summed into the rows' owner) and
with the Engram update of one process holding the whole table, batch by batch."""
import torch

from model.config import EngramArgs
from model.engram import Engram, EngramTable
from parallel.local import spawn

WORLD, ROWS, DIM = 2, 11, 3  # ceil(11 / 2) = 6 rows a rank: rank 0 rows 0..5, rank 1 rows 6..10 and a padding row
PART = -(-ROWS // WORLD)
CASES = {  # the ids each rank looks up
    "mixed_with_an_idle_rank": ([[0, 7, 7], [5, 10, 0]], []),  # rank 1 needs nothing; rank 0 both ranks' rows
    "the_other_rank_only": ([6, 9, 9, 6, 10], [[1, 1], [4, 0]]),  # each rank only rows of the other
}
ARGS = EngramArgs(layers=(1,), max_ngram_size=3, n_heads=2, head_dim=DIM)
HC, MODEL_DIM, EPS = 2, 4, 1e-20


def table_values() -> torch.Tensor:
    return torch.randn(ROWS, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def row_grads(rank: int, shape) -> torch.Tensor:
    return torch.randn(*shape, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))


def batch(rank: int):
    """Rank r's stream, its ids (rank 0 draws from both ranks' rows, rank 1 from rank 0's only) and the
    stream gradient."""
    g = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(2, 3, HC, MODEL_DIM, dtype=torch.float64, generator=g)
    ids = torch.randint(0, ROWS if rank == 0 else PART, (2, 3, 4), generator=g)
    return x, ids, torch.randn(x.shape, dtype=torch.float64, generator=g)


def engram(exchange=None, rank: int = 0, world: int = 1) -> Engram:
    module = Engram(MODEL_DIM, HC, ARGS, ROWS, EPS, exchange, rank, world).double()
    g = torch.Generator().manual_seed(1)
    whole = torch.cat([table_values(), torch.zeros(world * module.embed.part_rows - ROWS, DIM, dtype=torch.float64)])
    with torch.no_grad():
        module.embed.weight.copy_(whole[module.embed.start:module.embed.start + module.embed.part_rows])
        for p in (module.wkv.weight, module.q_weight, module.k_weight):
            p.copy_(torch.randn(p.shape, dtype=torch.float64, generator=g))
    return module


def dense(grad) -> torch.Tensor:
    assert grad.is_sparse
    return grad.to_dense()


def _worker(rank: int, out: str) -> None:
    from parallel.rows import RowExchange

    exchange, results = RowExchange(), {}
    for name, ids in CASES.items():
        table = EngramTable(ROWS, DIM, exchange, rank, WORLD).double()
        with torch.no_grad():
            table.weight.zero_()[:min(PART, ROWS - table.start)] = table_values()[table.start:table.start + PART]
        ids = torch.tensor(ids[rank], dtype=torch.long)
        rows = table(ids)
        (rows * row_grads(rank, ids.shape)).sum().backward()
        grad = table.weight.grad.coalesce()
        results[name] = {"rows": rows.detach(), "grad_rows": grad.indices()[0], "grad": dense(grad)}
    module = engram(exchange, rank, WORLD)
    x, ids, grad_out = batch(rank)
    x.requires_grad_()
    y = module(x, ids)
    (y * grad_out).sum().backward()
    results["engram"] = {"y": y.detach(), "x": x.grad, "table": dense(module.embed.weight.grad),
                         **{n: p.grad for n, p in module.named_parameters() if n != "embed.weight"}}
    torch.save(results, f"{out}/rank{rank}.pt")


def test_sharded_lookup_matches_one_process(tmp_path):
    """Rows and the owners' sparse gradients of 2 ranks ≡ the whole table in one process, for a rank that needs
    nothing and for ranks that need only the other's rows; the Engram update (its output, the stream's and every
    parameter's gradient) ≡ one process per batch. Planted: backward returning no gradient to the other rank
    (each keeps only its own rows'), duplicate ids' gradients not summed (``index_copy_``), the rows' owner taken
    as ``id % world`` (a worker fails): each fails."""
    spawn(_worker, WORLD, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    whole = table_values()
    for name, per_rank in CASES.items():
        grad = torch.zeros(WORLD * PART, DIM, dtype=torch.float64)
        for rank, ids in enumerate(per_rank):
            ids = torch.tensor(ids, dtype=torch.long)
            torch.testing.assert_close(results[rank][name]["rows"], whole[ids].view(*ids.shape, DIM), rtol=0, atol=0)
            grad.index_add_(0, ids.flatten(), row_grads(rank, ids.shape).view(-1, DIM))
        looked_up = sorted({i for ids in per_rank for i in torch.tensor(ids, dtype=torch.long).flatten().tolist()})
        for rank in range(WORLD):
            own = range(rank * PART, (rank + 1) * PART)
            assert results[rank][name]["grad_rows"].tolist() == [i - own.start for i in looked_up if i in own], name
            torch.testing.assert_close(results[rank][name]["grad"], grad[own.start:own.stop], rtol=1e-13, atol=1e-13)
    one = engram()
    table_grad = torch.zeros(WORLD * PART, DIM, dtype=torch.float64)
    for rank in range(WORLD):
        one.zero_grad(set_to_none=True)
        x, ids, grad_out = batch(rank)
        x.requires_grad_()
        y = one(x, ids)
        (y * grad_out).sum().backward()
        got = results[rank]["engram"]
        torch.testing.assert_close(got["y"], y.detach(), rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(got["x"], x.grad, rtol=1e-13, atol=1e-13)
        for n, p in one.named_parameters():
            if n != "embed.weight":
                torch.testing.assert_close(got[n], p.grad, rtol=1e-13, atol=1e-13)
        table_grad[:ROWS] += dense(one.embed.weight.grad)
    for rank in range(WORLD):
        torch.testing.assert_close(results[rank]["engram"]["table"], table_grad[rank * PART:(rank + 1) * PART],
                                   rtol=1e-13, atol=1e-13)
