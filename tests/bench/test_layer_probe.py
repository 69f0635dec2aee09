"""bench/layer_probe.py's memory marks, on CPU through a fake CUDA allocator.

Each block's backward allocates a known working set above what it started with; the probe must report that as the
block's backward peak even though the next block's backward-start hook (on the same gradient tensor, registered
first) resets the peak counter before this block's backward-end hook runs."""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from layer_probe import Clock, LayerProbe  # noqa: E402
from parallel.recompute import recompute_leading  # noqa: E402


class FakeAllocator:
    def __init__(self):
        self.allocated = self.peak = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def reset_peak(self) -> None:
        self.peak = self.allocated


class Spend(torch.autograd.Function):
    """Holds ``kept`` bytes from its forward to its backward; its backward needs ``work`` bytes on top."""

    @staticmethod
    def forward(ctx, x, allocator, kept, work):
        ctx.allocator, ctx.kept, ctx.work = allocator, kept, work
        allocator.alloc(kept)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.allocator.alloc(ctx.work)
        ctx.allocator.alloc(-ctx.work - ctx.kept)
        return grad * 2, None, None, None


class Block(nn.Module):
    def __init__(self, allocator, kept, work):
        super().__init__()
        self.allocator, self.kept, self.work = allocator, kept, work

    def forward(self, x):
        return Spend.apply(x, self.allocator, self.kept, self.work)


def test_backward_peak_of_every_block(monkeypatch):
    allocator = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocator.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocator.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", allocator.reset_peak)
    kept, work = [100, 200, 300], [5_000, 7_000, 3_000]
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): Block(allocator, k, w) for i, (k, w) in enumerate(zip(kept, work))})
    probe = LayerProbe(model, Clock(cuda=False))
    probe.memory = True  # the CPU clock turns it off; the fake allocator stands in for CUDA's

    x = torch.ones(4, requires_grad=True)
    for block in model.layers.values():
        x = block(x)
    x.sum().backward()

    rows = [probe._row(m) for m in probe.marks]
    assert [r["retained_bytes"] for r in rows] == kept
    assert [r["backward_bytes"] for r in rows] == work


# ----------------------------------------------------------------------------------- blocks of the (x, pre) stream

class CountingClock:
    """Marks are positions in a shared log of what happened, so a test can ask which came first."""

    def __init__(self, log):
        self.cuda, self.log = False, log

    def mark(self):
        self.log.append("mark")
        return len(self.log) - 1

    def ms(self, start, end):
        return end - start

    def sync(self):
        pass


class StreamBlock(nn.Module):
    """Takes and returns the stream (x, pre), as model.transformer.Block does with hyper-connections. ``pre_first``:
    pre's op is made first, so its gradient is computed last (autograd runs the later-made node first)."""

    def __init__(self, pre_first: bool):
        super().__init__()
        self.pre_first = pre_first

    def forward(self, x, pre, state=None):
        if self.pre_first:
            pre = pre * 3
            return x * 2, pre
        x = x * 2
        return x, pre * 3


def test_stream_blocks_backward_spans_from_first_output_to_last_input_gradient():
    """A block's backward starts when the first of its outputs' gradients arrives and ends when the last of its
    inputs' gradients is ready (x and pre both carry one). A probe that keys on one of the two (or on ``out`` as a
    tensor) marks the wrong moment in the blocks where the other comes first or last, or fails on the tuple."""
    log = []
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): StreamBlock(pre_first=i % 2 == 1) for i in range(4)})
    probe = LayerProbe(model, CountingClock(log))
    x = torch.ones(4, requires_grad=True)
    pre = torch.ones(2, requires_grad=True)
    arrivals = {}  # (stream index, "x" | "pre") -> where in the log its gradient arrived (after the probe's hooks)

    def arrived(key):
        def hook(grad):
            log.append(key)
            arrivals[key] = len(log) - 1
        return hook
    streams = [(x, pre)]
    for block in model.layers.values():
        streams.append(block(*streams[-1]))
    for i, pair in enumerate(streams):
        for name, t in zip(("x", "pre"), pair):
            t.register_hook(arrived((i, name)))
    (streams[-1][0].sum() + streams[-1][1].sum()).backward()
    for i, m in enumerate(probe.marks):
        inputs = [arrivals[(i, "x")], arrivals[(i, "pre")]]
        outputs = [arrivals[(i + 1, "x")], arrivals[(i + 1, "pre")]]
        assert m["b0"] < min(outputs), (i, m, outputs)  # at the first output gradient
        assert m["b1"] > min(inputs), (i, m, inputs)  # not before the second input gradient
        assert m["b0"] < m["b1"]


# ------------------------------------------------------------------------------------------------ time per part

def test_exclusive_ms_gives_each_interval_to_the_innermost_open_span():
    from layer_probe import OUTSIDE, exclusive_ms
    a, r, b, inner = ("attention", "forward"), ("rest", "recompute"), ("mhc", "backward"), ("moe", "recompute")
    marks = [(0, "mark", None, None),
             (1, "open", 1, a), (3, "close", 1, None),  # 2 ms of attention
             (4, "open", 2, b),  # the mhc backward, with a recomputation inside it
             (5, "open", 3, r), (6, "open", 4, inner), (9, "close_nested", 3, None),  # moe recompute never closed
             (10, "close", 2, None), (10, "close", 4, None),  # span 4 was closed by the nested close: an anomaly
             (12, "open", 5, a), (13, "mark", None, None)]  # left open: an anomaly
    totals, counts, anomalies = exclusive_ms(marks)
    assert totals == {OUTSIDE: 1 + 1 + 2, a: 2 + 1, b: 1 + 1, r: 1, inner: 3}
    assert counts == {a: 2, b: 1, r: 1, inner: 1}
    assert anomalies == 2


def test_part_probe_on_every_v41_part_with_recompute():
    """v41_mini (MoE, 4 hyper-connected copies, Engram on layers 1 and 5), every layer recomputed: each part is
    timed once per layer in each phase (mhc: 4 calls a block, plus the head's collapse, which is not recomputed),
    every span closes, the parts and the rest add up to the step, and the probe leaves model.hyper as it was."""
    from layer_probe import PartProbe
    from model import build_model, hyper
    from model.cli import compose

    cfg = compose(["model=v41_mini", "layout=v41_scaled", "model.kernel_backend=torch", "model.dspark.blocks=0"])
    model = build_model(cfg.model, cfg.layout)
    recompute_leading(model.layers.values(), len(model.layers))
    originals = hyper.hc_pre, hyper.hc_post, hyper.collapse
    probe = PartProbe(model, Clock(cuda=False))
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    probe.begin()
    out = model(ids)
    (out.logits.logsumexp(-1).mean() + sum(out.indexer_losses.values())).backward()
    probe.end()
    probe.remove()
    assert (hyper.hc_pre, hyper.hc_post, hyper.collapse) == originals
    result = probe.result()
    assert result["anomalies"] == 0
    parts = result["parts"]
    n = len(model.layers)
    expected = {"attention": (n, n), "moe": (n, n), "engram": (2, 2), "mhc": (4 * n + 1, 4 * n)}
    for part, (forward, recomputed) in expected.items():
        assert (parts[part]["forward_spans"], parts[part]["recompute_spans"], parts[part]["backward_spans"]) == \
            (forward, recomputed, forward), part
    assert parts["rest"]["recompute_spans"] == n
    assert sum(row["total_ms"] for row in parts.values()) == pytest.approx(result["step_ms"])
