"""Every setting of a job, typed and documented: the schema of ``conf/`` and the model's dimensions.

Each config group of ``conf/`` has a dataclass here; ``JobConfig`` holds them all and is registered with Hydra
(``model.cli.register_schema``), so OmegaConf checks every value's type while Hydra composes. Each field carries its
documentation, and a number its valid range, a text its choices (``setting``); ``build`` checks them when a config
is turned into these objects, so a value out of range is one line naming the setting before anything is built.

- ``model``: ``ModelArgs`` (the reference config's names) and the preset's ``name`` (``ModelConfig``). The V4.1 parts
  around the attention (SPEC §5) each have a switch: ``ffn`` (``dense`` SwiGLU or the ``moe`` of ``MoEArgs``),
  ``hc_mult`` (1: the plain residual stream; 4: V4.1's hyper-connected copies), ``engram.layers`` (empty: no
  Engram) and ``dspark.blocks`` (0: no draft head), each with its settings as a nested group.
- ``layout``: the knobs and lists ``model.layout.layout_from_config`` expands into a ``Layout`` (``LayoutConfig``).
- ``train``, ``data``, ``parallel``, ``logger``: ``TrainConfig``, ``DataConfig``, ``ParallelConfig``,
  ``LoggerConfig``.

A group whose values come only from ``conf/`` declares no defaults (the YAML is the one place a value is written);
the args classes that are also built in code (``ModelArgs``, ``DataConfig``, ``LoRA``) keep theirs.
"""
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from typing import Any, get_type_hints

from model.engram_layout import table_rows

SCORE_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
LORA_ATTENTION = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
LORA_TARGETS = (*LORA_ATTENTION, "shared_experts", "experts", "dense_ffn")
SYNTHETIC_TASKS = ("mqar", "passkey", "copy")
SAMPLE_BY = ("auto", "document", "paragraph", "line")  # data.sample_by
P2P = ("overlap", "deepspeed")  # parallel.p2p: the engine's boundary transfers (parallel/engine.py)


class SettingError(ValueError):
    """A setting whose value is outside what its field allows; the message names the setting and the fix."""


