"""CSA2 hot ops with one interface and two implementations: Triton (GPU) and the PyTorch reference.

``ops(backend, device)`` returns the module implementing ``sparse_attention``, ``indexer_select``,
``index_logits``, ``rope``, ``rms_norm``, ``cast``, ``swiglu``, ``permute_rows``, ``unpermute_rows``, ``hc_pre``,
``hc_post`` and ``hc_collapse`` (signatures in docs/DESIGN.md and ``kernels/reference.py``). ``auto`` picks Triton on
CUDA devices, the reference elsewhere.
"""
import contextlib
import threading
from functools import partial
from types import ModuleType

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from kernels import reference
from kernels.op_names import INDEXER_SELECT_OP, SPARSE_ATTENTION_OP

BACKENDS = ("auto", "torch", "triton")


def checkpoint_policy(keep_attention: bool):
    """Selective-checkpoint policy of a recomputed layer (``torch.utils.checkpoint.create_selective_checkpoint_
    contexts``). The indexer's selection is always saved: its outputs are integers (T x k int64: 0.27 GB at 64K
    for k = 512) and re-running it costs the whole scoring pass (about half a Full layer's forward at 64K); the
    recomputed layer reads the same picks, so gradients do not change. With ``keep_attention`` the sparse
    attention's outputs (out, LSE, selected mass) are saved too, so the backward does not re-run attention (4.3 GB
    per layer at 64K). The rest is recomputed. The PyTorch reference path has neither op and is recomputed whole:
    same gradients, no saving."""
    saved = {INDEXER_SELECT_OP, SPARSE_ATTENTION_OP} if keep_attention else {INDEXER_SELECT_OP}
    return partial(_policy, frozenset(saved))


def _policy(saved: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op.name() in saved else CheckpointPolicy.PREFER_RECOMPUTE


_recompute = threading.local()  # the backward runs a recomputation on the thread that runs that backward


def recomputing() -> bool:
    """Whether a recomputed layer (``checkpoint_contexts``) is being run again for its backward. Its outputs
    then serve only the gradients, so what has none (the selected mass: the indexer loss's detached target, read in
    the forward) need not be made again."""
    return getattr(_recompute, "depth", 0) > 0


@contextlib.contextmanager
def _recomputation(policy_context):
    """The selective policy's recomputation context, with ``recomputing()`` true inside it."""
    with policy_context:
        _recompute.depth = getattr(_recompute, "depth", 0) + 1
        try:
            yield
        finally:
            _recompute.depth -= 1


def checkpoint_contexts(keep_attention: bool):
    """``context_fn`` of a recomputed layer's non-reentrant checkpoint: the selective policy
    (``checkpoint_policy``) in both passes, and ``recomputing()`` true during the recomputation."""
    forward, recompute = create_selective_checkpoint_contexts(checkpoint_policy(keep_attention))
    return forward, _recomputation(recompute)


def ops(backend: str, device: torch.device) -> ModuleType:
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is not one of {BACKENDS}")
    if backend == "torch" or (backend == "auto" and torch.device(device).type != "cuda"):
        return reference
    from kernels import triton_ops  # imported lazily: Triton is only needed where it runs

    return triton_ops
