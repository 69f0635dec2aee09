"""Context parallelism in the model (SPEC §7): a row split over C = 2 gloo processes computes what one process does.

``model=tiny layout=v41_scaled`` in fp64 (layers 0-1 window, 2 Full m=2 | 3 Reuse, 4 Full | 5 Reuse, 6 Full m=1 and
candidate source, 7 Reuse, 8 Reindex inside the candidates, 9 Reuse: every mode), rows of 128 tokens in chunks of
64. Row 0's second document starts at token 37 and crosses the border, so its m = 2 group of tokens 63-64 straddles
it; row 1's documents end and start at the border. Each rank's loss is its chunk's share (the LM loss over the row's
label count, each indexer KL over the row's queries with a selection): the shares add up to the whole-row losses
and their gradients to the whole-row gradients. The same workers also run with a planted bug each (the window halo
dropped; an all-gather whose backward returns only the local gradient) and with every layer recomputed.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from parallel.local import spawn
from parallel.recompute import recompute_leading

T, C, BORDER = 128, 2, 64
VARIANTS = ("exact", "recompute", "no_halo", "gather_unsummed", "v41_mini")


def rows():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, T), generator=g)
    doc = torch.zeros(2, T, dtype=torch.long)
    doc[0, 37:] = 1  # crosses the border at 64, from an odd token (a straddling m = 2 group)
    doc[1, BORDER:] = 1  # ends at the border
    doc[1, BORDER + 30:] = 2
    labels = torch.roll(ids, -1, 1).masked_fill(torch.roll(doc, -1, 1) != doc, -100)
    labels[:, -1] = -100
    return ids, doc, labels


def build(model="tiny"):
    from model import ModelArgs, layout_from_config
    from model.cli import compose
    from model.transformer import Transformer

    cfg = compose([f"model={model}", "layout=v41_scaled", "model.kernel_backend=torch"])
    return Transformer(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout), seed=0).double()


def losses(logits, labels, indexer, count):
    lm = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / count
    return lm, {k: v for k, v in sorted(indexer.items())}


def _plant(variant):
    """Break one exchange of ``parallel/context.py`` for a variant; returns the undo."""
    from parallel import context

    if variant == "no_halo":
        saved = context.ContextShard.halo
        context.ContextShard.halo = lambda self, x, rows: saved(self, x, rows) * 0
        return lambda: setattr(context.ContextShard, "halo", saved)
    if variant == "gather_unsummed":
        saved = context._Gather.backward
        context._Gather.backward = staticmethod(
            lambda ctx, grad: (grad.chunk(ctx.shard.size, dim=1)[ctx.shard.rank].contiguous(), None))
        return lambda: setattr(context._Gather, "backward", saved)
    return lambda: None


def _worker(rank, out):
    import torch.distributed as dist
    from parallel.context import ContextShard

    torch.set_num_threads(1)
    ids, doc, labels = rows()
    shard = ContextShard(dist.group.WORLD, list(range(C)), T)
    results = {}
    for variant in VARIANTS:
        model = build("v41_mini" if variant == "v41_mini" else "tiny")
        if variant == "recompute":
            recompute_leading(model.layers.values(), len(model.layers))
        undo = _plant(variant)
        try:
            state = model.new_state(doc, ids, context=shard)
            candidates = {}
            state.on_store = lambda f, layer, t: candidates.update({layer: t}) if f == "candidates" else None
            x, pre = model.run_layers(*model.embed_tokens(state.geometry.chunk_of(ids)), state)
            logits = model.logits(x, pre)
            lm, indexer = losses(logits, state.geometry.chunk_of(labels), state.indexer_losses,
                                 (labels != -100).sum())
            (lm + sum(indexer.values())).backward()
        finally:
            undo()
        entries = state.geometry.entries(1)
        blocks = candidates[6]  # doc-relative block numbers of the candidate source (m = 1: entry = token)
        first_entry = entries.vis_lo.unsqueeze(-1) + blocks * model.layout.candidate_block_size
        results[variant] = {
            "lm": lm.detach(), "indexer": {k: v.detach() for k, v in indexer.items()}, "logits": logits.detach(),
            "grads": grads_of(model), "remote_candidates": int(((blocks >= 0) & (first_entry < shard.start)).sum())}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def grads_of(model):
    """Every parameter's gradient, dense (the Engram tables' are sparse)."""
    return {n: p.grad.to_dense() if p.grad.is_sparse else p.grad.clone() for n, p in model.named_parameters()
            if p.grad is not None}


def whole_row(model_name):
    ids, doc, labels = rows()
    model = build(model_name)
    output = model(ids, doc)
    lm, indexer = losses(output.logits, labels, output.indexer_losses, (labels != -100).sum())
    (lm + sum(indexer.values())).backward()
    return {"lm": lm.detach(), "indexer": {k: v.detach() for k, v in indexer.items()},
            "logits": output.logits.detach(), "grads": grads_of(model)}


@pytest.fixture(scope="module")
def reference():
    return whole_row("tiny")


@pytest.fixture(scope="module")
def chunks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("context"))
    spawn(_worker, C, out)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in range(C)]


def mismatches(reference, ranks) -> list[str]:
    """What of the chunks' forward and backward differs from the whole row's (fp64: 1e-10 of each tensor's norm)."""
    bad = []

    def check(name, got, want):
        if (got - want).norm() > 1e-10 * want.norm().clamp_min(1e-30):
            bad.append(name)

    check("logits", torch.cat([r["logits"] for r in ranks], dim=1), reference["logits"])
    check("lm", sum(r["lm"] for r in ranks), reference["lm"])
    for source, want in reference["indexer"].items():
        check(f"indexer {source}", sum(r["indexer"][source] for r in ranks), want)
    for name, want in reference["grads"].items():
        check(name, sum(r["grads"].get(name, torch.zeros_like(want)) for r in ranks), want)
    return bad


@pytest.mark.parametrize("variant", ["exact", "recompute"])
def test_chunks_equal_whole_row(reference, chunks, variant):
    """Logits, the LM loss, every indexer KL and every parameter's gradient, summed over the 2 chunks, equal the
    whole-row forward and backward (with every layer recomputed too: the exchanges run again in backward)."""
    assert mismatches(reference, [r[variant] for r in chunks]) == []


def test_v41_mini_chunks_equal_whole_row(chunks):
    """The same with hyper-connections, the MoE and Engram (its n-grams look back across the border; the draft
    head does not run): in fp64 every gradient, the mix scales' included, agrees to 1e-10."""
    assert mismatches(whole_row("v41_mini"), [r["v41_mini"] for r in chunks]) == []


def test_every_mode_and_a_remote_candidate(chunks):
    """The layout has every layer mode, and queries of the second chunk select inside candidate blocks whose
    entries lie in the first chunk."""
    from model.layout import Mode

    assert {p.mode for p in build().layout.plan} == set(Mode)
    assert chunks[1]["exact"]["remote_candidates"] > 0


@pytest.mark.parametrize("variant", ["no_halo", "gather_unsummed"])
def test_planted_exchange_bugs_are_caught(reference, chunks, variant):
    """A halo of zeros changes the second chunk's window (logits); an all-gather backward that keeps only the local
    gradient loses the second chunk's uses of the first chunk's entries (gradients of the compressors)."""
    bad = mismatches(reference, [r[variant] for r in chunks])
    assert bad, variant
    if variant == "gather_unsummed":
        assert "logits" not in bad and any("compressor" in name for name in bad)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.context_parallel=2", "data.seq_len=120"], 2, "data.seq_len=120 is not divisible into"),
    (["parallel.context_parallel=8"], 8, "chunks of 16 tokens, shorter than the sliding window"),
    (["parallel.context_parallel=3"], 4, "parallel.context_parallel=3 does not divide the 4 process"),
    (["parallel.context_parallel=2", "parallel.pipeline_stages=2"], 2, "does not divide the 1 process"),
    (["parallel.context_parallel=0"], 1, "parallel.context_parallel=0 is out of range — set a whole number >= 1"),
    (["parallel.context_parallel=2", "model=v41_mini", "train.dspark_loss_coef=0.1"], 2, "DSpark draft head"),
    (["parallel.context_parallel=2", "model.attention=dense", "layout=window_only"], 2, "model.attention=dense"),
])
def test_bad_context_settings_are_one_line_errors(overrides, world, message):
    """Each refusal is one ValueError line naming the setting (before any process group is made)."""
    from model.cli import compose
    from train.run.preflight import planned

    with pytest.raises(ValueError, match=message) as error:
        planned(compose(["data.seq_len=128", *overrides]), world)
    assert "\n" not in str(error.value)


def test_chunks_of_whole_groups_and_blocks_are_accepted():
    """v41_scaled: ratios 2 and 1, candidate blocks of 4 entries: chunks must be multiples of 8 tokens, >= 32
    (the window); C = 1 constrains nothing."""
    from parallel.context import chunk_length

    assert chunk_length(4, 128, 32, (0, 2, 1), 4) == 32
    assert chunk_length(1, 100, 32, (0, 2, 1), 4) == 100  # one chunk: any row
