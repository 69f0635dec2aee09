"""One checkpoint save and one resume timed on one device (issue 53): synchronous against asynchronous, by phase.

    python bench/save_timing.py [overrides...] [--steps N] [--out FILE.json] [--work-dir DIR]
    python bench/save_timing.py --smoke --out FILE.json      # CPU, the tiny model, fp32: seconds

The job is built as ``python -m train`` builds it: ``train/run/preflight.py``'s ``preflight`` then
``train/run/app.py``'s ``_trainer`` (engine, loader, evaluator), defaults ``model=small_moe layout=v41
data.seq_len=4096 data.micro_batch_size=1 parallel.recompute=layer`` (3.4 B parameters, ~54 GB of checkpoint with
its AdamW state; argv overrides win). It takes ``--steps`` steps (``Trainer.step``), then:

1. **sync**: ``Trainer.save`` with the writer of ``train.checkpoint_async=false`` (``BackgroundJob(False)``): the
   step loop waits for all of it;
2. **async**: one more step, then ``Trainer.save`` with the writer of ``train.checkpoint_async=true``: the time the
   loop is blocked (the copy into pinned CPU memory, ``checkpoint.stage``) against the background write
   (``checkpoint.write_staged``, its ``write_staged_s``), and the next step's time while the write runs against a
   step without one; ``staging_area_bytes``: the host memory the trainer's staging area holds page-locked
   (``train/formats/staging.py``; 0 on the CPU, where nothing is staged through it). The synchronous save's
   checkpoint is deleted first (two ~54 GB checkpoints do not fit a GPU machine's 64 GB disk);
3. **resume**: ``checkpoint.agree`` (find ``latest`` and check every file's SHA-256 against the manifest) and
   ``checkpoint.load`` into the same engine (a second engine would not fit beside the first).

The parts of a save are timed by wrapping, for the duration of a save, the functions ``train/formats/checkpoint.py``
calls through their modules (nothing of train/ is re-implemented): ``stage``, ``write_staged``, and inside it
``durable.write`` (per file: serialise, hash, write, fsync, rename), ``os.fsync``, the SHA-256 updates (a timing
wrapper around ``durable``'s ``hashlib.sha256``), ``durable.sync_dir``, ``manifest.write``, ``_publish`` and
``prune``. Serialising (``torch.save``) and writing are one stream into the file and are not separable without
changing train/: ``serialise_and_write_s`` is a file's time less its hashing and fsync. Bytes are those that
``durable.write`` reports having written (every file of the checkpoint, the manifest and ``latest``).
"""
import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from result_meta import result_meta, write_result  # noqa: E402

DEFAULTS = ["model=small_moe", "layout=v41", "data.seq_len=4096", "data.micro_batch_size=1",
            "train.grad_accum_steps=1", "parallel.recompute=layer", "logger.mode=disabled", "train.progress=false",
            "train.eval.probe_examples=0", "train.checkpoint_every=1000000", "train.keep_checkpoints=2"]
SMOKE = ["model=tiny", "layout=v41_scaled", "data.seq_len=64", "data.micro_batch_size=2", "train.precision=fp32",
         "train.device=cpu", "data.path={stdlib}/email"]
V41_PARAMS = 552e9  # DeepSeek V4.1 (issue 53: 12 B a trained parameter, "about 9 TB a checkpoint")
V41_GPUS = (128, 256, 512)  # the pretraining plans of docs/projection_v41.md


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the job (after the defaults)")
    p.add_argument("--steps", type=int, default=2, help="steps before the first save (the first one compiles)")
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny model, fp32: checks the script in seconds")
    p.add_argument("--work-dir", default=None, help="where the run directory goes (default: a temporary one)")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/save_timing.json if $OUT)")
    return p.parse_intermixed_args()  # overrides may come on both sides of an option (bench/gpu_save.sh)


