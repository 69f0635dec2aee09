"""Why does MoE routing collapse with depth at initialisation? Per MoE layer, on one forward of a fresh model:

    python bench/routing_probe.py [--tokens 2048] [--data text,random] [--steps N] [--freeze GROUPS]
                                  [--device auto|cpu|cuda] [--out FILE] [overrides, e.g. train.warmup_steps=2000]

- ``cosine``: the mean pairwise cosine similarity of the tokens' FFN inputs (the collapsed stream after
  ``ffn_norm``, what the gate reads): 0 for unrelated directions, 1 when every token is the same vector;
- ``stream_cosine``: the same of the stream entering the block (its copies averaged, as the draft head reads it);
- ``logit_std_experts``: the std of a token's gate logits across the experts (mean over tokens), and
  ``logit_std_tokens``: the std of one expert's logit across the tokens (mean over experts) — a router separates
  tokens only by the second;
- ``logit_mean_std`` / ``logit_mean_range``: the std / the max - min across the experts of each expert's logit
  averaged over the tokens — the part of the logits that every token shares. When it exceeds
  ``logit_std_tokens``, one expert wins for (nearly) every token whatever the token;
- ``load_max_over_mean`` and ``idle_experts`` of the top-k selection (with the bias as it is, zero at init);
- after each step, ``grads``: per parameter group the clipped gradient's norm, rms per weight and share of weights
  above AdamW's ``eps`` (where the first update is sign-like: ``gradient_stats``).

Which update collapses the routing: ``--freeze`` takes the parameter groups of the gradient-norm diagnostics
(``model/groups.py``: gate, experts, ffn, attn_out, hc, ...) that the steps leave untouched (no gradient, no optimizer
state); the schedule is the config's (``train.lr=...``, ``train.warmup_steps=...`` as overrides).

Two inputs: real text (the default corpus, the stdlib's *.py files through the byte tokenizer, one row of
``--tokens``) and uniformly random bytes (what bench/v41_slice.py feeds). Runs on CPU in fp32 (a few seconds for
v41_mini at 2K tokens); on a GPU as the trainer does (weights drawn on the device, bf16 autocast over fp32 weights
with ``train.precision`` auto, every layer recomputed in the backward, fused AdamW), for ``model=small_moe`` at 16K.
Writes JSON (``--out``; default ``$OUT/routing_probe.json``), again after every measurement, so a run cut short
keeps what it measured.
"""
import argparse
import gc
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model import layout_from_config  # noqa: E402
from layer_probe import use_device_init  # noqa: E402
from model.cli import compose, resolved  # noqa: E402
from model.groups import GROUPS, clip_group, param_group  # noqa: E402
from model.moe import MoE  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from parallel.job import compute_dtype, resolve_device, resolve_precision  # noqa: E402
from parallel.recompute import recompute_leading  # noqa: E402
from result_meta import result_meta, write_result  # noqa: E402
from train.data.loader import build_loader  # noqa: E402
from train.loss import compute_loss  # noqa: E402
from train.run.engine import plain_optimizer, warmup_cosine  # noqa: E402

DEFAULTS = ["model=v41_mini", "layout=v41_scaled"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--data", default="text,random", help="text, random or both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="also measure after each of the first optimizer steps")
    p.add_argument("--freeze", default="", help=f"comma list of parameter groups the steps leave as they are: "
                                               f"{', '.join(GROUPS)}")
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "routing_probe.json"))
    a = p.parse_args(argv)
    a.freeze = [g for g in a.freeze.split(",") if g]
    unknown = sorted(set(a.freeze) - set(GROUPS))
    if unknown:
        p.exit(2, f"error: --freeze {','.join(unknown)}: no such parameter group — use some of {', '.join(GROUPS)}\n")
    return a


def mean_pairwise_cosine(x: torch.Tensor) -> float:
    """Mean cosine over the distinct pairs of the rows of x [N, D]: (|sum of unit rows|² − N) / (N (N − 1))."""
    unit = torch.nn.functional.normalize(x.double(), dim=-1)
    n = unit.shape[0]
    return ((unit.sum(0).square().sum() - n) / (n * (n - 1))).item()


