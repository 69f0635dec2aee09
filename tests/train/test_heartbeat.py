"""train/processes/heartbeat.py read back (one process, fake beats of other ranks written into the group's store): a
rank whose beat is older than three intervals is named as stopped, one that never beat too, one that beats at an older
step as behind, and a rank that beats at this step is not named.

Planted bugs it catches: the beat's age taken the wrong way round (the stopped rank not named, or every rank named); a
rank behind compared to its own step instead of the waiting rank's (not named)."""
import time

import torch

from train.processes import distributed
from train.processes.heartbeat import Heartbeat, _client


def test_the_ranks_that_stopped_or_lag_are_named():
    distributed.init(torch.device("cpu"))
    heartbeat = Heartbeat(rank=0, world_size=5, interval_s=1.0)
    store, now = _client(), time.time()
    try:
        heartbeat.step = 7
        store.set("heartbeat/1", f"7 {now - 10}")  # stopped 10 s ago (three intervals: 3 s)
        store.set("heartbeat/3", f"6 {now}")  # alive, a step behind
        store.set("heartbeat/4", f"7 {now - 1}")  # alive at this step
        assert heartbeat.others() == ("rank 1 silent for 10 s (it had reached step 7); rank 2 never beat; "
                                      "rank 3 alive at step 6")
        store.set("heartbeat/1", f"7 {now}")
        store.set("heartbeat/2", f"7 {now}")
        store.set("heartbeat/3", f"7 {now}")
        assert heartbeat.others() == ""
    finally:
        heartbeat.close()
        for rank in range(5):
            store.delete_key(f"heartbeat/{rank}")
