"""Context parallelism's kernels on a GPU (issue 37): chunks of a row through the Triton kernels equal the whole row.

    CSA2_CODE=<commit> python bench/context_check.py --out $OUT/context_check.json [--seq-len 16384] [--chunks 2]

The CPU tests prove the exchanges exact in fp64 with the PyTorch kernels. What they cannot show is the GPU
kernels on a chunk's operands, which a whole row never gives them: queries ``L + window - 1`` (the chunk and its
window halo) against the whole row's ``S`` compressed entries, top-k indices into entries of other chunks, window
bounds shifted by the halo. Here ``C`` processes share the one GPU (gloo; its all-gather takes host tensors, so the
shard stages them through the host, the only change to ``parallel/context.py``'s exchanges), each computing its
chunk with the Triton kernels in bf16 autocast, on ``model=small``'s V4.1 attention shapes cut to 12 layers (every
mode: window, Full m=2 + Reuse, Full m=1 as the candidate source + Reuse, Reindex). The row has documents that
start before the border and end after it, and one that ends exactly at it.

Compared with the whole row through the same kernels (one process): the logits, the LM loss, each indexer KL, and
every parameter's gradient summed over the chunks, as relative errors ``|chunks - whole| / |whole|``. bf16 makes
these nonzero (the per-token GEMMs tile differently at other M, and the chunks' gradient sums run in another
order), so the yardstick is the same row through the PyTorch kernels (``model.kernel_backend=torch``): ``floor`` is
its distance to the Triton whole row. A check passes when the chunks are no farther from the whole row than twice
the floor; ``no_halo`` (the window halo replaced by zeros) must fail it, so the check can fail.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

LAYOUT = ["model=small", "layout=v41", "layout.window_layers=1", "layout.encoder.layers=6",
          "layout.decoder.layers=5"]
SMOKE = ["model=tiny", "layout=v41_scaled"]  # --smoke: the same code on the CPU in seconds (the floor is 0 there)


def rows(T: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, T), generator=g)
    doc = torch.zeros(1, T, dtype=torch.long)
    doc[0, T // 2 - T // 5 + 1:] = 1  # crosses the border at T/2, starting at an odd token (a straddling m=2 group)
    doc[0, 3 * T // 4:] = 2  # ends at the border of C = 4's third chunk
    labels = torch.roll(ids, -1, 1).masked_fill(torch.roll(doc, -1, 1) != doc, -100)
    labels[:, -1] = -100
    return ids, doc, labels


def build(overrides: list[str], backend: str, device):
    from model import ModelArgs, layout_from_config
    from model.cli import compose
    from model.transformer import Transformer

    cfg = compose(overrides + [f"model.kernel_backend={backend}"])
    return Transformer(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout), seed=0).to(device)


def step(model, ids, doc, labels, context=None):
    """Forward and backward of the row (or of ``context``'s chunk): (logits, lm, indexer KLs, gradients)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        state = model.new_state(doc, ids, context=context)
        chunk = state.geometry.chunk_of
        x, pre = model.run_layers(*model.embed_tokens(chunk(ids)), state)
        logits = model.logits(x, pre)
    count = int((labels != -100).sum())
    lm = F.cross_entropy(logits.flatten(0, 1).float(), chunk(labels).flatten(), ignore_index=-100,
                         reduction="sum") / count
    indexer = dict(sorted(state.indexer_losses.items()))
    (lm + sum(indexer.values())).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), lm.detach(), {k: v.detach() for k, v in indexer.items()}, grads


def distances(got, want) -> dict[str, float]:
    """Relative distance of each quantity: logits, lm, indexer/<source>, and grad/<parameter>."""
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    out = {"logits": rel(got[0], want[0]), "lm": rel(got[1], want[1])}
    out.update({f"indexer/{k}": rel(got[2][k], v) for k, v in want[2].items()})
    out.update({f"grad/{k}": rel(got[3][k], v) for k, v in want[3].items()})
    return out