@dataclass(frozen=True)
class Range:
    """The numbers a setting (or each number of a list or mapping setting) may take."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # > low (else >= low)
    high_open: bool = False  # < high (else <= high)

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        above = self.low is None or value > self.low or (value == self.low and not self.low_open)
        below = self.high is None or value < self.high or (value == self.high and not self.high_open)
        return above and below

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}" \
                   f"{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return f"{'<' if self.high_open else '<='} {_number(self.high)}"


def setting(doc: str, default=MISSING, *, ge=None, gt=None, le=None, lt=None, choices: tuple = (),
            one_or_list: bool = False, kw_only: bool = False):
    """A schema field: what it does (``doc``), its default (none: the preset YAML gives the value), the range of a
    number (``ge``/``gt``/``le``/``lt``; for a list or mapping, of each number in it), the values a text may take
    (``choices``), and ``one_or_list`` for a whole number or a list of them (typed ``Any``: OmegaConf has no union
    of a number and a list)."""
    metadata = {"doc": doc, "choices": tuple(choices), "one_or_list": one_or_list}
    if (ge, gt, le, lt) != (None,) * 4:
        metadata["range"] = Range(gt if gt is not None else ge, lt if lt is not None else le, gt is not None,
                                  lt is not None)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, kw_only=kw_only)
    return field(default=default, metadata=metadata, kw_only=kw_only)


# ---------------------------------------------------------------------------------------------------- model

@dataclass(frozen=True)
class MoEArgs:
    """The routed + shared experts of a MoE FFN (SPEC §5.1)."""
    n_routed_experts: int = setting("routed experts of every MoE layer", 384, ge=1)
    n_activated_experts: int = setting("experts each token is routed to (top-k), <= n_routed_experts", 6, ge=1)
    n_shared_experts: int = setting("shared experts every token passes through: 0 or 1 (V4.1 has one)", 1, ge=0,
                                    le=1)
    inter_dim: int = setting("hidden width of every expert, routed and shared", 2304, ge=1)
    score_func: str = setting("gate scores: sqrtsoftplus (V4.1), softmax or sigmoid", "sqrtsoftplus",
                              choices=SCORE_FUNCS)
    gate_temp: float = setting("temperature the gate logits are divided by", 1.0, gt=0)
    norm_topk_prob: bool = setting("renormalise the chosen experts' weights to sum to 1", True)
    route_scale: float = setting("factor on the routed experts' weighted sum", 1.5, gt=0)
    swiglu_limit: float = setting("clamp of the experts' SwiGLU inputs; 0: no clamp", 10.0, ge=0)
    bias_update_rate: float = setting("auxiliary-loss-free balance: the routing bias's step after every optimizer "
                                      "step; 0: the bias stays", 0.001, ge=0)

    def check(self, where: str = "model.moe") -> None:
        if self.n_activated_experts > self.n_routed_experts:
            raise ValueError(f"{where}.n_activated_experts={self.n_activated_experts} (top-k) must be in 1.."
                             f"{where}.n_routed_experts={self.n_routed_experts}")


@dataclass(frozen=True)
class EngramArgs:
    """Hashed n-gram memories added to the stream before some blocks (SPEC §5.3); no ``layers``: none."""
    layers: tuple[int, ...] = setting("layers whose input takes an Engram update; []: no Engram", (), ge=0)
    num_embeddings: tuple[int, ...] = setting("table rows per Engram layer (checked against the bucket primes); []: "
                                              "computed from the buckets", (), ge=1)
    max_ngram_size: int = setting("n-grams of sizes 2..max_ngram_size end at every position", 4, ge=2)
    vocab_size: int = setting("each (n-gram size, head) takes the next unused prime above this as its buckets",
                              16_000_000, ge=1)
    n_heads: int = setting("hash heads per n-gram size", 8, ge=1)
    head_dim: int = setting("width of a table row", 256, ge=1)
    pad_id: int = setting("token id whose normalised id fills look-back slots before a document's start", 2, ge=0)
    compressed_vocab_size: int | None = setting(
        "normalised ids of the tokenizer the tables were hashed with (the released 99092): every hash multiplier "
        "depends on it, so a data tokenizer that normalises to another count is refused; null: not checked", None,
        ge=1)
    train: bool = setting("false: the tables are frozen (no gradient, no optimizer state)", True)

    def __post_init__(self):
        for name in ("layers", "num_embeddings"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))


@dataclass(frozen=True)
class DSparkArgs:
    """The speculative draft head (``mtp.*``, SPEC §5.4); ``blocks`` 0: none."""
    blocks: int = setting("draft blocks; 0: no draft head", 0, ge=0)
    block_size: int = setting("tokens drafted at once: the sampled token and block_size - 1 noise tokens", 5, ge=2)
    target_layers: tuple[int, ...] = setting("the streams entering these layers are its features", (37, 38, 39),
                                             ge=0)
    markov_rank: int = setting("rank of its Markov head", 256, ge=1)
    noise_token_id: int = setting("the token that fills a draft block after its first token", 128799, ge=0)
    n_routed_experts: int = setting("routed experts of its MoE FFNs (the main MoE's other settings)", 128, ge=1)
    n_activated_experts: int = setting("experts each token is routed to in its MoE FFNs", 3, ge=1)

    def __post_init__(self):
        object.__setattr__(self, "target_layers", tuple(int(v) for v in self.target_layers))


@dataclass(frozen=True)
class ModelArgs:
    """The model's dimensions and parts, under the reference config's names (``config.json`` of an export)."""
    vocab_size: int = setting("tokens of the embedding and the LM head (>= the data tokenizer's)", 259, ge=1)
    dim: int = setting("width of the residual stream", 5120, ge=1)
    n_heads: int = setting("attention heads", 64, ge=1)
    head_dim: int = setting("the latent width: one vector is both K and V", 512, ge=1)
    rope_head_dim: int = setting("RoPE acts on the last rope_head_dim dims of q, KV and index q/k (even)", 64, ge=0)
    q_lora_rank: int = setting("rank of the query's low-rank projection", 1280, ge=1)
    o_groups: int = setting("groups of heads of the grouped output projection (divides n_heads)", 8, ge=1)
    o_lora_rank: int = setting("rank of each output group's projection", 1024, ge=1)
    window_size: int = setting("tokens of the sliding window (the query's own included)", 128, ge=1)
    index_n_heads: int = setting("heads of the lightning indexer", 32, ge=1)
    index_head_dim: int = setting("width of an indexer head", 128, ge=1)
    index_topk: int = setting("compressed entries each query selects", 512, ge=1)
    inter_dim: int = setting("hidden width of the dense SwiGLU FFN (ffn=dense)", 12288, ge=1)
    norm_eps: float = setting("RMSNorm epsilon", 1e-20, gt=0)
    rope_theta: float = setting("RoPE base of the window-only layers", 10000.0, gt=0)
    compress_rope_theta: float = setting("RoPE base of every rotation of a layer with a global branch", 160000.0,
                                         gt=0)
    rope_factor: float = setting("YaRN factor, applied to compressed layers only", 16.0, gt=0)
    original_seq_len: int = setting("YaRN's base length; 0: no YaRN", 65536, ge=0)
    beta_fast: float = setting("YaRN's fast boundary (rotations per original length)", 32.0, gt=0)
    beta_slow: float = setting("YaRN's slow boundary", 1.0, gt=0)
    init_std: float = setting("init std of the matrices (residual-branch outputs scaled by 1/sqrt(2 n_layers))",
                              0.006, ge=0)
    embed_init_std: float = setting("init std of the embedding: the residual stream's scale at init", 1.0, ge=0)
    head_init_std: float = setting("init std of the LM head", 0.006, ge=0)
    kernel_backend: str = setting("auto | torch | triton (kernels/__init__.py)", "auto",
                                  choices=("auto", "torch", "triton"))
    qat: bool = setting("simulate the served FP8/FP4 attention activations in the forward (model/qat.py)", False)
    attention: str = setting("csa2, or dense: the dense causal baseline of model/dense.py (with "
                             "layout=window_only)", "csa2", choices=("csa2", "dense"))
    dense_head_dim: int = setting("head width of the dense baseline (n_heads of them)", 128, ge=1)
    ffn: str = setting("dense (SwiGLU of inter_dim) or moe (moe.*)", "dense", choices=("dense", "moe"))
    moe: MoEArgs = setting("the MoE FFN (ffn=moe)", MoEArgs())
    hc_mult: int = setting("copies of the residual stream; 1: no hyper-connections", 1, ge=1)
    hc_sinkhorn_iters: int = setting("Sinkhorn iterations of the hyper-connections' mixing matrix", 20, ge=1)
    hc_eps: float = setting("epsilon of the hyper-connections' Sinkhorn normalisation", 1e-6, gt=0)
    engram: EngramArgs = setting("the Engram memories (engram.layers non-empty)", EngramArgs())
    dspark: DSparkArgs = setting("the DSpark draft head (dspark.blocks > 0)", DSparkArgs())

    def __post_init__(self):
        if self.n_heads % self.o_groups:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.o_groups={self.o_groups}")
        for name in ("head_dim", "index_head_dim"):
            if self.rope_head_dim > getattr(self, name) or self.rope_head_dim % 2:
                raise ValueError(f"model.rope_head_dim={self.rope_head_dim} must be even and <= model.{name}")
        if self.ffn == "moe":
            self.moe.check()
        if self.dspark.blocks:
            self.dspark_moe.check("model.dspark")
            if not self.dspark.target_layers:
                raise ValueError("model.dspark.target_layers is empty: DSpark reads the streams of >= 1 layer")
            if not 0 <= self.dspark.noise_token_id < self.vocab_size:
                raise ValueError(f"model.dspark.noise_token_id={self.dspark.noise_token_id} is outside the vocabulary "
                                 f"[0, model.vocab_size={self.vocab_size}): use a token id the model has")
        given = self.engram.num_embeddings
        if self.engram.layers and given and len(given) != len(self.engram.layers):
            raise ValueError(f"model.engram.num_embeddings={list(given)} needs one row count per Engram layer "
                             f"(model.engram.layers={list(self.engram.layers)}), or [] to compute them")
        if self.engram.layers and given:
            if tuple(given) != table_rows(self.engram):
                raise ValueError(f"model.engram.num_embeddings={list(given)} disagrees with the rows its bucket layout "
                                 f"gives, {list(table_rows(self.engram))}: set those, or [] to compute them")
        if self.engram.layers and not 0 <= self.engram.pad_id < self.vocab_size:
            raise ValueError(f"model.engram.pad_id={self.engram.pad_id} is outside the vocabulary "
                             f"[0, model.vocab_size={self.vocab_size}): use the tokenizer's padding id")

    @property
    def dspark_moe(self) -> MoEArgs:
        """The MoE of the DSpark blocks: ``moe`` with DSpark's expert counts (the reference's ``get_moe_config``)."""
        return replace(self.moe, n_routed_experts=self.dspark.n_routed_experts,
                       n_activated_experts=self.dspark.n_activated_experts)

    def check_stack(self, n_layers: int) -> None:
        """The rules that need the layout's depth: Engram layers and DSpark targets inside the stack."""
        for name, ids in (("model.engram.layers", self.engram.layers),
                          ("model.dspark.target_layers", self.dspark.target_layers if self.dspark.blocks else ())):
            outside = [i for i in ids if not 0 <= i < n_layers]
            if outside:
                raise ValueError(f"{name}={list(ids)} names layer(s) {outside} outside the stack's layers "
                                 f"0..{n_layers - 1}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{name}={list(ids)} names a layer twice")

    @classmethod
    def from_config(cls, values: Mapping) -> "ModelArgs":
        """From a ``model`` group (a saved run's config, a dict; its ``name`` is not a dimension); unknown keys and
        values out of range are an error that names them."""
        return build(cls, {k: v for k, v in values.items() if k != "name"}, "model")


