"""Point-to-point transfers between neighbouring pipeline stages that overlap compute (``parallel.p2p=overlap``).

DeepSpeed's pipeline engine moves each boundary tensor with a blocking ``send``/``recv`` on the default process
group, announces shapes with a metadata message first, and sends a stage's activations only once it has received
the gradient of an earlier microbatch. On NCCL that makes the sender's compute stream wait until the receiver has
posted its receive, sends the payload's float and byte tensors one after the other, and puts the gradient coming
back and the activations going forward (and every other op on the group) in one queue. Here instead:

- each boundary of each pipeline has two process groups of its own, one per direction, so activations going
  forward, gradients coming back and the data-parallel collectives never wait behind one another;
- a send is issued right after the pass that produced it (``EagerSends``) and asynchronously: the sender's compute
  goes on, and the request is kept (with its tensors) until it has completed;
- a payload's float and byte tensors travel in one batched call;
- the receiver allocates from the static payload schema and waits where it needs the data: on NCCL only its
  compute stream waits (the process runs ahead), on gloo the process blocks.

The schedule's order of passes, the tensors and hence every result are those of DeepSpeed's path (tests/).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule

from parallel.payload import Payload


@dataclass(frozen=True)
class Wire:
    """The tensors of one boundary crossing, as (shape, dtype) pairs: a payload's float and byte tensors going
    forward, or the float tensor's gradient coming back."""
    specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]

    @classmethod
    def of(cls, payload: Payload) -> "Wire":
        floats, raw = payload.wire_sizes()
        return cls((((floats,), payload.float_dtype), ((raw,), torch.uint8)))

    def gradient(self) -> "Wire":
        """What comes back: the gradient of the float tensor (the byte tensor has none)."""
        return Wire(self.specs[:1])

    @property
    def nbytes(self) -> int:
        return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in self.specs)

    def empty(self, device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.specs)

    def check(self, tensors) -> None:
        got = tuple((tuple(t.shape), t.dtype) for t in tensors)
        if got != self.specs:
            raise RuntimeError(f"pipeline send of {got}, but the receiving stage expects {self.specs} (the payload "
                               "schema of data.seq_len and data.micro_batch_size): every microbatch of a job must "
                               "have that shape")


@dataclass
class Link:
    """One side of a boundary: the peer's global rank and the two process groups of the boundary."""
    peer: int
    activations: object  # process group carrying activations forward
    gradients: object  # process group carrying gradients back


def boundary_groups(topo) -> dict[tuple[int, int], tuple[object, object]]:
    """(activation group, gradient group) of every boundary ``(data-parallel index, stage before it)``.

    Every rank creates every group, in the same order, as ``torch.distributed.new_group`` requires."""
    groups = {}
    for data in range(topo.get_dim("data")):
        for stage in range(topo.get_dim("pipe") - 1):
            ranks = [topo.get_rank(pipe=stage, data=data), topo.get_rank(pipe=stage + 1, data=data)]
            groups[(data, stage)] = (dist.new_group(ranks), dist.new_group(ranks))
    return groups


class StageLinks:
    """A stage's transfers with its neighbours: ``previous`` (activations in, gradients out) and ``next``
    (activations out, gradients in), each a ``Link`` or None at the ends of the pipeline."""

    def __init__(self, previous: Link | None, next: Link | None, incoming: Wire | None, outgoing: Wire | None,
                 device: torch.device):
        self.previous, self.next, self.device = previous, next, device
        self.incoming, self.outgoing = incoming, outgoing
        self.gradient_in = outgoing.gradient() if outgoing is not None else None
        self.gradient_out = incoming.gradient() if incoming is not None else None
        self._sending: list[tuple[list, tuple[torch.Tensor, ...]]] = []  # (requests, tensors kept alive)

    @classmethod
    def for_stage(cls, groups, stage_id: int, data_id: int, topo, incoming: Payload | None,
                  outgoing: Payload | None, device: torch.device) -> "StageLinks":
        """The links of pipeline stage ``stage_id`` of data-parallel replica ``data_id`` (``boundary_groups``)."""
        previous = next = None
        if incoming is not None:
            previous = Link(topo.get_rank(pipe=stage_id - 1, data=data_id), *groups[(data_id, stage_id - 1)])
        if outgoing is not None:
            next = Link(topo.get_rank(pipe=stage_id + 1, data=data_id), *groups[(data_id, stage_id)])
        return cls(previous, next, None if incoming is None else Wire.of(incoming),
                   None if outgoing is None else Wire.of(outgoing), device)

    def send_activations(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.outgoing.check(tensors)
        self._send(tensors, self.next.peer, self.next.activations)

    def recv_activations(self) -> tuple[torch.Tensor, ...]:
        return self._recv(self.incoming, self.previous.peer, self.previous.activations)

    def send_gradient(self, grad: torch.Tensor) -> None:
        self.gradient_out.check((grad,))
        self._send((grad,), self.previous.peer, self.previous.gradients)

    def recv_gradient(self) -> torch.Tensor:
        return self._recv(self.gradient_in, self.next.peer, self.next.gradients)[0]

    def _send(self, tensors, peer: int, group) -> None:
        self._reap()
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group) for t in tensors]
        self._sending.append((dist.batch_isend_irecv(ops), tuple(op.tensor for op in ops)))

    def _recv(self, wire: Wire, peer: int, group) -> tuple[torch.Tensor, ...]:
        self._reap()
        tensors = wire.empty(self.device)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer, group) for t in tensors]):
            request.wait()
        return tensors

    def _reap(self) -> None:
        """Let go of the sends that have completed (their tensors may be freed)."""
        self._sending = [(requests, kept) for requests, kept in self._sending
                         if not all(r.is_completed() for r in requests)]

    def drain(self) -> None:
        """Wait for every send still in flight (end of a schedule)."""
        for requests, _ in self._sending:
            for request in requests:
                request.wait()
        self._sending = []


class EagerSends(schedule.PipeSchedule):
    """A DeepSpeed schedule with each send moved to right after the pass that produced it.

    DeepSpeed interleaves sends and receives so that its blocking sends pair up step by step; with asynchronous
    sends a stage can send as soon as it has the data. Passes, receives and everything else keep their order."""

    def __init__(self, inner: schedule.PipeSchedule):
        super().__init__(inner.micro_batches, inner.stages, inner.stage_id)
        self.inner = inner

    def num_pipe_buffers(self) -> int:
        return self.inner.num_pipe_buffers()

    def steps(self):
        for commands in self.inner.steps():
            moved = []
            for command in commands:
                if isinstance(command, (schedule.SendActivation, schedule.SendGrad)):
                    continue
                moved.append(command)
                if isinstance(command, schedule.ForwardPass) and not self.is_last_stage:
                    moved.append(schedule.SendActivation(command.buffer_id))
                elif isinstance(command, schedule.BackwardPass) and not self.is_first_stage:
                    moved.append(schedule.SendGrad(command.buffer_id))
            yield moved
