"""Training health at initialisation (issue 11, docs/TRAINING_HEALTH.md).

The model is the `small` preset's shape scaled down with its ratios kept (the attention's head space 16x the
width: 4 heads x 512 = 2,048 at dim 128; the V4.1 10-layer layout), on real text. With the old recipe (every
matrix, the embedding and the head at std 0.02) both tests fail: the gradient norm at init is 25 (attention output
projections 24, the head 3.1) and the loss rises above its initial value during the warm-up below.
"""
import pytest
import torch

from model import build_model
from model.cli import compose
from model.groups import param_group
from train.data import build_loader
from train.engine import param_groups, warmup_cosine
from train.loss import compute_loss

SCALED_SMALL = ["model.dim=128", "model.n_heads=4", "model.head_dim=512", "model.rope_head_dim=64",
                "model.index_head_dim=64", "model.q_lora_rank=64", "model.o_lora_rank=64", "model.o_groups=2",
                "model.inter_dim=256", "model.kernel_backend=torch", "data.seq_len=256", "data.micro_batch_size=2"]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = compose(SCALED_SMALL)
    loader = build_loader(cfg.data, vocab_size=int(cfg.model.vocab_size))
    return cfg, next(loader), next(loader)


def lm_loss(model, batch):
    return compute_loss(model(batch["input_ids"], batch["doc_ids"]), batch["labels"], 1.0)


def test_gradient_at_init_is_carried_by_the_head(setup):
    """The LM head's gradient is the logit error against the unit-scale normalised last hidden state: O(1)
    by construction. A well-scaled trunk passes that error back without amplifying it, so no other group's
    gradient may exceed the head's. (Old recipe: attention outputs 24 vs head 3.1, from RMSNorms dividing by a
    residual stream of RMS 0.02-0.06.)"""
    cfg, batch, _ = setup
    model = build_model(cfg.model, cfg.layout)
    lm_loss(model, batch).total.backward()
    squares = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            squares[param_group(name)] = squares.get(param_group(name), 0.0) + p.grad.pow(2).sum().item()
    head = squares.pop("head") ** 0.5
    others = {group: value ** 0.5 for group, value in squares.items()}
    assert 0.3 < head < 8, head
    assert max(others.values()) < head, (others, head)


def test_warmup_to_a_high_lr_never_raises_the_loss(setup):
    """Eight AdamW steps (the trainer's decay groups and clipping) warming up linearly to lr 1e-2 on one batch:
    the held-out loss never exceeds its initial value. Adam's first updates are lr * sign(g) per weight, so
    this is what the first steps of any warm-up see."""
    cfg, batch, heldout = setup
    model = build_model(cfg.model, cfg.layout)
    optimizer = torch.optim.AdamW(param_groups(list(model.named_parameters()), 0.1), lr=1e-2, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(8, 100, 0.1))
    with torch.no_grad():
        initial = lm_loss(model, heldout).lm.item()
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        lm_loss(model, batch).total.backward()
        trunk = [p for n, p in model.named_parameters() if p.grad is not None and param_group(n) != "indexer"]
        torch.nn.utils.clip_grad_norm_(trunk, 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            losses.append(lm_loss(model, heldout).lm.item())
    assert max(losses) <= initial, (initial, losses)
    assert losses[-1] < initial - 0.3, (initial, losses)  # and it learns
