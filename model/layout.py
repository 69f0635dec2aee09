"""Layer-mode layouts: which layers compute KV (Full), re-select (Reindex) or reuse (Reuse).

The canonical form is the reference config's six fields (``Layout``). Hydra presets describe a layout by a few
readable knobs and ``layout_from_config`` expands them; any of the canonical lists given explicitly wins over
what the knobs generate. ``Layout.plan()`` checks every rule of SPEC §1.5 and resolves, per layer, where its
KV, its index keys, its selection and its candidate blocks come from.

``python -m model.layout [--plot PNG] [overrides]`` prints the per-layer table (and draws it: ``plot``).
"""
import enum
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cached_property

from model.config import LayoutConfig


class LayoutError(ValueError):
    """A layout that breaks a rule of SPEC §1.5; the message names the layer and the rule."""


class CandidateCapacityError(LayoutError):
    """Candidate blocks that may hold fewer entries than the model's top-k (``Layout.check_candidate_capacity``)."""


class Mode(str, enum.Enum):
    WINDOW = "window"  # m = 0: sliding window only
    FULL = "full"  # computes main KV, index K and its own selection
    REINDEX = "reindex"  # the latest Full's KV and index K, its own selection
    REUSE = "reuse"  # the latest Full's KV, the latest Full/Reindex's selection


@dataclass(frozen=True)
class LayerPlan:
    layer_id: int
    ratio: int
    mode: Mode
    kv_source: int | None = None  # Full layer whose compressed KV this layer reads
    index_source: int | None = None  # Full/Reindex layer whose selection this layer reads
    candidate_source: int | None = None  # candidate blocks restricting this layer's own selection
    makes_candidates: bool = False

    @property
    def selects(self) -> bool:
        return self.mode in (Mode.FULL, Mode.REINDEX)


