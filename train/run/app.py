"""``python -m train``: a Hydra app that trains a CSA2 model on the DeepSpeed engine.

``main`` is the Hydra entry point; ``run(cfg, run_dir)`` is the job itself, also called by the tests with a
composed config. Every check that needs no engine runs first (``train/run/preflight.py``), so bad input fails in
seconds. The run directory then receives the resolved ``config.yaml``, ``checkpoints/``, ``metrics.jsonl``,
``loss_curve.png`` (a MoE model's ``experts.jsonl`` and ``experts.png`` too) and the wandb run; the job ends with
an evaluation summary and a closing line (steps, wall time, tokens, run directory). SIGINT / SIGTERM stop it after
the current step with a checkpoint and a line that says how to resume (``train/processes/interrupt.py``). A job that
fails before its first step removes the run directory it made, so failed attempts leave nothing behind.
"""
import logging
import math
import os
import random
import shlex
import shutil
import signal
import time
from pathlib import Path

import datasets
import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from model.cli import CONF_DIR  # importing model.cli registers the schema conf/config.yaml names first
from model.config import JobConfig, plain
from model.flops import training_flops
from parallel.gradient_clock import GradientClock
from parallel.job import Job
from train.data.loader import build_loader
from train.evaluation.evaluate import Evaluator, data_tokenizer
from train.evaluation.probes import chance_levels
from train.formats import checkpoint
from train.formats.staging import StagingArea
from train.observe import rank_times, routing
from train.observe.health import ActivationStats
from train.observe.metrics import MetricsLogger
from train.processes import distributed
from train.processes.errors import ReportedError, reported
from train.processes.heartbeat import Heartbeat, interval_for
from train.processes.interrupt import Interrupted, Interrupts
from train.processes.timeouts import collective_timeout
from train.run.background import BackgroundJob
from train.run.engine import build_engine, train_step
from train.run.preflight import Checked, checkpoint_dir, launched_world_size, preflight

log = logging.getLogger(__name__)

HYDRA_FILES = {".hydra", "app.log"}  # what Hydra writes into a run directory before the job starts


class TrainingDiverged(ReportedError):
    """Too many non-finite steps in a row; the newest checkpoint predates them."""

    exit_code = 1  # the input was valid; the run cannot go on


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated, or the process's resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def run(cfg: DictConfig, run_dir: Path) -> dict[str, float]:
    """Train as ``cfg`` says, writing into ``run_dir``; returns the final evaluation row."""
    started = time.perf_counter()
    made_dir = not _holds_a_run(run_dir)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    trainer, own_dir = None, run_dir
    try:
        with Interrupts(announce=rank0) as interrupts:
            datasets.disable_progress_bars()  # one progress bar: the training loop's
            checked = preflight(cfg, run_dir, launched_world_size())
            distributed.init(checked.job.device, checked.job.config.train.startup_timeout_s, run_dir)
            own_dir, run_dir = run_dir, Path(distributed.from_rank0(str(run_dir)))
            if own_dir != run_dir and own_dir.is_dir() and not any(own_dir.iterdir()):
                own_dir.rmdir()  # Hydra's directory of another rank, a second off rank 0's: unused
            trainer = _trainer(run_dir, checked)
            logger = MetricsLogger(checked.job, run_dir, trainer.state["step"], enabled=rank0,
                                   run_id=checked.saved.get("wandb_id"))
            try:
                with interrupts.deferred():
                    trainer.train(logger, interrupts)
                log.info("evaluating: %d held-out micro-batches%s", checked.job.config.train.eval.batches,
                         ", then the retrieval probes" if checked.probes else "")
                final = {"step": trainer.state["step"], **trainer.evaluator(probes=True)}
                logger.log_eval(final)
                logger.summarize({f"eval/{k}": v for k, v in final.items()})
            finally:
                logger.close()
    except BaseException as error:
        if made_dir and rank0 and (trainer is None or trainer.steps_run == 0):
            shutil.rmtree(run_dir, ignore_errors=True)
        if not rank0:
            _remove_if_empty(own_dir)  # Hydra made it for this rank too (rank 0's, or its own a second off)
        if isinstance(error, Interrupted) and trainer is not None:
            raise Interrupted(error.signum, trainer.interrupted_line(error.signum)) from None
        raise
    if rank0:
        config = checked.job.config
        chance = chance_levels(data_tokenizer(config.data)) if checked.probes else {}
        print(summary_table(final, config, chance))
        print(closing_line(trainer, time.perf_counter() - started, run_dir), flush=True)
    return final