@dataclass(frozen=True)
class ModelConfig(ModelArgs):
    """The ``model`` group: ``ModelArgs`` and the preset's name."""
    name: str = setting("the preset (conf/model/<name>.yaml): in run names, tags and reports", kw_only=True)

    @property
    def args(self) -> ModelArgs:
        """The dimensions alone."""
        return ModelArgs(**{f.name: getattr(self, f.name) for f in fields(ModelArgs)})


# --------------------------------------------------------------------------------------------------- layout

@dataclass
class EncoderConfig:
    """``layout.encoder``: compressed layers in groups, each group one Full layer and Reuse layers."""
    layers: int = setting("layers of the encoder", ge=0)
    group_size: int = setting("layers per group (its first computes KV and selection, the others reuse them)", ge=1)
    ratio: int = setting("compression ratio m of the encoder's layers", ge=1)


@dataclass
class DecoderConfig:
    """``layout.decoder``: compressed layers after the encoder, one Full layer first."""
    layers: int = setting("layers of the decoder", ge=0)
    ratio: int = setting("compression ratio m of the decoder's layers", ge=1)
    reindex_every: int = setting("a Reindex layer (the Full layer's KV, its own selection) every this many layers; "
                                 "0: never", ge=0)
    full_every: int = setting("a new Full layer every this many layers; 0: only the first", ge=0)


