"""What the training benchmarks share: weights drawn on the device, a clock that reads GPU time on CUDA and wall
time on CPU, and per-layer time and memory probes of a training step.

- ``use_device_init``: ``model.transformer.init_parameters``' distribution drawn on the parameter's device (drawing 3 B
  values on the CPU takes a minute). Each tensor has its own generator seeded by (seed, full-model name), as in the
  real initialisation, so every stage split (and every shadow replica, named as its owner) starts from the same
  weights.
- ``Clock``: CUDA events on the current stream (the time the GPU spends between two marks), or
  ``time.perf_counter`` on CPU.
- ``LayerProbe``: marks at each block's forward start and end and at its backward start (the first of its outputs'
  gradients ready) and end (the last of its inputs' gradients ready), the latest microbatch's kept; on CUDA also
  the bytes allocated across the forward (what the block keeps until its backward) and the peak above the start of
  its backward. A block takes and returns the stream ``(x, pre)`` (``pre`` None on the plain stream): both carry
  gradients with hyper-connections. A block's input gradient is the output gradient of the block before it, whose
  backward-start hook runs first (it was registered first) and resets the peak counter: the peak is therefore
  folded into every block whose backward is still open before each reset, not read after it.
- ``PartProbe``: time per part of the blocks (attention, the FFN or MoE, the hyper-connections' mixes, collapse
  and expand, Engram) over one training step, forward, recomputation and backward apart (``exclusive_ms``).
"""
import contextlib
import itertools
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
        with_grad = _grad_tensors(inputs)
        pending = [len(with_grad)]

        def last_input_gradient(grad):  # the block's backward has ended when every input has its gradient
            pending[0] -= 1
            if pending[0] == 0:
                self._backward_end(i)
        for t in with_grad:
            t.register_hook(last_input_gradient)

    def _forward_end(self, i, out):
        self._mark(i, "f1")
        started = [False]

        def first_output_gradient(grad):  # its backward starts with the first output gradient that arrives
            if not started[0]:
                started[0] = True
                self._backward_start(i)
        for t in _grad_tensors(out if isinstance(out, tuple) else (out,)):
            t.register_hook(first_output_gradient)

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


def _grad_tensors(values) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]


# --------------------------------------------------------------------------------------------- time per part

REST = "rest"  # time outside every part
PHASES = ("forward", "recompute", "backward")  # of a part; the rest has recompute and other
OUTSIDE = (REST, "other")


def exclusive_ms(marks: list[tuple[float, str, int, tuple | None]]) -> tuple[dict[tuple, float], dict[tuple, int], int]:
    """Exclusive time per label from ordered marks ``(t_ms, action, key, label)``: ``open`` starts span ``key``
    (``label``), ``close`` ends it, ``close_nested`` ends it and every span opened after it that is still open (a
    recomputation stopped early, before its parts' own ends), ``mark`` only marks the time (the timeline's ends).
    The time from each mark to the next goes to the innermost open span, i.e. the most recently opened one still
    open, or to ``OUTSIDE`` outside every span; the last mark ends the timeline. Returns (ms per label, opened
    spans per label, anomalies: closes of spans not open plus spans left open)."""
    totals: dict[tuple, float] = {}
    counts: dict[tuple, int] = {}
    spans: dict[int, tuple] = {}  # open spans in opening order (dicts keep it): the last is the innermost
    anomalies = 0
    for (t, action, key, label), following in zip(marks, marks[1:] + [None]):
        if action == "open":
            spans[key] = label
            counts[label] = counts.get(label, 0) + 1
        elif action == "mark":
            pass
        elif key not in spans:
            anomalies += 1
        elif action == "close":
            del spans[key]
        else:
            keys = list(spans)
            for inner in keys[keys.index(key):]:
                del spans[inner]
        if following is not None:
            label = spans[next(reversed(spans))] if spans else OUTSIDE
            totals[label] = totals.get(label, 0.0) + following[0] - t
    return totals, counts, anomalies + len(spans)


