"""The objective (train/loss.py) and the training step's guard against non-finite steps."""
import torch

from model import build_model
from model.cli import compose
from tests.support.pipeline_harness import job_of
from train.loss import IGNORE_INDEX, Loss, compute_loss, lm_loss
from train.processes import distributed
from train.run import engine as engine_module
from train.run.engine import build_engine, train_step


def _batch(rows: int = 2, length: int = 64, vocab: int = 256) -> dict:
    """Random tokens, two documents per row (labels stop at each document's end, as the loader makes them)."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    doc_ids = (torch.arange(length) >= length // 3).long().expand(rows, length).contiguous()
    labels = input_ids.roll(-1, dims=1)
    labels[doc_ids != doc_ids.roll(-1, dims=1)] = IGNORE_INDEX
    labels[:, -1] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels, "doc_ids": doc_ids}


def _tiny_model(cfg):
    torch.manual_seed(0)
    return build_model(cfg.model, cfg.layout)


def test_indexer_loss_changes_no_trunk_gradient():
    cfg = compose([])
    model, batch = _tiny_model(cfg), _batch()
    grads = {}
    for coef in (0.0, 3.0):
        model.zero_grad(set_to_none=True)
        loss = compute_loss(model(batch["input_ids"], batch["doc_ids"]), batch["labels"], coef)
        assert loss.indexer, "the default layout has index sources"
        loss.total.backward()
        grads[coef] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    trunk = [n for n in grads[3.0] if ".indexer." not in n]
    indexer = [n for n in grads[3.0] if ".indexer." in n]
    assert trunk and indexer
    assert [n for n in trunk if not torch.equal(grads[0.0][n], grads[3.0][n])] == []
    assert all(not grads[0.0].get(n, torch.zeros(1)).any() for n in indexer), "coef 0: the indexer learns nothing"
    assert any(grads[3.0][n].any() for n in indexer), "coef > 0: the indexer learns from its KL"


def test_loss_parts_and_metrics():
    cfg = compose([])
    batch = _batch()
    loss = compute_loss(_tiny_model(cfg)(batch["input_ids"], batch["doc_ids"]), batch["labels"], 0.5)
    assert torch.allclose(loss.total, loss.lm + 0.5 * loss.indexer_total)
    assert loss.tokens == int((batch["labels"] != IGNORE_INDEX).sum())
    metrics = loss.metrics()
    assert {"loss", "lm_loss", "indexer_loss"} <= set(metrics)
    assert {f"indexer_loss/layer{layer}" for layer in loss.indexer} <= set(metrics)


def test_all_padding_batch_is_zero_not_nan():
    logits = torch.randn(1, 4, 8, requires_grad=True)
    value, count = lm_loss(logits, torch.full((1, 4), IGNORE_INDEX))
    assert count == 0 and value.item() == 0.0
    value.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_non_finite_step_is_skipped(monkeypatch):
    """A NaN loss leaves weights (and the schedule) untouched and is reported; the next good step trains."""
    distributed.init(torch.device("cpu"))
    engine = build_engine(job_of(["data.micro_batch_size=2"]))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    lr = engine.get_lr()[0]

    def nan_loss(*args):
        loss = compute_loss(*args)
        return Loss(loss.total * float("nan"), loss.lm, loss.indexer, loss.tokens)

    monkeypatch.setattr(engine_module, "compute_loss", nan_loss)
    result = train_step(engine, [_batch()])
    assert result.bad and not result.applied
    assert all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    assert engine.get_lr()[0] == lr
    monkeypatch.undo()
    result = train_step(engine, [_batch()])
    assert not result.bad
    assert any(not torch.equal(before[n], p) for n, p in engine.module.named_parameters())


def test_window_only_layout_has_no_indexer_loss():
    cfg = compose(["layout=window_only", "layout.window_layers=2"])
    batch = _batch(rows=1, length=32)
    loss = compute_loss(_tiny_model(cfg)(batch["input_ids"], batch["doc_ids"]), batch["labels"], 1.0)
    assert loss.indexer == {} and loss.indexer_total.item() == 0.0 and torch.isfinite(loss.total)