class Phases:
    """Seconds and calls per phase, accumulated by wrappers set on module attributes for the span of ``wrapped``."""

    def __init__(self):
        self.seconds, self.calls, self.bytes, self.guard = {}, {}, 0, threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self.guard:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.calls[name] = self.calls.get(name, 0) + 1

    def timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)
        return wrapper

    def hashing(self, make=hashlib.sha256):
        """``hashlib``'s stand-in for ``durable``: its ``sha256()`` objects time their ``update``."""
        phases = self

        class TimedDigest:
            def __init__(self):
                self.digest = make()

            def update(self, data):
                start = time.perf_counter()
                self.digest.update(data)
                phases.add("hash", time.perf_counter() - start)

            def hexdigest(self):
                return self.digest.hexdigest()

        return type("TimedHashlib", (), {"sha256": staticmethod(TimedDigest)})

    @contextlib.contextmanager
    def wrapped(self):
        from train.formats import checkpoint, durable, manifest
        write = durable.write

        def counted_write(*args, **kwargs):
            entry = self.timed("file", write)(*args, **kwargs)
            with self.guard:
                self.bytes += entry["bytes"]
            return entry

        patches = [(checkpoint, "stage", self.timed("stage", checkpoint.stage)),
                   (checkpoint, "write_staged", self.timed("write_staged", checkpoint.write_staged)),
                   (checkpoint, "_publish", self.timed("publish", checkpoint._publish)),
                   (checkpoint, "prune", self.timed("prune", checkpoint.prune)),
                   (manifest, "write", self.timed("manifest", manifest.write)),
                   (durable, "write", counted_write),
                   (durable, "sync_dir", self.timed("sync_dir", durable.sync_dir)),
                   (durable, "hashlib", self.hashing()),
                   (os, "fsync", self.timed("fsync", os.fsync))]
        saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
        for module, name, value in patches:
            setattr(module, name, value)
        try:
            yield self
        finally:
            for module, name, value in saved:
                setattr(module, name, value)

    def report(self) -> dict:
        """The phases of one save: seconds, and GB/s of the bytes written where a phase moves all of them."""
        s = self.seconds.get
        files = s("file", 0.0)
        parts = {"stage_s": s("stage", 0.0), "write_staged_s": s("write_staged", 0.0), "files_s": files,
                 "hash_s": s("hash", 0.0), "fsync_s": s("fsync", 0.0),
                 "serialise_and_write_s": files - s("hash", 0.0) - s("fsync", 0.0),
                 "sync_dir_s": s("sync_dir", 0.0), "manifest_s": s("manifest", 0.0), "publish_s": s("publish", 0.0),
                 "prune_s": s("prune", 0.0), "files": self.calls.get("file", 0), "bytes_written": self.bytes}
        gb = self.bytes / 1e9
        parts["gb_per_s"] = {k.removesuffix("_s"): gb / parts[k] for k in
                             ("stage_s", "write_staged_s", "hash_s", "fsync_s", "serialise_and_write_s")
                             if parts[k] > 0}
        return parts


def compose_job(a):
    import sysconfig
    from model.cli import compose
    overrides = DEFAULTS + ([o.format(stdlib=sysconfig.get_paths()["stdlib"]) for o in SMOKE] if a.smoke else []) \
        + a.overrides
    return overrides, compose(overrides)


def measure(a, publish) -> dict:
    """The three phases; ``publish(res)`` after each, so that a run cut by its time limit keeps the phases it
    finished (``phases_done``)."""
    import torch
    from train.formats import checkpoint
    from train.processes import distributed
    from train.run import app
    from train.run.background import BackgroundJob
    from train.run.preflight import launched_world_size, preflight

    overrides, cfg = compose_job(a)
    if a.work_dir:
        Path(a.work_dir).mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="save_timing_", dir=a.work_dir))
    checked = preflight(cfg, run_dir, launched_world_size())
    job = checked.job
    cuda = job.device.type == "cuda"
    if cuda:
        from layer_probe import use_device_init
        use_device_init()  # the weights drawn on the GPU: the CPU draw of billions of values is not what is timed
    distributed.init(job.device, job.config.train.startup_timeout_s, run_dir)
    res = {**result_meta(), "overrides": overrides, "device": torch.cuda.get_device_name(job.device) if cuda else "cpu",
           "run_dir": str(run_dir)}
    t = time.perf_counter()
    trainer = app._trainer(run_dir, checked)
    res["build_s"] = time.perf_counter() - t
    res["params"] = sum(p.numel() for p in trainer.engine.module.parameters())
    sync = (lambda: torch.cuda.synchronize(job.device)) if cuda else (lambda: None)

    def step() -> float:
        sync()
        start = time.perf_counter()
        trainer.step(trainer.state["step"] + 1)
        sync()
        return time.perf_counter() - start

    res["warm_step_s"] = [step() for _ in range(a.steps)]
    res["phases_done"] = []

    sync_save = Phases()  # 1. synchronous: the writer of train.checkpoint_async=false
    trainer.writer = BackgroundJob(False, "checkpoint writer")
    with sync_save.wrapped():
        start = time.perf_counter()
        trainer.save()
        res["sync"] = {"total_s": time.perf_counter() - start, **sync_save.report()}
    res["sync"]["step"] = trainer.state["step"]
    res["phases_done"].append("sync")
    publish(res)
    # removed before the next save: two ~54 GB checkpoints do not fit a GPU machine's 64 GB disk at once
    shutil.rmtree(trainer.checkpoint_dir / checkpoint.tag_for(trainer.state["step"]))

    quiet_step = step()  # 2. asynchronous: a step without a write, the save, the step beside the write
    async_save = Phases()
    trainer.writer = BackgroundJob(True, "checkpoint writer")
    with async_save.wrapped():
        start = time.perf_counter()
        trainer.save()
        blocked = time.perf_counter() - start
        saved_step = trainer.state["step"]
        step_beside = step()
        still_writing = trainer.writer._thread is not None and trainer.writer._thread.is_alive()
        trainer.writer.wait()
        until_published = time.perf_counter() - start
    res["async"] = {"blocked_s": blocked, "step_without_write_s": quiet_step, "step_during_write_s": step_beside,
                    "write_outlasted_the_step": still_writing, "until_published_s": until_published,
                    "step": saved_step, "staging_area_bytes": trainer.staging.nbytes, **async_save.report()}
    res["phases_done"].append("async")
    publish(res)

    res["resume"] = resume(trainer, job, sync)  # 3. find + verify, load
    for key in ("verify", "load"):
        res["resume"][f"{key}_gb_per_s"] = res["resume"]["bytes_read"] / 1e9 / res["resume"][f"{key}_s"]
    res["phases_done"].append("resume")
    res["not_separable"] = ("serialising (torch.save) and writing a file are one stream: serialise_and_write_s is a "
                            "file's time less its hashing and fsync; resume's load reads the files memory-mapped "
                            "into the engine, reading and copying in one")
    res["projection_v41"] = projection(res)
    return res


