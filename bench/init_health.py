"""How sharp is a model at initialisation? The first optimizer step, measured for several init recipes.

    python bench/init_health.py [--device cuda] [--variants before,after] [--lrs 1e-6,...] [overrides]

For each variant (a named set of config overrides, ``VARIANTS``) on the same two batches of real text (the
stdlib corpus, ``data.seq_len`` tokens, one row): the initial LM loss, the gradient norm per parameter group
(model/groups.py), the RMS of every layer's residual stream, attention and FFN outputs and of the logits
(train/observe/health.py), and then the **first-step curve**: the held-out LM loss after one AdamW step from init at
each learning rate (the trainer's AdamW, decay groups and trunk/indexer clipping). Adam's first update is lr * sign(g)
per weight whatever the gradient's size, so this curve is what a warm-up's first steps see: a loss *above* the
initial one after one small step means the recipe overshoots. Also, at ``--attribute-lr``, the held-out loss
change when only one parameter group takes that sign step: which group moves the function most.

Defaults: ``model=small layout=v41 data.seq_len=16384 parallel.recompute=layer`` in bf16 autocast on a GPU;
``--smoke`` runs the tiny model at 256 tokens on CPU. Writes JSON (``--out``, default ``$OUT/init_health.json``).
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model.cli import compose, resolved  # noqa: E402
from result_meta import result_meta  # noqa: E402
from model import layout_from_config  # noqa: E402
from model.groups import param_group  # noqa: E402
from model.transformer import Transformer, init_std  # noqa: E402
from parallel.recompute import recompute_leading  # noqa: E402
from train.data.loader import build_loader  # noqa: E402
from train.loss import compute_loss  # noqa: E402
from train.observe.health import ActivationStats  # noqa: E402
from train.run.engine import param_groups  # noqa: E402

VARIANTS = {  # name -> overrides on top of the defaults
    "before": ["model.init_std=0.02", "model.embed_init_std=0.02", "model.head_init_std=0.02"],  # issue 11's runs
    "embed1": ["model.init_std=0.02", "model.embed_init_std=1.0", "model.head_init_std=0.02"],
    "std006": ["model.init_std=0.006", "model.embed_init_std=0.006", "model.head_init_std=0.006"],
    "embed1_std006": ["model.init_std=0.006", "model.embed_init_std=1.0", "model.head_init_std=0.006"],
    "after": [],  # the defaults of conf/model
}
DEFAULTS = ["model=small", "layout=v41", "data.seq_len=16384", "data.micro_batch_size=1", "parallel.recompute=layer"]
SMOKE = ["model=tiny", "layout=v41_scaled", "data.seq_len=256", "data.micro_batch_size=1"]


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--lrs", default="1e-6,3e-6,1e-5,3e-5,1e-4,3e-4")
    p.add_argument("--attribute-lr", type=float, default=1e-5)
    p.add_argument("--smoke", action="store_true", help="tiny model, 256 tokens, CPU")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "init_health.json"))
    return p.parse_args()


class Probe:
    """One model on two fixed batches: ``train_batch`` for the gradient, ``heldout`` for the losses."""

    def __init__(self, cfg, device: torch.device, batches: tuple[dict, dict]):
        args, layout = cfg.model.args, layout_from_config(cfg.layout)
        with torch.device(device):
            self.model = Transformer(args, layout, seed=0, init=False)
        draw_on_device(self.model, args, layout.n_layers)
        if cfg.parallel.recompute == "layer":
            recompute_leading(self.model.layers.values(), len(self.model.layers))
        self.train_batch, self.heldout = batches
        self.autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
        self.coef = float(cfg.train.indexer_loss_coef)

    def loss(self, batch):
        with self.autocast:
            return compute_loss(self.model(batch["input_ids"], batch["doc_ids"]), batch["labels"], self.coef)

    @torch.no_grad()
    def heldout_lm(self) -> float:
        return self.loss(self.heldout).lm.item()


def draw_on_device(model: Transformer, args, n_layers: int) -> None:
    """The init recipe's distribution (``init_std`` per name) drawn where the weights live: a 3 B model's CPU
    draw would take minutes, and the probe needs the recipe, not the training run's exact values."""
    generator = None
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            generator = generator or torch.Generator(p.device).manual_seed(0)
            with torch.no_grad():
                p.normal_(std=init_std(name, args, n_layers), generator=generator)