@dataclass
class LayoutConfig:
    """The ``layout`` group: knobs that generate the reference config's lists (``model.layout.generate``); a list
    given explicitly (not null) replaces what the knobs generate."""
    name: str = setting("the preset (conf/layout/<name>.yaml): in run names, tags, groups and reports")
    window_layers: int = setting("window-only layers at the bottom of the stack", ge=0)
    encoder: EncoderConfig = setting("the encoder's layers")
    decoder: DecoderConfig = setting("the decoder's layers")
    candidates: bool = setting("the decoder's first Full layer makes candidate blocks for the later index sources")
    candidate_topk_blocks: int = setting("candidate blocks kept per query", ge=1)
    candidate_block_size: int = setting("compressed entries per candidate block", ge=1)
    compress_ratios: list[int] | None = setting("the ratio of every layer (0: window only); null: from the knobs",
                                                ge=0)
    kv_source_layer_ids: list[int] | None = setting("the Full layers; null: from the knobs", ge=0)
    index_source_layer_ids: list[int] | None = setting("the Full and Reindex layers; null: from the knobs", ge=0)
    candidate_source_layer_id: int | None = setting("the layer that makes candidate blocks; null: from the knobs",
                                                    ge=0)


# ---------------------------------------------------------------------------------------------------- train

@dataclass(frozen=True)
class Muon:
    """``train.muon`` (``parallel/muon.py``): the matrices' optimizer under ``train.optimizer=muon``."""
    momentum: float = setting("decay of the momentum average (Nesterov's look-ahead uses it too)", 0.95, ge=0, lt=1)
    update_rms: float = setting("RMS of a matrix's orthogonalised update per unit of lr, matched to AdamW's so that "
                                "its lr and weight decay carry over: 0.18 in DeepSeek-V4, 0.2 in Moonlight", 0.18,
                                gt=0)


@dataclass(frozen=True)
class LoRA:
    """``train.lora`` (``model/lora.py``): ``rank`` 0 is off; ``alpha`` scales the update by ``alpha / rank``."""
    rank: int = setting("rank of every adapter; 0: off (full fine-tuning). > 0 freezes the whole base (train."
                        "init_from's weights, required) and trains y = W x + (alpha / rank) B A x", 0, ge=0)
    alpha: float = setting("scale of the update: alpha / rank", 16.0, gt=0)
    targets: tuple[str, ...] = setting(
        "the adapted matrices of every block: wq_a, wq_b, wkv, wo_a, wo_b (attention projections), shared_experts, "
        "experts (every routed expert's w1, w2, w3; a multiple-of-8 rank with CUDA's grouped GEMM), dense_ffn",
        LORA_ATTENTION)
    quantized_base: bool = setting(
        "keep the frozen base's matrices in the released FP8 (attention, shared experts) / FP4 (routed experts) form "
        "and multiply on those bytes (model/quantized_base.py): about 1.03 / 0.53 bytes a value instead of bf16's 2; "
        "needs train.init_from a released directory", False)

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, values: Mapping | None) -> "LoRA | None":
        """The settings of a ``train.lora`` mapping (a saved run's config), checked; None when it is absent or its
        rank is 0."""
        lora = build(cls, values, "train.lora") if values is not None else None
        if lora is not None:
            lora.check()
        return lora if lora is not None and lora.rank else None

    def check(self, args: ModelArgs | None = None) -> None:
        """The targets are distinct known names; with ``args``, ones this model has."""
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) < len(self.targets):
            raise ValueError(f"train.lora.targets={list(self.targets)}: use a non-empty list of distinct names from "
                             f"{list(LORA_TARGETS)}" + (f" ({', '.join(map(repr, unknown))} unknown)" if unknown else ""))
        if args is None:
            return
        missing = {"dense_ffn": args.ffn != "dense", "experts": args.ffn != "moe",
                   "shared_experts": args.ffn != "moe" or not args.moe.n_shared_experts,
                   **{t: args.attention != "csa2" for t in LORA_ATTENTION}}
        absent = [t for t in self.targets if missing[t]]
        if absent:
            raise ValueError(f"train.lora.targets: this model (model.ffn={args.ffn}, model.attention={args.attention}"
                             f", {args.moe.n_shared_experts if args.ffn == 'moe' else 0} shared expert(s)) has no "
                             f"{', '.join(absent)} — leave {'it' if len(absent) == 1 else 'them'} out")