@dataclass(frozen=True)
class Layout:
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8

    def __post_init__(self):
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        self.plan  # validate eagerly: a bad layout fails when the config is built

    @property
    def n_layers(self) -> int:
        return len(self.compress_ratios)

    @cached_property
    def plan(self) -> tuple[LayerPlan, ...]:
        self._check_lists()
        plans = []
        for layer, m in enumerate(self.compress_ratios):
            if m == 0:
                plans.append(LayerPlan(layer, 0, Mode.WINDOW))
                continue
            kv = self._latest(self.kv_source_layer_ids, layer, ratio=m)
            if kv is None:
                raise LayoutError(f"layer {layer} (ratio {m}) has no KV source: no layer <= {layer} with ratio {m} "
                                  f"is in kv_source_layer_ids {list(self.kv_source_layer_ids)}")
            index = self._latest(self.index_source_layer_ids, layer)
            index_kv = self._latest(self.kv_source_layer_ids, index, ratio=self.compress_ratios[index])
            if index_kv != kv:
                raise LayoutError(f"layer {layer} reads the KV of layer {kv} but its latest index source, layer "
                                  f"{index}, selects entries of the KV of layer {index_kv}: indices point into one KV")
            mode = Mode.FULL if layer == kv else Mode.REINDEX if layer == index else Mode.REUSE
            restricted = self._restricted_by_candidates(layer, mode)
            plans.append(LayerPlan(layer, m, mode, kv, index, self.candidate_source_layer_id if restricted else None,
                                   makes_candidates=layer == self.candidate_source_layer_id))
        return tuple(plans)

    def _restricted_by_candidates(self, layer: int, mode: Mode) -> bool:
        """Whether ``layer`` selects only inside the candidate blocks: as in the reference, every index source
        (Full or Reindex) after the candidate source. A block is a run of ``candidate_block_size`` entries of the
        candidate source's KV, so it names the same tokens in another KV only at the same compression ratio."""
        cand = self.candidate_source_layer_id
        if mode not in (Mode.FULL, Mode.REINDEX) or cand is None or layer <= cand:
            return False
        if self.compress_ratios[layer] != self.compress_ratios[cand]:
            raise LayoutError(f"layer {layer} (ratio {self.compress_ratios[layer]}) is an index source after the "
                              f"candidate source, layer {cand} (ratio {self.compress_ratios[cand]}): every such layer "
                              "selects inside the candidate blocks, which cover other tokens at another ratio")
        return True

    def check_candidate_capacity(self, index_topk: int) -> None:
        """Refuse candidate blocks that may hold fewer entries than a selection: a query is guaranteed only
        ``(blocks - 1) * block_size + 1`` candidate entries (its newest block may hold one), and where they are
        fewer than ``index_topk`` the reference still returns ``index_topk`` picks, the extra ones outside the
        candidates in an order it does not define. Such a layout is an error here rather than a silent difference."""
        if not any(p.candidate_source is not None for p in self.plan):
            return
        guaranteed = (self.candidate_topk_blocks - 1) * self.candidate_block_size + 1
        if guaranteed < index_topk:
            blocks = -(-(index_topk - 1) // self.candidate_block_size) + 1
            raise CandidateCapacityError(
                f"candidate_topk_blocks={self.candidate_topk_blocks} blocks of candidate_block_size="
                f"{self.candidate_block_size} guarantee a query only {guaranteed} candidate entries, fewer than "
                f"index_topk={index_topk}; the reference then picks entries outside the candidates. Use "
                f"layout.candidate_topk_blocks>={blocks}, or model.index_topk<={guaranteed}")

    def check_row(self, seq_len: int) -> None:
        """A row of ``seq_len`` tokens (``data.seq_len``) holds an entry of every compressed KV: a layer whose KV
        has none would select from nothing."""
        largest = max(self.compress_ratios)
        if seq_len < largest:
            raise LayoutError(f"data.seq_len={seq_len} holds no compressed entry of the layout's ratio {largest} — set "
                              f"data.seq_len>={largest}")

    def _latest(self, ids, layer, ratio=None):
        found = [i for i in ids if i <= layer and (ratio is None or self.compress_ratios[i] == ratio)]
        return max(found, default=None)

    def _check_lists(self):
        n = self.n_layers
        if n == 0:
            raise LayoutError("compress_ratios is empty: a model needs at least one layer")
        for layer, m in enumerate(self.compress_ratios):
            if m < 0:
                raise LayoutError(f"layer {layer} has compress ratio {m}: ratios are 0 (window-only) or >= 1")
        lists = {"kv_source_layer_ids": self.kv_source_layer_ids, "index_source_layer_ids": self.index_source_layer_ids}
        if self.candidate_source_layer_id is not None:
            lists["candidate_source_layer_id"] = (self.candidate_source_layer_id,)
        for name, ids in lists.items():
            for layer in ids:
                if not 0 <= layer < n:
                    raise LayoutError(f"{name} names layer {layer}, but the model has layers 0..{n - 1}")
                if self.compress_ratios[layer] == 0:
                    raise LayoutError(f"layer {layer} is window-only (ratio 0) and cannot be named in {name}: "
                                      "sources must be compressed layers")
            if len(set(ids)) != len(ids):
                raise LayoutError(f"{name} {list(ids)} names a layer twice")
        for layer in self.kv_source_layer_ids:
            if layer not in self.index_source_layer_ids:
                raise LayoutError(f"layer {layer} is a KV source (Full) but not in index_source_layer_ids: "
                                  "every KV source is an index source")
        cand = self.candidate_source_layer_id
        if cand is not None and cand not in self.kv_source_layer_ids:
            raise LayoutError(f"candidate source layer {cand} is not a Full layer (not in kv_source_layer_ids)")
        if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
            raise LayoutError("candidate_topk_blocks and candidate_block_size must be >= 1")

    def readers(self, index_source: int) -> list[int]:
        """Layers whose attention reads the selection of ``index_source`` (itself and the Reuse layers after it)."""
        return [p.layer_id for p in self.plan if p.index_source == index_source]

    @cached_property
    def last_use(self) -> dict[tuple[str, int], int]:
        """Last layer that consumes each shared field, keyed by (field, producing layer). The state of a
        microbatch drops a field right after that layer, and a pipeline boundary carries exactly the fields
        produced before it and last used after it."""
        last: dict[tuple[str, int], int] = {}
        for p in self.plan:
            if p.mode is Mode.WINDOW:
                continue
            last[("kv", p.kv_source)] = p.layer_id
            for field in ("topk", "index_logits", "index_target"):
                last[(field, p.index_source)] = p.layer_id
            if p.selects:
                last[("index_k", p.kv_source)] = p.layer_id
            if p.makes_candidates:
                last.setdefault(("candidates", p.layer_id), p.layer_id)
            if p.candidate_source is not None:
                last[("candidates", p.candidate_source)] = p.layer_id
        return last

    def counts(self) -> dict[Mode, int]:
        return {mode: sum(p.mode is mode for p in self.plan) for mode in Mode}

    def table(self) -> str:
        rows = [("layer", "ratio", "mode", "kv src", "index src", "candidates")]
        for p in self.plan:
            cand = f"from {p.candidate_source}" if p.candidate_source is not None else (
                "produces" if p.makes_candidates else "")
            rows.append((str(p.layer_id), str(p.ratio), p.mode.value, _dash(p.kv_source), _dash(p.index_source), cand))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.rjust(w) if i < 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                 for r in rows]
        counts = self.counts()
        lines.append(f"{self.n_layers} layers: " + ", ".join(f"{counts[m]} {m.value}" for m in Mode))
        return "\n".join(lines)


