"""Model dimensions (the reference config's names), built from a Hydra node or keyword arguments."""
from dataclasses import dataclass, fields


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
    inter_dim: int = 12288  # dense SwiGLU hidden width
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
    attention: str = "csa2"  # csa2 | dense (the dense causal baseline of model/dense.py, on layout=window_only)
    dense_head_dim: int = 128  # head width of the dense baseline (n_heads of them)

    def __post_init__(self):
        if self.attention not in ("csa2", "dense"):
            raise ValueError(f"model.attention={self.attention!r}: use csa2 or dense")
        if self.n_heads % self.o_groups:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.o_groups={self.o_groups}")
        if self.original_seq_len < 0:
            raise ValueError(f"model.original_seq_len={self.original_seq_len}: the YaRN base length is >= 1, or 0 "
                             "for no YaRN")
        for name in ("head_dim", "index_head_dim"):
            if self.rope_head_dim > getattr(self, name) or self.rope_head_dim % 2:
                raise ValueError(f"model.rope_head_dim={self.rope_head_dim} must be even and <= model.{name}")

    @classmethod
    def from_config(cls, cfg) -> "ModelArgs":
        """Build from a mapping (e.g. ``cfg.model``); unknown keys are an error that names them."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in dict(cfg).items() if k != "name"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model setting(s) {unknown}; known: {sorted(known)}")
        return cls(**values)
