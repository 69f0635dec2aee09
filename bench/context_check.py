"""Context parallelism's kernels on a GPU (issues 37, 55): a row's chunks through the Triton kernels equal the row.

    CSA2_CODE=<commit> python bench/context_check.py --out $OUT/context_check.json [--seq-len 16384] [--chunks 2]
        [--plant no_halo]

The CPU tests prove the exchanges exact in fp64 with the PyTorch kernels. What they cannot show is the GPU
kernels on a chunk's operands, which a whole row never gives them: queries ``L + window - 1`` (the chunk and its
window halo) against the whole row's ``S`` compressed entries, top-k indices into entries of other chunks, window
bounds shifted by the halo. Here ``C`` processes share the one GPU (gloo; its all-gather takes host tensors, so the
shard stages them through the host, the only change to ``parallel/context.py``'s exchanges), each computing its
chunk with the Triton kernels in bf16 autocast, on ``model=small``'s V4.1 attention shapes (64 heads x 512, window
128, top-512, indexer 32 x 128, 2,048 candidate blocks) cut to 6 layers, one of every mode: window, Full m=2, its
Reuse, Full m=1 as the candidate source, its Reuse, Reindex. Every layer is recomputed in the backward (the
exchanges run again there, as in training). The row has documents that start before the border and end after it,
and one that ends exactly at it.

Compared with the whole row through the same kernels (one process): the logits, the LM loss, each indexer KL, and
every parameter's gradient summed over the chunks, as relative errors ``|chunks - whole| / |whole|``. bf16 makes
these nonzero (the per-token GEMMs tile differently at other M, and the chunks' gradient sums run in another
order), so the yardstick is the same row through the PyTorch reference kernels (``model.kernel_backend=torch``):
``floor`` is its distance to the Triton whole row. The check passes when the chunks are no farther from the whole
row than twice the floor. The reference is the independent one: the formulas of ``kernels/reference.py``, sharing
no code with the Triton kernels nor with the chunking under check, on the unsplit row. Written over the whole row
it does not fit (at 16K its attention gathers 20 GiB of key rows and its indexer 32 GiB of scores, and autograd
keeps both), so its attention and indexer ops run a block of queries at a time (``bench/query_blocks.py``, about
``--block-gib`` of intermediates a block): the same values, one block alive. ``--plant no_halo`` replaces the
window halo by zeros: that run must fail the check (exit 0 when it does), so the check can fail.

Memory at T = 64K (P = 0.483 B parameters; the GPU is shared by the C processes):
- whole row, rank 0 alone: fp32 weights and gradients 2 x 1.9 GB, bf16 weight copies ~1 GB; the 6 recomputed
  layers' inputs 6 x T x 2,048 x 4 B = 3.2 GB; the selections kept for the backward (top-k T x 512 int64 = 0.27 GB
  for each of 3 selecting layers, candidate blocks T x 2,048 int64 = 1.07 GB); one layer's forward and backward
  (q, the attention output and their gradients are T x 32,768 bf16 = 4.3 GB each; ~24 GB in all, as for
  ``model=small``'s measured 64K step): ~35 GB.
- the chunks, C processes at once: each holds its weights, gradients and copies (~5 GB) and 1/C of the activations
  above (the entries gathered over the row are T x 512 bf16, 64 MB); rank 0 also the whole row's gradients (1.9 GB)
  and logits: ~24 + 8 + 5 C GB, 52 GB at C = 4, plus C CUDA contexts (~0.5 GB each).
- the yardstick, rank 0 alone after the others exit: the whole row in the reference's fp32 per-token ops, ~1.5x the
  Triton row's layer (~36 GB), plus one query block (``--block-gib``, 2 GiB): ~45 GB.
Well under 78 GiB; at 16K a quarter of the activations. Each process's peak is measured into the result
(``peak_gib``).
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

LAYOUT = ["model=small", "layout=v41", "layout.window_layers=1", "layout.encoder.layers=2",
          "layout.encoder.group_size=2", "layout.decoder.layers=3", "layout.decoder.reindex_every=2"]
SMOKE = ["model=tiny", "layout=v41_scaled"]  # --smoke: the same code on the CPU in seconds
PLANTS = ("no_halo",)


def rows(T: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, T), generator=g)
    doc = torch.zeros(1, T, dtype=torch.long)
    doc[0, T // 2 - T // 5 + 1:] = 1  # crosses the border at T/2, starting at an odd token (a straddling m=2 group)
    doc[0, 3 * T // 4:] = 2  # ends at the border of C = 4's third chunk
    labels = torch.roll(ids, -1, 1).masked_fill(torch.roll(doc, -1, 1) != doc, -100)
    labels[:, -1] = -100
    return ids, doc, labels


def config(overrides: list[str], backend: str = "auto"):
    from model.cli import compose

    return compose(overrides + [f"model.kernel_backend={backend}"])


def build(overrides: list[str], backend: str, device):
    """The model, every layer recomputed in the backward (one layer's activations alive: 64K fits)."""
    from model import ModelArgs, layout_from_config
    from model.transformer import Transformer
    from parallel.recompute import recompute_leading

    cfg = config(overrides, backend)
    model = Transformer(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout), seed=0).to(device)
    recompute_leading(model.layers.values(), len(model.layers))
    return model


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


