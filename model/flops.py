"""Model FLOPs of a training step: what TFLOP/s and MFU are computed from (training metrics, bench/train_step.py).

Computed work only, forward + backward, activation recomputation not counted (the MFU convention):
- matmuls: 6 x params x tokens for every matrix applied per token (embedding lookup excluded, LM head included);
  the indexer's matrices 4 x (their inputs are detached: no input gradient); a frozen matrix (LoRA's base) 2 x
  fewer (no weight gradient is computed; ``passes``); ``wk`` per compressed entry (T/m);
  a MoE's routed experts only as the share a token activates (top-k of the experts), its gate and shared expert
  whole; Engram's table lookups and its elementwise gate weights excluded (not matmuls), its ``wkv`` counted; the
  hyper-connection mixes counted (one [mix, hc x D] matrix per sublayer and token), their collapse and expand
  not (elementwise); the draft head (``mtp.*``) only when the job trains it: its matrices per drafted token
  (``block_size`` a token), the shared head too.
- sparse attention: 4 x H x D per (query, visible slot) forward, x3 forward + backward; visible slots per query
  min(W, t+1) + min(K, (t+1)//m) (window-only layers: the first term).
- indexer scoring (no gradient): 2 x index heads x index dim per (query, entry scored): all (t+1)//m visible
  entries for a source without candidates, at most candidate blocks x block size for one restricted to them;
  the student logits on the K selected entries 2 x T x K x heads x dim, x3.
- dense attention (``model.attention=dense``, the baseline): 4 x H x ``dense_head_dim`` per causal pair T(T+1)/2
  forward, x3.
"""
import torch

from model.config import ModelArgs
from model.layout import Layout, Mode


def causal_slots(T: int, m: int, cap: int) -> int:
    """sum over t < T of min(cap, (t+1)//m): the entries a causal query sees, summed over the sequence."""
    below_cap = min(T, cap * m)  # queries t with (t+1)//m possibly below cap: t+1 in 1..below_cap
    q, r = divmod(below_cap + 1, m)  # sum of u//m over u = 0..below_cap
    return m * q * (q - 1) // 2 + r * q + (T - below_cap) * cap


def passes(name: str, p: torch.Tensor) -> int:
    """Matmul FLOPs per value of weight ``name`` and row it multiplies, in a training step: the forward 2, the
    gradient of its input 2 (not an indexer matrix's: its inputs are detached), the gradient of the weight 2 when it
    trains (``p.requires_grad``: LoRA's frozen base has none)."""
    return 2 + 2 * (".indexer." not in name) + 2 * p.requires_grad


def model_flops(model, layout: Layout, args: ModelArgs, T: int, B: int, dense: bool = False,
                dspark: bool = False, layers: range | None = None) -> dict[str, int]:
    """FLOPs of one forward + backward of ``B`` rows of ``T`` tokens through ``model`` (its parameters give the
    matmuls; the attention terms come from ``layout``), split into matmul, attention and indexer; ``dspark``: the
    draft head trains. ``layers``: the layers ``model`` holds when it is a slice of the stack (a pipeline stage,
    bench/v41_slice.py), whose attention terms alone count (default: every layer of the layout)."""
    tokens = B * T
    matmul = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.startswith("embed") or ".engram.embed." in name or name.endswith(("q_weight",
                                                                                                "k_weight")):
            continue
        drafting = name.startswith("mtp.")
        moe = args.dspark_moe if drafting else args.moe
        active = p.numel() * moe.n_activated_experts // moe.n_routed_experts if ".ffn.experts." in name else p.numel()
        if drafting:
            matmul += passes(name, p) * active * tokens * args.dspark.block_size if dspark else 0
        elif ".indexer.wk." in name:
            matmul += passes(name, p) * active * B * (T // layout.compress_ratios[int(name.split(".")[1])])
        else:
            matmul += passes(name, p) * active * tokens
    if dspark:
        matmul += passes("head.weight", model.head.weight) * model.head.weight.numel() * tokens * args.dspark.block_size
    attention = indexer = 0
    H, D, W, K = args.n_heads, args.head_dim, args.window_size, args.index_topk
    index_width = args.index_n_heads * args.index_head_dim
    plans = layout.plan if layers is None else [layout.plan[i] for i in layers]
    if dense:
        attention = len(plans) * 3 * 4 * H * args.dense_head_dim * B * T * (T + 1) // 2
    else:
        for plan in plans:
            slots = causal_slots(T, 1, W)
            if plan.mode is not Mode.WINDOW:
                slots += causal_slots(T, plan.ratio, K)
                if plan.selects:
                    scored = T if plan.candidate_source is None else \
                        layout.candidate_topk_blocks * layout.candidate_block_size
                    indexer += 2 * index_width * causal_slots(T, plan.ratio, scored) * B
                    indexer += 3 * 2 * index_width * causal_slots(T, plan.ratio, K) * B
            attention += 3 * 4 * H * D * slots * B
    return {"matmul": matmul, "attention": attention, "indexer": indexer, "total": matmul + attention + indexer}


def training_flops(args: ModelArgs, layout: Layout, seq_len: int, micro_batch: int, dspark: bool = False) -> int:
    """Model FLOPs of one microbatch of the whole model (built on the meta device: no memory, no init), with the
    attention ``model.attention`` names."""
    from model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args, layout)
    return model_flops(model, layout, args, seq_len, micro_batch, dense=args.attention == "dense",
                       dspark=dspark and args.dspark.blocks > 0)["total"]
