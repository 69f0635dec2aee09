"""What the training benchmarks share: weights drawn on the device, a clock that reads GPU time on CUDA and wall
time on CPU, and per-layer time and memory probes of a training step.

- ``use_device_init``: ``model.transformer.init_parameters``' distribution drawn on the parameter's device (drawing 3 B
  values on the CPU takes a minute). Each tensor has its own generator seeded by (seed, full-model name), as in the
  real initialisation, so every stage split (and every shadow replica, named as its owner) starts from the same
  weights.
- ``Clock``: CUDA events on the current stream (the time the GPU spends between two marks), or
  ``time.perf_counter`` on CPU.
- ``LayerProbe``: marks at each block's forward start and end and at its backward start (its output's gradient
  ready) and end (its input's gradient ready), the latest microbatch's kept; on CUDA also the bytes allocated across
  the forward (what the block keeps until its backward) and the peak above the start of its backward. A block's
  input gradient is the output gradient of the block before it, whose backward-start hook runs first (it was
  registered first) and resets the peak counter: the peak is therefore folded into every block whose backward is
  still open before each reset, not read after it.
"""
import statistics
import time
from functools import partial

import torch

from parallel.balance import ModeTimes, mode_key


def use_device_init() -> None:
    """Make every model and shadow replica built from now on draw its weights on their device."""
    import model.transformer
    import parallel.stage

    device_init = partial(model.transformer.init_parameters, on_device=True)
    model.transformer.init_parameters = parallel.stage.init_parameters = device_init


class _WallMark:
    def __init__(self):
        self.t = time.perf_counter()


class Clock:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return _WallMark()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        """Milliseconds between two marks (on CUDA, after the marks have been reached: ``sync`` first)."""
        return start.elapsed_time(end) if self.cuda else 1e3 * (end.t - start.t)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class LayerProbe:
    def __init__(self, model, clock: Clock, memory: bool = False):
        """Probe the blocks of ``model`` (a Transformer or a stage's slice of one). ``memory`` (CUDA only) also
        resets the peak-memory counter at every backward start, so do not read a step's peak with it on."""
        self.clock, self.memory = clock, memory and clock.cuda
        self.blocks = list(model.layers.values())
        self.marks = [{} for _ in self.blocks]
        self.open_backwards: set[int] = set()
        self.handles = []
        for i, block in enumerate(self.blocks):
            self._probe(i, block, block)
        if getattr(model, "has_head", False):  # the final norm + head as one more probed span
            self.marks.append({})
            self._probe(len(self.blocks), model.norm, model.head)

    def _probe(self, i, first, last):
        self.handles += [first.register_forward_pre_hook(lambda mod, inputs: self._forward_start(i, inputs)),
                         last.register_forward_hook(lambda mod, inputs, out: self._forward_end(i, out))]

    def _mark(self, i, key):
        self.marks[i][key] = self.clock.mark()
        if self.memory:
            self.marks[i][key + "_bytes"] = torch.cuda.memory_allocated()

    def _forward_start(self, i, inputs):
        self._mark(i, "f0")
        if inputs[0].requires_grad:
            inputs[0].register_hook(lambda grad: self._backward_end(i))

    def _forward_end(self, i, out):
        self._mark(i, "f1")
        if out.requires_grad:
            out.register_hook(lambda grad: self._backward_start(i))

    def _fold_peak(self) -> None:
        """Carry the peak since the last reset into every block whose backward is running."""
        peak = torch.cuda.max_memory_allocated()
        for j in self.open_backwards:
            self.marks[j]["b_peak"] = max(self.marks[j]["b_peak"], peak)

    def _backward_start(self, i):
        self._mark(i, "b0")
        if self.memory:
            self._fold_peak()
            torch.cuda.reset_peak_memory_stats()
            self.marks[i]["b_peak"] = self.marks[i]["b0_bytes"]
            self.open_backwards.add(i)

    def _backward_end(self, i):
        self._mark(i, "b1")
        if self.memory:
            self._fold_peak()
            self.open_backwards.discard(i)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _row(self, m: dict) -> dict:
        row = {"fwd_ms": self.clock.ms(m["f0"], m["f1"]) if "f1" in m else float("nan"),
               "bwd_ms": self.clock.ms(m["b0"], m["b1"]) if "b1" in m else float("nan")}
        if "f1_bytes" in m:
            row["retained_bytes"] = m["f1_bytes"] - m["f0_bytes"]
        if "b_peak" in m:
            row["backward_bytes"] = m["b_peak"] - m["b0_bytes"]
        return row

    def per_layer(self) -> list[dict]:
        """Per block: layer id, mode key, fwd_ms, bwd_ms (NaN if not reached) and, with memory, the bytes."""
        self.clock.sync()
        return [{"layer": block.attn.plan.layer_id, "mode": mode_key(block.attn.plan), **self._row(m)}
                for block, m in zip(self.blocks, self.marks)]

    def head_ms(self) -> float | None:
        """Forward + backward of the final norm and head (None on a stage without them)."""
        if len(self.marks) == len(self.blocks):
            return None
        self.clock.sync()
        row = self._row(self.marks[-1])
        return row["fwd_ms"] + row["bwd_ms"]

    def per_mode(self) -> dict[str, ModeTimes]:
        """Mean over the blocks of each mode."""
        groups: dict[str, list[dict]] = {}
        for row in self.per_layer():
            groups.setdefault(row["mode"], []).append(row)

        def mean(rows, key):
            values = [r[key] for r in rows if key in r]
            return statistics.mean(values) if values else None
        return {mode: ModeTimes(mean(rows, "fwd_ms"), mean(rows, "bwd_ms"), mean(rows, "retained_bytes"),
                                mean(rows, "backward_bytes")) for mode, rows in groups.items()}
