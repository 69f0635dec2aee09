"""The dense-attention baseline (``model.attention=dense``) and the parameter groups of the health metrics."""
import pytest
import torch

from model import LayoutError, build_model
from model.cli import compose
from model.groups import GROUPS, param_group

DENSE = ["model.attention=dense", "layout=window_only_scaled", "model.dense_head_dim=32"]


def test_dense_attention_keeps_documents_apart():
    """A document packed after another gives the logits it gives alone in its row: attention is masked to the
    document and RoPE positions restart (the CPU path builds the explicit mask; one-document rows take plain
    causal SDPA, so the two paths are compared too)."""
    torch.manual_seed(0)
    cfg = compose(DENSE)
    model = build_model(cfg.model, cfg.layout).double()
    first, second = torch.randint(0, 256, (1, 23)), torch.randint(0, 256, (1, 17))
    packed = model(torch.cat([first, second], 1), torch.cat([torch.zeros(1, 23), torch.ones(1, 17)], 1).long())
    alone = model(second)
    torch.testing.assert_close(packed.logits[:, 23:], alone.logits, rtol=1e-10, atol=1e-10)
    changed = model(torch.cat([torch.randint(0, 256, (1, 23)), second], 1),
                    torch.cat([torch.zeros(1, 23), torch.ones(1, 17)], 1).long())
    torch.testing.assert_close(changed.logits[:, 23:], alone.logits, rtol=1e-10, atol=1e-10)


def test_dense_attention_needs_a_layout_without_compressed_layers():
    cfg = compose(["model.attention=dense"])
    with pytest.raises(LayoutError, match="layout=window_only"):
        build_model(cfg.model, cfg.layout)


@pytest.mark.parametrize("overrides", [[], DENSE, ["layout=all_full_scaled"]])
def test_every_parameter_has_a_group(overrides):
    cfg = compose(overrides)
    groups = {param_group(name) for name, _ in build_model(cfg.model, cfg.layout, device="meta").named_parameters()}
    assert groups <= set(GROUPS)
    assert param_group("layers.3.attn.indexer.k_norm.weight") == "indexer"
    assert param_group("layers.3.attn.compressor.norm.weight") == "norms_sinks"
    with pytest.raises(KeyError, match="no group"):
        param_group("layers.3.attn.new_thing.weight")
