"""DeepSeek's released format (SPEC §6) in and out: a miniature V4.1 (``model=v41_mini``) written here in that
format by the test's own writer (e4m3 / e2m1 decoded from their bit layouts, not through ``model/quant.py``), then
imported (``train.init_from``) and compared with the fp64 oracle of ``tests/support/oracle.py``; exported back
(``--format deepseek``) byte for byte; the codecs against hand-worked values; a pipeline stage and an
expert-parallel rank reading only their share (bytes counted); damaged directories and configs refused in one line.

The test's writer picks each block's scale as DeepSeek's activation quantiser does, ``2^⌈log2(amax/qmax)⌉``, which
is not the module's rule: some blocks (largest code <= qmax/2) and the planted all-zero block can only come back
byte for byte through the kept source scales, so the byte test would catch an export that recomputed them.
"""
import dataclasses
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model import Transformer
from model.config import apply, plain
from model.deepseek_config import reference_config, reference_fields, released_model
from model.quant import BLOCK_FP8, BLOCK_ROW, dequantize, quantize
from train.export import export_deepseek
from train.formats import checkpoint, manifest
from train.formats.init_from import load_stage, rank_share
from train.formats.released_format import ReleasedWeights

from tests.support.oracle import oracle_forward
from tests.support.released_format import (Dispatch, OVERRIDES, Rows, VISION, hf_config, opened, run_config,
                                           write_release)
from tests.support.v41_oracle import (  # noqa: E402, F401 (_one_thread: the autouse fixture, here too)
    MIN_GAP, _one_thread, assert_close_rel, batch, configured, random_state)


# ------------------------------------------------------------------------------------------------ the test's writer


def setup_release(root: Path, seed: int = 0, tries: int = 5):
    """A released miniature whose decoded parameters give the oracle unambiguous discrete choices."""
    args, layout = configured(OVERRIDES)
    model = Transformer(args, layout, run_dspark=True).double()
    dims, layout_d = dataclasses.asdict(args), dataclasses.asdict(layout)
    ids, doc = batch(seed)
    for k in range(tries):
        directory = root / f"release{k}"
        decoded = write_release(directory, random_state(model, seed + 1000 * k), hf_config(args, layout))
        params, diag = {n: v.requires_grad_(not n.endswith("gate.bias")) for n, v in decoded.items()}, {}
        outputs = oracle_forward(params, dims, layout_d, ids, doc, diag=diag, draft=True)
        if min(diag[key] for key in ("topk_margin", "block_margin", "route_margin", "argmax_margin")) > MIN_GAP:
            return directory, args, layout, model, decoded, ids, doc, outputs
    raise RuntimeError("no seed with unambiguous discrete choices")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return setup_release(tmp_path_factory.mktemp("released"))


# ------------------------------------------------------------------------------------------------ import

def test_config_json_gives_the_model(release):
    """DeepSeek's HF config.json -> the miniature's ModelArgs and Layout (every field that describes the weights),
    the vision ones ignored."""
    directory, args, layout, *_ = release
    config = json.loads((directory / "config.json").read_text())
    assert reference_config(*released_model(config), "bf16") == reference_config(args, layout, "bf16")
    assert {"vision_config", "image_token_id", "quantization_config"} <= set(reference_fields(config)[1])


def test_import_matches_the_fp64_oracle(release):
    """The imported miniature's logits, indexer losses and draft parts equal the oracle on the decoded values
    (relative 1e-10): FP8 / FP4 / e8m0 dequantised exactly, every tensor in its place. Planted in the module and
    caught: nibbles swapped, scale exponent off by one (127 vs 128 bias), the FP8 scale transposed over blocks,
    the wo_a scale ignored."""
    directory, args, layout, model, decoded, ids, doc, (logits, indexer, draft) = release
    config = run_config(directory)
    assert config.model.index_n_heads == 8 and config.model.engram.num_embeddings == args.engram.num_embeddings or \
        config.model.engram.num_embeddings  # set from config.json (v41_mini has 4 index heads and computed rows)
    init = opened(config)
    assert not init.match.new and not init.match.ignored
    assert sorted(init.source.ignored) == sorted(VISION)
    target = Transformer(args, layout, run_dspark=True).double()
    load_stage(target, init.source, set(init.match.loaded))
    out, errors = target(ids, doc), {}
    assert_close_rel(out.logits, logits, "logits", errors)
    for s, kl in indexer.items():
        assert_close_rel(out.indexer_losses[s], kl, f"indexer {s}", errors)
    for part, value in draft.items():
        assert_close_rel(out.draft_losses[part], value, f"draft {part}", errors)
    state = target.state_dict()
    assert all(torch.equal(state[n], v) for n, v in decoded.items())


