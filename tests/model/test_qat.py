"""Quantisation-aware training (model/qat.py): the served grids on hand-worked values, the straight-through
gradient, and which attention tensors a ``model.qat=true`` layer rounds (every one the served model quantises: the
window KV, the compressed KV, the indexer's queries and keys; nothing else)."""
import pytest
import torch

import kernels
from kernels import reference
from model.qat import served_values, simulate


def _block(values: list[float], width: int) -> torch.Tensor:
    return torch.tensor(values + [0.0] * (width - len(values)))


def test_fp8_window_kv_on_hand_worked_values():
    """amax 1 -> scale 2^ceil(log2(1/448)) = 2^-8; 0.3 x 256 = 76.8 -> 80 (e4m3 spacing 8 in [64, 128)) ->
    0.3125; 0.001 x 256 = 0.256 -> 0.25 (subnormal step 2^-9 x 2^7... 0.25 exactly) -> 2^-10; the second block of 32
    has its own scale (amax 2^-20 is below the 1e-4 floor: scale 2^ceil(log2(1e-4/448)) = 2^-22, so 2^-20 is 4)."""
    x = torch.cat([_block([1.0, 0.3, -0.001], 32), _block([2.0 ** -20], 32)])
    got = served_values(x, "window_kv")
    want = torch.cat([_block([1.0, 0.3125, -0.25 / 256], 32), _block([2.0 ** -20], 32)])
    assert torch.equal(got, want)


def test_fp4_index_on_hand_worked_values():
    """amax 6 -> scale 1: 2.6 -> 3, 0.25 -> 0 and 0.75 -> 1 (ties to the even code), -1.25 -> -1, 5 -> 4 (tie, even);
    a block of amax 3 takes scale 2^ceil(log2(0.5)) = 0.5: 3 -> 3, 1.1 -> 1 (2.2 -> 2 at that scale)."""
    x = torch.cat([_block([6.0, 2.6, 0.25, 0.75, -1.25, 5.0], 32), _block([3.0, 1.1], 32)])
    want = torch.cat([_block([6.0, 3.0, 0.0, 1.0, -1.0, 4.0], 32), _block([3.0, 1.0], 32)])
    assert torch.equal(served_values(x, "index"), want)


def test_fp4_compressed_kv_takes_e4m3_scales_and_clamps():
    """Blocks of 16, scale amax / 6 rounded to e4m3: amax 5 -> 0.8333 -> 0.8125 (spacing 1/16 in [0.5, 1)), so 5
    divides to 6.15 and clamps to 6 -> 4.875; 1 -> 1.23 -> 1 -> 0.8125. The second block of 16 is scaled apart."""
    x = torch.cat([_block([5.0, 1.0], 16), _block([6.0], 16)])
    want = torch.cat([_block([4.875, 0.8125], 16), _block([6.0], 16)])
    assert torch.equal(served_values(x, "compressed_kv"), want)


def test_the_gradient_goes_straight_through():
    x = torch.randn(3, 64, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(3, 64)
    out = simulate(x, "index", True)
    assert not torch.equal(out, x)
    (got,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(got, grad)
    assert simulate(x, "index", False) is x


def test_a_width_off_the_block_is_a_one_line_error():
    with pytest.raises(ValueError, match="not a multiple of its quantisation block"):
        served_values(torch.randn(2, 24), "window_kv")


def _kernel_inputs(monkeypatch, qat: bool) -> dict:
    """The tensors a tiny model's forward hands to the attention and selection ops, by role."""
    from model import Transformer, layout_from_config
    from model.cli import compose
    from model.config import ModelArgs

    cfg = compose(["model=tiny", f"model.qat={str(qat).lower()}"])
    args, layout = ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)
    seen = {"window_kv": [], "compressed_kv": [], "index_q": [], "index_k": []}
    attention, select = reference.sparse_attention, reference.indexer_select

    def sparse_attention(q, kv_window, window_lo, kv_comp, *rest, **kw):
        seen["window_kv"].append(kv_window.detach())
        if kv_comp is not None:
            seen["compressed_kv"].append(kv_comp.detach())
        return attention(q, kv_window, window_lo, kv_comp, *rest, **kw)

    def indexer_select(q, w, k, *rest, **kw):
        seen["index_q"].append(q.detach())
        seen["index_k"].append(k.detach())
        return select(q, w, k, *rest, **kw)

    monkeypatch.setattr(reference, "sparse_attention", sparse_attention)
    monkeypatch.setattr(reference, "indexer_select", indexer_select)
    torch.manual_seed(0)
    model = Transformer(args, layout)
    ids = torch.randint(0, args.vocab_size, (1, 128))
    model(ids, torch.zeros_like(ids))
    return seen


@pytest.mark.parametrize("qat", [True, False])
def test_qat_rounds_exactly_the_served_tensors(monkeypatch, qat):
    """With qat every window KV, compressed KV and index q/k the kernels receive is on its served grid (rounding it
    again changes nothing); without, none is (random activations are not on a grid)."""
    seen = _kernel_inputs(monkeypatch, qat)
    kinds = {"window_kv": "window_kv", "compressed_kv": "compressed_kv", "index_q": "index", "index_k": "index"}
    for role, tensors in seen.items():
        assert tensors, role
        for t in tensors:
            assert torch.equal(served_values(t, kinds[role]), t) == qat, (role, qat)
