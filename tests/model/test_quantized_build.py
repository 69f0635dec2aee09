"""A LoRA stage built without its full-precision base (``train.lora.quantized_base``, ``model/quantized_build.py``):
the frozen base is born as empty quantised buffers and filled with the bytes the release stores
(``train.formats.init_from.fill_stored``), against today's other way, the stage built and loaded in full precision and
then converted (``quantize_base``), on the released miniature of ``tests/train/test_released_format.py``."""
import pytest
import torch

from model import Transformer, layout_from_config
from model.lora import LoRA, attach
from model.quant import dequantize
from model.quantized_base import TABLE_BLOCK, QuantizedMatrix, QuantizedTable, quantize_base, quantized_form, \
    stored_slots
from model.quantized_build import quantized_transformer
from tests.support.float_shapes import FLOATS, FloatShapes
from tests.support.released_format import OVERRIDES, Dispatch, Rows, hf_config, opened, run_config, write_release
from tests.support.v41_oracle import _one_thread, configured, random_state  # noqa: F401 (_one_thread: autouse)
from train.formats.init_from import fill_stored, load_stage
from train.formats.sources import InitError

LORA = LoRA(4, 8.0, ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts", "experts"), quantized_base=True)
SMALLER = ["model.moe.n_routed_experts=4", "model.moe.inter_dim=32", "model.dspark.n_routed_experts=2",
           "model.engram.vocab_size=100"]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A released miniature (its Engram tables and draft head too, fewer and narrower experts and smaller tables
    than ``v41_mini``'s: the format test's writer takes a while per block), opened as ``train.init_from`` opens it."""
    args, layout = configured([*OVERRIDES, *SMALLER])
    directory = tmp_path_factory.mktemp("released") / "release"
    write_release(directory, random_state(Transformer(args, layout).double(), 0), hf_config(args, layout))
    config = run_config(directory)
    init = opened(config)
    init.layout = layout_from_config(config.layout)
    return init


WHOLE = {}
# stage 1 of 2 (layers 5-9, the head and the draft head) on expert rank 1 of 2 and table rank 1 of 2 (layer 5's table)
SLICE = {"layer_ids": range(5, 10), "experts": Dispatch(1, 2), "engram_rows": (Rows(1, 2), 1, 2)}


def _converted(init, part=WHOLE):
    """Today's way: the stage built and loaded in full precision, then its base quantised."""
    model = Transformer(init.args, init.layout, seed=5, **part)
    attach(model, LORA, seed=5)
    load_stage(model, init.source, set(init.match.loaded))
    quantize_base(model, quantized_form, "torch")
    return model


def _built(init, filled: bool = True, part=WHOLE):
    """The stage built holding its base quantised, then filled from the stored bytes."""
    model = quantized_transformer(quantized_form, init.args, init.layout, seed=5, **part)
    attach(model, LORA, seed=5)
    if filled:
        fill_stored(model, init.source, set(init.match.loaded))
        load_stage(model, init.source, set(init.match.loaded))
    return model


def _decoded(module) -> torch.Tensor:
    if isinstance(module, QuantizedTable):  # every row held (no exchange: a stand-in's table may not look up)
        codes, scale = module.packed[:, :module.dim], module.packed[:, module.dim:]
        return dequantize(codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu), "fp8", TABLE_BLOCK)
    return module.dequantized()


@pytest.mark.parametrize("part", [WHOLE, SLICE], ids=["whole", "stage1-experts1-rows1"])
def test_a_stage_built_without_its_base_equals_the_converted_one(release, part):
    """The whole model, and a pipeline stage on an expert rank and a table rank: before any load, every tensor
    outside the base is the ordinary build's draw bit for bit (init by name); after the fill and load, every
    quantised module decodes to the converted stage's values bit for bit and every other tensor is equal, and the
    held bytes are the file's own (the converter may pick another scale for a block whose largest code is <= qmax/2:
    the same values). Planted and caught: the experts' slots off by one expert, the scales left unfilled, the
    materialised tensors not drawn, a table's rows read from row 0 instead of its start, a rank's experts filled
    from expert 0 on."""
    fresh, ordinary = _built(release, False, part), Transformer(release.args, release.layout, seed=5, **part)
    attach(ordinary, LORA, seed=5)
    base = {name for name in stored_slots(fresh)}
    drawn = {n: t for n, t in ordinary.state_dict().items() if n not in base}
    kept = fresh.state_dict()
    assert set(drawn) <= set(kept) and len(drawn) > 50
    for name, value in drawn.items():
        assert torch.equal(kept[name], value), name

    built, converted = _built(release, part=part), _converted(release, part)
    modules = dict(converted.named_modules())
    held = [(n, m) for n, m in built.named_modules() if isinstance(m, (QuantizedMatrix, QuantizedTable))]
    assert len(held) == len([m for m in modules.values() if isinstance(m, (QuantizedMatrix, QuantizedTable))]) > 20
    assert any(isinstance(m, QuantizedTable) for _, m in held)
    for name, module in held:
        assert torch.equal(_decoded(module), _decoded(modules[name])), name
    state, want = built.state_dict(), converted.state_dict()
    assert set(state) == set(want)
    for name, value in want.items():
        if not name.endswith((".codes", ".scale", ".packed")):
            assert torch.equal(state[name], value), name
    slots = stored_slots(built)
    stored = release.source.load_stored(list(slots), {n: s.rows for n, s in slots.items() if s.rows})
    for name, slot in slots.items():
        codes, scale, *_ = stored[name]
        assert torch.equal(slot.codes, codes.view(torch.uint8)) and torch.equal(slot.scale, scale.view(torch.uint8))


def test_no_full_precision_copy_of_the_base_is_ever_made(release):
    """Building, adapting, filling and loading the stage makes no floating-point tensor of the full shape of a base
    target that only the base has (a routed stack, an Engram table, Engram's wkv...), while today's way (built,
    loaded, converted) makes every one of them: the detector sees what a return of the old way would do."""
    model = _built(release)
    targets = {tuple(m.shape) for m in model.modules() if isinstance(m, QuantizedMatrix)} | {
        (m.packed.shape[0], m.dim) for m in model.modules() if isinstance(m, QuantizedTable)}
    others = {tuple(t.shape) for t in [*model.parameters(), *model.buffers()] if t.dtype in FLOATS}
    only_base = targets - others
    stacks = {tuple(m.shape) for m in model.modules() if isinstance(m, QuantizedMatrix) and m.experts > 1}
    assert stacks <= only_base and len(only_base) >= 4
    with FloatShapes() as new:
        _built(release)
    assert not new.shapes & only_base, sorted(new.shapes & only_base)
    with FloatShapes() as old:
        _converted(release)
    assert only_base <= old.shapes


def test_a_base_tensor_the_source_lacks_is_a_one_line_error(release):
    """A frozen base tensor held as released that the source does not give (``train.init_strict=false`` lets the
    match through) cannot be drawn at random: ``fill_stored`` names it instead of leaving the buffers empty."""
    model = _built(release, filled=False)
    lacking = "layers.2.ffn.experts.1.w2.weight"
    assert lacking in stored_slots(model)
    with pytest.raises(InitError, match=rf"lacks {lacking} \(1 such\).*train.lora.quantized_base=false"):
        fill_stored(model, release.source, set(release.match.loaded) - {lacking})