@pytest.mark.parametrize("stage,expert_rank", [(0, 0), (1, 1)])
def test_a_stage_and_an_expert_rank_read_only_their_share(release, stage, expert_rank):
    """Stage ``stage`` of 2 (layers 0-4 / 5-9 and the head) on expert rank ``expert_rank`` of 2 and table rank 1 of
    2 reads exactly its tensors: the bytes read are the stored sizes of its layers, its half of every MoE's experts
    and its half of each Engram table (counted from the headers here), less than half of the files, and its values
    equal the decoded ones. Planted and caught: loading every expert (the bytes), a table shard read from row 0
    (the values; and in ``rank_share``, what the preflight prints)."""
    directory, args, layout, _, decoded, *_ = release
    source = ReleasedWeights(directory)
    layers = range(0, 5) if stage == 0 else range(5, 10)
    model = Transformer(args, layout, layers, experts=Dispatch(expert_rank, 2), engram_rows=(Rows(1, 2), 1, 2),
                        run_dspark=True).double()
    names = set(model.state_dict())
    load_stage(model, source, names)
    expected = 0
    for file in set(source.weight_map.values()):
        with open(directory / file, "rb") as handle:
            length = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            base = name.removesuffix(".scale") + ".weight" if name.endswith(".scale") else name
            if base in names:
                size = entry["data_offsets"][1] - entry["data_offsets"][0]
                if base.endswith("engram.embed.weight"):
                    rows = entry["shape"][0]
                    half = -(-rows // 2)
                    size = size // rows * (rows - half)
                expected += size
    total = sum((directory / f).stat().st_size for f in set(source.weight_map.values()))
    assert source.bytes_read == expected and 0 < expected < total / 2
    share = rank_share(source.shapes(), args, layers, stage == 0, stage == 1, expert_rank, 2, 1, 2)
    assert set(share) == names
    for name, (start, rows) in model.row_shards().items():  # the preflight's rows are the ones the stage loads
        assert share[name] == (start, min(start + model.state_dict()[name].shape[0], rows)), name
    assert sum(source.stored_bytes(n, r) for n, r in share.items()) == expected
    for name, value in model.state_dict().items():
        start, _ = model.row_shards().get(name, (0, 0))
        want = decoded[name][start:start + value.shape[0]] if name in model.row_shards() else decoded.get(name)
        if name in model.row_shards():
            assert torch.equal(value[:want.shape[0]], want), name
        elif ".experts." in name and name.split(".experts.")[1].split(".")[0].isdigit():
            assert torch.equal(value, want), name
        else:
            assert torch.equal(value, want), name


# ------------------------------------------------------------------------------------------------ export

def fake_checkpoint(root: Path, state: dict, config) -> Path:
    """A checkpoint tag directory as ``train/formats/checkpoint.py`` reads one: per-layer files, trainer state,
    manifest."""
    from parallel.stage_checkpoint import is_expert, split_by_layer

    tag = root / "global_step1"
    tag.mkdir(parents=True)
    for part, tensors in split_by_layer({k: v for k, v in state.items() if not is_expert(k)}).items():
        torch.save(tensors, tag / part)
    for part, tensors in split_by_layer({k: v for k, v in state.items() if is_expert(k)}).items():
        torch.save(tensors, tag / f"experts_{part.removesuffix('.pt')}_00000.pt")
    (tag / checkpoint.TRAINER_STATE).write_text(json.dumps({"step": 1, "config": plain(config)}))
    manifest.write(tag)
    return tag


def stored_bytes(directory: Path) -> dict[str, bytes]:
    out = {}
    for file in json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values():
        with safe_open(str(directory / file), framework="pt") as handle:
            for name in handle.keys():
                t = handle.get_tensor(name)
                out[name] = (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def test_released_import_export_is_byte_identical(release, tmp_path):
    """Released -> import (fp32 masters, as training holds them) -> export: every tensor's dtype, shape and bytes,
    scales included (the all-zero block's arbitrary scale, the blocks whose largest code is below qmax/2), the
    vision tensors, the shard of every tensor and config.json's fields. Planted and caught: the export recomputing
    every scale (keep= ignored), fp4 nibbles swapped on the way out, a plain bf16 tensor written as fp32."""
    directory, args, layout, *_ = release
    init = opened(run_config(directory))
    model = Transformer(args, layout, run_dspark=True)  # fp32, as the trainer's master weights
    load_stage(model, init.source, set(init.match.loaded))
    tag = fake_checkpoint(tmp_path / "ckpt", model.state_dict(), run_config(directory))
    files, report = export_deepseek(str(tag), tmp_path / "out")
    assert all(entry["exact"] and entry["blocks_rescaled"] == 0 for entry in report.values())
    assert stored_bytes(tmp_path / "out") == stored_bytes(directory)
    index = lambda d: json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]  # noqa: E731
    assert index(tmp_path / "out") == index(directory)
    config = lambda d: json.loads((d / "config.json").read_text())  # noqa: E731
    assert config(tmp_path / "out") == config(directory)


def test_a_trained_tensor_is_requantised_and_reported(release, tmp_path):
    """A changed matrix comes out requantised (its error in the report, the others exact); without a source the
    export is our own layout and reads back to the same values (the module's scales are idempotent)."""
    directory, args, layout, *_ = release
    init = opened(run_config(directory))
    model = Transformer(args, layout, run_dspark=True)
    load_stage(model, init.source, set(init.match.loaded))
    state = model.state_dict()
    state["layers.3.attn.wq_b.weight"] = state["layers.3.attn.wq_b.weight"] * 1.01
    config = run_config(directory)
    tag = fake_checkpoint(tmp_path / "ckpt", state, config)
    _, report = export_deepseek(str(tag), tmp_path / "out")
    inexact = {n for n, v in report.items() if not v["exact"]}
    assert inexact == {"layers.3.attn.wq_b.weight"}
    assert 0 < report["layers.3.attn.wq_b.weight"]["rel_rms_error"] < 0.05
    tag2 = fake_checkpoint(tmp_path / "ckpt2", state, apply(config, {"train.init_from": None}))
    export_deepseek(str(tag2), tmp_path / "fresh")
    again = ReleasedWeights(tmp_path / "fresh")
    first = ReleasedWeights(tmp_path / "out")
    names = first.names()
    assert again.load(names) .keys() == first.load(names).keys()
    assert all(torch.equal(a, b) for a, b in zip(again.load(names).values(), first.load(names).values()))


def test_a_lora_run_exports_its_merged_adapters_in_the_released_form(release, tmp_path):
    """A LoRA checkpoint (adapters of one FP8 attention matrix and one FP4 routed expert, B non-zero) exported over
    its released base: every other tensor byte for byte as the source stores it, the two adapted ones in their
    stored dtype with new scales, holding the released grid's rounding of ``W + (alpha/r) B A`` (W read back from
    the source, the product formed here). Planted and caught: the merge without the scale, the export writing the
    base instead of the merged weight."""
    directory, args, layout, *_ = release
    config = run_config(directory, "train.lora.rank=4", "train.lora.alpha=8", "train.lora.targets=[wq_b,experts]")
    g = torch.Generator().manual_seed(2)
    source = ReleasedWeights(directory)
    adapted = ["layers.3.attn.wq_b.weight", "layers.3.ffn.experts.2.w1.weight"]
    adapters, merged = {}, {}
    for name in adapted:
        w = source.load([name])[name]
        a, b = torch.randn(4, w.shape[1], generator=g) * 0.1, torch.randn(w.shape[0], 4, generator=g) * 0.1
        stem = name.removesuffix(".weight")
        adapters[f"{stem}.lora.A"], adapters[f"{stem}.lora.B"] = a, b
        merged[name] = w + 2.0 * b @ a
    tag = fake_checkpoint(tmp_path / "ckpt", adapters, config)
    _, report = export_deepseek(str(tag), tmp_path / "out")
    assert {n for n, v in report.items() if not v["exact"]} == set(adapted)
    written, stored = stored_bytes(tmp_path / "out"), stored_bytes(directory)
    changed = {*adapted, *(n.removesuffix(".weight") + ".scale" for n in adapted)}
    assert written.keys() == stored.keys()
    untouched = [n for n in stored if n not in changed]
    assert [written[n] for n in untouched] == [stored[n] for n in untouched]
    out = ReleasedWeights(tmp_path / "out")
    for name in adapted:
        assert written[name][:2] == stored[name][:2] and written[name][2] != stored[name][2]  # dtype, shape; bytes
        form = ("fp4", BLOCK_ROW) if ".experts." in name else ("fp8", BLOCK_FP8)
        assert torch.equal(out.load([name])[name], dequantize(*quantize(merged[name], *form), *form))


def test_lora_training_over_the_quantised_base_equals_the_dequantised_one(release, tmp_path, monkeypatch):
    """Two LoRA steps over the released miniature, the base kept as released (``train.lora.quantized_base``) and
    dequantised into fp32: the same losses (the quantised values are the released ones; fp32 on the CPU), and the
    stored bytes were filled in (a spy counts the tensors). Planted and caught: the setting not reaching
    ``InitFrom``."""
    import train.formats.init_from as init_from_module
    from model.cli import compose
    from tests.support.train_run import SMALL, _train_rows
    from train.run.app import run

    directory, *_ = release
    held = []
    fill = init_from_module.fill_stored
    monkeypatch.setattr(init_from_module, "fill_stored", lambda *a: held.append(fill(*a)) or held[-1])
    losses = {}
    for quantized in ("false", "true"):
        run(compose([*SMALL, "model=v41_mini", "model.kernel_backend=torch", f"train.init_from={directory}",
                     "train.init_strict=false", "train.max_steps=2", "train.lora.rank=4",
                     "train.lora.targets=[wq_a,wq_b,wkv,wo_a,wo_b,shared_experts,experts]",
                     f"train.lora.quantized_base={quantized}"]), tmp_path / quantized)
        losses[quantized] = [r["loss"] for r in _train_rows(tmp_path / quantized)]
    assert len(held) == 1 and held[0] > 0
    assert len(losses["true"]) == 2
    torch.testing.assert_close(losses["true"], losses["false"], rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------ codecs

def test_dequantisation_against_hand_worked_values():
    """FP8: byte 0x38 is 1.0, 0x40 2.0, 0xC4 -3.0, 0x01 2^-9 (subnormal), 0x7E 448; e8m0 byte 127 is 1, 128 is 2,
    120 is 2^-7, 0 is 2^-127. One 32x32 block per scale: [[127, 129]] over a 1x64 row scales columns 32.. by 4.
    FP4: byte 0x21 holds 0.5 (low nibble, column 0) then 1.0 (column 1); 0xF8 holds -0.0 then -6.0."""
    codes = torch.tensor([[0x38, 0x40, 0xC4, 0x01, 0x7E] + [0] * 27 + [0x38] * 32], dtype=torch.uint8)
    scale = torch.tensor([[127, 129]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = dequantize(codes.view(torch.float8_e4m3fn), scale, "fp8", BLOCK_FP8)
    assert got[0, :5].tolist() == [1.0, 2.0, -3.0, 2.0 ** -9, 448.0] and got[0, 32:].eq(4.0).all()
    for byte, value in ((127, 1.0), (128, 2.0), (120, 2.0 ** -7), (0, 2.0 ** -127)):
        s = torch.full((1, 1), byte, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        assert dequantize(torch.full((1, 1), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn), s, "fp8",
                          BLOCK_FP8).item() == value
    packed = torch.tensor([[0x21, 0xF8] + [0] * 14], dtype=torch.uint8)
    got = dequantize(packed, torch.tensor([[127]], dtype=torch.uint8).view(torch.float8_e8m0fnu), "fp4", BLOCK_ROW)
    assert got[0, :4].tolist() == [0.5, 1.0, -0.0, -6.0] and torch.signbit(got[0, 2])
    codes, s = quantize(got, "fp4", BLOCK_ROW)
    assert codes[0, :2].tolist() == [0x21, 0xF8] and s.view(torch.uint8).item() == 127


def test_quantise_is_idempotent_and_keeps_what_it_is_given():
    """dequantise -> quantise gives the same codes and scales for the module's own output (every block), also via
    bf16; the ceil rule's block with largest code 224 (amax/2^e in (224, 232)) requantises to 448 at half the scale
    unless the scale is kept; rounding of e2m1 ties goes to the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 96, generator=g) * torch.logspace(-4, 4, 96)
    for fmt, block in (("fp8", BLOCK_FP8), ("fp4", BLOCK_ROW), ("fp8", BLOCK_ROW)):
        codes, scale = quantize(w, fmt, block)
        again = quantize(dequantize(codes, scale, fmt, block, torch.bfloat16), fmt, block)
        assert torch.equal(again[0].view(torch.uint8), codes.view(torch.uint8)), fmt
        assert torch.equal(again[1].view(torch.uint8), scale.view(torch.uint8)), fmt
    block = torch.full((1, 32), 1.0)
    block[0, 0] = 224.0  # codes up to 224 at scale 1: what 2^ceil(log2(amax/448)) writes for amax in (224, 232)
    one = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert quantize(block, "fp8", BLOCK_FP8)[1].view(torch.uint8).item() == 126
    codes, kept = quantize(block, "fp8", BLOCK_FP8, keep=one)
    assert kept.view(torch.uint8).item() == 127 and codes.float()[0, 0].item() == 224.0
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5] * 4])
    got = dequantize(*quantize(ties, "fp4", BLOCK_ROW, keep=one), "fp4", BLOCK_ROW)
    assert got[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


# ------------------------------------------------------------------------------------------------ bad input

def test_a_truncated_or_mismatched_shard_names_the_tensor_and_file(release, tmp_path):
    directory = release[0]
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    last = bad / "model-00002-of-00003.safetensors"
    last.write_bytes(last.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model-00002-of-00003.safetensors is truncated: tensor \S+ ends at"):
        ReleasedWeights(bad)
    shutil.copy(directory / "model-00002-of-00003.safetensors", last)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.1.attn.wq_a.weight"] = "model-00001-of-00003.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"puts tensor layers.1.attn.wq_a.weight in model-00001-of-00003.safetensors, "
                                         r"but model-00002-of-00003.safetensors holds it"):
        ReleasedWeights(bad)
    shutil.copy(directory / "model.safetensors.index.json", bad / "model.safetensors.index.json")
    with safe_open(str(last), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    tensors["layers.1.attn.wq_a.scale"] = tensors["layers.1.attn.wq_a.scale"][:1]
    save_file(tensors, str(last))
    with pytest.raises(ValueError, match=r"tensor layers.1.attn.wq_a.scale in model-00002-of-00003.safetensors has "
                                         r"shape \[1, 4\]; layers.1.attn.wq_a.weight \[64, 128\] needs \[2, 4\]"):
        ReleasedWeights(bad).shapes()


@pytest.mark.parametrize("change,message", [
    (lambda t: t.update(topk_method="greedy"), r"topk_method='greedy' is not a model this framework builds"),
    (lambda t: t.update(first_k_dense_replace=3), r"first_k_dense_replace=3: a stack that mixes dense and MoE"),
    (lambda t: t.update(rope_scaling={"rope_type": "linear", "factor": 2}), r"rope_scaling type 'linear'"),
    (lambda t: t.update(mla_kv_rank=512), r"fields this framework does not have: \['mla_kv_rank'\]"),
    (lambda t: t.update(hidden_act="gelu"), r"hidden_act='gelu'"),
])
def test_unsupported_config_is_a_one_line_error(release, change, message):
    config = json.loads((release[0] / "config.json").read_text())
    change(config["text_config"])
    with pytest.raises(ValueError, match=message) as error:
        reference_fields(config)
    assert "\n" not in str(error.value)


def test_unsupported_quantisation_is_a_one_line_error(release):
    config = json.loads((release[0] / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    with pytest.raises(ValueError, match=r"quantization_config.weight_block_size=\[128, 128\]; this framework reads"):
        reference_fields(config)


def test_score_of_a_released_directory(release, tmp_path, capsys, monkeypatch):
    """``python -m train.score <released dir> --tokens`` prints each document's perplexity and writes log-probs and
    logits (beside the input file, whatever the current directory: issue 57) that equal the oracle's on the decoded
    weights (fp32: relative 1e-5)."""
    from train.score import main

    directory, *_, ids, doc, (logits, _, _) = release
    docs = ids[0, :30].tolist(), ids[1, :13].tolist()  # row 0's first and row 1's documents: doc_ids 0 throughout
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # without --out the scores go beside the input, not into the current directory
    main([str(directory), "--tokens", str(tmp_path / "docs.json"), "--logits", "--device", "cpu"])
    printed = capsys.readouterr().out
    written = tmp_path / "docs.json.score.safetensors"
    assert printed.splitlines()[-1] == f"wrote {written} (2 documents)" and list(elsewhere.iterdir()) == []
    with safe_open(str(written), framework="pt") as handle:
        got = {k: handle.get_tensor(k) for k in handle.keys()}
    for i, (row, n) in enumerate(((0, 30), (1, 13))):
        want = logits[row, :n].double()
        assert (got[f"doc{i}.logits"].double() - want).abs().max() <= 1e-5 * want.abs().max()
        lp = torch.log_softmax(want[:-1], -1).gather(-1, ids[row, 1:n, None]).squeeze(-1)
        assert torch.allclose(got[f"doc{i}.logprobs"].double(), lp, atol=1e-4)
        assert f"doc {i}: {n} tokens, perplexity {math.exp(-got[f'doc{i}.logprobs'].double().mean()):.4f}" in printed
