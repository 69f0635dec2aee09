"""Runs a few pipelined training steps in N gloo processes and saves what the tests compare.

Each process writes ``rank<r>.pt``: per-step losses, its stage's parameters (full-model names), its shadow
replicas, the ledger's findings and the backward-traversal counter."""
import os

import torch

from parallel.local import spawn

SEQ_LEN, MICRO_BATCH, MICROBATCHES, STEPS = 64, 2, 4, 2


def batches(vocab: int):
    """Deterministic microbatches: two packed documents per row, next-token labels."""
    g = torch.Generator().manual_seed(0)
    while True:
        x = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN), generator=g)
        doc = torch.zeros_like(x)
        doc[:, 40:] = 1
        yield (x, doc), torch.roll(x, -1, 1)


def _worker(rank, world, out, cuts, index_k, recompute):
    from model import ModelArgs, layout_from_config
    from model.cli import compose
    from parallel.engine import CSA2PipelineModule, LanguageModelLoss, build_engine
    from parallel.partition import partition

    cfg = compose([])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    plan = partition(args, layout, SEQ_LEN, world, cuts)
    loss = LanguageModelLoss(1.0, list(layout.index_source_layer_ids))
    module = CSA2PipelineModule(args, layout, plan, loss, MICRO_BATCH, SEQ_LEN, torch.float32, index_k, 0,
                                recompute)
    engine = build_engine(module, {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICROBATCHES,
        "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}}})
    data = batches(args.vocab_size)
    losses, live_after = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data).item())
        live_after.append(module.stage.ledger.live())
    stage = module.stage
    torch.save({"losses": losses, "parts": {k: v.item() for k, v in engine.get_additional_losses().items()},
                "params": {n: p.detach().clone() for n, p in stage.model.named_parameters()},
                "shadows": {n: p.detach().clone() for n, p in stage.shadows.named_parameters()},
                "live_after": live_after, "peak_microbatches": stage.ledger.peak_microbatches,
                "backward_traversals": stage.backward_traversals, "stage": engine.stage_id}, f"{out}/rank{rank}.pt")


def run(out: str, stages: int, cuts=None, index_k: str = "shadow", recompute: bool = False):
    """Run the job in ``stages`` processes; returns the per-rank results."""
    os.makedirs(out, exist_ok=True)
    spawn(_worker, stages, stages, out, cuts, index_k, recompute)
    return [torch.load(f"{out}/rank{r}.pt", weights_only=True) for r in range(stages)]
