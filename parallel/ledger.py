"""Live shared tensors per pipeline stage, for tests and debug logs.

Every tensor a microbatch's ``SharedState`` holds is registered with a weak reference; it counts as live until
Python and autograd have both let go of it. After a training step nothing may be live; during a step no more
than the in-flight microbatches need.
"""
import logging
import weakref

import torch

from model.state import FIELDS, SharedState

log = logging.getLogger(__name__)


class Ledger:
    def __init__(self, stage_id: int):
        self.stage_id = stage_id
        self._live: dict[int, tuple[str, int, int]] = {}  # id -> (field, producing layer, microbatch)
        self._microbatch = 0
        self.peak = 0  # most shared tensors alive at once
        self.peak_microbatches = 0  # most microbatches with shared tensors alive at once

    def live(self) -> list[tuple[str, int, int]]:
        return sorted(self._live.values())

    def live_microbatches(self) -> int:
        return len({mb for _, _, mb in self._live.values()})

    def watch(self, state: SharedState) -> None:
        """Register the fields present now and make the state register whatever it stores later."""
        microbatch = self._microbatch
        self._microbatch += 1

        def register(field: str, source: int, tensor: torch.Tensor) -> None:
            key = id(tensor)
            self._live[key] = (field, source, microbatch)
            weakref.finalize(tensor, self._live.pop, key, None)
            self.peak = max(self.peak, len(self._live))
            self.peak_microbatches = max(self.peak_microbatches, self.live_microbatches())

        for field in FIELDS:
            for source, tensor in getattr(state, field).items():
                register(field, source, tensor)
        state.on_store = register
        log.debug("stage %d: microbatch %d, live shared tensors %s", self.stage_id, microbatch, self.live())
