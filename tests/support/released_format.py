"""What test_released_format.py shares with other tests (Dispatch, OVERRIDES, Rows, hf_config, opened, run_config,
write_release), here so that no test module imports another."""
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from model import layout_from_config
from model.config import apply
from model.deepseek_config import adopt_released_config
from model.quant import BLOCK_FP8, BLOCK_ROW
from train.formats.init_from import InitFrom


OVERRIDES = ["model.engram.num_embeddings=[]"]


def e4m3_value(byte: int) -> float:
    """OCP e4m3fn from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 subnormal."""
    sign, exp, man = byte >> 7, (byte >> 3) & 15, byte & 7
    magnitude = man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return -magnitude if sign else magnitude


E4M3 = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float64)  # 0x7F, 0xFF are NaN: not used
E4M3_FINITE = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F])
E2M1 = torch.tensor([(-1) ** (n >> 3) * [0, .5, 1, 1.5, 2, 3, 4, 6][n & 7] for n in range(16)], dtype=torch.float64)


def nearest(values: torch.Tensor, table: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The code (index into ``table``) nearest each value, among ``allowed`` codes."""
    return allowed[(values.unsqueeze(-1) - table[allowed]).abs().argmin(-1)]


def ceil_rule_exponent(amax: float, qmax: float) -> int:
    return 0 if amax == 0 else math.ceil(math.log2(amax / qmax))


def write_block_quantised(w: torch.Tensor, block, fp4: bool, zero_block: bool = False):
    """(codes bytes, scale bytes, the decoded fp64 values) of ``w`` in blocks of ``block``."""
    out, inp = w.shape
    r, c = block
    scales = torch.zeros(-(-out // r), -(-inp // c), dtype=torch.int64)
    codes = torch.zeros(out, inp, dtype=torch.int64)
    decoded = torch.zeros(out, inp, dtype=torch.float64)
    table, allowed, qmax = (E2M1, torch.arange(16), 6.0) if fp4 else (E4M3, E4M3_FINITE, 448.0)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * r, (i + 1) * r), slice(j * c, (j + 1) * c)
            e = ceil_rule_exponent(w[rows, cols].abs().max().item(), qmax)
            if zero_block and i == j == 0:
                w[rows, cols], e = 0.0, -27  # an all-zero block whose scale only the file knows
            scales[i, j] = e + 127
            codes[rows, cols] = nearest(w[rows, cols] / 2.0 ** e, table, allowed)
            decoded[rows, cols] = table[codes[rows, cols]] * 2.0 ** e
    if fp4:
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
        return packed, scales.to(torch.uint8).view(torch.float8_e8m0fnu), decoded
    return codes.to(torch.uint8).view(torch.float8_e4m3fn), scales.to(torch.uint8).view(torch.float8_e8m0fnu), decoded


def stored_as(name: str) -> str:
    """SPEC §6 as the test reads it: fp8 32x32 / fp4 rows of 32 / fp8 rows of 32 (Engram tables) / fp32 / bf16."""
    if name.endswith("engram.embed.weight"):
        return "fp8_rows"
    if ".ffn.experts." in name:
        return "fp4"
    if any(name.endswith(f".{m}.weight") for m in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b",
                                                    "indexer.wq_b", "engram.wkv", "main_proj")) or \
            ".shared_experts." in name:
        return "fp8"
    if name.endswith(("attn_sink", "gate.bias")) or ".hc_" in name:
        return "fp32"
    return "bf16"


def hf_config(args, layout) -> dict:
    """The miniature's config.json as DeepSeek's HF config spells V4.1-Flash's (values from the model)."""
    moe, eng, ds = args.moe, args.engram, args.dspark
    from model.engram_layout import table_rows
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "moe_intermediate_size": moe.inter_dim, "num_hidden_layers": layout.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": 1, "head_dim": args.head_dim,
        "qk_rope_head_dim": args.rope_head_dim, "q_lora_rank": args.q_lora_rank, "o_lora_rank": args.o_lora_rank,
        "o_groups": args.o_groups, "hidden_act": "silu", "swiglu_limit": moe.swiglu_limit,
        "rms_norm_eps": args.norm_eps, "attention_bias": False, "max_position_embeddings": 1048576,
        "rope_theta": args.rope_theta, "rope_scaling": {
            "rope_type": "yarn", "factor": args.rope_factor, "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow, "original_max_position_embeddings": args.original_seq_len},
        "n_routed_experts": moe.n_routed_experts, "n_shared_experts": moe.n_shared_experts,
        "num_experts_per_tok": moe.n_activated_experts, "scoring_func": moe.score_func, "topk_method": "noaux_tc",
        "norm_topk_prob": moe.norm_topk_prob, "routed_scaling_factor": moe.route_scale,
        "sliding_window": args.window_size,
        "compress_ratios": [*layout.compress_ratios, *[0] * ds.blocks], "compress_rope_theta": args.compress_rope_theta,
        "kv_source_layer_ids": list(layout.kv_source_layer_ids),
        "index_source_layer_ids": list(layout.index_source_layer_ids), "index_n_heads": args.index_n_heads,
        "index_head_dim": args.index_head_dim, "index_topk": args.index_topk,
        "candidate_source_layer_id": layout.candidate_source_layer_id,
        "candidate_topk_blocks": layout.candidate_topk_blocks, "candidate_block_size": layout.candidate_block_size,
        "hc_mult": args.hc_mult, "hc_sinkhorn_iters": args.hc_sinkhorn_iters, "hc_eps": args.hc_eps,
        "engram_layer_ids": list(eng.layers), "engram_num_embeddings": list(table_rows(eng)),
        "engram_max_ngram_size": eng.max_ngram_size, "engram_vocab_size": eng.vocab_size,
        "engram_n_heads": eng.n_heads, "engram_head_dim": eng.head_dim, "engram_pad_token_id": eng.pad_id,
        "engram_compressed_vocab_size": eng.compressed_vocab_size, "num_nextn_predict_layers": ds.blocks,
        "dspark_block_size": ds.block_size, "dspark_noise_token_id": ds.noise_token_id,
        "dspark_target_layer_ids": list(ds.target_layers), "dspark_markov_rank": ds.markov_rank,
        "dspark_n_routed_experts": ds.n_routed_experts, "dspark_num_experts_per_tok": ds.n_activated_experts}
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1, "image_token_id": 129264,
            "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
            "text_config": text, "vision_config": {"num_hidden_layers": 2, "hidden_size": 8}}