def _worker(rank: int, overrides: list[str], T: int, C: int, out: str) -> None:
    from parallel.context import ContextShard

    class HostShard(ContextShard):
        """gloo gathers host tensors: stage each exchange through the host (results unchanged, bits included)."""

        def _all_gather(self, x):
            return [p.to(x.device) for p in super()._all_gather(x.cpu())]

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    ids, doc, labels = (t.to(device) for t in rows(T))
    shard = HostShard(dist.group.WORLD, list(range(C)), T)
    model = build(overrides, "auto", device)
    whole = step(model, ids, doc, labels) if rank == 0 else None
    result = {}
    for variant in ("exact", "no_halo"):
        saved = ContextShard.halo
        if variant == "no_halo":
            ContextShard.halo = lambda self, x, rows: saved(self, x, rows) * 0
        try:
            logits, lm, indexer, grads = step(model, ids, doc, labels, shard)
        finally:
            ContextShard.halo = saved
        parts = [torch.empty_like(logits.cpu()) for _ in range(C)]
        dist.all_gather(parts, logits.cpu())
        packed = torch.stack([lm, *indexer.values()]).cpu()
        dist.all_reduce(packed)
        for g in grads.values():  # the sum over chunks, through the host (gloo)
            host = g.cpu()
            dist.all_reduce(host)
            g.copy_(host)
        if rank == 0:
            chunks = (torch.cat(parts, dim=1).to(device), packed[0].to(device),
                      dict(zip(indexer, packed[1:].to(device))), grads)
            result[variant] = distances(chunks, whole)
        del grads
    if rank == 0:
        del model
        torch.cuda.empty_cache()
        floor = distances(step(build(overrides, "torch", device), ids, doc, labels), whole)
        torch.save({"floor": floor, **result}, os.path.join(out, "distances.pt"))


def _entry(rank: int, world: int, port: int, args: tuple) -> None:
    """``parallel.local.spawn``'s environment, but every rank on device 0 (LOCAL_RANK would name a GPU)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    _worker(rank, *args)


def verdict(d: dict) -> dict:
    """Each variant's worst quantities against twice the floor (a quantity with a zero floor: against 1e-6)."""
    report = {}
    for variant in ("exact", "no_halo"):
        over = {k: (v, d["floor"][k]) for k, v in d[variant].items() if v > max(2 * d["floor"][k], 1e-6)}
        worst = sorted(d[variant].items(), key=lambda kv: -kv[1] / max(d["floor"][kv[0]], 1e-6))[:8]
        report[variant] = {"passes": not over, "over_twice_floor": len(over),
                           "worst": {k: {"chunks": v, "floor": d["floor"][k]} for k, v in worst},
                           "logits": d[variant]["logits"], "lm": d[variant]["lm"],
                           "max_grad": max(v for k, v in d[variant].items() if k.startswith("grad/"))}
    report["floor_max_grad"] = max(v for k, v in d["floor"].items() if k.startswith("grad/"))
    return report


def main() -> int:
    import torch.multiprocessing as mp
    from parallel.local import free_port
    from result_meta import result_meta

    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="model=tiny on the CPU (checks the script, not kernels)")
    a = p.parse_args()
    overrides = SMOKE if a.smoke else LAYOUT
    tmp = Path(a.out).with_suffix(".d")
    tmp.mkdir(parents=True, exist_ok=True)
    mp.spawn(_entry, args=(a.chunks, free_port(), (overrides, a.seq_len, a.chunks, str(tmp))), nprocs=a.chunks)
    d = torch.load(tmp / "distances.pt")
    res = {**result_meta(), "command": " ".join(["python", *sys.argv]), "model": overrides, "seq_len": a.seq_len,
           "chunks": a.chunks, **verdict(d), "distances": d}
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "distances"}, indent=1))
    return 0 if res["exact"]["passes"] and not res["no_halo"]["passes"] else 1


if __name__ == "__main__":
    sys.exit(main())
