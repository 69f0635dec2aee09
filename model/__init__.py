"""CSA2 model in plain PyTorch: layouts, layers, accounting. No distributed code here.

Public names are imported lazily so that ``python -m model.layout`` / ``python -m model.accounting`` run their
module once, as ``__main__``, without the package having imported it first."""
import importlib

_EXPORTS = {
    "ModelArgs": "model.config", "Layout": "model.layout", "LayoutError": "model.layout", "Mode": "model.layout",
    "layout_from_config": "model.layout", "Transformer": "model.transformer", "ModelOutput": "model.transformer",
}
__all__ = [*_EXPORTS, "build_model"]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def build_model(model_cfg, layout_cfg, device=None, seed: int = 0):
    """A Transformer from the ``model`` and ``layout`` config nodes (validated; errors name the problem)."""
    import torch

    from model.config import ModelArgs
    from model.layout import layout_from_config
    from model.transformer import Transformer

    with torch.device(device or "cpu"):
        return Transformer(ModelArgs.from_config(model_cfg), layout_from_config(layout_cfg), seed=seed)
