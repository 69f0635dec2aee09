"""The ``parallel`` settings against each other, the model, the row and the world: what their ranges and choices
(``model/config.py``) cannot say alone. Run once, when a job is planned (``parallel.job.plan``), before any process
group; each message names the setting and what works."""
from model.config import ModelArgs, ParallelConfig
from model.layout import Layout
from parallel.context import chunk_length


def check_parallel(parallel: ParallelConfig) -> None:
    """Recompute, kept attention and offload settings that only run together."""
    if parallel.recompute == "block" and parallel.recompute_layers is None:
        raise ValueError("parallel.recompute=block needs parallel.recompute_layers >= 1 (the leading layers of each "
                         "stage to recompute), got null")
    keep = parallel.keep_attention_layers
    counts = list(keep) if isinstance(keep, list) else [keep]
    if isinstance(keep, list) and len(counts) != parallel.pipeline_stages:
        raise ValueError(f"parallel.keep_attention_layers={keep} has {len(counts)} entries for "
                         f"parallel.pipeline_stages={parallel.pipeline_stages}: give one per stage")
    if any(counts) and parallel.recompute == "none":
        raise ValueError(f"parallel.keep_attention_layers={keep} keeps the attention outputs of recomputed layers, "
                         "but parallel.recompute=none recomputes none")
    if parallel.recompute_offload and parallel.recompute == "none":
        raise ValueError("parallel.recompute_offload=true keeps recomputed layers' inputs on the host, but "
                         "parallel.recompute=none recomputes none: use parallel.recompute=layer (or block)")


def check_experts(expert_parallel: int, args: ModelArgs, replicas: int) -> None:
    """``parallel.expert_parallel`` against the model and the ``replicas`` (C x D ranks) of a stage."""
    if expert_parallel == 1:
        return
    if args.ffn != "moe":
        raise ValueError(f"parallel.expert_parallel={expert_parallel} needs routed experts: model.ffn={args.ffn} has "
                         "none (use model.ffn=moe, or parallel.expert_parallel=1)")
    if replicas % expert_parallel:
        works = [e for e in range(1, replicas + 1) if replicas % e == 0]
        raise ValueError(f"parallel.expert_parallel={expert_parallel} does not divide the {replicas} data-parallel "
                         f"replica(s) of a stage (processes / parallel.pipeline_stages): use one of {works}, or more "
                         "processes")
    counts = [args.moe.n_routed_experts] + ([args.dspark.n_routed_experts] if args.dspark.blocks else [])
    if any(n % expert_parallel for n in counts):
        works = [e for e in range(1, replicas + 1) if replicas % e == 0 and all(n % e == 0 for n in counts)]
        raise ValueError(f"parallel.expert_parallel={expert_parallel} does not divide the routed experts "
                         f"({' and '.join(map(str, counts))}): use one of {works}")


def check_context(parallel: ParallelConfig, seq_len: int, args: ModelArgs, layout: Layout,
                  trains_dspark: bool) -> None:
    """``parallel.context_parallel`` against the row and the model, and ``parallel.head_chunk`` against the draft
    head (``trains_dspark``: the job trains it)."""
    context = parallel.context_parallel
    chunk_length(context, seq_len, args.window_size, layout.compress_ratios, layout.candidate_block_size)
    if context > 1 and trains_dspark:
        raise ValueError(f"parallel.context_parallel={context} cannot train the DSpark draft head (its blocks read the "
                         "tokens and logits after their anchor, in the next chunk): set train.dspark_loss_coef=0 or "
                         "parallel.context_parallel=1")
    if trains_dspark and parallel.head_chunk:
        raise ValueError("parallel.head_chunk cannot train the DSpark draft head (its loss reads the main logits at "
                         "its anchors): set train.dspark_loss_coef=0 or parallel.head_chunk=0")
    if context > 1 and args.attention == "dense":
        raise ValueError(f"parallel.context_parallel={context} splits CSA2 attention only: model.attention=dense "
                         "needs parallel.context_parallel=1")