@dataclass
class EvalConfig:
    """``train.eval``: the held-out loss every ``every`` steps and at the end; the retrieval probes at the end."""
    every: int = setting("steps between evaluations; 0: only at the end", ge=0)
    batches: int = setting("held-out micro-batches per rank", ge=1)
    probe_examples: int = setting("passkey and MQAR samples each, at every probe length; 0: no probes", ge=0)
    probe_lens: list[int] | None = setting("context lengths of the probes, e.g. [2048, 8192]; null: data.seq_len "
                                           "and twice it", ge=1)
    probe_seed: int = setting("seed of the probes' samples", ge=0)
    mqar_pairs: int = setting("key-value pairs of an MQAR probe", ge=1)
    mqar_queries: int = setting("questions of an MQAR probe", ge=1)


@dataclass
class TrainConfig:
    """The ``train`` group: the training loop (``train/run/app.py``), AdamW (or Muon) with linear warm-up and cosine
    decay, the loss weights, evaluation, checkpoints and where the weights start."""
    seed: int = setting("seeds the initial weights (with their names), Python, NumPy and torch", ge=0)
    device: str = setting("auto (the local GPU if any, else the CPU), cpu or cuda", choices=("auto", "cpu", "cuda"))
    precision: str = setting("auto (bf16 autocast on GPU, fp32 on CPU), bf16 or fp32",
                             choices=("auto", "bf16", "fp32"))
    max_steps: int = setting("the schedule's length in optimizer steps", ge=1)
    stop_at: int | None = setting("stop (with a checkpoint) at this step although the schedule runs to max_steps; "
                                  "null: at max_steps", ge=1)
    global_batch_size: int | None = setting(
        "rows per optimizer step over all data-parallel replicas (= data.micro_batch_size x microbatches x "
        "replicas); null: from grad_accum_steps", ge=1)
    grad_accum_steps: int | None = setting("microbatches of each pipeline per step; null (and no global_batch_size): "
                                           "one per pipeline stage", ge=1)
    lr: float = setting("peak learning rate, reached after warmup_steps (0: the weights stay)", ge=0)
    min_lr_ratio: float = setting("the cosine decays to min_lr_ratio x lr at max_steps (1: constant)", ge=0, le=1)
    warmup_steps: int = setting("steps of the linear warm-up from lr / warmup_steps", ge=0)
    optimizer: str = setting("adamw, or muon: Muon for the matrices, AdamW for the embedding, head, norms and "
                             "biases (parallel/muon.py, DeepSeek-V4's split)", choices=("adamw", "muon"))
    weight_decay: float = setting("decoupled weight decay, on matrices only (AdamW's and Muon's)", ge=0)
    betas: list[float] = setting("AdamW's two moment decays [beta1, beta2]", ge=0, lt=1)
    eps: float = setting("AdamW's epsilon", gt=0)
    grad_clip: float = setting("clip the global gradient norm to this (per clipping group); 0: no clipping", ge=0)
    indexer_loss_coef: float = setting("weight of the summed indexer KLs (they reach the indexer parameters only)",
                                       ge=0)
    dspark_loss_coef: float = setting("weight of the draft head's loss (it reaches the draft head only); 0: the head "
                                      "is built, loaded and exported but never run", ge=0)
    log_every: int = setting("steps between rows of metrics.jsonl (step 1 always has one)", ge=1)
    peak_tflops: float = setting("one GPU's bf16 dense matmul peak, MFU's denominator (989: H100 / H200 SXM spec)",
                                 gt=0)
    progress: bool = setting("a tqdm bar on rank 0")
    eval: EvalConfig = setting("evaluation")
    checkpoint_every: int = setting("steps between checkpoints (and at the last step); 0: none", ge=0)
    checkpoint_dir: str | None = setting("where checkpoints go; null: <run dir>/checkpoints")
    keep_checkpoints: int = setting("newest complete checkpoints kept; 0: all", ge=0)
    checkpoint_async: bool = setting("write checkpoints in a background thread while the next steps run (the state is "
                                     "copied to CPU memory first); false: the step waits for the write")
    resume: str | None = setting("null, auto (newest in checkpoint_dir, else fresh) or a checkpoint dir or tag dir")
    init_from: str | None = setting(
        "start from trained weights (weights only: fresh optimizer, schedule and data): a checkpoint of ours, an "
        "exported dir (python -m train.export) or DeepSeek's released dir; a checkpoint found by resume wins")
    init_strict: bool = setting("false: keep the seeded init of tensors the source lacks, ignore those this model "
                                "lacks (listed)")
    max_bad_steps: int = setting("stop after this many non-finite steps in a row (each one is skipped)", ge=1)
    startup_timeout_s: float = setting("seconds any collective may wait until the first step is done (start-up, "
                                       "loading a checkpoint, the first step's compilation)", gt=0)
    collective_timeout_s: float = setting("seconds any collective may wait from the second step on: a stopped or "
                                          "stuck rank then ends the job with a line naming the step and the rank "
                                          "that waited", gt=0)
    lora: LoRA = setting("LoRA fine-tuning (model/lora.py)", LoRA())
    muon: Muon = setting("Muon's settings (train.optimizer=muon)", Muon())