class _Boundary(torch.autograd.Function):
    """Identity on the tensors of a part's inputs (or outputs) whose backward calls ``callback``: there the part's
    backward ends (or starts). Views, so nothing is copied or saved."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class PartProbe:
    """Time per part of the blocks over one training step, from marks (``Clock``) at each part's forward start and
    end, at its backward start and end, and around each layer's recomputation, attributed by ``exclusive_ms``.

    Parts: ``attention`` (attn_norm + the attention, indexer included), ``moe`` or ``ffn`` (ffn_norm + the MoE or the
    dense FFN), ``mhc`` (every ``hyper.hc_pre``, ``hyper.hc_post``, ``hyper.collapse``: the mixes with their
    Sinkhorn split and the collapse into a sublayer's input, the expand of its output into the copies, the head's
    collapse), ``engram``
    (the Engram update, its table lookup included; the n-gram hashing is once per step, outside). Phases:
    - ``forward``: the part's first forward (the training forward), once per layer;
    - ``recompute``: its forward again inside the backward (``parallel.recompute=layer``; ``kernels.recomputing()``):
      a recomputed layer re-runs its forward when its backward first needs a saved tensor, i.e. inside the backward
      of its last part; that time is the recomputation's, not that part's backward. ``(rest, recompute)`` is the
      recomputation outside every part (the checkpoint's own work, the plain residual adds);
    - ``backward``: from the part's output gradients arriving (an identity autograd node on its outputs) to its
      input gradients leaving (one on its inputs, weights included), recomputation excluded: the gradient
      computation alone.
    ``(rest, other)`` is everything else between ``begin`` and ``end``, forward and backward (embedding, head and
    loss, the plain residual adds and their gradients, the n-gram hashing, gradient clipping and reduction, the
    optimizer, the expert balance, and the host's gaps: the GPU's idle time between marks counts where it falls).
    Spans are exclusive: a span opened inside another takes its time from it, so the parts, phases and rest add up
    to the probed step. On CUDA the marks are events on the current stream, so a time is GPU time between marks
    issued in this order; the autograd engine runs a node's backward on its forward's stream (one stream here).
    The probe adds an identity view per part input and output and ~50 events per layer: compare ``step_ms`` with
    an unprobed step."""

    def __init__(self, model, clock: Clock):
        import kernels
        from model import hyper
        from model.moe import MoE

        self.clock, self.kernels = clock, kernels
        self.marks: list[tuple] = []
        self._keys = itertools.count()
        self.handles, self._restore = [], []
        for block in model.layers.values():
            self._module_span("attention", block.attn_norm, block.attn)
            self._module_span("moe" if isinstance(block.ffn, MoE) else "ffn", block.ffn_norm, block.ffn)
            if hasattr(block, "engram"):
                self._module_span("engram", block.engram, block.engram)
        for name in ("hc_pre", "hc_post", "collapse"):
            self._patch(hyper, name, self._function_span("mhc", getattr(hyper, name)))
        self._patch(kernels, "checkpoint_contexts", self._recompute_span(kernels.checkpoint_contexts))

    def _patch(self, owner, name, value) -> None:
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._restore.append(lambda: setattr(owner, name, original))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for restore in reversed(self._restore):
            restore()
        self.handles, self._restore = [], []

    def _open(self, label: tuple) -> int:
        key = next(self._keys)
        self.marks.append((self.clock.mark(), "open", key, label))
        return key

    def _close(self, key: int, nested: bool = False) -> None:
        self.marks.append((self.clock.mark(), "close_nested" if nested else "close", key, None))

    def begin(self) -> None:
        """Start the timeline (before the step)."""
        self.marks = [(self.clock.mark(), "mark", None, None)]

    def end(self) -> None:
        """End the timeline (after the step)."""
        self.marks.append((self.clock.mark(), "mark", None, None))

    def _phase(self) -> str:
        return "recompute" if self.kernels.recomputing() else "forward"

    @staticmethod
    def _through(values: tuple, callback) -> tuple | None:
        """``values`` with their gradient-carrying tensors through a ``_Boundary`` of ``callback`` (None: none
        carries a gradient here)."""
        carried = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not carried or not torch.is_grad_enabled():
            return None
        out = list(values)
        for i, t in zip(carried, _Boundary.apply(callback, *(values[i] for i in carried))):
            out[i] = t
        return tuple(out)

    def _enter(self, values: tuple) -> tuple[tuple, int | None]:
        """A part's inputs through a boundary whose backward ends the part's backward span, and that span's key
        (None: no input carries a gradient)."""
        key = next(self._keys)
        entered = self._through(values, lambda: self._close(key))
        return (values, None) if entered is None else (entered, key)

    def _exit(self, part: str, key: int | None, values: tuple) -> tuple:
        """A part's outputs through a boundary whose backward opens the part's backward span ``key``."""
        def start():
            self.marks.append((self.clock.mark(), "open", key, (part, "backward")))
        exited = None if key is None else self._through(values, start)
        return values if exited is None else exited

    def add_part(self, part: str, module) -> None:
        """Time ``module`` (its forward, recomputation and backward) as ``part`` too, e.g. the routed experts
        inside ``moe``: spans are exclusive, so a part nested in another takes its time out of it."""
        self._module_span(part, module, module)

    def _module_span(self, part: str, first, last) -> None:
        """A part that runs from ``first``'s forward start to ``last``'s forward end (hooks)."""
        pending = []

        def start(module, args):
            span = self._open((part, self._phase()))
            args, key = self._enter(args)
            pending.append((span, key))
            return args

        def end(module, args, output):
            span, key = pending.pop()
            self._close(span)
            if isinstance(output, tuple):  # the attention's (out, produced): the stream's part is out
                return (*self._exit(part, key, output[:1]), *output[1:])
            return self._exit(part, key, (output,))[0]
        self.handles += [first.register_forward_pre_hook(start), last.register_forward_hook(end)]

    def _function_span(self, part: str, fn):
        def probed(*args):
            span = self._open((part, self._phase()))
            args, key = self._enter(args)
            out = fn(*args)
            self._close(span)
            if isinstance(out, tuple):
                return self._exit(part, key, out)
            return self._exit(part, key, (out,))[0]
        return probed

    def _recompute_span(self, checkpoint_contexts):
        """``kernels.checkpoint_contexts`` whose recomputation context is a ``(rest, recompute)`` span; it ends every
        span opened inside it (an early-stopped recomputation never reaches its last parts' ends)."""
        @contextlib.contextmanager
        def span(inner):
            key = self._open((REST, "recompute"))
            try:
                with inner:
                    yield
            finally:
                self._close(key, nested=True)

        def contexts(*args, **kwargs):
            forward, recompute = checkpoint_contexts(*args, **kwargs)
            return forward, span(recompute)
        return contexts

    def result(self) -> dict:
        """Per part and phase: ms and spans; ``rest``; ``step_ms`` (first to last mark); ``share`` of each part's
        total (all phases) and of the rest in the step; ``anomalies`` (0 when every span opened and closed)."""
        self.clock.sync()
        first = self.marks[0][0]
        timeline = [(self.clock.ms(first, m), action, key, label) for m, action, key, label in self.marks]
        totals, counts, anomalies = exclusive_ms(timeline)
        step_ms = timeline[-1][0]
        parts: dict[str, dict] = {}
        for (part, phase), ms in sorted(totals.items()):
            row = parts.setdefault(part, {f"{p}_ms": 0.0 for p in (("recompute", "other") if part == REST else PHASES)})
            row[f"{phase}_ms"] = ms
            if (part, phase) != OUTSIDE:
                row[f"{phase}_spans"] = counts.get((part, phase), 0)
        for row in parts.values():
            row["total_ms"] = sum(v for k, v in row.items() if k.endswith("_ms"))
            row["share"] = row["total_ms"] / step_ms if step_ms > 0 else float("nan")
        return {"step_ms": step_ms, "parts": parts, "anomalies": anomalies}