def resume(trainer, job, sync) -> dict:
    """``checkpoint.agree`` on ``latest`` (every file's SHA-256 checked) and ``checkpoint.load`` into the engine."""
    from train.formats import checkpoint, manifest
    from train.run.preflight import checkpoint_dir
    start = time.perf_counter()
    ref = checkpoint.agree("auto", checkpoint_dir(job.config.train, trainer.run_dir))
    verify = time.perf_counter() - start
    saved = checkpoint.check_compatible(ref, job.config)
    start = time.perf_counter()
    checkpoint.load(trainer.engine, ref, saved["config"]["parallel"]["pipeline_stages"])
    sync()
    load = time.perf_counter() - start
    files = json.loads((ref.path / manifest.MANIFEST).read_text())["files"]  # what the verification read
    return {"tag": ref.tag, "verify_s": verify, "load_s": load, "bytes_read": sum(e["bytes"] for e in files.values())}


PROJECTION_ASSUMES = ("each GPU writes, verifies and loads an even share of the checkpoint (optimistic: under ZeRO-1 a "
                      "stage's first data-parallel rank writes its weights besides its optimizer rows) at the rate "
                      "measured here on one GPU, whatever the number of writers (not measured: a shared filesystem's "
                      "aggregate rate caps it)")


def pretraining_plan(gpus: int) -> dict | None:
    """The fastest pretraining configuration that fits on ``gpus`` GPUs in docs/projection_v41.md's file (P x E x D x
    C and its step time), or None."""
    path = ROOT / "bench/results/projection_v41/projection.json"
    rows = [r for r in json.loads(path.read_text())["best"] if r["job"] == "pretraining" and r["gpus"] == gpus
            and r["fits"]] if path.is_file() else []
    if not rows:
        return None
    best = max(rows, key=lambda r: r["tokens_per_s"])
    split = "{stages} x {expert_parallel} x {data_parallel} x {context_parallel}".format(**best)
    return {"split": split, "step_s": best["step_s"]}


def projection(res: dict) -> dict:
    """V4.1's checkpoint (the measured bytes per parameter x 552 B) and its phases per GPU at the measured rates, for
    the pretraining plans' GPU counts (``PROJECTION_ASSUMES``), beside each plan's projected step time."""
    per_param = res["async"]["bytes_written"] / res["params"]
    total = per_param * V41_PARAMS
    rates = {"stage": res["async"]["gb_per_s"].get("stage"),
             "write": res["async"]["gb_per_s"].get("write_staged"),
             "sync_save": res["sync"]["bytes_written"] / 1e9 / res["sync"]["total_s"],
             "verify": res["resume"]["verify_gb_per_s"], "load": res["resume"]["load_gb_per_s"]}
    plans = {}
    for gpus in V41_GPUS:
        share_gb = total / gpus / 1e9
        plans[gpus] = {"share_gb_per_gpu": share_gb,
                       **{f"{k}_s": share_gb / r for k, r in rates.items() if r}}
        plan = pretraining_plan(gpus)
        if plan and "stage_s" in plans[gpus]:  # the async save's stall and write in the plan's steps
            plans[gpus].update(plan=plan["split"], step_s=plan["step_s"],
                               stall_share_of_a_step=plans[gpus]["stage_s"] / plan["step_s"],
                               write_in_steps=plans[gpus]["write_s"] / plan["step_s"])
    return {"params": V41_PARAMS, "bytes_per_param_measured": per_param, "checkpoint_tb": total / 1e12,
            "checkpoint_tb_at_12_bytes": V41_PARAMS * 12 / 1e12, "gb_per_s_per_gpu": rates, "per_gpu_count": plans,
            "assumes": PROJECTION_ASSUMES}


def main() -> int:
    a = parse()
    os.environ.setdefault("CSA2_KERNEL_POISON", "0")
    out = a.out or (os.path.join(os.environ["OUT"], "save_timing.json") if os.environ.get("OUT") else None)

    def publish(res: dict) -> None:
        if out:  # whole or not at all: a write cut by the time limit leaves the previous phase's file
            write_result(Path(out), res)

    res = measure(a, publish)
    publish(res)
    print(json.dumps(res, indent=1, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
