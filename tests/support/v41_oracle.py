"""What test_v41_oracle.py shares with other tests (MIN_GAP, _one_thread, assert_close_rel, batch, configured,
objective, random_state), here so that no test module imports another."""
import math

import pytest
import torch
import torch.nn.functional as F

from model.cli import compose
from model.config import ModelArgs
from model.layout import layout_from_config


B, T = 2, 48
DOCS = [[30, 18], [13, 35]]  # two documents per row
WORDS = 16  # token ids 0..15: repeated n-grams (duplicate Engram rows), and drafts that hit
MIN_GAP = 1e-6  # smallest gap at a discrete boundary; the two sides' fp64 scores differ by ~1e-15
TOL = 1e-10  # max |model - oracle| as a fraction of the oracle tensor's largest magnitude (measured: <= 5e-13)
DRAFT_WEIGHTS = {"ce": 0.7, "l1": 1.3, "confidence": 0.5}  # unequal, so that no two parts' gradients can swap

# The preset's 4 index heads give an index score of exactly 0 (every head's ReLU off) to 1 entry in 16, and ties at
# 0 make the top-k ambiguous for random weights in most seeds; with 8 heads (1 in 256) they are rare. Nothing of the
# V4.1 parts depends on it.
BASE = ["model.kernel_backend=torch", "model.index_n_heads=8"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """conftest's ``one_thread`` for every test of the modules that import this fixture."""
    yield


def configured(overrides):
    cfg = compose(["model=v41_mini", *BASE, *overrides])
    return ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)


def random_state(model, seed: int) -> dict:
    """fp64 values for every floating entry of the model's state dict (its names: per-expert matrices, gate biases),
    away from the init: mix projections, biases and scales drawn; routing biases ~0.15 (routing scores differ by
    ~0.1); routed and shared experts' W1, W3 3x wider than unit scale, so that hidden values pass the SwiGLU limit."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            continue
        noise = torch.randn(t.shape, generator=g, dtype=torch.float64)
        if name.endswith(("embed.weight", "attn_sink", "_base")):
            value = noise
        elif name.endswith("gate.bias"):
            value = 0.15 * noise
        elif name.endswith(("_scale", "q_weight", "k_weight")) or t.dim() == 1:
            value = 1 + 0.3 * noise
        elif name == "head.weight":  # the rows of the batch's tokens larger: some drafts hit their target
            value = noise / math.sqrt(t.shape[-1]) * torch.where(torch.arange(t.shape[0]) < WORDS, 3.0, 1.0)[:, None]
        elif ".experts." in name and name.endswith(("w1.weight", "w3.weight")):
            value = 3 * noise / math.sqrt(t.shape[-1])
        else:
            value = noise / math.sqrt(t.shape[-1])
        state[name] = value.requires_grad_(not name.endswith("gate.bias"))  # the bias is a buffer: no gradient
    return state


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, WORDS, (B, T), generator=g)
    doc = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(lens)]) for lens in DOCS])
    return ids, doc


def objective(logits, indexer_losses, draft_losses, ids):
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return ce + sum(indexer_losses.values()) + sum(DRAFT_WEIGHTS[k] * v for k, v in draft_losses.items())


def assert_close_rel(actual, expected, what, errors):
    """max |actual - expected| <= TOL * max |expected|; records the relative error in ``errors``."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    ref = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    errors[what] = err / ref if ref else err
    assert err <= TOL * ref + 1e-300, f"{what}: max abs error {err:.3e} vs max magnitude {ref:.3e} (tol {TOL:g})"
