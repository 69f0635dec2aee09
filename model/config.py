"""Model dimensions (the reference config's names), built from a Hydra node or keyword arguments.

The V4.1 parts around the attention (SPEC §5) each have a switch: ``ffn`` (``dense`` SwiGLU or the ``moe`` of
``MoEArgs``), ``hc_mult`` (1: the plain residual stream; 4: V4.1's hyper-connected copies), ``engram.layers``
(empty: no Engram) and ``dspark.blocks`` (0: no draft head). Their settings are nested nodes (``model.moe.*``,
``model.engram.*``, ``model.dspark.*``) so that each part's knobs read as one group on the command line.
"""
from dataclasses import dataclass, fields, is_dataclass, replace

SCORE_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    """The routed + shared experts of a MoE FFN (SPEC §5.1)."""
    n_routed_experts: int = 384
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    inter_dim: int = 2304  # every expert's hidden width (routed and shared)
    score_func: str = "sqrtsoftplus"  # sqrtsoftplus | softmax | sigmoid
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0  # 0: no clamp
    bias_update_rate: float = 0.001  # auxiliary-loss-free balance: bias step after every optimizer step

    def check(self, where: str = "model.moe") -> None:
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"{where}.score_func={self.score_func!r}: use one of {', '.join(SCORE_FUNCS)}")
        if self.n_routed_experts < 1:
            raise ValueError(f"{where}.n_routed_experts={self.n_routed_experts}: a MoE FFN needs >= 1 routed expert")
        if not 1 <= self.n_activated_experts <= self.n_routed_experts:
            raise ValueError(f"{where}.n_activated_experts={self.n_activated_experts} (top-k) must be in 1.."
                             f"{where}.n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts not in (0, 1):
            raise ValueError(f"{where}.n_shared_experts={self.n_shared_experts}: use 0 or 1 (V4.1 has one)")
        if self.bias_update_rate < 0:
            raise ValueError(f"{where}.bias_update_rate={self.bias_update_rate}: use a rate >= 0 (0: the bias stays)")
        if self.gate_temp <= 0 or self.swiglu_limit < 0 or self.inter_dim < 1:
            raise ValueError(f"{where}: gate_temp > 0, swiglu_limit >= 0 and inter_dim >= 1 are required, got "
                             f"{self.gate_temp}, {self.swiglu_limit}, {self.inter_dim}")


@dataclass(frozen=True)
class EngramArgs:
    """Hashed n-gram memories added to the stream before some blocks (SPEC §5.3); no ``layers``: none."""
    layers: tuple[int, ...] = ()
    num_embeddings: tuple[int, ...] = ()  # table rows per Engram layer (checked); empty: computed from the buckets
    max_ngram_size: int = 4  # n-grams of sizes 2..max_ngram_size end at every position
    vocab_size: int = 16_000_000  # each (n-gram size, head) takes the next unused prime above this as its buckets
    n_heads: int = 8
    head_dim: int = 256
    pad_id: int = 2  # token id whose normalised id fills look-back slots before a document's start
    # Normalised ids of the tokenizer the tables were trained with (the released 99092): every hash multiplier
    # depends on it, so a data tokenizer that normalises to another count is refused; null: not checked.
    compressed_vocab_size: int | None = None
    train: bool = True  # false: the tables are frozen (no gradient, no optimizer state)

    def __post_init__(self):
        for name in ("layers", "num_embeddings"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))