def input_ids(kind: str, tokens: int, vocab: int, seed: int) -> torch.Tensor:
    """One row [1, tokens]: the corpus's first row (``text``) or uniform random bytes (``random``)."""
    if kind == "random":
        return torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(seed))
    cfg = resolved(compose([f"data.seq_len={tokens}", "data.micro_batch_size=1"]))
    return next(build_loader(cfg.data, vocab_size=vocab))["input_ids"][:1]


def layer_rows(model: Transformer, ids: torch.Tensor, dtype: torch.dtype) -> list[dict]:
    """The per-MoE-layer measures of one forward of ``model`` on ``ids`` (under autocast to ``dtype``)."""
    seen: dict[str, dict] = {}
    hooks = []
    for name, block in model.layers.items():
        if not isinstance(block.ffn, MoE):
            continue

        def on_block(module, args, name=name):
            x = args[0]
            seen.setdefault(name, {})["stream_cosine"] = mean_pairwise_cosine(
                (x if x.dim() == 3 else x.mean(2)).flatten(0, 1))

        def on_ffn(module, args, name=name):
            x = args[0].flatten(0, 1)
            logits = x.double() @ module.gate.weight.double().T / module.args.gate_temp
            _, chosen = module.gate(x)
            counts = torch.bincount(chosen.flatten(), minlength=module.args.n_routed_experts).double()
            shared = logits.mean(0)  # each expert's logit averaged over the tokens
            seen.setdefault(name, {}).update(
                cosine=mean_pairwise_cosine(x), logit_std_experts=logits.std(1).mean().item(),
                logit_std_tokens=logits.std(0).mean().item(), logit_mean_std=shared.std().item(),
                logit_mean_range=(shared.max() - shared.min()).item(),
                load_max_over_mean=(counts.max() / counts.mean()).item(), idle_experts=int((counts == 0).sum()))

        hooks += [block.register_forward_pre_hook(on_block), block.ffn.register_forward_pre_hook(on_ffn)]
    with torch.no_grad(), autocast(ids.device, dtype):
        model(ids)
    for h in hooks:
        h.remove()
    return [{"layer": int(name), **values} for name, values in sorted(seen.items(), key=lambda kv: int(kv[0]))]


def autocast(device: torch.device, dtype: torch.dtype):
    """The trainer's precision: bf16 autocast over the fp32 weights, or none (``parallel/stage.py``)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def freeze(model: Transformer, groups: list[str]) -> list[str]:
    """Take the parameters of ``groups`` (``model/groups.py``) out of training; the names of those frozen."""
    frozen = [n for n, p in model.named_parameters() if param_group(n) in groups]
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    return frozen


def train_steps(model: Transformer, cfg, ids: torch.Tensor, steps: int, dtype: torch.dtype):
    """Yield after each of ``steps`` optimizer steps on the row ``ids`` (next-token loss), as the trainer takes
    them: AdamW (fused on a GPU), or Muon with AdamW (``train.optimizer``), with its decay groups, betas, eps and
    warm-up schedule (``train/run/engine.py``) over the parameters that require a gradient, each clipping group
    (``model.groups.clip_group``: the trunk, the indexer) clipped at ``train.grad_clip`` by its own norm, then the
    balance step of the routing biases. The Engram tables (sparse gradients) stay. Yields (step, the LM loss before
    it, ``gradient_stats`` of its update)."""
    train = cfg.train
    named = [(n, p) for n, p in model.named_parameters()
             if p.requires_grad and not n.endswith("engram.embed.weight")]
    optimizer = plain_optimizer(named, train, cfg.model.args, fused=ids.device.type == "cuda")
    clipped: dict[str, list[torch.nn.Parameter]] = {}
    for n, p in named:
        clipped.setdefault(clip_group(param_group(n)), []).append(p)
    schedule = warmup_cosine(int(train.warmup_steps), int(train.max_steps), float(train.min_lr_ratio))
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = float(train.lr) * schedule(step)
        optimizer.zero_grad(set_to_none=True)
        with autocast(ids.device, dtype):
            loss = compute_loss(model(ids[:, :-1]), ids[:, 1:], float(train.indexer_loss_coef))
        loss.total.backward()
        for params in clipped.values():
            torch.nn.utils.clip_grad_norm_(params, float(train.grad_clip))
        stats = gradient_stats(named, float(train.eps))
        optimizer.step()
        model.balance_experts(lambda loads: None)
        yield step + 1, loss.lm.item(), stats
    model.eval()


def gradient_stats(named: list[tuple[str, torch.nn.Parameter]], eps: float) -> dict[str, dict]:
    """Per parameter group (``model/groups.py``), the clipped gradient AdamW is about to take: its norm, its rms per
    weight, and the share of weights with ``|g| > eps``. Adam's first update is ``lr * g / (|g| + eps)``, so those
    weights move by more than half the lr whatever the gradient's size (sign-like), the others by ``lr * |g| / eps``."""
    grads: dict[str, list[torch.Tensor]] = {}
    for n, p in named:
        if p.grad is not None:
            grads.setdefault(param_group(n), []).append(p.grad.detach().double().flatten())
    stats = {}
    for group, parts in sorted(grads.items()):
        g = torch.cat(parts)
        stats[group] = {"norm": g.norm().item(), "rms": g.square().mean().sqrt().item(),
                        "above_eps": (g.abs() > eps).double().mean().item()}
    return stats


