"""What the data loaders share: each rank's micro-batches cut from one global stream of rows."""
import numpy as np
import torch

FIELDS = ("input_ids", "labels", "doc_ids")


class RankRows:
    """Base of the loaders. Every ``__next__`` takes the next ``world_size * micro_batch_size`` rows of the global
    stream, the same on every rank, and keeps the ``rank``-th ``micro_batch_size`` of them: a subclass gives
    ``_next_row(keep)`` (the row's ``input_ids, labels, doc_ids`` arrays, or None where ``keep`` is False: rows of
    other ranks advance the stream without being built) and the token counters ``tokens_total``,
    ``tokens_padding`` of the global stream."""

    micro_batch_size: int
    rank: int
    world_size: int
    tokens_total: int
    tokens_padding: int

    def _next_row(self, keep: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        raise NotImplementedError

    @property
    def padding_fraction(self) -> float:
        return self.tokens_padding / self.tokens_total if self.tokens_total else 0.0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        mine = [row for slot in range(self.world_size * self.micro_batch_size)
                if (row := self._next_row(keep=slot // self.micro_batch_size == self.rank)) is not None]
        return {key: torch.from_numpy(np.stack(column)) for key, column in zip(FIELDS, zip(*mine))}