def shared_cpu_warning(device: torch.device) -> str | None:
    """On a CPU other jobs keep busy, torch's threads of one process wait for each other at every parallel op: the
    default job took 3.4 s a step on 2 shared cores against 0.92 s with one thread (README, "CPU threads"). The
    warning is for a load average above the core count with more than one thread."""
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    load = os.getloadavg()[0]
    if device.type != "cpu" or threads == 1 or load <= cores:
        return None
    return (f"the CPU is shared (load average {load:.1f} on {cores} cores) and torch runs {threads} threads in this "
            "process, which then wait on each other: a step can take several times longer — OMP_NUM_THREADS=1 "
            "python -m train ... runs one thread")


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:  # not empty (rank 0's run, or another job's), or gone already
        pass


def _holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` has anything besides what Hydra put there for this job (a run being resumed, say)."""
    return run_dir.is_dir() and any(p.name not in HYDRA_FILES for p in run_dir.iterdir())


def _trainer(run_dir: Path, checked: Checked) -> "Trainer":
    """The engine, data and evaluator of this process, restored from the checkpoint to resume if any."""
    job = checked.job
    config = job.config
    if distributed.rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(plain(config)), run_dir / "config.yaml")
    seed_everything(config.train.seed)
    engine = build_engine(job, checked.memory_line)
    loader = build_loader(config.data, rank=engine.replica_id, world_size=engine.replicas,
                          vocab_size=job.args.vocab_size, documents=checked.train_documents)
    evaluator = Evaluator(job, engine, checked.heldout_documents, checked.probes)
    log.info("%s model (%.2fM trained parameters on this stage), %s layout, %s on %s, %d process(es); run dir %s",
             config.model.name, sum(p.numel() for p in engine.module.owned_parameters()) / 1e6, config.layout.name,
             job.precision, job.device.type, distributed.world_size(), run_dir)
    log.info("%s", checked.data_line)
    crowded = shared_cpu_warning(job.device)
    if crowded:
        log.warning("%s", crowded)
    ref, saved = checkpoint.agree(config.train.resume, checkpoint_dir(config.train, run_dir)), checked.saved
    if ref != checked.resume:  # a file the preflight's size check passed has the wrong digest: an older one
        saved = checkpoint.check_compatible(ref, config)
    if checked.warm_start:  # a fresh run's weights, or the frozen base of a LoRA run (its checkpoints: adapters)
        checked.warm_start.load_into(engine)
        if distributed.rank() == 0:
            checked.warm_start.report(run_dir)
    if ref:
        resume_state = checkpoint.load(engine, ref, saved["config"]["parallel"]["pipeline_stages"])
        checkpoint.set_rng_state(resume_state["rng"])
        loader.load_state_dict(resume_state["loader"])
        log.info("resumed from %s at step %d%s", ref.path, saved["step"],
                 f" (train.init_from={config.train.init_from} is not used: train.resume wins)"
                 if config.train.init_from and not checked.warm_start else "")
    return Trainer(job, engine, loader, evaluator, checkpoint_dir(config.train, run_dir),
                   {key: saved.get(key, 0) for key in ("step", "bad_streak", "skipped")}, run_dir)


class Trainer:
    """The step loop: train, log, evaluate and checkpoint from ``state["step"]`` to ``train.stop_at`` (or
    ``max_steps``). ``state`` (step, bad_streak, skipped) is what a checkpoint records of the loop itself."""

    def __init__(self, job: Job, engine, loader, evaluator: Evaluator, checkpoint_dir: Path, state: dict[str, int],
                 run_dir: Path):
        self.job, self.engine, self.loader, self.evaluator = job, engine, loader, evaluator
        self.train_config, self.device = job.config.train, job.device
        self.checkpoint_dir, self.state, self.run_dir = checkpoint_dir, state, run_dir
        self.saved_step = state["step"]  # newest checkpoint of this run (0: none)
        self.steps_run = 0  # optimizer steps of this process (a resumed job starts at 0)
        self.wandb_id = None
        self.flops_per_step = self._flops_per_step() if job.on_gpu else None
        self.activations = ActivationStats(engine.module.stage.model, scope=engine.module.stage)
        self.clock = GradientClock(engine)  # each rank's time to its gradients: the slow ranks named on logged steps
        self.routed = job.args.ffn == "moe" or job.trains_dspark  # the same on every rank: gathers are collective
        self.expert_loads: dict[str, list[float]] = {}  # of the last logged step (experts.jsonl)
        self.writer = BackgroundJob(self.train_config.checkpoint_async, "checkpoint writer")
        self.staging = StagingArea()  # the GPU's tensors of every save, in host memory page-locked once
        # every rank's beat in the group's store: a timed-out collective names the ranks that stopped beating
        self.heartbeat = Heartbeat(distributed.rank(), distributed.world_size(),
                                   interval_for(self.train_config.collective_timeout_s))
        # the writer's collectives run beside the training's: on a group of their own, as torch's async_save does
        self.save_group = distributed.side_group() if self.writer.enabled and self.train_config.checkpoint_every \
            else None

    def _flops_per_step(self) -> float:
        """Model FLOPs of one optimizer step over all GPUs (``model/flops.py``): the MFU numerator."""
        job, data = self.job, self.job.config.data
        per_microbatch = training_flops(job.args, job.layout, data.seq_len, data.micro_batch_size, job.trains_dspark)
        return per_microbatch * self.engine.micro_batches * self.engine.replicas

    def train(self, logger: MetricsLogger, interrupts: Interrupts) -> None:
        train = self.train_config
        stop = train.stop_at or train.max_steps
        self.wandb_id = logger.run_id
        bar = tqdm(total=stop, initial=self.state["step"], unit="step", dynamic_ncols=True,
                   disable=not (distributed.rank() == 0 and train.progress))
        try:
            for step in range(self.state["step"] + 1, stop + 1):
                row = self.step(step)
                if self.logs(step) or row["skipped"]:
                    logger.log(row)
                    if self.expert_loads:
                        logger.log_experts(step, self.expert_loads)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                **({"mfu": f"{row['mfu']:.1%}"} if "mfu" in row else {}), refresh=False)
                bar.update(1)
                self.stop_if_diverged()
                signum = self.agreed_interrupt(interrupts)
                if train.eval.every and step % train.eval.every == 0 and step != stop and not signum:
                    logger.log_eval({"step": step, **self.evaluator(probes=False)})  # the end has its own
                if train.checkpoint_every and (step % train.checkpoint_every == 0 or step == stop or signum) \
                        and self.state["bad_streak"] == 0:
                    self.save()
                if signum:
                    raise Interrupted(signum)  # run() words the last line
        finally:
            bar.close()
            try:
                self.writer.wait()  # the last checkpoint is published before the job goes on or ends
            finally:
                self.heartbeat.close()  # after the save's collectives: this rank beats as long as it has peers
                self.staging.release()  # its last copies are written (or their write failed): unlocked

    def logs(self, step: int) -> bool:
        """Whether ``step`` gets a row of metrics (and its diagnostics): every ``train.log_every``-th, and step 1, the
        start every plot and ``python -m train.routing_criteria`` read."""
        return step % self.train_config.log_every == 0 or step == 1

    def step(self, step: int) -> dict:
        """One optimizer step; returns its ``metrics.jsonl`` row."""
        logged = self.logs(step)
        self.writer.check()  # a checkpoint write that failed in the background fails the job here
        start = time.perf_counter()
        self.clock.start()
        timed = collective_timeout(step, self.train_config.collective_timeout_s, self.heartbeat)
        with self.activations.recording(logged), timed:
            result = train_step(self.engine, [next(self.loader) for _ in range(self.engine.micro_batches)])
        seconds = time.perf_counter() - start
        if self.steps_run == 0:  # start-up and the first step are over: a hang from now on is named sooner
            distributed.set_timeout(self.train_config.collective_timeout_s)
        self.state["step"] = step
        self.steps_run += 1
        if result.bad:
            self.state["bad_streak"] += 1
            self.state["skipped"] += 1
            log.warning("step %d: non-finite %s (loss %s, grad_norm %s), update skipped (%d in a row)", step,
                        result.cause or "loss", result.metrics["loss"], result.metrics["grad_norm"],
                        self.state["bad_streak"])
        else:
            self.state["bad_streak"] = 0
        row = {"step": step, **result.metrics, "tokens_per_s": result.tokens / seconds,
               "padding_fraction": self.loader.padding_fraction, "memory_mb": memory_mb(self.device),
               "skipped": result.bad, "skipped_total": self.state["skipped"]}
        if self.flops_per_step is not None:  # per GPU, against one GPU's peak
            tflops = self.flops_per_step / seconds / distributed.world_size() / 1e12
            row.update(tflops=tflops, mfu=tflops / self.train_config.peak_tflops)
        if logged and distributed.world_size() > 1:
            times = rank_times.gather(self.clock.seconds, self.device)
            row.update(rank_times.series(times))
            if distributed.rank() == 0 and (line := rank_times.slow_ranks_line(step, times)):
                log.warning("%s", line)
        if logged:
            pipe = self.engine.grid.get_pipe_parallel_group()
            row.update(self.activations.collect(pipe))
            if self.routed:
                layers = routing.gather(self.engine, pipe)
                row.update(routing.scalars(layers))
                row.update(routing.received_scalars(routing.received_rows(self.engine)))
                self.expert_loads = routing.normalised_loads(layers)
        return row

    def agreed_interrupt(self, interrupts: Interrupts) -> int:
        """The signal that stops the job after this step (0: none), the same on every rank: any rank's signal stops
        all of them at one step, so that they save together; SIGTERM (a scheduler's) wins over SIGINT."""
        mine = interrupts.signum
        votes = distributed.sum_over_ranks({"sigterm": float(mine == signal.SIGTERM),
                                            "sigint": float(mine == signal.SIGINT)})
        return signal.SIGTERM if votes["sigterm"] else signal.SIGINT if votes["sigint"] else 0

    def interrupted_line(self, signum: int) -> str:
        """The job's last line after a signal: where it stopped, its newest checkpoint, the command that resumes."""
        name, step = signal.Signals(signum).name, self.state["step"]
        if not self.saved_step:
            why = " (train.checkpoint_every=0)" if not self.train_config.checkpoint_every else ""
            return f"stopped by {name} after step {step}; there is no checkpoint{why}, nothing to resume"
        return (f"stopped by {name} after step {step}; newest checkpoint: step {self.saved_step} — resume with: "
                f"{resume_command(self.run_dir)}")

    def stop_if_diverged(self) -> None:
        streak, limit = self.state["bad_streak"], self.train_config.max_bad_steps
        if streak < limit:
            return
        step = self.state["step"]
        kept = f"step {self.saved_step} in {self.checkpoint_dir}" if self.saved_step else "none was written"
        raise TrainingDiverged(f"steps {step - streak + 1}..{step} had a non-finite loss or gradients "
                               f"(train.max_bad_steps={limit} in a row); every one was skipped. "
                               f"Last good checkpoint: {kept} — lower train.lr or raise train.warmup_steps; "
                               "train.resume=auto continues from that checkpoint")

    def save(self) -> None:
        """Copy the state now; write and publish it in the background (``train.checkpoint_async``) or at once."""
        trainer_state = {**self.state, "wandb_id": self.wandb_id, "config": plain(self.job.config)}
        resume_state = {"rng": checkpoint.rng_state(), "loader": self.loader.state_dict()}
        self.writer.wait()  # one save at a time, one staged copy in memory; the previous one's failure raised here
        files = checkpoint.stage(self.engine, trainer_state, resume_state, self.staging)
        step, keep = self.state["step"], self.train_config.keep_checkpoints
        self.writer.submit(lambda: checkpoint.write_staged(self.checkpoint_dir, step, files, keep, self.save_group))
        self.saved_step = step


def resume_command(run_dir: Path) -> str:
    """The command that continues this job: its launcher, its overrides, this run directory, ``resume=auto``."""
    task = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    kept = [o for o in task if not o.lstrip("+").startswith(("train.resume=", "hydra.run.dir="))]
    world = distributed.world_size()
    launcher = "python -m train" if world == 1 else (
        f"torchrun --standalone --nproc-per-node {world} -m train"
        if os.environ.get("LOCAL_WORLD_SIZE") == str(world) else "<your launcher> -m train")
    return " ".join([launcher, *map(shlex.quote, kept), shlex.quote(f"hydra.run.dir={run_dir}"), "train.resume=auto"])


PROBES_NOTE = ("  (guessing: the accuracy of random digits in the answer's format. The probes are zero-shot: a model "
               "never trained on their key=value format, as on the default data, scores below it, often 0; "
               "data=synthetic trains retrieval — docs/ABLATIONS.md)")


def summary_table(final: dict[str, float], config: JobConfig, chance: dict[str, float] | None = None) -> str:
    """The closing evaluation summary, one metric per line; probe accuracies beside the accuracy of guessing (what
    their "chance" is, and why a short run scores below it, said once at the end: issue 57)."""
    chance = chance or {}
    lines = [f"evaluation after {final['step']} steps ({config.model.name} model, {config.layout.name} layout)"]
    for key, value in final.items():
        if key in ("step", "lm_loss_se"):
            continue
        line = f"  {key:<32} {value:10.4f}"
        if key == "lm_loss" and math.isfinite(final.get("lm_loss_se", math.nan)):
            line += f"   (± {final['lm_loss_se']:.4f}, its standard error over the evaluation batches)"
        if key.split("/")[0] in chance:
            line += f"   (guessing {chance[key.split('/')[0]]:.4f})"
        lines.append(line)
    if any(key.split("/")[0] in chance for key in final):
        lines.append(PROBES_NOTE)
    return "\n".join(lines)


def closing_line(trainer: Trainer, seconds: float, run_dir: Path) -> str:
    """Steps of this job, wall time, tokens trained and where everything is."""
    last, steps, data = trainer.state["step"], trainer.steps_run, trainer.job.config.data
    tokens = steps * trainer.engine.micro_batches * trainer.engine.replicas * data.micro_batch_size * data.seq_len
    minutes, secs = divmod(round(seconds), 60)
    span = f"steps {last - steps + 1}-{last}" if steps else f"no steps (already at step {last})"
    return f"done: {span} in {minutes}m{secs:02d}s wall time, {tokens:,} tokens trained; run dir {run_dir}"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")  # CONF_DIR is absolute
def main(cfg: DictConfig) -> None:
    with reported():
        run(cfg, Path(HydraConfig.get().runtime.output_dir))
    distributed.close()