def text_batches(cfg, device: torch.device) -> tuple[dict, dict]:
    """The first two rows of the corpus: one to take the gradient on, one held out."""
    loader = build_loader(cfg.data, vocab_size=int(cfg.model.vocab_size))
    return tuple({k: v.to(device) for k, v in next(loader).items()} for _ in range(2))


def run_variant(name: str, overrides: list[str], a, device, batches) -> dict:
    cfg = resolved(compose(overrides))
    torch.manual_seed(0)
    probe = Probe(cfg, device, batches)
    model = probe.model
    stats = ActivationStats(model)
    with stats.recording():
        initial = probe.loss(probe.train_batch)
        initial.total.backward()
    row = {"variant": name, "overrides": overrides, "initial_lm_loss": initial.lm.item(),
           "initial_heldout_lm_loss": probe.heldout_lm(), **stats.collect()}
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    squares = {}
    for n, p in named:
        squares[param_group(n)] = squares.get(param_group(n), 0.0) + p.grad.float().pow(2).sum().item()
    row.update({f"grad_norm/{g}": math.sqrt(v) for g, v in squares.items()})
    row["grad_norm"] = math.sqrt(sum(v for g, v in squares.items() if g != "indexer"))
    trunk = [p for n, p in named if param_group(n) != "indexer"]
    indexer = [p for n, p in named if param_group(n) == "indexer"]
    for params in (trunk, indexer):  # the trainer's clipping: trunk and indexer each by its own norm
        torch.nn.utils.clip_grad_norm_(params, float(cfg.train.grad_clip))
    grads = {n: p.grad for n, p in named}
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}

    def restore():
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])

    curve = {}
    for lr in a.lrs:
        optimizer = torch.optim.AdamW(param_groups(list(model.named_parameters()), float(cfg.train.weight_decay)),
                                      lr=lr, betas=tuple(cfg.train.betas), eps=float(cfg.train.eps))
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        optimizer.step()
        curve[f"{lr:g}"] = probe.heldout_lm()
        del optimizer
        restore()
    row["first_step_heldout_lm_loss"] = curve
    attribution = {}
    with torch.no_grad():
        for group in sorted({param_group(n) for n, _ in named} - {"indexer"}):
            for n, p in named:
                if param_group(n) == group:
                    p.sub_(a.attribute_lr * grads[n].sign())
            attribution[group] = probe.heldout_lm() - row["initial_heldout_lm_loss"]
            restore()
    row[f"sign_step_{a.attribute_lr:g}_heldout_delta"] = attribution
    del probe, model, saved, grads
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict], lrs: list[float]) -> str:
    head = f"{'variant':10s} {'loss0':>6s} {'gnorm':>7s} {'resid_L':>8s} {'logits':>7s} " + \
        " ".join(f"{lr:>7g}" for lr in lrs)
    lines = [head, "-" * len(head)]
    for r in rows:
        last = max((k for k in r if k.startswith("act_rms/resid/layer")), key=lambda k: int(k.rsplit("layer", 1)[1]))
        lines.append(f"{r['variant']:10s} {r['initial_heldout_lm_loss']:6.3f} {r['grad_norm']:7.2f} {r[last]:8.3f} "
                     f"{r['act_rms/logits']:7.3f} " +
                     " ".join(f"{r['first_step_heldout_lm_loss'][f'{lr:g}']:7.3f}" for lr in lrs))
    return "\n".join(lines)


def main() -> None:
    a = parse()
    a.lrs = [float(x) for x in a.lrs.split(",")]
    device = torch.device(a.device)
    base = (SMOKE if a.smoke else DEFAULTS) + a.overrides
    rows = []
    started = time.time()
    batches = text_batches(resolved(compose(base)), device)
    for name in a.variants.split(","):
        t0 = time.time()
        rows.append(run_variant(name, base + VARIANTS[name], a, device, batches))
        rows[-1]["seconds"] = time.time() - t0
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.startswith("act_rms/")}), flush=True)
    result = {**result_meta(), "defaults": base, "lrs": a.lrs, "seconds": time.time() - started, "variants": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(table(rows, a.lrs))


if __name__ == "__main__":
    main()