def _dash(value):
    return "-" if value is None else str(value)


def generate(window_layers: int, encoder: dict, decoder: dict, candidates: bool) -> dict:
    """Canonical lists from the knobs of a V4.1-shaped stack: window layers, an encoder of groups that each
    start with a Full layer, and a decoder with one Full layer, Reindex every ``reindex_every`` layers (0 = never)
    and a new Full layer every ``full_every`` layers (0 = only the first). With ``candidates`` the decoder's first
    Full layer is the candidate source, if a later index source (which selects inside its blocks) exists."""
    ratios = [0] * window_layers + [encoder["ratio"]] * encoder["layers"] + [decoder["ratio"]] * decoder["layers"]
    start = window_layers
    kv = [start + i for i in range(0, encoder["layers"], encoder["group_size"])]
    index = list(kv)
    start += encoder["layers"]
    for i in range(decoder["layers"]):
        if i == 0 or (decoder.get("full_every") and i % decoder["full_every"] == 0):
            kv.append(start + i)
            index.append(start + i)
        elif decoder.get("reindex_every") and i % decoder["reindex_every"] == 0:
            index.append(start + i)
    cand = start if candidates and any(i > start for i in index) else None  # made only where something reads them
    return dict(compress_ratios=ratios, kv_source_layer_ids=kv, index_source_layer_ids=index,
                candidate_source_layer_id=cand)


CANONICAL = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id")


def layout_from_config(config: LayoutConfig | Mapping) -> Layout:
    """A Layout from the ``layout`` group (a ``LayoutConfig``, or a saved run's mapping of it): knobs generate the
    lists, explicit lists override them.

    When only ``kv_source_layer_ids`` is overridden, the index sources are regenerated around it (the new KV
    sources plus the generated Reindex layers), so a single override stays a valid layout."""
    values = asdict(config) if isinstance(config, LayoutConfig) else dict(config)
    lists = generate(values["window_layers"], dict(values["encoder"]), dict(values["decoder"]), values["candidates"])
    given = {k: values.get(k) for k in CANONICAL if values.get(k) is not None}
    if "kv_source_layer_ids" in given and "index_source_layer_ids" not in given:
        reindex = set(lists["index_source_layer_ids"]) - set(lists["kv_source_layer_ids"])
        lists["index_source_layer_ids"] = sorted(set(given["kv_source_layer_ids"]) | reindex)
    lists.update({k: list(v) if k != "candidate_source_layer_id" else v for k, v in given.items()})
    return Layout(**lists, candidate_topk_blocks=values["candidate_topk_blocks"],
                  candidate_block_size=values["candidate_block_size"])


MODE_COLORS = {Mode.WINDOW: "#c8c8c8", Mode.FULL: "#1f4e9c", Mode.REINDEX: "#e08a1e", Mode.REUSE: "#9cc3e6"}
MODE_MEANING = {Mode.WINDOW: "window only", Mode.FULL: "computes KV, index keys and its selection",
                Mode.REINDEX: "the latest Full layer's KV, selects again", Mode.REUSE: "reads the latest selection"}


