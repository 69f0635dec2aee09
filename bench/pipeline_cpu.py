"""CPU pipeline benchmark (gloo, tiny model): per-stage forward/backward time, measured bubble against the
1F1B ideal (P-1)/(M+P-1), payload bytes per boundary, and shadow vs payload index K.

    python bench/pipeline_cpu.py --stages 1 2 4 --microbatches 8 --steps 3 --out bench/results/pipeline_cpu.json

Each configuration runs in its own group of processes; one warm-up step, then ``--steps`` timed steps. On a
machine with fewer cores than processes the stages share cores, which inflates compute times; the table says
how many cores were available.
"""
import argparse
import json
import os
import tempfile
import time

import torch

from parallel.deepspeed_private import instructions, use_instructions
from parallel.local import spawn

SEQ_LEN, MICRO_BATCH = 256, 2


def _timed(engine, table, key):
    """Wrap one pipeline instruction so that its wall time is added to ``table[key]``."""
    inner = instructions(engine)[key]

    def run(self, *args, **kwargs):
        start = time.perf_counter()
        inner(self, *args, **kwargs)
        table[key.__name__] = table.get(key.__name__, 0.0) + time.perf_counter() - start
    return run


def _worker(rank, world, cuts, microbatches, steps, index_k, out):
    from deepspeed.runtime.pipe import schedule

    from model.cli import compose, resolved
    from parallel.job import plan
    from train.run.engine import build_engine

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    config = resolved(compose([f"parallel.pipeline_stages={world}", f"parallel.cuts={cuts or 'null'}",
                               f"parallel.index_k={index_k}", f"data.seq_len={SEQ_LEN}",
                               f"data.micro_batch_size={MICRO_BATCH}", f"train.grad_accum_steps={microbatches}",
                               "train.precision=fp32"]))
    engine = build_engine(plan(config, world, torch.device("cpu")))
    module, plan = engine.module, engine.module.plan
    times: dict[str, float] = {}
    use_instructions(engine, {**instructions(engine), **{
        k: _timed(engine, times, k) for k in (schedule.ForwardPass, schedule.BackwardPass)}})
    g = torch.Generator().manual_seed(rank)

    def data():
        while True:
            x = torch.randint(0, config.model.vocab_size, (MICRO_BATCH, SEQ_LEN), generator=g)
            yield (x, torch.zeros_like(x)), x

    it = data()
    engine.train_batch(it)  # warm-up
    times.clear()
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_batch(it)
    wall = (time.perf_counter() - start) / steps
    outgoing = module.stage.outgoing
    result = {"stage": engine.stage_id, "layers": [plan.stages[engine.stage_id].start, plan.stages[engine.stage_id].stop],
              "step_s": wall, "forward_s": times.get("ForwardPass", 0.0) / steps / microbatches,
              "backward_s": times.get("BackwardPass", 0.0) / steps / microbatches,
              "payload_bytes": outgoing.nbytes() if outgoing else 0}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def measure(stages: int, microbatches: int, steps: int, index_k: str, cuts=None) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, stages, stages, cuts, microbatches, steps, index_k, out)
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(stages)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="bench/results/pipeline_cpu.json")
    opts = parser.parse_args()
    rows = []
    for stages in opts.stages:
        for index_k in (["shadow", "payload"] if stages > 1 else ["shadow"]):
            ranks = measure(stages, opts.microbatches, opts.steps, index_k)
            step = max(r["step_s"] for r in ranks)
            busy = [opts.microbatches * (r["forward_s"] + r["backward_s"]) for r in ranks]
            rows.append({"stages": stages, "index_k": index_k, "microbatches": opts.microbatches, "step_s": step,
                         "bubble_measured": 1 - sum(busy) / len(busy) / step,
                         "bubble_ideal": (stages - 1) / (opts.microbatches + stages - 1), "ranks": ranks})
    print(f"tiny model, {SEQ_LEN} tokens x {MICRO_BATCH} per microbatch, {os.cpu_count()} CPU cores, gloo")
    print(f"{'P':>2} {'index K':<8} {'step s':>7} {'tok/s':>7} {'bubble':>7} {'ideal':>6}  per stage fwd/bwd ms, "
          "payload out")
    for row in rows:
        tokens = row["microbatches"] * MICRO_BATCH * SEQ_LEN
        stages = "  ".join(f"[{r['layers'][0]}-{r['layers'][1] - 1}] {1e3 * r['forward_s']:.0f}/"
                           f"{1e3 * r['backward_s']:.0f} {r['payload_bytes'] / 2 ** 10:.0f}KiB" for r in row["ranks"])
        print(f"{row['stages']:>2} {row['index_k']:<8} {row['step_s']:7.2f} {tokens / row['step_s']:7.0f} "
              f"{row['bubble_measured']:7.1%} {row['bubble_ideal']:6.1%}  {stages}")
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
