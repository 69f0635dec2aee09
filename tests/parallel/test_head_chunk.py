"""The LM head and its cross-entropy a chunk of tokens at a time (``parallel.head_chunk``, ``chunked_lm_loss``).

The reference is the plain loss on the whole logits, written here: ``F.cross_entropy`` of ``features @ W^T`` over the
labelled tokens, in fp64, so the chunked sum must agree to rounding (1e-12), gradients included. The engine test
runs one optimizer step of ``tiny`` with and without chunks (fp32: the head's weight gradient is summed over chunks,
so to 1e-6, not bitwise) and counts the head's calls: each chunk once in the forward and once in its recomputation.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from train.loss import IGNORE_INDEX, chunked_lm_loss


def test_chunked_loss_and_gradients_equal_the_whole_logits():
    """Chunks of 7 over 2 x 20 tokens (the last one short), a quarter of the labels ignored: the loss, the features'
    and the head weight's gradients equal the whole-logits reference (catches a chunk border off by one, a chunk
    normalised by its own label count, an ignored label counted)."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(2, 20, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 16, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 20), generator=g)
    labels[torch.rand(2, 20, generator=g) < 0.25] = IGNORE_INDEX

    want = F.cross_entropy((features @ weight.T).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    want_grads = torch.autograd.grad(want, (features, weight))
    got, count = chunked_lm_loss(features, lambda f: f @ weight.T, labels, chunk=7)
    got_grads = torch.autograd.grad(got, (features, weight))

    assert count == int((labels != IGNORE_INDEX).sum())
    assert math.isclose(got.item(), want.item(), rel_tol=1e-12)
    for g_, w_ in zip(got_grads, want_grads):
        assert (g_ - w_).abs().max() <= 1e-12 * w_.abs().max()


def _step(head_chunk: int):
    from tests.support.pipeline_harness import job_of
    from train.processes import distributed
    from train.run.engine import build_engine, train_step

    distributed.init(torch.device("cpu"))
    engine = build_engine(job_of(["data.seq_len=64", "data.micro_batch_size=2", "train.grad_accum_steps=1",
                                  f"parallel.head_chunk={head_chunk}"]))
    stage = engine.module.stage
    calls = []
    head = stage.head
    engine.module.loss_fn.head = lambda f: calls.append(f.shape[0]) or head(f)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 65), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone(), "doc_ids": torch.zeros(2, 64, dtype=torch.long)}
    batch["labels"][0, :9] = IGNORE_INDEX
    result = train_step(engine, [batch])
    weights = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    return result.metrics, weights, calls


def test_a_step_with_head_chunks_equals_one_without():
    """One AdamW step of ``tiny`` with 128 tokens in chunks of 48 (48, 48, 32): the loss, the gradient norm and the
    updated weights match the step without chunks, and the head ran per chunk, forward and recomputation."""
    want, want_weights, unchunked_calls = _step(0)
    got, got_weights, calls = _step(48)
    assert unchunked_calls == [] and calls == [48, 48, 32] + [32, 48, 48]  # the backward recomputes last first
    for key in ("loss", "lm_loss", "grad_norm"):
        assert math.isclose(got[key], want[key], rel_tol=1e-6), key
    for name, w in want_weights.items():
        assert (got_weights[name] - w).norm() <= 1e-6 * w.norm(), name


@pytest.mark.parametrize("overrides, message", [
    (["parallel.head_chunk=-1"], "parallel.head_chunk=-1 is out of range — set a whole number >= 0"),
    (["parallel.head_chunk=4096", "model=v41_mini", "train.dspark_loss_coef=0.1"], "cannot train the DSpark"),
])
def test_bad_head_chunk_settings_are_one_line_errors(overrides, message):
    from model.cli import compose
    from train.run.preflight import planned

    with pytest.raises(ValueError, match=message) as error:
        planned(compose(["data.seq_len=128", *overrides]), world_size=1)
    assert "\n" not in str(error.value)
