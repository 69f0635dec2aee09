"""``python -m train``: a Hydra app that trains a CSA2 model on the DeepSpeed engine.

``main`` is the Hydra entry point; ``run(cfg, run_dir)`` is the job itself, also called by the tests with a
composed config. The run directory receives the resolved ``config.yaml``, ``checkpoints/``, ``metrics.jsonl``,
``loss_curve.png`` and the wandb run; the job ends with an evaluation summary.
"""
import logging
import random
import time
from pathlib import Path

import datasets
import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from model import ModelArgs, layout_from_config
from train import checkpoint, distributed
from train.data import build_loader
from train.engine import build_engine, check_parallel, resolve_device, resolve_precision, train_step
from train.evaluate import Evaluator, data_tokenizer
from train.health import ActivationStats
from train.metrics import MetricsLogger

log = logging.getLogger(__name__)

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")  # absolute: Hydra reads a relative one as a package
LOGGER_MODES = ("offline", "online", "disabled")


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the newest checkpoint predates them."""


def check_config(cfg: DictConfig) -> None:
    """Fail before any work on settings that cannot run; each message names the setting."""
    ModelArgs.from_config(cfg.model)
    layout_from_config(cfg.layout)
    tokenizer = data_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer ({cfg.data.tokenizer or 'byte-level'}) has {tokenizer.vocab_size} tokens but "
                         f"model.vocab_size={cfg.model.vocab_size}: set model.vocab_size>={tokenizer.vocab_size}")
    train = cfg.train
    for key in ("max_steps", "grad_accum_steps", "log_every", "max_bad_steps", "eval.batches"):
        value = OmegaConf.select(train, key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"train.{key} must be an integer >= 1, got {value!r}")
    if not isinstance(train.checkpoint_every, int) or train.checkpoint_every < 0:
        raise ValueError(f"train.checkpoint_every must be an integer >= 0 (0: no checkpoints), "
                         f"got {train.checkpoint_every!r}")
    if train.stop_at is not None and not 1 <= train.stop_at <= train.max_steps:
        raise ValueError(f"train.stop_at must be in 1..train.max_steps={train.max_steps}, got {train.stop_at}")
    check_parallel(cfg.parallel)
    if cfg.logger.mode not in LOGGER_MODES:
        raise ValueError(f"logger.mode must be one of {LOGGER_MODES}, got {cfg.logger.mode!r}")


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
    check_config(cfg)
    datasets.disable_progress_bars()  # one progress bar: the training loop's
    device = resolve_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    distributed.init(device)
    run_dir = Path(distributed.from_rank0(str(run_dir)))
    checkpoint_dir = Path(cfg.train.checkpoint_dir or run_dir / "checkpoints")
    ref = checkpoint.find(cfg.train.resume, checkpoint_dir)
    saved = checkpoint.check_compatible(ref, cfg) if ref else {}
    if distributed.rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)

    seed_everything(cfg.train.seed)
    engine = build_engine(cfg, precision, device)
    loader = build_loader(cfg.data, rank=engine.grid.data_parallel_id, world_size=engine.dp_world_size,
                          vocab_size=cfg.model.vocab_size)
    evaluator = Evaluator(cfg, device, engine)
    log.info("%s model (%.2fM parameters on this stage), %s layout, %s on %s, %d process(es); run dir %s",
             cfg.model.name, sum(p.numel() for p in engine.module.owned_parameters()) / 1e6, cfg.layout.name,
             precision, device.type, distributed.world_size(), run_dir)
    if ref:
        resume_state = checkpoint.load(engine, ref, saved["config"]["parallel"]["pipeline_stages"])
        checkpoint.set_rng_state(resume_state["rng"])
        loader.load_state_dict(resume_state["loader"])
        log.info("resumed from %s at step %d", ref.path, saved["step"])

    trainer = Trainer(cfg, engine, loader, evaluator, checkpoint_dir, device,
                      {key: saved.get(key, 0) for key in ("step", "bad_streak", "skipped")})
    logger = MetricsLogger(cfg, run_dir, trainer.state["step"], enabled=distributed.rank() == 0)
    try:
        trainer.train(logger)
        final = {"step": trainer.state["step"], **evaluator(probes=True)}
        logger.log_eval(final)
        logger.summarize({f"eval/{k}": v for k, v in final.items()})
    finally:
        logger.close()
    if distributed.rank() == 0:
        print(summary_table(final, cfg))
    return final


class Trainer:
    """The step loop: train, log, evaluate and checkpoint from ``state["step"]`` to ``train.stop_at`` (or
    ``max_steps``). ``state`` (step, bad_streak, skipped) is what a checkpoint records of the loop itself."""

    def __init__(self, cfg: DictConfig, engine, loader, evaluator: Evaluator, checkpoint_dir: Path,
                 device: torch.device, state: dict[str, int]):
        self.cfg, self.engine, self.loader, self.evaluator = cfg, engine, loader, evaluator
        self.checkpoint_dir, self.device, self.state = checkpoint_dir, device, state
        self.saved_step = state["step"]  # newest checkpoint of this run (0: none)
        self.activations = ActivationStats(engine.module.stage.model, scope=engine.module.stage)

    def train(self, logger: MetricsLogger) -> None:
        train = self.cfg.train
        stop = train.stop_at or train.max_steps
        bar = tqdm(total=stop, initial=self.state["step"], unit="step", dynamic_ncols=True,
                   disable=not (distributed.rank() == 0 and train.progress))
        try:
            for step in range(self.state["step"] + 1, stop + 1):
                row = self.step(step)
                if step % train.log_every == 0 or row["skipped"]:
                    logger.log(row)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
                self.stop_if_diverged()
                if train.eval.every and step % train.eval.every == 0 and step != stop:  # the end has its own
                    logger.log_eval({"step": step, **self.evaluator(probes=False)})
                if train.checkpoint_every and (step % train.checkpoint_every == 0 or step == stop) \
                        and self.state["bad_streak"] == 0:
                    self.save()
        finally:
            bar.close()

    def step(self, step: int) -> dict:
        """One optimizer step; returns its ``metrics.jsonl`` row."""
        train = self.cfg.train
        start = time.perf_counter()
        logged = step % train.log_every == 0
        with self.activations.recording(logged):
            result = train_step(self.engine, [next(self.loader) for _ in range(train.grad_accum_steps)])
        seconds = time.perf_counter() - start
        self.state["step"] = step
        if result.bad:
            self.state["bad_streak"] += 1
            self.state["skipped"] += 1
            log.warning("step %d: non-finite loss or gradients (loss %s), update skipped (%d in a row)",
                        step, result.metrics["loss"], self.state["bad_streak"])
        else:
            self.state["bad_streak"] = 0
        row = {"step": step, **result.metrics, "tokens_per_s": result.tokens / seconds,
               "padding_fraction": self.loader.padding_fraction, "memory_mb": memory_mb(self.device),
               "skipped": result.bad, "skipped_total": self.state["skipped"]}
        if logged:
            row.update(self.activations.collect(self.engine.grid.get_pipe_parallel_group()))
        return row

    def stop_if_diverged(self) -> None:
        streak, limit = self.state["bad_streak"], self.cfg.train.max_bad_steps
        if streak < limit:
            return
        step = self.state["step"]
        kept = f"step {self.saved_step} in {self.checkpoint_dir}" if self.saved_step else "none was written"
        raise TrainingDiverged(f"steps {step - streak + 1}..{step} had a non-finite loss or gradients "
                               f"(train.max_bad_steps={limit} in a row); every one was skipped. "
                               f"Last good checkpoint: {kept}.")

    def save(self) -> None:
        trainer_state = {**self.state, "config": OmegaConf.to_container(self.cfg, resolve=True)}
        resume_state = {"rng": checkpoint.rng_state(), "loader": self.loader.state_dict()}
        checkpoint.save(self.engine, self.checkpoint_dir, self.state["step"], trainer_state, resume_state,
                        self.cfg.train.keep_checkpoints)
        self.saved_step = self.state["step"]


def summary_table(final: dict[str, float], cfg: DictConfig) -> str:
    """The closing evaluation summary, one metric per line."""
    lines = [f"evaluation after {final['step']} steps ({cfg.model.name} model, {cfg.layout.name} layout)"]
    for key, value in final.items():
        if key != "step":
            lines.append(f"  {key:<32} {value:10.4f}")
    return "\n".join(lines)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg, Path(HydraConfig.get().runtime.output_dir))