@dataclass(frozen=True)
class DSparkArgs:
    """The speculative draft head (``mtp.*``, SPEC §5.4); ``blocks`` 0: none."""
    blocks: int = 0
    block_size: int = 5  # tokens drafted at once: the sampled token and block_size - 1 noise tokens
    target_layers: tuple[int, ...] = (37, 38, 39)  # the streams entering these layers are its features
    markov_rank: int = 256
    noise_token_id: int = 128799
    n_routed_experts: int = 128  # its MoE FFNs: the main MoE's settings with these expert counts
    n_activated_experts: int = 3

    def __post_init__(self):
        object.__setattr__(self, "target_layers", tuple(int(v) for v in self.target_layers))


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 259
    dim: int = 5120
    n_heads: int = 64
    head_dim: int = 512  # the latent width: one vector is both K and V
    rope_head_dim: int = 64  # RoPE acts on the last rope_head_dim dims of q, KV and index q/k
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    inter_dim: int = 12288  # dense SwiGLU hidden width (ffn=dense)
    norm_eps: float = 1e-20
    rope_theta: float = 10000.0  # window-only layers
    compress_rope_theta: float = 160000.0  # every rotation of a layer with a global branch
    rope_factor: float = 16.0  # YaRN, applied to compressed layers only
    original_seq_len: int = 65536  # 0: no YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    init_std: float = 0.006  # matrices (residual-branch outputs scaled by 1/sqrt(2 * n_layers))
    embed_init_std: float = 1.0  # the embedding: the residual stream's scale at init
    head_init_std: float = 0.006  # the LM head
    kernel_backend: str = "auto"  # auto | torch | triton (see kernels/__init__.py)
    qat: bool = False  # simulate the served FP8/FP4 attention activations in the forward (model/qat.py)
    attention: str = "csa2"  # csa2 | dense (the dense causal baseline of model/dense.py, on layout=window_only)
    dense_head_dim: int = 128  # head width of the dense baseline (n_heads of them)
    ffn: str = "dense"  # dense | moe
    moe: MoEArgs = MoEArgs()
    hc_mult: int = 1  # copies of the residual stream; 1: no hyper-connections
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram: EngramArgs = EngramArgs()
    dspark: DSparkArgs = DSparkArgs()

    def __post_init__(self):
        if self.attention not in ("csa2", "dense"):
            raise ValueError(f"model.attention={self.attention!r}: use csa2 or dense")
        if self.ffn not in ("dense", "moe"):
            raise ValueError(f"model.ffn={self.ffn!r}: use dense or moe")
        if self.n_heads % self.o_groups:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.o_groups={self.o_groups}")
        if self.original_seq_len < 0:
            raise ValueError(f"model.original_seq_len={self.original_seq_len}: the YaRN base length is >= 1, or 0 "
                             "for no YaRN")
        for name in ("head_dim", "index_head_dim"):
            if self.rope_head_dim > getattr(self, name) or self.rope_head_dim % 2:
                raise ValueError(f"model.rope_head_dim={self.rope_head_dim} must be even and <= model.{name}")
        if self.hc_mult < 1:
            raise ValueError(f"model.hc_mult={self.hc_mult}: use 1 (no hyper-connections) or more copies")
        if self.hc_sinkhorn_iters < 1:
            raise ValueError(f"model.hc_sinkhorn_iters={self.hc_sinkhorn_iters}: use >= 1")
        if self.ffn == "moe":
            self.moe.check()
        if self.dspark.blocks:
            self.dspark_moe.check("model.dspark")
            if self.dspark.block_size < 2:
                raise ValueError(f"model.dspark.block_size={self.dspark.block_size}: a draft block holds the sampled "
                                 "token and >= 1 noise token")
            if not self.dspark.target_layers:
                raise ValueError("model.dspark.target_layers is empty: DSpark reads the streams of >= 1 layer")
            if not 0 <= self.dspark.noise_token_id < self.vocab_size:
                raise ValueError(f"model.dspark.noise_token_id={self.dspark.noise_token_id} is outside the vocabulary "
                                 f"[0, model.vocab_size={self.vocab_size}): use a token id the model has")
        given = self.engram.num_embeddings
        if self.engram.layers and given and len(given) != len(self.engram.layers):
            raise ValueError(f"model.engram.num_embeddings={list(given)} needs one row count per Engram layer "
                             f"(model.engram.layers={list(self.engram.layers)}), or [] to compute them")
        if self.engram.layers and self.engram.max_ngram_size < 2:
            raise ValueError(f"model.engram.max_ngram_size={self.engram.max_ngram_size}: n-grams start at 2")
        if self.engram.layers and given:
            from model.engram import table_rows  # the bucket primes (model/engram.py imports this module)

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
    def from_config(cls, cfg) -> "ModelArgs":
        """Build from a mapping (e.g. ``cfg.model``); unknown keys are an error that names them."""
        return _build(cls, cfg, "model")


def _build(cls, cfg, where: str):
    """A (nested) args dataclass from a mapping; nested dataclass fields take a mapping of their own."""
    known = {f.name: f for f in fields(cls)}
    values = {k: v for k, v in dict(cfg).items() if k != "name"}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown setting(s) {[f'{where}.{k}' for k in unknown]}; known: "
                         f"{sorted(f'{where}.{k}' for k in known)}")
    for name, value in values.items():
        default = known[name].default
        if is_dataclass(default) and not is_dataclass(value):
            values[name] = _build(type(default), {**_as_dict(default), **dict(value)}, f"{where}.{name}")
    return cls(**values)


def _as_dict(args) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(args)}
