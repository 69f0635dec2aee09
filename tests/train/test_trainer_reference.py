"""The trainer against an independent plain-PyTorch training loop, and its pieces against hand-made cases.

The reference below is written from SPEC §2 and the config's documented meaning, not from ``train/run/engine.py``:
``torch.optim.AdamW`` with weight decay on every parameter but norm gains and attention sinks (chosen by name),
the trunk and the indexer clipped each by its own global norm (the indexer's parameters are the ones under
``.indexer.``), the loss averaged over the step's microbatches, and the learning rate from the warmup + cosine
formula. Planted bugs this catches: one joint clipping norm, decay on norms or sinks, a schedule off by a step,
microbatches summed instead of averaged.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from model import ModelArgs, layout_from_config
from model.cli import compose, resolved
from model.diagnostics import index_recall
from model.transformer import Transformer
from parallel.job import plan
from train.formats import checkpoint
from train.processes import distributed
from train.run.engine import build_engine, train_step

SEQ_LEN, MICRO_BATCH, MICROBATCHES, STEPS = 64, 2, 2, 3  # 2 warmup steps, 1 cosine
CONFIG = [f"data.seq_len={SEQ_LEN}", f"data.micro_batch_size={MICRO_BATCH}", f"train.grad_accum_steps={MICROBATCHES}",
          "train.warmup_steps=2", "train.max_steps=5", "train.min_lr_ratio=0.1", "train.lr=0.01",
          "train.weight_decay=0.1", "train.grad_clip=0.00001", "train.indexer_loss_coef=0.5"]


def batches(vocab: int, count: int) -> list[dict]:
    """Rows of two documents with next-token labels; the last 6 positions are padding (label -100)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN + 1), generator=g)
        doc = torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.long)
        doc[:, 37:] = 1
        labels = ids[:, 1:].clone()
        labels[:, 36] = -100  # no label across the document boundary
        labels[:, -6:] = -100
        out.append({"input_ids": ids[:, :-1], "labels": labels, "doc_ids": doc})
    return out