VISION = {"vision.blocks.0.attn.qkv.weight": torch.randn(24, 8), "aligner.proj.weight": torch.randn(16, 8)}


def write_release(directory: Path, state: dict, config: dict, shards: int = 3) -> dict:
    """The release's files for ``state`` (fp64, our names); returns the decoded fp64 values by name. Tensors go
    round-robin by layer into ``shards`` files plus the vision ones, with the index."""
    directory.mkdir(parents=True)
    files, decoded = [{} for _ in range(shards)], {}
    for k, (name, value) in enumerate(state.items()):
        form = stored_as(name)
        shard = files[int(name.split(".")[1]) % shards if name.startswith("layers.") else k % shards]
        w = value.detach().clone()
        if form in ("fp8", "fp4", "fp8_rows"):
            block = BLOCK_FP8 if form == "fp8" else BLOCK_ROW
            codes, scale, decoded[name] = write_block_quantised(w, block, form == "fp4",
                                                                zero_block=name == "layers.0.attn.wq_a.weight")
            shard[name], shard[name.removesuffix(".weight") + ".scale"] = codes, scale
        else:
            shard[name] = w.to(torch.float32 if form == "fp32" else torch.bfloat16)
            decoded[name] = shard[name].double()
    files[-1].update({k: v.bfloat16() for k, v in VISION.items()})
    weight_map = {}
    for i, tensors in enumerate(files):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return decoded


def run_config(directory: Path, *overrides):
    """The settings of a run with ``train.init_from`` the released ``directory``, after the preflight's first step:
    its config.json sets the model."""
    from model.cli import compose, resolved

    config = resolved(compose(["model=v41_mini", "model.kernel_backend=torch", *overrides]))
    return adopt_released_config(apply(config, {"train.init_from": str(directory)}))


def opened(config) -> InitFrom:
    """``train.init_from`` of ``config`` opened and matched against its model, as the preflight does."""
    return InitFrom(config.train.init_from, config.train.init_strict, config.model.args,
                    layout_from_config(config.layout))


class Dispatch:
    """The expert range a rank of ``world`` holds (what ``parallel/experts.py`` gives a model), without a group."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def experts_of(self, n):
        held = n // self.world
        return range(self.rank * held, (self.rank + 1) * held)


class Rows:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world
