"""Kernel-launching ATen ops in one Reuse layer's forward, counted on any device (issue 6's launch goal).

    TRITON_INTERPRET=1 python bench/layer_ops.py [overrides] [--json FILE]

The GPU count (bench/train_step.py, torch profiler) needs the H200; this is its device-independent proxy: every
ATen op dispatched in the attention module's forward (prefill: no_grad, bf16 autocast, the Triton kernels
through the interpreter) except those that launch no kernel on a GPU (views, allocations, dtype arithmetic).
``F.rms_norm`` counts as one launch (CUDA runs it as one fused kernel; the CPU build decomposes it), each Triton
kernel launch as one (the ATen ops the interpreter runs inside a launch are not counted). Shapes are the
``small`` model's at a short ``data.seq_len`` (the count does not depend on T).
"""
import argparse
import collections
import contextlib
import datetime
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "lift_fresh", "detach", "alias", "_unsafe_view",
             "promote_types", "result_type"}


class CountOps(TorchDispatchMode):
    """Counts dispatched ATen ops by name, leaving out views and allocations; ``opaque(name)`` counts the ops
    dispatched inside it as one launch of ``name``."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.inside = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        custom = func.namespace == "csa2"  # a torch.library op of ours: the kernels it launches are counted
        if self.inside is None and not func.is_view and not custom and name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def opaque(self, name: str):
        outer, self.inside = self.inside, name
        try:
            yield
        finally:
            self.inside = outer
        if outer is None:
            self.counts[name] += 1


def count_as_one(mode: CountOps):
    """Triton launches and ``F.rms_norm`` become one launch each in ``mode``'s counts."""
    from triton.runtime.interpreter import InterpretedFunction

    run, rms_norm = InterpretedFunction.run, torch.nn.functional.rms_norm

    def launch(self, *args, **kwargs):
        with mode.opaque(f"triton:{self.fn.__name__}"):
            return run(self, *args, **kwargs)

    def fused_rms_norm(*args, **kwargs):
        with mode.opaque("rms_norm (fused on CUDA)"):
            return rms_norm(*args, **kwargs)
    InterpretedFunction.run = launch
    torch.nn.functional.rms_norm = fused_rms_norm


def main():
    p = argparse.ArgumentParser()
    p.add_argument("overrides", nargs="*")
    p.add_argument("--json", default=None)
    p.add_argument("--weights", default="fp32", choices=["fp32", "bf16"],
                   help="fp32: training's fp32 masters under bf16 autocast (weights cast per use); bf16: bf16 "
                        "weights without autocast, as an inference prefill runs")
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the Triton kernels run through the interpreter on the CPU)")
    from model import ModelArgs, layout_from_config
    from model.cli import compose
    from model.layout import Mode
    from model.transformer import Transformer

    cfg = compose(["model=small", "layout=v41", "data.seq_len=256", "model.kernel_backend=triton", *a.overrides])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    reuse = next(p.layer_id for p in layout.plan if p.mode is Mode.REUSE)
    source = layout.plan[reuse].kv_source
    torch.manual_seed(0)
    model = Transformer(args, layout, range(source, reuse + 1))  # the Full layer that feeds it, and the Reuse layer
    T = int(cfg.data.seq_len)
    x = torch.randn(1, T, args.dim)
    if a.weights == "bf16":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    state = model.new_state(torch.zeros(1, T, dtype=torch.long))
    mode = CountOps()
    count_as_one(mode)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.weights == "fp32"):
        h = x
        for block in model.layers.values():
            if block.attn.plan.layer_id == reuse:
                xn = block.attn_norm(h)
                reads = state.reads(block.attn.plan)
                mode.counts.clear()  # launches of the layers before it were counted too
                with mode:
                    block.attn(xn, state.geometry, reads)
                break
            h = block(h, state)
    counts = mode.counts
    total = sum(counts.values())
    print(f"Reuse layer {reuse} (KV of layer {source}), attention forward, {a.weights} weights: "
          f"{total} kernel launches")
    for name, n in counts.most_common():
        print(f"  {n:3d}  {name}")
    if a.json:
        summary = {"layer": reuse, "weights": a.weights, "launches": total, "by_op": dict(counts),
                   "command": "TRITON_INTERPRET=1 python " + " ".join(sys.argv),
                   "machine": f"{platform.node()} (CPU, Triton interpreter count)",
                   "date": datetime.date.today().isoformat()}
        Path(a.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