# ----------------------------------------------------------------------------------------------------- data

def span(value, name: str) -> tuple[int, int]:
    """``[lo, hi]`` (or one int, meaning ``[n, n]``) of ``data.synthetic.<name>`` as an inclusive range."""
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    if not 0 <= lo <= hi:
        raise ValueError(f"data.synthetic.{name} must be an int or a range [lo, hi] with 0 <= lo <= hi, got {value}")
    return int(lo), int(hi)


@dataclass(frozen=True)
class SyntheticConfig:
    """``data.synthetic``: the trainable retrieval tasks (``train/data/synthetic.py``)."""
    tasks: dict[str, float] = setting("share of the synthetic rows per task: mqar, passkey, copy",
                                      {"mqar": 1.0, "passkey": 0.0, "copy": 0.0}, ge=0)
    eval_examples: int = setting("held-out examples per task, scored at every evaluation", 256, ge=0)
    keys: str = setting("one token each: MQAR keys (and copy symbols)", "abcdefghijklmnop")
    values: str = setting("MQAR values (and copy symbols); chance = 1 / len(values)", "ABCDEFGHIJKLMNOP")
    digits: str = setting("passkey digits", "0123456789")
    filler: str = setting("what fills the room between facts", " ")
    markers: str = setting("the start of a fact (passkey needle, copy block) and of its repeat", "#=")
    pairs: Any = setting("mqar: keys per example, an int or [lo, hi] (distinct keys, values drawn independently)",
                         (12, 16), ge=1, one_or_list=True)
    spacing: Any = setting("mqar: filler tokens before each record, an int or [lo, hi]", 0, ge=0, one_or_list=True)
    distance: Any = setting("mqar: a question's key was last written this many tokens back, an int or [lo, hi]",
                            (12, 64), ge=0, one_or_list=True)
    align: int = setting("mqar: records start at multiples of this position (2: one per ratio-2 entry)", 2, ge=1)
    passkey_digits: int = setting("passkey: digits of the key", 5, ge=1)
    copy_length: Any = setting("copy: symbols per block, an int or [lo, hi]", (8, 48), ge=1, one_or_list=True)
    loss: str = setting("what the training loss counts: answers (the retrieved symbols) or all (every next token)",
                        "answers", choices=("answers", "all"))

    def __post_init__(self):
        for name in ("pairs", "spacing", "distance", "copy_length"):
            value = getattr(self, name)
            object.__setattr__(self, name, value if isinstance(value, int) else tuple(value))
            span(value, name)
        unknown = sorted(set(self.tasks) - set(SYNTHETIC_TASKS))
        if unknown or not self.tasks or min(self.tasks.values()) < 0 or sum(self.tasks.values()) <= 0:
            raise ValueError(f"data.synthetic.tasks must map some of {SYNTHETIC_TASKS} to non-negative shares with a "
                             f"positive sum, got {dict(self.tasks)}")

    @classmethod
    def from_mapping(cls, values: Mapping) -> "SyntheticConfig":
        """From ``data.synthetic`` (plain containers); an unknown key or a value out of range is an error that
        names it."""
        return build(cls, values, "data.synthetic")

    @property
    def active_tasks(self) -> list[str]:
        """Tasks with a positive share, in ``SYNTHETIC_TASKS`` order."""
        return [task for task in SYNTHETIC_TASKS if self.tasks.get(task, 0) > 0]


