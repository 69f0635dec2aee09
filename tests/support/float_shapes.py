"""Which floating-point tensors an op sequence makes: what tests of the quantised base use to show that no full-
precision copy of a base matrix is ever built."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class FloatShapes(TorchDispatchMode):
    """The shapes of every floating-point tensor (fp16 .. fp64, off the meta device) that any op makes."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype in FLOATS and not t.is_meta:
                self.shapes.add(tuple(t.shape))
        return out
