"""What is alive on the GPU at a step's peak, by the source line that allocated it (``train_step.py --memory-peak``).

``torch.cuda.memory._record_memory_history`` logs every allocation and free of one step with its Python stack.
Replaying that log finds the moment of the most allocated bytes; the blocks alive then are grouped by the innermost
frame inside this repository (``model/``, ``kernels/``, ``parallel/``, ``train/``), so a line reads e.g.
``model/attention.py:142 forward  31.2 GiB in 40 blocks``. Memory allocated before the step began (weights, their
gradients, optimizer state) has no record and is reported as one ``before the step`` line.
"""
import torch

OURS = ("/model/", "/kernels/", "/parallel/", "/train/")


HELPERS = ("kernels/triton_common.py",)  # buffer helpers: the caller is the origin


def origin(frames: list[dict]) -> str:
    """The innermost frame of ours (``dir/file.py:line function``) outside the buffer helpers, else the innermost
    frame at all."""
    for frame in frames:
        name = frame["filename"]
        if name.endswith(HELPERS):
            continue
        for part in OURS:
            if part in name:
                return f"{part.strip('/')}/{name.split(part, 1)[1]}:{frame['line']} {frame['name']}"
    return f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def peak_breakdown(step, device, top: int = 30, max_entries: int = 3_000_000) -> dict:
    """Run ``step()`` once under the allocator's history and return the peak's live bytes by origin."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for e in trace if e["action"] in ("alloc", "free_completed")]
    live, peak, at = 0, 0, -1
    for i, e in enumerate(events):
        live += e["size"] if e["action"] == "alloc" else -e["size"]
        if live > peak:
            peak, at = live, i
    blocks = {}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            blocks[e["addr"]] = e
        else:
            blocks.pop(e["addr"], None)
    groups: dict[str, list] = {}
    for e in blocks.values():
        g = groups.setdefault(origin(e.get("frames", [])), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    gib = 2 ** 30
    return {"before_step_gib": before / gib, "step_peak_above_gib": peak / gib, "peak_gib": (before + peak) / gib,
            "events": len(events), "truncated": len(trace) >= max_entries,
            "at_peak": [{"origin": name, "gib": round(size / gib, 3), "blocks": n} for name, (size, n) in ranked[:top]]}
