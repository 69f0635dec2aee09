"""The pipeline plan as a picture (``python -m parallel.plan --plot PNG ...``): the stages over the layers, the 1F1B
schedule of one step, and what crosses each boundary.

The schedule is ``parallel/simulate.py``'s replay of the instructions the engine runs, with each stage's forward
its share of the cost the split balanced (FLOPs, or measured times with ``parallel.layer_times``) and a backward
twice its forward; transfers are left out (at 354 GB/s over NVLink they took 0.1% of a measured step,
docs/PARALLELISM.md). The boundaries' fields and bytes are those the plan prints (``parallel/payload.py``).
"""
import torch

from model.config import ModelArgs
from model.layout import MODE_COLORS, Layout, Mode
from parallel.batch import BatchPlan
from parallel.payload import boundary_fields
from parallel.simulate import StageWork, ideal_bubble, simulate

FIELD_COLORS = {"h": "#4c72b0", "pre_mix": "#64b5cd", "doc_ids": "#8c8c8c", "input_ids": "#b0b0b0",
                "kv": "#1f4e9c", "index_k": "#2a9d8f", "topk": "#e08a1e", "candidates": "#c44e52",
                "index_logits": "#8172b2", "index_target": "#ccb974", "dspark_feature": "#55a868"}
STAGE_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c")


def draw(path, args: ModelArgs, layout: Layout, split, batch: BatchPlan, micro_batch: int, seq_len: int,
         dtype: torch.dtype, index_k: str, title: str = "") -> None:
    """Draw ``split`` (``parallel.balance.split_stages``) of a job running ``batch`` into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    stages = split.plan.stages
    P, M, total = len(stages), batch.microbatches, sum(split.costs)
    shares = [sum(split.costs[i] for i in layers) / total for layers in stages]
    timeline = simulate([StageWork(share / 3, 2 * share / 3) for share in shares], M)
    boundaries = [[f for f in boundary_fields(args, layout, layers.stop - 1, micro_batch, seq_len, dtype, index_k)
                   if f.shape] for layers in stages[:-1]]  # the indexer losses' scalars left out
    heights = [1.4, 0.45 * P + 0.9, 0.4 * max(1, P - 1) + 0.9]  # inches: layers, schedule, boundaries
    fig, (layer_ax, time_ax, bytes_ax) = plt.subplots(3, 1, figsize=(13, sum(heights)),
                                                      gridspec_kw={"height_ratios": heights})

    for p in layout.plan:  # the stages over the layers
        layer_ax.add_patch(Rectangle((p.layer_id, 0), 1, 1, facecolor=MODE_COLORS[p.mode], edgecolor="white"))
    for s, layers in enumerate(stages):
        layer_ax.add_patch(Rectangle((layers.start + 0.05, 1.15), len(layers) - 0.1, 0.5,
                                     facecolor=STAGE_COLORS[s % len(STAGE_COLORS)], alpha=0.8))
        peak = f", est. {split.peaks[s] / 2 ** 30:,.1f} GiB" if split.peaks else ""
        layer_ax.text(layers.start + len(layers) / 2, 1.4, f"stage {s}: layers {layers.start}-{layers.stop - 1}",
                      ha="center", va="center", fontsize=8, color="white")
        layer_ax.text(layers.start + len(layers) / 2, 1.95, f"{shares[s]:.0%} of {split.unit}{peak}",
                      ha="center", va="center", fontsize=7)
    layer_ax.set(xlim=(0, layout.n_layers), ylim=(2.3, -0.1), yticks=[], xlabel="layer")
    layer_ax.legend(handles=[Patch(color=MODE_COLORS[m], label=m.value) for m in Mode if layout.counts()[m]],
                    loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)

    for s, passes in enumerate(timeline.passes):  # the 1F1B schedule
        color = STAGE_COLORS[s % len(STAGE_COLORS)]
        for kind, microbatch, start, end in passes:
            time_ax.add_patch(Rectangle((start, s + 0.1), end - start, 0.8, facecolor=color,
                                        alpha=0.45 if kind == "fwd" else 0.95, edgecolor="white"))
            time_ax.text((start + end) / 2, s + 0.5, f"{'F' if kind == 'fwd' else 'B'}{microbatch}", ha="center",
                         va="center", fontsize=6 if M > 8 else 7)
    time_ax.set(xlim=(0, timeline.pipeline_s), ylim=(P, 0), yticks=[s + 0.5 for s in range(P)],
                yticklabels=[f"stage {s}" for s in range(P)],
                xlabel="time (1 = one microbatch's forward and backward through every layer; a backward takes "
                       "twice its forward; transfers not drawn)")
    bubble = ", ".join(f"{b:.0%}" for b in timeline.bubble)
    time_ax.set_title(f"1F1B schedule of one step: {M} microbatches (F forward, B backward); bubble per stage "
                      f"{bubble} (balanced stages: (P-1)/(M+P-1) = {ideal_bubble(P, M):.0%})", fontsize=9)

    if not boundaries:
        bytes_ax.text(0.5, 0.5, "one stage: nothing crosses a boundary", ha="center", va="center")
        bytes_ax.axis("off")
    seen = {}
    for b, fields in enumerate(boundaries):  # what crosses each boundary
        left = 0.0
        for f in fields:
            mib = f.nbytes / 2 ** 20
            color = FIELD_COLORS.get(f.name, "#999999")
            seen.setdefault(f.name, Patch(color=color, label=f.name))
            bytes_ax.barh(b, mib, left=left, color=color, edgecolor="white", height=0.7)
            label = f.name + ("" if f.source is None else f"[{f.source}]")
            if mib > 0.045 * sum(x.nbytes for x in fields) / 2 ** 20:
                bytes_ax.text(left + mib / 2, b, label, ha="center", va="center", fontsize=6, color="white")
            left += mib
        bytes_ax.text(left, b, f"  {left:,.1f} MiB", va="center", fontsize=7)
    if boundaries:
        widest = max(sum(f.nbytes for f in fields) for fields in boundaries) / 2 ** 20
        bytes_ax.set(xlim=(0, widest * 1.15), ylim=(len(boundaries) - 0.5, -0.5),
                     yticks=range(len(boundaries)), yticklabels=[f"{b} -> {b + 1}" for b in range(len(boundaries))],
                     xlabel=f"MiB per microbatch ({micro_batch} x {seq_len} tokens; index K by {index_k})")
        bytes_ax.set_title("what crosses each boundary (forward; the differentiable fields' gradients come back)",
                           fontsize=9)
        bytes_ax.legend(handles=list(seen.values()), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7,
                        frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