def probe(overrides: list[str], tokens: int, kinds: list[str], seed: int = 0, steps: int = 0,
          frozen_groups: list[str] = (), device: str = "cpu", report=lambda result: None) -> dict:
    """Every kind of input through a freshly initialised model of ``overrides``, and (``steps``) again after each
    of the trainer's first optimizer steps on that input, ``frozen_groups`` left untouched (one model per kind).
    ``report`` gets the result so far after every measurement."""
    cfg = resolved(compose(DEFAULTS + overrides))
    args, layout = cfg.model.args, layout_from_config(cfg.layout)
    where = resolve_device(device)
    dtype = compute_dtype(resolve_precision(cfg.train.precision, where))
    if where.type == "cuda":
        use_device_init()  # a 3 B model's CPU draw takes minutes (bench/train_step.py)
    result = {"overrides": DEFAULTS + overrides, "tokens": tokens, "device": str(where), "dtype": str(dtype),
              "frozen_groups": list(frozen_groups), "inputs": {}}
    for kind in kinds:
        torch.manual_seed(seed)
        with torch.device(where):
            model = Transformer(args, layout, seed=seed).eval()
        if where.type == "cuda":  # the activations of 40 layers at 16K do not fit otherwise
            recompute_leading(model.layers.values(), len(model.layers))
        result["frozen_parameters"] = len(freeze(model, list(frozen_groups)))
        ids = input_ids(kind, tokens + 1, args.vocab_size, seed).to(where)
        rows = result["inputs"][kind] = [{"step": 0, "layers": layer_rows(model, ids[:, :-1], dtype)}]
        report(result)
        for step, loss, grads in train_steps(model, cfg, ids, steps, dtype):
            rows.append({"step": step, "lm_loss_before": loss, "lr": optimizer_lr(cfg, step - 1), "grads": grads,
                         "layers": layer_rows(model, ids[:, :-1], dtype)})
            report(result)
        del model
        if where.type == "cuda":  # the next kind's model needs the memory this one held
            gc.collect()
            torch.cuda.empty_cache()
    return result


def optimizer_lr(cfg, step: int) -> float:
    train = cfg.train
    return float(train.lr) * warmup_cosine(int(train.warmup_steps), int(train.max_steps),
                                           float(train.min_lr_ratio))(step)


def table(result: dict) -> str:
    lines = []
    for kind, steps in result["inputs"].items():
        for at in steps:
            lines.append(f"{kind} after {at['step']} steps: layer  cosine  stream_cos  std_exp  std_tok  shared  "
                         "max/mean  idle")
            lines += [f"{'':{len(kind)}}  {r['layer']:5d}  {r['cosine']:6.3f}  {r['stream_cosine']:10.3f}  "
                      f"{r['logit_std_experts']:7.4f}  {r['logit_std_tokens']:7.4f}  {r['logit_mean_std']:6.4f}  "
                      f"{r['load_max_over_mean']:8.2f}  {r['idle_experts']:4d}" for r in at["layers"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    a = parse(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = result_meta()

    def write(result: dict) -> None:
        write_result(out, {**meta, **result})

    result = probe(a.overrides, a.tokens, a.data.split(","), a.seed, a.steps, a.freeze, a.device, write)
    write(result)
    print(table(result))


if __name__ == "__main__":
    main()