class _Clock:
    """Seconds and peak GPU memory (GiB allocated, and reserved: what the other processes cannot have) of each
    phase of a process."""

    def __init__(self, device):
        self.device, self.seconds, self.peak_gib = device, {}, {}

    def start(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()

    def stop(self, phase: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak_gib[phase] = {"allocated": torch.cuda.max_memory_allocated() / 2 ** 30,
                                    "reserved": torch.cuda.max_memory_reserved() / 2 ** 30}
            torch.cuda.empty_cache()  # hand the cache back to the processes sharing the GPU
        self.seconds[phase] = time.perf_counter() - self.t0


def _chunks(model, ids, doc, labels, shard, plant: str | None, device):
    """This chunk's step (with ``plant``'s bug), then its parts gathered over the group: on rank 0, the row's
    (logits, lm, indexer KLs, gradients summed over the chunks)."""
    from parallel.context import ContextShard

    saved = ContextShard.halo
    if plant == "no_halo":
        ContextShard.halo = lambda self, x, rows: saved(self, x, rows) * 0
    try:
        logits, lm, indexer, grads = step(model, ids, doc, labels, shard)
    finally:
        ContextShard.halo = saved
    parts = [torch.empty_like(logits.cpu()) for _ in range(shard.size)]
    dist.all_gather(parts, logits.cpu())
    packed = torch.stack([lm, *indexer.values()]).cpu()
    dist.all_reduce(packed)
    for g in grads.values():  # the sum over chunks, through the host (gloo)
        host = g.cpu()
        dist.all_reduce(host)
        g.copy_(host)
    return (torch.cat(parts, dim=1).to(device), packed[0].to(device), dict(zip(indexer, packed[1:].to(device))),
            grads)


def _worker(rank: int, overrides: list[str], T: int, C: int, plant: str | None, block_bytes: int, out: str) -> None:
    from parallel.context import ContextShard
    from query_blocks import by_query_blocks

    class HostShard(ContextShard):
        """gloo gathers host tensors: stage each exchange through the host (results unchanged, bits included)."""

        def _all_gather(self, x):
            return [p.to(x.device) for p in super()._all_gather(x.cpu())]

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    clock = _Clock(device)
    ids, doc, labels = (t.to(device) for t in rows(T))
    shard = HostShard(dist.group.WORLD, list(range(C)), T)
    model = build(overrides, "auto", device)
    clock.start()
    whole = step(model, ids, doc, labels) if rank == 0 else None
    clock.stop("whole")
    clock.start()
    chunks = _chunks(model, ids, doc, labels, shard, plant, device)
    clock.stop("chunks")
    peaks = [None] * C
    dist.all_gather_object(peaks, clock.peak_gib.get("chunks"))
    if rank != 0:
        return
    result = {"chunks": distances(chunks, whole)}
    del model, chunks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    clock.start()
    with by_query_blocks(block_bytes):
        result["floor"] = distances(step(build(overrides, "torch", device), ids, doc, labels), whole)
    clock.stop("floor")
    result["seconds"], result["peak_gib"] = clock.seconds, {**clock.peak_gib, "chunks_by_rank": peaks}
    torch.save(result, os.path.join(out, "distances.pt"))


def _entry(rank: int, world: int, port: int, args: tuple) -> None:
    """``parallel.local.spawn``'s environment, but every rank on device 0 (LOCAL_RANK would name a GPU)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    _worker(rank, *args)


def verdict(d: dict, plant: str | None) -> dict:
    """The chunks' worst quantities against twice the floor (a quantity with a zero floor: against 1e-6). A plant
    is caught when its chunks fail the check."""
    chunks, floor = d["chunks"], d["floor"]
    over = {k: v for k, v in chunks.items() if v > max(2 * floor[k], 1e-6)}
    worst = sorted(chunks.items(), key=lambda kv: -kv[1] / max(floor[kv[0]], 1e-6))[:8]
    grad_max = lambda dist_: max(v for k, v in dist_.items() if k.startswith("grad/"))  # noqa: E731
    return {"plant": plant, "passes": not over, "as_expected": (not over) == (plant is None),
            "over_twice_floor": len(over), "worst": {k: {"chunks": v, "floor": floor[k]} for k, v in worst},
            "logits": chunks["logits"], "lm": chunks["lm"], "max_grad": grad_max(chunks),
            "floor_max_grad": grad_max(floor), "seconds": d["seconds"], "peak_gib": d["peak_gib"]}


def check_split(overrides: list[str], T: int, C: int) -> None:
    """Bad --seq-len / --chunks: the one line ``parallel.context.chunk_length`` names the fix with."""
    from model import ModelArgs, layout_from_config
    from parallel.context import chunk_length

    cfg = config(overrides)
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    chunk_length(C, T, args.window_size, layout.compress_ratios, layout.candidate_block_size)


def main() -> int:
    import torch.multiprocessing as mp
    from parallel.local import free_port
    from result_meta import result_meta

    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--plant", choices=PLANTS, help="run the chunks with this bug: the check must fail")
    p.add_argument("--block-gib", type=float, default=2.0,
                   help="the yardstick's intermediates per block of queries (bench/query_blocks.py)")
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="model=tiny on the CPU (checks the script, not kernels)")
    a = p.parse_args()
    overrides = SMOKE if a.smoke else LAYOUT
    try:
        check_split(overrides, a.seq_len, a.chunks)
    except ValueError as e:
        print(f"error: {e} (--seq-len, --chunks)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:  # not under --out: a device call brings back only a few files
        args = (overrides, a.seq_len, a.chunks, a.plant, int(a.block_gib * 2 ** 30), tmp)
        mp.spawn(_entry, args=(a.chunks, free_port(), args), nprocs=a.chunks)
        d = torch.load(Path(tmp) / "distances.pt")
    res = {**result_meta(), "command": " ".join(["python", *sys.argv]), "model": overrides, "seq_len": a.seq_len,
           "chunks": a.chunks, **verdict(d, a.plant), "distances": {k: d[k] for k in ("chunks", "floor")}}
    part = Path(a.out).with_suffix(".part")
    part.write_text(json.dumps(res, indent=1))
    part.replace(a.out)
    print(json.dumps({k: v for k, v in res.items() if k != "distances"}, indent=1))
    return 0 if res["as_expected"] else 1


if __name__ == "__main__":
    sys.exit(main())
