"""Recomputed layers' inputs kept in host memory between the forward and the backward (``parallel.recompute_offload``).

With ``parallel.recompute=layer`` the GPU holds, for every layer until its backward, the one tensor the layer is
recomputed from: its input stream, fp32 [B,T,dim] (x hc copies in V4.1). At 128K on ``small`` these are 39 GiB of
the card's 140; V4.1's 4-copy stream makes them the first stage's largest item. ``HostCopy`` moves such an input
to pinned host memory on a copy stream of its own as soon as the layer's forward has read it, and brings it back
for the recomputation when the backward reaches the layer, the previous layer's input already on its way
(``HostStash``: the backward recomputes the layers in reverse order). The values are copied, not converted: the step is bit-identical to keeping them.

The recomputation gets the copy as a tensor with the original's ``requires_grad``, so it saves exactly the tensors
the forward saved; the gradient reaches the original through the forward's graph, as with any non-reentrant
checkpoint. On the CPU there is no host to move to: the copy is a clone (what the tests exercise).
"""
import torch


class HostCopy:
    """One layer's input, on the host once the copy stream has taken it; ``tensor()`` is the original in the
    forward and the restored copy in the recomputation.

    The copy back is issued from ``output_grad`` (a hook on the layer's output, which runs when the backward reaches
    the layer and before its recomputation): a selective checkpoint replays exactly the forward's ops, so the
    recomputation itself must not run any (``tensor()`` runs none)."""

    def __init__(self, x: torch.Tensor, previous: "HostCopy | None"):
        self.requires_grad, self.device = x.requires_grad, x.device
        self.previous = previous
        self.original: torch.Tensor | None = x
        self.restored: torch.Tensor | None = None
        self.on_gpu = x.device.type == "cuda"
        if not self.on_gpu:
            self.host = x.detach().clone()
            return
        stream = copy_stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.host.copy_(x.detach(), non_blocking=True)
        x.record_stream(stream)  # the allocator keeps x's memory until the copy has read it

    def release(self, output: torch.Tensor) -> None:
        """The forward is done with the original: from now on only the host copy holds the values. ``output``
        (the layer's) brings it back when its gradient arrives."""
        self.original = None
        if output.requires_grad:
            output.register_hook(self.output_grad)

    def prefetch(self) -> None:
        """Start bringing the copy back (on the copy stream), unless it is back or on its way."""
        if self.restored is not None:
            return
        if not self.on_gpu:
            self.restored, self.host = self.host.clone(), None
            return
        stream = copy_stream(self.device)
        with torch.cuda.stream(stream):
            self.restored = self.host.to(self.device, non_blocking=True)
            self.arrived = torch.cuda.Event()
            self.arrived.record(stream)
        # The pinned block goes back to torch's host allocator now, which reuses it only once the copy has read it:
        # the backward holds two layers' inputs on the host side at most, not the whole step's until the next one.
        self.host = None

    def output_grad(self, grad: torch.Tensor) -> None:
        """The backward has reached the layer: its input back on the device for the compute stream, the previous
        layer's on its way."""
        self.prefetch()
        if self.on_gpu:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.arrived)
            self.restored.record_stream(current)
        if self.previous is not None:
            self.previous.prefetch()

    def tensor(self) -> torch.Tensor:
        """The original during the forward; the copy during the recomputation."""
        if self.original is not None:
            return self.original
        if self.restored is None:
            raise RuntimeError("a recomputed layer's offloaded input was not brought back: the backward reached "
                               "the layer without its output's gradient (parallel.recompute_offload)")
        x, self.restored = self.restored, None
        return x.requires_grad_(self.requires_grad)


class HostStash:
    """The chain of one forward's ``HostCopy``s, newest last (each links to the one before it)."""

    def __init__(self):
        self.last: HostCopy | None = None

    def keep(self, x: torch.Tensor) -> HostCopy:
        self.last = HostCopy(x, self.last)
        return self.last


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every host copy, so copies queue behind each other, not behind compute."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]