def _runs(layers: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted layer ids, as (first, last)."""
    runs = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], layer)
        else:
            runs.append((layer, layer))
    return runs


def plot(layout: Layout, path, title: str = "") -> None:
    """The layout as a picture: one cell per layer in its mode's colour, and below it which layer's KV, which
    layer's selection and which candidate blocks each layer reads, as bars over the layers that read them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    n, plan = layout.n_layers, layout.plan
    fig, ax = plt.subplots(figsize=(max(8.0, 0.3 * n + 2.5), 3.4))
    for p in plan:
        ax.add_patch(Rectangle((p.layer_id, 0), 1, 1, facecolor=MODE_COLORS[p.mode], edgecolor="white"))
        dark = p.mode in (Mode.FULL, Mode.REINDEX)
        ax.text(p.layer_id + 0.5, 0.5, str(p.layer_id), ha="center", va="center", fontsize=7,
                color="white" if dark else "black")
    start = 0  # the compression ratio of each run of layers, above the cells
    for layer in range(1, n + 1):
        if layer == n or layout.compress_ratios[layer] != layout.compress_ratios[start]:
            ax.text((start + layer) / 2, -0.25, f"m={layout.compress_ratios[start]}", ha="center", va="bottom",
                    fontsize=8)
            ax.plot([start + 0.1, layer - 0.1], [-0.12, -0.12], color="black", lw=0.8)
            start = layer
    rows = (("KV of", "reads the KV of"), ("selection of", "reads the selection of"),
            ("candidates of", "selects inside the candidate blocks of"))
    readers = {row: {} for row, _ in rows}
    for p in plan:
        for (row, _), source in zip(rows, (p.kv_source, p.index_source, p.candidate_source)):
            if source is not None:
                readers[row].setdefault(source, []).append(p.layer_id)
        if p.makes_candidates:
            ax.text(p.layer_id + 0.5, 3.5, "makes", ha="center", va="center", fontsize=7, style="italic")
    for y, (row, _) in enumerate(rows, start=1):
        for source, layers in readers[row].items():
            color = MODE_COLORS[plan[source].mode]
            for first, last in _runs(layers):
                ax.add_patch(Rectangle((first + 0.08, y + 0.25), last - first + 0.84, 0.5, facecolor=color,
                                       alpha=0.35, edgecolor=color))
                label = f"{row} {source}" if last - first >= 3 else str(source)
                ax.text((first + last + 1) / 2, y + 0.5, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.2, n + 0.2)
    ax.set_ylim(4, -0.5)
    ax.set_yticks([0.5, 1.5, 2.5, 3.5], ["mode"] + [label for _, label in rows])
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(left=False)
    counts = layout.counts()
    ax.legend(handles=[Patch(color=MODE_COLORS[m], label=f"{m.value} ({counts[m]}): {MODE_MEANING[m]}")
                       for m in Mode if counts[m]], loc="upper center", bbox_to_anchor=(0.5, -0.02),
              ncol=2, fontsize=8, frameon=False)
    ax.set_title(title or f"{n} layers", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str]) -> None:
    import argparse

    from model.cli import job_config, run_cli

    command = argparse.ArgumentParser(prog="python -m model.layout",
                                      description="Print a layout's per-layer table; --plot also draws it.")
    command.add_argument("--plot", metavar="PNG", help="also draw the layout into this PNG file")
    command.add_argument("overrides", nargs="*", help="config overrides, as for python -m train (layout=v41 ...)")
    options = command.parse_intermixed_args(argv)

    def show():
        config = job_config(options.overrides).layout
        layout = layout_from_config(config)
        print(layout.table())
        if options.plot:
            plot(layout, options.plot, title=f"layout={config.name}: " + ", ".join(
                f"{count} {mode.value}" for mode, count in layout.counts().items() if count))
            print(f"drew {options.plot}")

    run_cli(show)


if __name__ == "__main__":
    main(sys.argv[1:])
