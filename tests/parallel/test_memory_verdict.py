"""The memory verdict (``parallel/plan.py``): a job's per-stage peak estimates against its device's memory, in the
precision the job computes in; a job that cannot fit is refused before any weights are built, naming the estimate,
the memory and settings that fit. Also ``python -m parallel.plan --help`` and the model/layout pairing message."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from model import LayoutError, ModelArgs, Transformer, layout_from_config
from model.cli import compose, resolved
from parallel.job import plan
from parallel.plan import DoesNotFit, Memory, check_memory, fitting_settings, verdict
from tests.support.cli import run_module
from train.run.preflight import planned

REPO = Path(__file__).resolve().parents[2]
GPU_JOB = ["model=small", "layout=v41", "data.seq_len=65536", "data.micro_batch_size=1"]  # the README's H200 job
GIB = 2 ** 30


def parameters(cfg) -> int:
    """Every parameter of the whole model, counted on the meta device (not through parallel/memory.py)."""
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout), init=False)
    return sum(p.numel() for p in model.parameters())


def job(overrides, world, on_gpu=True):
    """The composed config and the job it plans on ``world`` GPUs (or CPU processes)."""
    cfg = compose(overrides)
    return cfg, plan(resolved(cfg), world, torch.device("cuda" if on_gpu else "cpu"))


def test_gpu_verdict_is_the_largest_stage_against_one_gpu():
    cfg, planned_job = job([*GPU_JOB, "parallel.recompute=layer"], world=1)
    split, batch = planned_job.split, planned_job.batch
    peak = max(split.peaks)
    found = verdict(split, batch, Memory(True, peak + 1))
    assert found.fits and found.need == peak and found.stage == 0
    assert found.state == parameters(cfg) * 16  # fp32 weight + gradient + two AdamW moments, one replica
    assert not verdict(split, batch, Memory(True, peak - 1)).fits
    line = check_memory(planned_job, Memory(True, 141 * GIB, given=True))
    assert line.startswith("memory: fits (bf16 on GPU, train.precision=auto) — stage 0 needs an estimated "
                           f"{peak / GIB:,.1f} GiB") and "141.0 GiB per GPU (given by --memory)" in line


def test_host_verdict_adds_up_every_process_on_the_host():
    """Two CPU processes of a 2-stage pipeline on one host hold both stages in its RAM; ZeRO-1 off a single
    replica changes nothing."""
    cfg, planned_job = job(["parallel.pipeline_stages=2"], world=2, on_gpu=False)
    split, batch = planned_job.split, planned_job.batch
    both = sum(split.peaks)
    assert verdict(split, batch, Memory(False, both, processes=2)).fits
    found = verdict(split, batch, Memory(False, both - 1, processes=2))
    assert not found.fits and found.need == both and found.state == parameters(cfg) * 16
    assert "the processes on this host need" in found.describe() and "shared by 2 processes" in found.describe()


def test_a_job_that_does_not_fit_names_settings_that_do():
    """Each suggested setting, composed as an override and split again, fits the memory; the job as given
    does not."""
    _, planned_job = job(GPU_JOB, world=1)
    split, capacity = planned_job.split, 141 * GIB
    assert max(split.peaks) > capacity
    with pytest.raises(DoesNotFit) as refused:
        check_memory(planned_job, Memory(True, capacity, given=True))
    line = str(refused.value)
    assert line.startswith(f"the job does not fit in memory (bf16 on GPU, train.precision=auto): stage 0 needs an "
                           f"estimated {max(split.peaks) / GIB:,.1f} GiB") and "\n" not in line
    assert line.endswith("; or parallel.check_memory=false to run it anyway")
    anyway = check_memory(job([*GPU_JOB, "parallel.check_memory=false"], world=1)[1],
                          Memory(True, capacity, given=True))
    assert anyway.startswith("memory: does not fit (bf16 on GPU") and anyway.endswith("running anyway "
                                                                                     "(parallel.check_memory=false)")
    settings = fitting_settings(planned_job, Memory(True, capacity, given=True))
    assert settings and " — settings that would fit (estimated need): " + "; ".join(settings) in line
    for setting in settings:
        overrides = setting.split(" (")[0].split(" on ")[0].split()
        world = int(setting.split(" on ")[1].split()[0]) if " on " in setting else 1
        fitted = job([*GPU_JOB, *overrides], world=world)[1].split
        assert max(fitted.peaks) <= capacity, setting
        assert f"({max(fitted.peaks) / GIB:,.1f} GiB)" in setting


def test_model_preset_without_its_layout_names_the_pairing():
    with pytest.raises(LayoutError) as refused:
        planned(compose(["model=v41_flash"]), world_size=1)
    line = str(refused.value)
    assert line.startswith("model=v41_flash (index_topk=512) is paired with layout=v41_scaled, whose candidate "
                           "blocks hold too few entries")
    assert " — pair the model with a layout whose candidate blocks hold its top-k: layout=v41, or a preset" in line
    paired = resolved(compose(["model=v41_flash", "layout=v41"]))
    layout_from_config(paired.layout).check_candidate_capacity(paired.model.index_topk)


def _run(*command, timeout=240):
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    return subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=timeout)


def test_a_job_that_cannot_fit_is_refused_in_seconds(tmp_path):
    """V4.1-Flash's 14 B parameters at 64K tokens in fp32 on the CPU (terabytes) are refused in preflight: one line,
    status 2, no run directory, no weights built (the process stays small)."""
    started = time.perf_counter()
    done = _run("train", "model=v41_flash", "layout=v41", "data.seq_len=65536", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("error: the job does not fit in memory (fp32 on CPU, train.precision=auto): the "
                                  "process needs an estimated ") and done.stderr.count("\n") == 1, done.stderr
    assert "GiB of host RAM available (on this machine)" in done.stderr and "choose a smaller model" in done.stderr
    assert not (tmp_path / "run").exists()
    assert time.perf_counter() - started < 90


def test_plan_cli_help_and_the_jobs_precision():
    helped = run_module("parallel.plan", "--help")
    assert helped.returncode == 0 and "--world-size N" in helped.stdout and "--memory SIZE" in helped.stdout
    gpu = run_module("parallel.plan", "train.device=cuda", "--memory", "141GiB", *GPU_JOB, "parallel.recompute=layer")
    assert gpu.returncode == 0, gpu.stderr
    assert "compute bfloat16 autocast over float32 weights" in gpu.stdout
    assert "memory: fits (bf16 on GPU, train.precision=auto) — stage 0 needs an estimated" in gpu.stdout
    refused = run_module("parallel.plan", "train.device=cuda", "--memory", "141GiB", *GPU_JOB)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "pipeline: 1 stage(s)" in refused.stdout
    assert refused.stderr.startswith("error: the job does not fit in memory (bf16 on GPU")
