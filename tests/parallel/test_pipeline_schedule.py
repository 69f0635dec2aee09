"""The overlapped transfers' schedule (parallel/p2p.py) and the 1F1B simulator (parallel/simulate.py)."""
import pytest
import torch
from deepspeed.runtime.pipe import schedule

from parallel.p2p import EagerSends, Wire
from parallel.simulate import StageWork, ideal_bubble, simulate

SENDS = (schedule.SendActivation, schedule.SendGrad)
PASSES = {schedule.SendActivation: schedule.ForwardPass, schedule.SendGrad: schedule.BackwardPass}


def flat(steps):
    return [c for commands in steps for c in commands]


def names(commands, keep=lambda c: True):
    return [repr(c) for c in commands if keep(c)]


@pytest.mark.parametrize("kind", ["train", "inference"])
def test_eager_sends_move_only_the_sends(kind):
    """Same commands; everything but the sends in DeepSpeed's order; each send right after the pass that filled
    its buffer; the sends of each kind in DeepSpeed's order (the receiver matches them in that order)."""
    for stages in range(1, 6):
        for microbatches in (stages, stages + 1, 2 * stages + 1):
            for stage in range(stages):
                make = (schedule.TrainSchedule if kind == "train" else schedule.InferenceSchedule)
                inner = make(micro_batches=microbatches, stages=stages, stage_id=stage)
                want, got = flat(inner.steps()), flat(EagerSends(inner).steps())
                assert sorted(names(got)) == sorted(names(want))
                others = lambda c: not isinstance(c, SENDS)  # noqa: E731
                assert names(got, others) == names(want, others)
                for i, command in enumerate(got):
                    if isinstance(command, SENDS):
                        before = got[i - 1]
                        assert type(before) is PASSES[type(command)] and before.buffer_id == command.buffer_id
                for send in SENDS:
                    assert names(got, lambda c: isinstance(c, send)) == names(want, lambda c: isinstance(c, send))


def test_wire_refuses_a_tensor_of_another_schema():
    wire = Wire((((6,), torch.float32), ((16,), torch.uint8)))
    wire.check((torch.zeros(6), torch.zeros(16, dtype=torch.uint8)))
    assert wire.gradient().specs == (((6,), torch.float32),) and wire.nbytes == 40
    with pytest.raises(RuntimeError, match="receiving stage expects"):
        wire.check((torch.zeros(7), torch.zeros(16, dtype=torch.uint8)))


@pytest.mark.parametrize("p2p", ["overlap", "deepspeed"])
def test_balanced_stages_with_free_transfers_give_the_1f1b_closed_form(p2p):
    for stages in (1, 2, 3, 4, 8):
        for microbatches in (stages, 2 * stages + 1, 16):
            timeline = simulate([StageWork(1.0, 3.0)] * stages, microbatches, p2p)
            assert timeline.pipeline_s == pytest.approx((microbatches + stages - 1) * 4.0)
            assert timeline.bubble == pytest.approx([ideal_bubble(stages, microbatches)] * stages)


def test_transfers_by_hand():
    """P = 2, M = 2, forward 1, backward 3, activations 0.1, gradient 0.05 (worked out on paper):
    overlapped, stage 1 gets activation 1 while it runs backward 0, and only the gradients are on the critical
    path; DeepSpeed's blocking order sends activation 1 after gradient 0 has arrived, so both are."""
    work = [StageWork(1.0, 3.0, send_s=0.1, grad_s=0.05), StageWork(1.0, 3.0)]
    overlap, blocking = simulate(work, 2, "overlap"), simulate(work, 2, "deepspeed")
    assert overlap.pipeline_s == pytest.approx(12.15)
    assert overlap.exposed_wait_s == pytest.approx((4.15, 1.1))
    assert blocking.pipeline_s == pytest.approx(12.3)
    assert overlap.busy_s == blocking.busy_s == (8.0, 8.0)


def test_step_adds_the_slowest_reduction_and_optimizer():
    work = [StageWork(1.0, 3.0, reduce_s=0.5, optimizer_s=0.2), StageWork(1.0, 3.0, reduce_s=0.1, optimizer_s=0.3)]
    timeline = simulate(work, 4)
    assert timeline.step_s == pytest.approx(timeline.pipeline_s + 0.5 + 0.3)
