"""Muon for the matrices, AdamW for the rest: DeepSeek-V4's optimizer (``train.optimizer=muon``).

For each matrix ``W`` of ``n`` rows and ``m`` columns (``model/matrices.py`` says which parameters are matrices, and how
a stacked or grouped one splits into independent ones), with gradient ``G_t``:

    M_t = mu M_{t-1} + (1 - mu) G_t                  momentum, as an average
    O_t = NS(mu M_t + (1 - mu) G_t)                   Nesterov's look-ahead, orthogonalised by Newton-Schulz
    W_t = W_{t-1} (1 - lr wd) - lr * rms * sqrt(max(n, m)) * O_t

``NS`` maps a matrix ``U S V^T`` to about ``U V^T``: every singular value is driven to 1. The factor ``sqrt(max(n,
m))`` gives ``O_t`` an RMS of about ``rms`` per value, the size of a typical AdamW update, so that AdamW's learning
rate and weight decay carry over. ``rms`` is ``train.muon.update_rms``: 0.18 in DeepSeek-V4's report; Moonlight's
paper and torch's ``match_rms_adamw`` use 0.2.

Why it matters here (``docs/TRAINING_HEALTH.md``, issue 54): where every token's input to a matrix is nearly the same
vector ``x`` (attention near uniform at initialisation), the gradient is nearly the rank-one ``g x^T``. AdamW's first
steps are then about ``lr * sign(g) sign(x)^T``, and they move every token's output by ``lr * |x|_1 * sign(g)``: one
shift shared by all tokens, growing with the fan-in, which collapsed MoE routing with depth. Muon spreads the same
update RMS over all singular directions; a rank-one gradient gets a step of spectral norm ``lr * rms * sqrt(max(n,
m))``, and the shared shift it writes is smaller than AdamW's by about ``(0.8 / rms) sqrt(min(n, m))`` (0.8: the
mean of ``|x_i|`` over their RMS for Gaussian values): 70 times at 256 x 256 (``tests/parallel/test_muon.py``).

The Newton-Schulz iterations are DeepSeek-V4's hybrid schedule: 8 of the quintic whose coefficients (3.4445, -4.7750,
2.0315) raise small singular values fast (Keller Jordan's), which leaves them spread around 1, then 2 of (2, -1.5,
0.5), whose fixed point 1 has zero slope, to settle them there. They run in bf16 on a GPU, in fp32 on the CPU. A
matrix is normalised by its own Frobenius norm first, so the momentum's scale (average or sum) does not matter.

AdamW is torch's (fused on a GPU), stepping the groups without a ``matrix``; each group with one holds parameters
(or ZeRO row shards of them, cut at matrix boundaries: ``parallel/zero.py``) that read as ``[-1, rows, columns]``.
"""
import math

import torch

HYBRID_SCHEDULE = (((3.4445, -4.7750, 2.0315), 8), ((2.0, -1.5, 0.5), 2))  # ((a, b, c), iterations) in turn
EPS = 1e-7  # the Frobenius norm's floor: a zero gradient gives a zero update
BATCH_VALUES = 2 ** 28  # values orthogonalised in one call (1 GiB in fp32): bounds the step's extra memory


def orthogonalize(matrices: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """About ``U V^T`` of each ``U S V^T`` in ``matrices`` (``[..., rows, columns]``), in ``dtype`` (default: bf16 on a
    GPU, fp32 otherwise); returned in the input's dtype. Each step is ``X <- a X + (b A + c A^2) X`` with ``A = X
    X^T``, on the wide form of the matrix so that ``A`` is the smaller Gram matrix."""
    dtype = dtype or (torch.bfloat16 if matrices.is_cuda else torch.float32)
    tall = matrices.shape[-2] > matrices.shape[-1]
    x = matrices.to(dtype)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)  # every singular value <= 1
    for (a, b, c), iterations in HYBRID_SCHEDULE:
        for _ in range(iterations):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(matrices.dtype)


class MuonWithAdamW(torch.optim.AdamW):
    """One optimizer for the engine: AdamW over the groups whose ``matrix`` is None, Muon over the others (the module
    docstring). A group's ``lr`` and ``weight_decay`` mean the same in both, so the schedule sets every group alike.

    Muon's state per parameter is ``momentum_buffer``; a parameter whose saved state is AdamW's (a checkpoint of a run
    with ``train.optimizer=adamw``) is refused at its first step."""

    def __init__(self, groups: list[dict], *, lr: float, betas, eps: float, weight_decay: float, momentum: float,
                 update_rms: float, fused: bool | None = None, ns_dtype: torch.dtype | None = None):
        super().__init__(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=fused)
        for group in self.param_groups:
            group.setdefault("matrix", None)
        self.momentum, self.update_rms, self.ns_dtype = momentum, update_rms, ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = [g for g in groups if g["matrix"] is None]  # what AdamW's step iterates
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = groups
        for group in groups:
            if group["matrix"] is not None:
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        """The group's matrices (all of one shape) orthogonalised a batch at a time: a few large GEMMs instead of
        ten small ones per parameter and iteration, with at most ``BATCH_VALUES`` of them in flight."""
        rows, columns = group["matrix"]
        batch: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        values = 0
        for p in group["params"]:
            if p.grad is None:
                continue
            batch.append((p, self._look_ahead(p).reshape(-1, rows, columns)))
            values += p.numel()
            if values >= BATCH_VALUES:
                self._apply(group, batch)
                batch, values = [], 0
        if batch:
            self._apply(group, batch)

    def _look_ahead(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The momentum updated with ``p``'s gradient, and Nesterov's look-ahead from it."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            if state:
                raise ValueError(f"a matrix of shape {tuple(p.shape)} has AdamW's saved state ({sorted(state)}), "
                                 "not Muon's: resume with the checkpoint's train.optimizer, or start from its "
                                 "weights with train.init_from (a fresh optimizer)")
            state["momentum_buffer"] = torch.zeros_like(p)
        momentum = state["momentum_buffer"]
        momentum.lerp_(p.grad, 1 - self.momentum)
        return p.grad.lerp(momentum, self.momentum)

    def _apply(self, group: dict, batch: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        rows, columns = group["matrix"]
        lr = group["lr"]
        matrices = [m for _, m in batch]
        updates = orthogonalize(torch.cat(matrices), dtype=self.ns_dtype).split([m.shape[0] for m in matrices])
        scale = lr * self.update_rms * math.sqrt(max(rows, columns))
        for (p, _), update in zip(batch, updates):
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update.reshape(p.shape), alpha=-scale)