def reference_lr(cfg, step: int) -> float:
    """lr after ``step`` updates: linear warmup from lr/warmup, then cosine from lr down to min_lr_ratio * lr."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / (t.max_steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def reference_training(cfg, data: list[dict]) -> list[dict]:
    """Plain PyTorch: per step the lr, both pre-clip norms, the clipped gradients and the parameters after it."""
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    model = Transformer(args, layout, seed=cfg.train.seed)
    named = dict(model.named_parameters())
    no_decay = [n for n in named if n.endswith("norm.weight") or n.endswith("attn_sink")]
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named.items() if n not in no_decay], "weight_decay": cfg.train.weight_decay},
         {"params": [named[n] for n in no_decay], "weight_decay": 0.0}],
        lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps)
    groups = {"trunk": [n for n in named if ".indexer." not in n], "indexer": [n for n in named if ".indexer." in n]}
    steps = []
    for step in range(STEPS):
        lr = reference_lr(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        for batch in data[step * MICROBATCHES:(step + 1) * MICROBATCHES]:
            out = model(batch["input_ids"], batch["doc_ids"])
            lm = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), batch["labels"].reshape(-1),
                                 ignore_index=-100)
            loss = lm + cfg.train.indexer_loss_coef * torch.stack(list(out.indexer_losses.values())).sum()
            (loss / MICROBATCHES).backward()
        norms = {}  # in float64 (torch's fp32 vector_norm of one long CPU vector is off by ~1e-4 here), then
        for group, names in groups.items():  # rounded to the gradients' fp32 as torch's clip_grad_norm_ has it
            norm = torch.cat([named[n].grad.reshape(-1) for n in names]).double().norm().float()
            norms[group] = norm.item()
            for n in names:
                named[n].grad.mul_(torch.clamp(cfg.train.grad_clip / (norm + 1e-6), max=1.0))
        grads = {n: p.grad.clone() for n, p in named.items()}
        optimizer.step()
        steps.append({"lr": lr, "norms": norms, "grads": grads,
                      "params": {n: p.detach().clone() for n, p in named.items()}})
    return steps


def engine_training(cfg, data: list[dict]) -> list[dict]:
    """The same steps through ``train/run/engine.py`` (DeepSpeed pipeline engine, one stage, one process)."""
    distributed.init(torch.device("cpu"))
    engine = build_engine(plan(resolved(cfg), 1, torch.device("cpu")))
    stage = engine.module.stage.model
    clip, clipped = engine._clip_gradients, {}

    def clip_and_keep():
        clip()
        clipped.update({n: p.grad.clone() for n, p in stage.named_parameters()})
    engine._clip_gradients = clip_and_keep
    steps = []
    for step in range(STEPS):
        result = train_step(engine, data[step * MICROBATCHES:(step + 1) * MICROBATCHES])
        assert not result.bad
        steps.append({"lr": result.metrics["lr"], "grads": dict(clipped),
                      "norms": {"trunk": engine.grad_norm.item(), "indexer": engine.indexer_grad_norm.item()},
                      "params": {n: p.detach().clone() for n, p in stage.named_parameters()}})
    return steps


# Before clipping, step 0's gradients of the two loops are bitwise equal (checked 2026-12-01). The clip norms are
# summed differently: the engine adds per-tensor squares in fp32 (in the model's parameter order, so that any stage
# split gives the same bits), this reference in float64; at step 0 the indexer group's norms are 1 ulp apart, so its
# clipped gradients differ by 1.5e-7 of the largest element (the trunk's norms agree), 7e-6 by step 2. AdamW
# divides each element by its own RMS, so an update carries its gradient's relative error whatever the element's
# size, up to lr x GRAD_RTOL in a parameter: 2.3e-7 measured at steps 1-2 on a near-zero indexer weight (lr 1e-2).
# Decay on a norm gain (1.0) moves it by lr x weight_decay = 1e-3 a step; the other planted bugs fail the lr, norm
# and gradient checks first.
GRAD_RTOL = 1e-4


def test_training_steps_match_plain_pytorch():
    cfg = compose(CONFIG)
    data = batches(cfg.model.vocab_size, STEPS * MICROBATCHES)
    want, got = reference_training(cfg, data), engine_training(cfg, data)
    for step, (w, g) in enumerate(zip(want, got)):
        assert g["lr"] == pytest.approx(w["lr"], rel=1e-12), step
        for group in ("trunk", "indexer"):
            assert w["norms"][group] > 5 * cfg.train.grad_clip  # each group's clipping binds (else untested)
            assert g["norms"][group] == pytest.approx(w["norms"][group], rel=1e-5), (step, group)
        assert g["grads"].keys() == w["grads"].keys()
        for name, grad in w["grads"].items():
            torch.testing.assert_close(g["grads"][name], grad, rtol=GRAD_RTOL, atol=1e-9, msg=f"step {step} {name}")
        for name, value in w["params"].items():
            torch.testing.assert_close(g["params"][name], value, rtol=1e-5, atol=GRAD_RTOL * cfg.train.lr,
                                       msg=f"step {step} {name}")


def test_rng_state_round_trip(tmp_path):
    """What ``checkpoint.rng_state`` saves (through torch.save / weights_only load) brings back Python's, NumPy's
    and torch's streams exactly where they were."""
    import random

    import numpy as np

    torch.manual_seed(3), random.seed(3), np.random.seed(3)

    def draws():
        return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()

    draws()
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    after_save = draws()
    draws()  # the stream moves on (a resumed job's fresh seeding, say)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == after_save


def test_index_recall_by_hand():
    """One head, 4 compressed entries with scores 4, 3, 2, 1 (query . entry), all visible; k = 2, so the dense top-2
    is {0, 1}. Query 0 selected {0, 2}: 1 of 2 right. Query 1 selected {1} and an empty slot: 1 of 1 right (the
    number selected, not k, is the denominator). Query 2 selected nothing: not counted. Recall = (0.5 + 1) / 2."""
    kv = torch.zeros(1, 4, 2)
    kv[0, :, 0] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    q = torch.zeros(1, 3, 1, 2)
    q[..., 0] = 1.0
    vis_lo, vis_hi = torch.zeros(1, 3, dtype=torch.long), torch.full((1, 3), 4)
    topk = torch.tensor([[[0, 2], [1, -1], [-1, -1]]])
    assert index_recall(q, kv, vis_lo, vis_hi, topk, scale=1.0).item() == pytest.approx(0.75)
    # entry 0 not visible to query 0: its dense top-2 becomes {1, 2}, so {0, 2} scores 1 of 2 still; {1} 1 of 1
    vis_lo[0, 0] = 1
    assert index_recall(q, kv, vis_lo, vis_hi, topk, scale=1.0).item() == pytest.approx(0.75)
    topk[0, 0] = torch.tensor([0, 3])  # now 0 of 2 for query 0 (0 is invisible, 3 not in its top-2)
    assert index_recall(q, kv, vis_lo, vis_hi, topk, scale=1.0).item() == pytest.approx(0.5)