@dataclass
class DataConfig:
    """The ``data`` group: the arguments of ``train.data.loader.build_loader``."""
    source: str = setting("stdlib: this interpreter's *.py files; hf: any datasets source (path)", "stdlib",
                          choices=("stdlib", "hf"))
    path: str | None = setting("stdlib: root of the *.py files (null: the stdlib); hf: a file or directory of "
                               ".txt/.md/.jsonl/.json/.parquet/.csv, or a dataset name", None)
    name: str | None = setting("hf: the dataset's config name", None)
    split: str = setting("hf: the split to read", "train")
    text_field: str = setting("hf: the column holding the document text", "text")
    sample_by: str = setting("hf text files: one document per file (document), paragraph or line; auto: per file, "
                             "but a single file per paragraph (per line if it has no blank line)", "auto",
                             choices=SAMPLE_BY)
    format: str = setting("hf fine-tuning data (train/data/sft.py): text, chat or prompt_response (loss on responses "
                          "only); auto: text if text_field is a column, else chat if messages_field is, else "
                          "prompt_response", "auto", choices=("auto", "text", "chat", "prompt_response"))
    messages_field: str = setting("hf chat data: the column of [{role, content}, ...]", "messages")
    prompt_field: str = setting("hf prompt_response data: the prompt column", "prompt")
    response_field: str = setting("hf prompt_response data: the response column", "response")
    streaming: bool = setting("read through a datasets.IterableDataset with a seeded buffer shuffle", False)
    shuffle_buffer: int = setting("streaming: documents in the shuffle buffer", 10_000, ge=1)
    tokenizer: str | None = setting("a tokenizers JSON file; null: byte-level (bytes 0-255, BOS 256, EOS 257, PAD "
                                    "258)", None)
    bos_token: str | None = setting("special token names in that file; null: tokenizer_config.json's, else guessed",
                                    None)
    eos_token: str | None = setting("see bos_token", None)
    pad_token: str | None = setting("see bos_token", None)
    seq_len: int = setting("tokens of a row (>= the layout's largest compression ratio)", 2048, ge=1)
    micro_batch_size: int = setting("rows per microbatch", 4, ge=1)
    shuffle_seed: int = setting("seed of the document order, the packing and the synthetic tasks", 0, ge=0)
    heldout_fraction: float = setting("documents whose key hashes below this are the held-out set", 0.05, ge=0, le=1)
    pack_buffer: int = setting("rows' worth of tokens packed best-fit together", 256, ge=1)
    pack_carry: int = setting("least-full rows of a buffer held back and refilled by the next one", 64, ge=0)
    synthetic_fraction: float = setting("share of rows that are synthetic retrieval tasks; 1: the text source is "
                                        "not read", 0.0, ge=0, le=1)
    synthetic: SyntheticConfig = setting("the synthetic tasks", SyntheticConfig())


# ------------------------------------------------------------------------------------------------- parallel

@dataclass
class ParallelConfig:
    """The ``parallel`` group: pipeline stages (data parallelism takes the rest of the launched processes), the
    split, transfers, recompute, ZeRO, and expert and context parallelism (docs/PARALLELISM.md)."""
    pipeline_stages: int = setting("pipeline stages", ge=1)
    cuts: list[int] | None = setting("explicit stage starts, e.g. [10,20,30]; null: split by the cost model at "
                                     "data.seq_len", ge=1)
    layer_times: str | None = setting("measured time of each layer mode (a JSON of bench/multigpu.py, same model, "
                                      "seq_len, micro-batch and recompute): the split balances these instead of FLOPs")
    index_k: str = setting("shadow: later stages recompute index keys with replicas of wk/k_norm; payload: send them",
                           choices=("shadow", "payload"))
    p2p: str = setting("boundary transfers: overlap (asynchronous, batched, own process groups, parallel/p2p.py) or "
                       "deepspeed (blocking)", choices=P2P)
    recompute: str = setting("none, layer (activation checkpointing of every layer) or block (of the first "
                             "recompute_layers layers of every stage)", choices=("none", "layer", "block"))
    recompute_layers: int | None = setting("recompute=block: leading layers of each stage that recompute", ge=1)
    recompute_offload: bool = setting("with recompute: each recomputed layer's input waits in pinned host memory "
                                      "(model/offload.py); bit-identical, for PCIe copies")
    head_chunk: int = setting("tokens per chunk of the LM head and its loss on the last stage (train/loss.py); 0: "
                              "the whole microbatch's logits at once (the draft head needs 0)", ge=0)
    keep_attention_layers: Any = setting(
        "of the recomputed layers, how many leading ones of each stage keep their attention output and LSE (their "
        "backward does not re-run attention); a list gives each stage its own count", ge=0, one_or_list=True)
    zero_stage: int = setting("1: ZeRO stage 1, the optimizer state partitioned over each stage's data-parallel "
                              "ranks (parallel/zero.py; bitwise the updates of 0); 0: replicated", ge=0, le=1)
    check_memory: bool = setting("refuse a job whose estimated peak memory exceeds the GPU's (or the host's RAM); "
                                 "false: warn and run")
    expert_parallel: int = setting("data-parallel replicas of a stage that split every MoE layer's routed experts; "
                                   "1: every replica holds every expert", ge=1)
    expert_overlap: bool = setting("with expert parallelism, run the shared expert while the routed slots travel")
    context_parallel: int = setting("ranks that split each row into contiguous chunks (parallel/context.py); 1: "
                                    "whole rows on every rank", ge=1)


