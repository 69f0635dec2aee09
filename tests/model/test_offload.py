"""Recomputed layers' inputs kept on the host (``parallel.recompute_offload``, ``model/offload.py``).

The property is bit-identity: a recomputed layer that reads its input back from the host copy computes exactly what
the one holding its input does (fp32 here, every layer recomputed, on ``tiny`` and on ``v41_mini``'s 4-copy stream,
MoE and Engram), and the forward does not keep the input alive itself (else nothing is freed). On the CPU the copy
is a clone; the copy stream and pinned memory run on the GPU (``bench/train_step.py ... parallel.recompute_offload``).
"""
import gc
import weakref

import pytest
import torch

from model.cli import compose
from model import ModelArgs, layout_from_config
from model.transformer import Transformer
from parallel.recompute import recompute


def build(name: str, offload: bool) -> Transformer:
    cfg = compose([f"model={name}", "layout=v41_scaled", "model.kernel_backend=torch"])
    model = Transformer(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout), seed=0)
    for block in model.layers.values():
        recompute(block, offload=offload)
    return model


def loss_and_grads(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, 48), generator=g)
    doc = torch.zeros_like(ids)
    doc[0, 23:] = 1
    out = model(ids, doc)
    loss = out.logits.logsumexp(-1).mean() + sum(out.indexer_losses.values())
    loss.backward()
    return loss.detach(), {n: p.grad.to_dense() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["tiny", "v41_mini"])
def test_offloaded_inputs_give_bitwise_the_same_step(name):
    """Loss and every gradient equal bit for bit (catches a restored input that is not the original's values,
    or one without its ``requires_grad``, which changes what the recomputation saves)."""
    want_loss, want = loss_and_grads(build(name, offload=False))
    got_loss, got = loss_and_grads(build(name, offload=True))
    assert torch.equal(got_loss, want_loss)
    assert want.keys() == got.keys()
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


def test_the_forward_keeps_no_reference_to_an_offloaded_input():
    """After a recomputed block's forward, its input is freed once the caller drops it (only the host copy holds
    the values); without offloading the checkpoint keeps it (so the test can tell the two apart)."""
    alive = {}
    for offload in (False, True):
        model = build("tiny", offload)
        block = model.layers["2"]
        ids = torch.randint(0, 256, (1, 64))
        state = model.new_state(torch.zeros_like(ids), ids)
        x, pre = model.embed_tokens(ids)
        for i in range(2):
            x, pre = model.layers[str(i)](x, pre, state)
        x = x.clone()
        ref = weakref.ref(x)
        out, _ = block(x, pre, state)
        del x
        gc.collect()
        alive[offload] = ref() is not None
        out.sum().backward()
    assert alive == {False: True, True: False}


def test_host_copies_are_let_go_once_brought_back():
    """After the backward every layer's host copy is released (on a GPU the pinned blocks return to the allocator
    for the next step; kept, a second step at 192K needed twice the host memory and was killed)."""
    model = build("tiny", offload=True)
    ids = torch.randint(0, 256, (1, 64))
    state = model.new_state(torch.zeros_like(ids), ids)
    x, pre = model.run_layers(*model.embed_tokens(ids), state)
    held, chain = state.host_stash.last, []
    while held is not None:
        chain.append(held)
        held = held.previous
    assert len(chain) == len(model.layers) and all(h.host is not None for h in chain)
    model.logits(x, pre).sum().backward()
    assert all(h.host is None and h.restored is None for h in chain)
