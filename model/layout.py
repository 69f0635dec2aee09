"""Layer-mode layouts: which layers compute KV (Full), re-select (Reindex) or reuse (Reuse).

The canonical form is the reference config's six fields (``Layout``). Hydra presets describe a layout by a few
readable knobs and ``layout_from_config`` expands them; any of the canonical lists given explicitly wins over
what the knobs generate. ``Layout.plan()`` checks every rule of SPEC §1.5 and resolves, per layer, where its
KV, its index keys, its selection and its candidate blocks come from.

``python -m model.layout [overrides]`` prints the per-layer table.
"""
import enum
import sys
from dataclasses import dataclass
from functools import cached_property


class LayoutError(ValueError):
    """A layout that breaks a rule of SPEC §1.5; the message names the layer and the rule."""


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
            raise LayoutError(
                f"candidate_topk_blocks={self.candidate_topk_blocks} blocks of candidate_block_size="
                f"{self.candidate_block_size} guarantee a query only {guaranteed} candidate entries, fewer than "
                f"index_topk={index_topk}; the reference then picks entries outside the candidates. Use "
                f"layout.candidate_topk_blocks>={blocks}, or model.index_topk<={guaranteed}")

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


def layout_from_config(cfg) -> Layout:
    """A Layout from a ``conf/layout`` node: knobs generate the lists, explicit lists override them.

    When only ``kv_source_layer_ids`` is overridden, the index sources are regenerated around it (the new KV
    sources plus the generated Reindex layers), so a single override stays a valid layout."""
    cfg = dict(cfg)
    lists = generate(cfg["window_layers"], dict(cfg["encoder"]), dict(cfg["decoder"]), cfg["candidates"])
    given = {k: cfg.get(k) for k in CANONICAL if cfg.get(k) is not None}
    if "kv_source_layer_ids" in given and "index_source_layer_ids" not in given:
        reindex = set(lists["index_source_layer_ids"]) - set(lists["kv_source_layer_ids"])
        lists["index_source_layer_ids"] = sorted(set(given["kv_source_layer_ids"]) | reindex)
    lists.update({k: list(v) if k != "candidate_source_layer_id" else v for k, v in given.items()})
    return Layout(**lists, candidate_topk_blocks=cfg["candidate_topk_blocks"],
                  candidate_block_size=cfg["candidate_block_size"])


def main(argv: list[str]) -> None:
    from model.cli import compose_checked, run_cli

    run_cli(lambda: print(layout_from_config(compose_checked(argv).layout).table()))


if __name__ == "__main__":
    main(sys.argv[1:])
