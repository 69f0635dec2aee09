"""bench/layer_probe.py's memory marks, on CPU through a fake CUDA allocator.

Each block's backward allocates a known working set above what it started with; the probe must report that as the
block's backward peak even though the next block's backward-start hook (on the same gradient tensor, registered
first) resets the peak counter before this block's backward-end hook runs."""
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from layer_probe import Clock, LayerProbe  # noqa: E402


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
