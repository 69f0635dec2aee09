"""The batch of an optimizer step: global batch, microbatches per pipeline, data-parallel replicas, 1F1B bubble;
and that ``python -m parallel.plan`` fails on a batch the job would refuse, as the job does."""
import pytest

from parallel.batch import BatchConfigError, plan_batch
from tests.support.cli import run_module


def test_global_batch_fixes_the_microbatches_whatever_the_split():
    # 16 rows per step on 8 processes: 2 stages x 4 replicas -> 2 microbatches of 2 rows each
    two_stages = plan_batch(micro_batch=2, stages=2, world_size=8, global_batch=16)
    assert (two_stages.microbatches, two_stages.data_parallel, two_stages.global_batch) == (2, 4, 16)
    assert two_stages.bubble == pytest.approx(1 / 3)  # (P-1)/(M+P-1)
    one_stage = plan_batch(micro_batch=2, stages=1, world_size=8, global_batch=16)
    assert (one_stage.microbatches, one_stage.data_parallel, one_stage.global_batch, one_stage.bubble) == (1, 8, 16, 0)


def test_defaults_give_every_stage_a_microbatch():
    """Neither setting: one microbatch per stage, so ``parallel.pipeline_stages=P`` runs as typed."""
    for stages in (1, 2, 4):
        plan = plan_batch(micro_batch=4, stages=stages, world_size=stages)
        assert plan.microbatches == stages and plan.global_batch == 4 * stages
    assert plan_batch(micro_batch=4, stages=1, world_size=1, microbatches=3).global_batch == 12


@pytest.mark.parametrize("kwargs, message", [
    (dict(stages=2, world_size=2, microbatches=1), r"1 microbatch\(es\) per step .* fewer than parallel.pipeline_stages=2"
                                                    r".* train.global_batch_size to 8, 12, 16"),
    (dict(stages=2, world_size=2, global_batch=4), r"train.global_batch_size=4\) is fewer than"),
    (dict(stages=1, world_size=2, global_batch=6), r"global_batch_size=6 is not a multiple of .* = 8 — use 8, 16"),
    (dict(stages=1, world_size=1, global_batch=8, microbatches=3), "means 2 microbatch.* set only one of them"),
    (dict(stages=4, world_size=6), "pipeline_stages=4 does not divide the 6 launched"),
    (dict(stages=1, world_size=1, global_batch=0), "global_batch_size=0 is not a positive integer"),
])
def test_batches_that_cannot_run_name_the_fix(kwargs, message):
    with pytest.raises(BatchConfigError, match=message):
        plan_batch(micro_batch=4, **kwargs)


def test_plan_cli_prints_the_bubble_and_refuses_what_the_job_would():
    ok = run_module("parallel.plan", "parallel.pipeline_stages=2", "train.global_batch_size=16")
    assert ok.returncode == 0, ok.stderr
    assert "16 rows per step = 4 rows x 4 microbatch(es) x 1 data-parallel replica(s)" in ok.stdout
    assert "1F1B bubble 20%" in ok.stdout
    bad = run_module("parallel.plan", "--world-size", "2", "parallel.pipeline_stages=2", "train.grad_accum_steps=1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: 1 microbatch(es) per step") and " — set train.global_batch_size" in bad.stderr