@dataclass
class LoggerConfig:
    """The ``logger`` group: the job's wandb run (``train/observe/metrics.py``)."""
    mode: str = setting("offline (no account: wandb sync <run dir>/wandb/offline-run-*), online or disabled",
                        choices=("offline", "online", "disabled"))
    project: str = setting("wandb project")
    entity: str | None = setting("wandb entity (team); null: the account's default")
    name: str | None = setting("run name; null: <model>-<layout>-<run dir name>")
    group: str | None = setting("run group; null: the layout and the job's layout.* overrides")
    tags: list[str] = setting("tags; the layout and model names are always added")
    plots: bool = setting("draw the run's PNGs from metrics.jsonl when the job ends (loss_curve, health, layers, "
                          "experts); false: metrics.jsonl and wandb only")


@dataclass
class JobConfig:
    """A whole job: one field per config group of ``conf/``."""
    model: ModelConfig = setting("the model (conf/model)")
    layout: LayoutConfig = setting("which layers are window, Full, Reindex or Reuse (conf/layout)")
    train: TrainConfig = setting("the training loop (conf/train)")
    data: DataConfig = setting("corpus, tokenizer and batch geometry (conf/data)")
    logger: LoggerConfig = setting("the wandb run (conf/logger)")
    parallel: ParallelConfig = setting("parallelism and memory (conf/parallel)")


# ------------------------------------------------------------------------------------------------- building

def build(cls, values: Mapping, where: str):
    """A schema dataclass from a mapping (plain containers): nested dataclass fields from mappings of their own,
    every value checked against its field's range and choices first. An unknown key or a value out of range is a
    ``SettingError`` naming the setting (``where``: the group's dotted path)."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise SettingError(f"unknown setting(s) {[_key(where, k) for k in unknown]} — known: "
                           f"{sorted(_key(where, k) for k in known)}")
    types = get_type_hints(cls)
    built = {}
    for name, value in values.items():
        kind, key = types[name], _key(where, name)
        if is_dataclass(kind) and isinstance(value, Mapping):
            built[name] = build(kind, value, key)
        else:
            check_value(key, value, known[name])
            built[name] = value
    return cls(**built)


def check_value(key: str, value, spec: dataclasses.Field) -> None:
    """``value`` of setting ``key`` against the range or choices ``setting`` declared for it."""
    allowed, choices = spec.metadata.get("range"), spec.metadata.get("choices")
    if choices and value not in choices:
        raise SettingError(f"{key}={value!r} is not a choice — use one of {', '.join(map(str, choices))}")
    if allowed is None or value is None:
        return
    items = list(value.items()) if isinstance(value, Mapping) else list(enumerate(value, 1)) \
        if isinstance(value, Sequence) and not isinstance(value, str) else None
    if items is None:
        if _is_number(value) and not allowed.holds(value):
            raise SettingError(f"{key}={_number(value)} is out of range — set {_noun(value)} {allowed}")
        return
    for where, item in items:
        if _is_number(item) and not allowed.holds(item):
            part = f"element {where}" if isinstance(where, int) else where
            raise SettingError(f"{key}={_shown(value)} has {part} = {_number(item)}, out of range — set each to "
                               f"{_noun(item)} {allowed}")


def apply(config, changes: Mapping[str, Any]):
    """``config`` (a schema dataclass) with dotted settings changed, e.g. ``{"parallel.recompute": "layer",
    "model.moe.inter_dim": 64}``; the changed objects are rebuilt, so their checks run again."""
    grouped: dict[str, dict] = {}
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        grouped.setdefault(head, {})[rest] = value
    updates = {}
    for head, values in grouped.items():
        updates[head] = values[""] if "" in values else apply(getattr(config, head), values)
    return replace(config, **updates)


def plain(config) -> dict:
    """A schema dataclass as plain containers (mappings, lists, values): what a run saves (``config.yaml``, a
    checkpoint's trainer state) and ``build`` reads back."""
    def convert(value):
        if isinstance(value, Mapping):
            return {k: convert(v) for k, v in value.items()}
        return [convert(v) for v in value] if isinstance(value, (list, tuple)) else value
    return convert(dataclasses.asdict(config))


def schema_field(key: str, cls=JobConfig) -> tuple[dataclasses.Field, Any] | None:
    """The field of a dotted setting (``train.eval.every``) and its annotated type; None when the schema has
    none."""
    head, _, rest = key.partition(".")
    found = {f.name: f for f in fields(cls)}.get(head)
    if found is None:
        return None
    kind = get_type_hints(cls)[head]
    if not rest:
        return found, kind
    return schema_field(rest, kind) if is_dataclass(kind) else None


def _key(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() and abs(value) < 1e15 else str(value)


def _noun(value) -> str:
    return "a whole number" if isinstance(value, int) else "a number"


def _shown(value) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return _number(value) if _is_number(value) else repr(value)
