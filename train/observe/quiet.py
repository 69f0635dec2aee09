"""A job's console: rank 0 speaks, libraries only when something is wrong.

DeepSpeed announces itself with ``print`` (layer seeds, topology, the stage split, an op it built) and warns
when it has to guess the accelerator; none of that is a problem, so it goes to the DEBUG log. Ranks other than
0 log errors only (``train/__main__.py``): they would repeat rank 0's lines.
"""
import contextlib
import io
import logging
import os

log = logging.getLogger("deepspeed.prints")


def name_the_accelerator(device: str = "auto") -> None:
    """Before DeepSpeed is imported: tell it the accelerator of ``train.device``. Left to itself it detects one
    (with a warning on CPU) and moves the model there, so that ``train.device=cpu`` on a machine with a GPU trained
    on the GPU and then failed at the first evaluation, which feeds the CPU device's batches to the model."""
    import torch

    accelerator = "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    os.environ.setdefault("DS_ACCELERATOR", accelerator)


@contextlib.contextmanager
def prints_to_debug():
    """What the block prints to stdout goes to the DEBUG log instead."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        for line in captured.getvalue().splitlines():
            log.debug(line)
