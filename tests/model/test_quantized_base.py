"""A LoRA run's frozen base kept in the released FP8/FP4 form (issue 56, ``model/quantized_base.py``,
``kernels/triton_quant_gemm.py``), on the CPU.

The kernel runs through the Triton interpreter (fp32 and fp16; the interpreter computes bf16 wrongly) against the
dequantise-then-matmul product written here in fp64 from ``model/quant.py``'s dequantisation, and its decoding of
every FP8 code against torch's own ``float8_e4m3fn``. The converted model runs against the fp64 oracle of
``tests/support/oracle.py`` given the dequantised base and the merged adapters ``W + (alpha/r) B A``: logits and the
adapters' gradients."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process
os.environ["CSA2_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")


from kernels.triton_quant_gemm import dequantize_stack, quant_matmul  # noqa: E402
from model import Transformer  # noqa: E402
from model.lora import LoRA, attach  # noqa: E402
from model.quant import BLOCK_FP8, BLOCK_ROW, dequantize, e2m1_to_float, quantize  # noqa: E402
from model.quantized_base import QuantizedLinear, QuantizedMatrix, QuantizedTable, quantize_base  # noqa: E402
from tests.support.oracle import oracle_forward
from tests.support.v41_oracle import (MIN_GAP, _one_thread, batch, configured, objective,
                                      random_state)  # noqa: E402, F401
from train.formats.released_format import quantized_form  # noqa: E402

FORMS = [pytest.param("fp8", BLOCK_FP8, id="fp8"), pytest.param("fp4", BLOCK_ROW, id="fp4")]


def _stack(fmt, block, experts, out, fan_in, seed=0):
    """A quantised stack ``[experts, out, in]`` with some tiny columns (FP8 subnormal codes, FP4 zeros) and its
    dequantised values in fp64."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, out, fan_in, generator=g) * torch.where(torch.arange(fan_in) % 7 == 3, 1e-3, 1.0)
    parts = [quantize(m, fmt, block) for m in w]
    codes, scale = torch.stack([c for c, _ in parts]), torch.stack([s for _, s in parts])
    values = torch.stack([dequantize(c, s, fmt, block, torch.float64) for c, s in parts])
    return codes, scale, values


@pytest.mark.parametrize("dequantize", [False, True], ids=["fused", "transient"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fmt, block", FORMS)
def test_grouped_kernel_equals_dequantise_then_matmul(fmt, block, dtype, tol, dequantize):
    """Rows sorted by expert (3 experts, one with no rows) times each expert's matrix, forward and backward to the
    input, fused and through the transient dequantised stack; 40 x 70 (fp8) / 40 x 66 (fp4) cross the 32-column
    scale blocks, the interpreter's 16 x 16 x 32 tiles and end inside them (72 columns for the transient path: torch's
    grouped GEMM strides rows by 16 bytes). Planted and caught: the FP4 nibbles swapped, the scale's block column
    read as k // R, the tile table's expert off by one, the backward reducing over the input columns (the forward's
    transpose); the transient path's forward multiplying by W[e] untransposed, its stack written an expert off."""
    out, fan_in = 40, 72 if dequantize else 70 if fmt == "fp8" else 66
    codes, scale, values = _stack(fmt, block, 3, out, fan_in)
    counts = torch.tensor([17, 0, 21])
    x = torch.randn(int(counts.sum()), fan_in, dtype=dtype, requires_grad=True)
    y = quant_matmul(x, codes, scale, counts, fmt == "fp4", block, (out, fan_in), dequantize=dequantize)
    grad = torch.randn(y.shape, dtype=dtype)
    (dx,) = torch.autograd.grad(y, x, grad)
    xs, gs = x.detach().double().split(counts.tolist()), grad.double().split(counts.tolist())
    want_y = torch.cat([part @ values[e].T for e, part in enumerate(xs)])
    want_dx = torch.cat([part @ values[e] for e, part in enumerate(gs)])
    for got, want in ((y, want_y), (dx, want_dx)):
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert ((got.double() - want).norm() / want.norm()).item() < tol


@pytest.mark.parametrize("fmt, block", FORMS)
def test_matrices_stacked_by_rows_take_one_transient_product(fmt, block):
    """``QuantizedRows`` of two quantised stacks (w1 over w3: 40 and 32 rows, 72 columns) whose experts get at least
    ``DEQUANT_ROWS`` rows each (one expert none) multiply through one stacked transient buffer: forward and backward to
    the input against each expert's dequantised matrices stacked, in fp64. Planted and caught: the second matrix
    written over the first's rows, the experts' stride of the stacked buffer taken as one matrix's, the backward's
    input gradient of one part only."""
    from model.quantized_base import DEQUANT_ROWS, QuantizedRows

    (c1, s1, v1), (c3, s3, v3) = _stack(fmt, block, 3, 40, 72, seed=1), _stack(fmt, block, 3, 32, 72, seed=2)
    parts = [QuantizedMatrix(c, s_, fmt, block, v.shape, "triton") for c, s_, v in ((c1, s1, v1), (c3, s3, v3))]
    counts = torch.tensor([DEQUANT_ROWS, 0, 2 * DEQUANT_ROWS + 5])
    x = torch.randn(int(counts.sum()), 72, requires_grad=True)
    y = QuantizedRows(parts).linear(x, counts)
    grad = torch.randn(y.shape)
    (dx,) = torch.autograd.grad(y, x, grad)
    values = torch.cat([v1, v3], dim=1)  # [3, 72, 72]
    xs, gs = x.detach().double().split(counts.tolist()), grad.double().split(counts.tolist())
    want_y = torch.cat([part @ values[e].T for e, part in enumerate(xs)])
    want_dx = torch.cat([part @ values[e] for e, part in enumerate(gs)])
    for got, want in ((y, want_y), (dx, want_dx)):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


def test_a_transient_buffer_of_another_shape_is_refused():
    """``dequantize_stack(out=)`` writes only into a view of the stack's shape with contiguous rows: one line saying
    what it got."""
    codes, scale = quantize(torch.randn(64, 64), "fp8", BLOCK_FP8)
    with pytest.raises(ValueError, match=r"out is \(1, 64, 32\)"):
        dequantize_stack(codes[None], scale[None], False, BLOCK_FP8, (64, 64), torch.float32,
                         out=torch.empty(1, 64, 32))


def test_many_rows_a_matrix_take_the_transient_product():
    """``dequantizes``: from ``DEQUANT_ROWS`` rows a matrix on average, and only for rows torch's grouped GEMM can
    stride; a linear (one matrix) by its rows alone. Planted and caught: the rule inverted, the rows not divided
    among the experts, the alignment ignored (torch's grouped GEMM would refuse 70 fp32 columns)."""
    from model.quantized_base import DEQUANT_ROWS, dequantizes

    assert dequantizes(DEQUANT_ROWS * 48, 48, (2304, 5120), torch.bfloat16)
    assert not dequantizes(DEQUANT_ROWS * 48 - 1, 48, (2304, 5120), torch.bfloat16)
    assert dequantizes(DEQUANT_ROWS, 1, (32768, 1280), torch.bfloat16)
    assert not dequantizes(DEQUANT_ROWS * 3, 3, (40, 70), torch.float32)
    assert dequantizes(DEQUANT_ROWS * 3, 3, (40, 72), torch.float32)


@pytest.mark.parametrize("fmt, block", FORMS)
def test_nans_reach_the_products_the_reference_gives_them(fmt, block):
    """A NaN scale on blocks the matrix's edges cut (the last column block, and for FP8 the last row block, which
    the kernel reads past the edge) and (FP8) a NaN code: forward and backward to x, the outputs NaN where the
    dequantise-then-matmul product (fp64) is, the others equal to it: what the kernel reads past the edges must not
    spread a NaN further (it zeroes nothing there: a code reads 0, and 0 times a NaN scale lands only on outputs
    the block's codes inside make NaN). Planted and caught: codes past the edge read as a NaN code (their load's
    other)."""
    out, fan_in = 40, 70 if fmt == "fp8" else 66
    codes, scale, _ = _stack(fmt, block, 2, out, fan_in, seed=1)
    scale = scale.view(torch.uint8).clone()
    scale[0, -1, -1] = 255  # the corner block
    if fmt == "fp8":
        scale[1, -1, 0] = 255  # the last row block, read past row 40
        codes = codes.view(torch.uint8).clone()
        codes[0, 5, 9] = 0x7F
        codes = codes.view(torch.float8_e4m3fn)
    values = torch.stack([dequantize(c, s, fmt, block, torch.float64) for c, s in zip(codes, scale)])
    counts = torch.tensor([19, 23])
    x = torch.randn(int(counts.sum()), fan_in, requires_grad=True)
    y = quant_matmul(x, codes, scale, counts, fmt == "fp4", block, (out, fan_in))
    grad = torch.randn(y.shape)
    (dx,) = torch.autograd.grad(y, x, grad)
    xs, gs = x.detach().double().split(counts.tolist()), grad.double().split(counts.tolist())
    want_y = torch.cat([part @ values[e].T for e, part in enumerate(xs)])
    want_dx = torch.cat([part @ values[e] for e, part in enumerate(gs)])
    for got, want in ((y, want_y), (dx, want_dx)):
        assert want.isnan().any() and not want.isnan().all()
        assert torch.equal(got.isnan(), want.isnan())
        number = ~want.isnan()
        assert ((got[number].double() - want[number]).norm() / want[number].norm()).item() < 1e-6


def test_every_code_decodes_as_torch_and_the_reference_do():
    """x = I reads the decoded matrix back: every finite one of the 256 FP8 bytes (subnormals, -0, 448) as torch's
    ``float8_e4m3fn``, every FP4 nibble as ``model/quant.py``'s table, times scales 2^-9 .. 2^6, per 32 x 32 block
    (fp8) / per 32 of a row (fp4). (The two NaN codes stay out: a NaN anywhere in a row of W spoils the whole GEMM
    row.) Planted and caught: the e4m3 bias 8, subnormals read as normals, the scale's bias 128."""
    eye = torch.eye(64)
    fp8 = torch.arange(256, dtype=torch.uint8).view(8, 32).repeat(8, 2)  # [64, 64]: 2 x 2 blocks
    fp8[(fp8 & 127) == 127] = 0
    fp8_scale = torch.tensor([[118, 133], [127, 121]], dtype=torch.uint8)
    got = quant_matmul(eye, fp8[None], fp8_scale[None], None, False, BLOCK_FP8, (64, 64)).T
    factor = torch.ldexp(torch.ones(2, 2), fp8_scale.int() - 127)
    want = fp8.view(torch.float8_e4m3fn).float() * factor.repeat_interleave(32, 0).repeat_interleave(32, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    fp4 = torch.arange(256, dtype=torch.uint8).view(8, 32).repeat(8, 1)  # [64, 32] bytes: [64, 64] values
    fp4_scale = torch.arange(64 * 2, dtype=torch.uint8).view(64, 2) % 16 + 118
    got = quant_matmul(eye, fp4[None], fp4_scale[None], None, True, BLOCK_ROW, (64, 64)).T
    nibbles = torch.stack([fp4 & 15, fp4 >> 4], -1).flatten(-2)
    want = e2m1_to_float(nibbles) * torch.ldexp(torch.ones(64, 2), fp4_scale.int() - 127).repeat_interleave(32, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


EVERY_SCALE = (0, 1, 2, 100, 126, 127, 128, 200, 253, 254, 255)  # 2^-127 (subnormal) .. 2^127, and NaN


@pytest.mark.parametrize("fmt, block", FORMS)
def test_the_decode_is_the_reference_dequantisation_bit_for_bit(fmt, block):
    """Every FP8 byte (NaNs, subnormals, -0, 448) and every packed FP4 byte (every pair of nibbles) times every scale
    of ``EVERY_SCALE`` (2^-127, a subnormal, to 2^127, where large codes overflow to inf; 255 NaN), decoded by
    ``dequantize_stack`` (the GEMM kernel's ``_decode_tile``, written out) against ``model/quant.py``'s
    ``dequantize`` in fp32: the same bits wherever the reference is a number (-0 included), NaN where it is NaN.
    Each code meets each scale: row block i, column block j holds scale ``EVERY_SCALE[(i + j) % 11]`` and every row
    holds every code. The matrix is the third of a stack whose first two are zero codes at scale 1 (the expert's
    offsets count; those two must come back zero). Planted and caught: the FP4 nibbles swapped, the scale of the
    next 32 columns, the e8m0 byte 0 read as zero and 255 as inf, e4m3's NaN missed, FP4's sign dropped from the low
    nibble."""
    n_scales = len(EVERY_SCALE)
    if fmt == "fp8":
        codes = torch.arange(256, dtype=torch.uint8).repeat(32 * n_scales, 1)  # [352, 256]
    else:
        codes = torch.arange(256, dtype=torch.uint8).repeat(n_scales, 1)  # [11, 256] bytes: [11, 512] values
    shape = (codes.shape[0], codes.shape[1] * (2 if fmt == "fp4" else 1))
    rows, cols = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    pick = (torch.arange(rows)[:, None] + torch.arange(cols)[None, :]) % n_scales
    scale = torch.tensor(EVERY_SCALE, dtype=torch.uint8)[pick]
    want = dequantize(codes.view(torch.float8_e4m3fn) if fmt == "fp8" else codes, scale.view(torch.float8_e8m0fnu),
                      fmt, block, torch.float32)
    assert want.isnan().any() and want.isinf().any() and (want.view(torch.int32) == -2 ** 31).any()  # NaN, inf, -0
    assert ((want != 0) & (want.abs() < 2 ** -126)).any()  # fp32 subnormals
    other, one = torch.zeros_like(codes), torch.full_like(scale, 127)
    stack, scales = torch.stack([other, other, codes]), torch.stack([one, one, scale])
    first, second, got = dequantize_stack(stack, scales, fmt == "fp4", block, shape, torch.float32)
    assert not first.any() and not second.any()
    assert torch.equal(got.isnan(), want.isnan())
    number = ~want.isnan()
    assert torch.equal(got[number].view(torch.int32), want[number].view(torch.int32))


EVERY_MOE = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts", "experts")
RANK, ALPHA = 4, 8.0


def _quantized_state(model, seed: int) -> dict:
    """``random_state``'s fp64 values with every matrix the release stores quantised in the blocks (``layers.*``)
    and the draft head's routed experts replaced by its dequantised FP8 / FP4 values (the Engram tables too, which
    ``quantize_base`` leaves as they are: a lookup, not a GEMM)."""
    state = {}
    for name, value in random_state(model, seed).items():
        form = quantized_form(name) if name.startswith("layers.") or ".ffn.experts." in name else None
        if form is not None and value.dim() == 2:
            value = dequantize(*quantize(value.detach(), *form), *form, torch.float64).requires_grad_(False)
        state[name] = value
    return state


def _oracle_params(state: dict, model, scale: float) -> tuple[dict, dict]:
    """The oracle's parameters (the dequantised base with every adapted matrix merged, ``W + scale · B A``, built
    from leaves A and B) and those leaves under the model's parameter names."""
    leaves = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters() if p.requires_grad}
    params = {n: v.detach() for n, v in state.items()}
    for name, a in leaves.items():
        if not name.endswith(".A"):
            continue
        b = leaves[name[:-1] + "B"]
        if ".experts.lora." in name:  # a stack: ...experts.lora.w1.A [E, r, in]
            stack, matrix = name.split(".lora.")[0], name.split(".")[-2]
            for e in range(a.shape[0]):
                target = f"{stack}.{e}.{matrix}.weight"
                params[target] = params[target] + scale * b[e] @ a[e]
        else:
            target = name.removesuffix(".lora.A") + ".weight"
            params[target] = params[target] + scale * b @ a
    return params, leaves


def test_quantized_base_model_matches_the_oracle():
    """``model=v41_mini`` with adapters on every matrix (B random, so that each update shows) and its base converted
    to the released FP8 / FP4 form (the reference GEMMs, fp64) against the oracle given the dequantised base with
    the adapters merged: logits to fp64 rounding, and the gradient of every A and B. What the released form changes
    is shown to matter: the un-rounded base gives other logits. Planted and caught: the stacked operands' outputs
    (wq_a | wkv, w1 | w3) joined in the other order, wo_a's grouped product reading the tokens' rows without
    grouping them or its output viewed as [G, rank, N], an adapter left behind on the replaced nn.Linear."""
    args, layout = configured([])
    lora = LoRA(RANK, ALPHA, EVERY_MOE)
    ids, doc = batch(0)
    for k in range(5):
        model = Transformer(args, layout, run_dspark=True).double()
        state = _quantized_state(model, 1000 * k)
        model.load_state_dict({n: v.detach() for n, v in state.items()})
        attach(model, lora, seed=3)
        model.double()  # the adapters too
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".B"):
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
        params, leaves = _oracle_params(state, model, lora.scale)
        diag = {}
        logits, indexer, draft = oracle_forward(params, *_dims(args, layout), ids, doc, diag=diag, draft=True)
        if min(diag[key] for key in ("topk_margin", "block_margin", "route_margin", "argmax_margin")) > MIN_GAP:
            break
    quantize_base(model, quantized_form, "torch")
    left = [n for n in model.state_dict() if n.startswith("layers.") and quantized_form(n)]
    assert not left and isinstance(model.layers["0"].attn.wq_a, QuantizedLinear)  # every stored matrix converted
    assert all(isinstance(model.layers[str(i)].engram.embed, QuantizedTable) for i in args.engram.layers)
    assert isinstance(model.layers["0"].ffn.experts.w1, QuantizedMatrix)
    out = model(ids, doc)
    torch.testing.assert_close(out.logits, logits, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad(objective(out.logits, out.indexer_losses, out.draft_losses, ids),
                              [p for p in model.parameters() if p.requires_grad])
    want = torch.autograd.grad(objective(logits, indexer, draft, ids), list(leaves.values()))
    for name, g_got, g_want in zip(leaves, got, want):
        torch.testing.assert_close(g_got, g_want, rtol=1e-9, atol=1e-9 * g_want.abs().max().item(), msg=name)
    unrounded = {**params, **{n: v for n, v in random_state(model, 1000 * k).items() if n not in leaves}}
    assert (oracle_forward(unrounded, *_dims(args, layout), ids, doc, draft=True)[0] - logits).abs().max() > 1e-3


def _dims(args, layout):
    import dataclasses

    return dataclasses.asdict(args), dataclasses.asdict(layout)


def test_grouped_triton_experts_equal_the_reference_loop():
    """The routed experts with adapters, converted to FP4 stacks: the grouped path (one Triton kernel per matrix over
    the experts, under the interpreter, fp32) against the loop over the experts with the PyTorch reference
    (dequantise one expert, multiply): outputs, the input's gradient and every adapter's. An expert with no rows;
    counts handed as offsets, or the loop's per-expert slices of the stack cut at the wrong expert, fail."""
    from model.moe import RoutedExperts

    args = configured([])[0]
    runs = []
    for backend, grouped in (("triton", True), ("torch", False)):
        torch.manual_seed(0)
        experts = RoutedExperts(args.dim, args.moe)
        for w in (experts.w1, experts.w2, experts.w3):
            torch.nn.init.normal_(w, std=0.05)
        model = torch.nn.Module()  # attach and quantize_base look for layers: one block whose FFN holds these
        model.layers, model.args = torch.nn.ModuleDict({"0": torch.nn.Module()}), args
        model.layers["0"].ffn = torch.nn.Module()
        model.layers["0"].ffn.experts = experts
        attach(model, LoRA(8, 16.0, ("experts",)), seed=0)
        with torch.no_grad():
            for w in ("w1", "w2", "w3"):
                experts.lora[w].B.normal_(std=0.1)
        quantize_base(model, quantized_form, backend)
        counts = torch.tensor([5, 0, 3, 8, 1, 7, 2, 6])
        x = torch.randn(int(counts.sum()), args.dim, requires_grad=True)
        out = experts(x, counts, torch.rand(int(counts.sum())), grouped=grouped)
        grads = torch.autograd.grad(out.square().sum(), [x, *experts.parameters()])
        runs.append((out, *grads))
    for got, want in zip(*runs):
        assert torch.isfinite(got).all()
        assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_the_memory_model_counts_the_converted_bytes():
    """``parallel.memory.lora_counts`` under ``quantized_base`` times ``STORED_BYTES`` against the bytes of the codes
    and scales of every matrix a converted ``v41_mini`` holds quantised (the draft head's experts too). Planted and
    caught: FP8 costed at 1.03 bytes a value (a scale per 32, the Engram tables' rows), FP4 at 0.5 (no scales); the
    tables' FP8 rows at fp32's 4 bytes or without their scales; the draft head's experts left at fp32."""
    from model.quantized_base import STORED_BYTES
    from parallel.memory import lora_counts

    args, layout = configured([])
    lora = LoRA(RANK, ALPHA, EVERY_MOE, quantized_base=True)
    model = Transformer(args, layout)
    attach(model, lora, seed=0)
    quantize_base(model, quantized_form, "torch")
    held = {"fp8": 0, "fp4": 0}
    for module in model.modules():  # ...attn.wq_a.weight (a QuantizedLinear's), ...ffn.experts.w1, mtp.0...
        if isinstance(module, QuantizedMatrix):
            held[module.fmt] += module.codes.nbytes + module.scale.nbytes
    assert isinstance(model.mtp[0].ffn.experts.w1, QuantizedMatrix)
    counts = lora_counts(args, layout, lora)
    assert held["fp8"] > 0 and held["fp4"] > 0
    for fmt in ("fp8", "fp4"):
        assert sum(counts[fmt]) * STORED_BYTES[fmt] == pytest.approx(held[fmt], rel=1e-12)
    # the Engram tables: estimate()'s frozen state with and without them held as released, against the packed bytes
    from parallel.memory import estimate, parameter_counts

    tables = sum(m.packed.nbytes for m in model.modules() if isinstance(m, QuantizedTable))
    table_values = sum(parameter_counts(args, layout)["tables"])
    assert tables == table_values * (1 + 1 / args.engram.head_dim)  # v41_mini's rows of 16: one scale a row
    kept = estimate(args, layout, 1, 32, torch.float32, layout.n_layers, 1, 1, False, lora=lora)
    fp32 = estimate(args, layout, 1, 32, torch.float32, layout.n_layers, 1, 1, False,
                    lora=LoRA(RANK, ALPHA, EVERY_MOE, quantized_base=False))
    low = lora_counts(args, layout, lora)
    fp32_matrices = sum(low["fp8"]) * (4 - STORED_BYTES["fp8"]) + sum(low["fp4"]) * (4 - STORED_BYTES["fp4"])
    assert sum(fp32.state) - sum(kept.state) == pytest.approx(fp32_matrices + table_values * 4 - tables, rel=1e-12)


@pytest.mark.parametrize("expert_parallel", [1, 2, None], ids=["E1", "E2", "one_expert_a_rank"])
def test_the_memory_model_counts_the_largest_transient_copy(expert_parallel):
    """``parallel.memory``'s transient copy per layer under ``quantized_base`` against the converted ``v41_mini``'s
    own matrices: at a rank's chunk of ``DEQUANT_ROWS`` tokens or more, the larger of its largest FP8 matrix and its
    rank's w1 over w3 stack (1 / E of the experts), in bf16; below it, none. Planted and caught: the stack of one
    matrix (w1 alone), the experts not divided among the ranks, the FP8 matrices left out."""
    from model.quantized_base import DEQUANT_ROWS
    from parallel.memory import _dequantized_copies

    args, layout = configured([])
    lora = LoRA(RANK, ALPHA, EVERY_MOE, quantized_base=True)
    model = Transformer(args, layout)
    attach(model, lora, seed=0)
    quantize_base(model, quantized_form, "torch")
    expert_parallel = expert_parallel or args.moe.n_routed_experts
    want = []
    for i in range(layout.n_layers):
        held = [m for m in model.layers[str(i)].modules() if isinstance(m, QuantizedMatrix)]
        fp8 = max((m.shape.numel() for m in held if m.fmt == "fp8"), default=0)
        experts = model.layers[str(i)].ffn.experts
        stack = (experts.w1.shape.numel() + experts.w3.shape.numel()) // expert_parallel
        want.append(max(fp8, stack) * 2)
    tokens = DEQUANT_ROWS * args.moe.n_routed_experts  # every local expert gets at least DEQUANT_ROWS rows
    assert fp8 > 0 and _dequantized_copies(args, layout, lora, tokens, expert_parallel, torch.bfloat16) == want
    local, k = args.moe.n_routed_experts // expert_parallel, args.moe.n_activated_experts
    below = min(DEQUANT_ROWS - 1, (DEQUANT_ROWS - 1) * local // k)  # fewer tokens, and fewer rows an expert
    assert set(_dequantized_copies(args, layout, lora, below, expert_parallel, torch.bfloat16)) == {0}


def test_the_transient_copy_is_a_floor_of_the_layers_transient(monkeypatch):
    """``estimate``'s transient under a quantised base is, per layer, the larger of the backward's working set and
    the copy (which lives inside one MoE product, not in the attention's backward where the layer peaks: measured,
    the stage's peak did not move with a 2.1 GiB copy). Planted and caught: the copy added to the working set."""
    import parallel.memory as memory
    from model.quantized_base import DEQUANT_ROWS

    args, layout = configured([])
    lora = LoRA(RANK, ALPHA, EVERY_MOE, quantized_base=True)
    seq = DEQUANT_ROWS * args.moe.n_routed_experts

    def transient():
        return memory.estimate(args, layout, 1, seq, torch.bfloat16, layout.n_layers, 1, 1, False, lora=lora).transient
    copies = memory._dequantized_copies(args, layout, lora, seq, 1, torch.bfloat16)
    with_copies = transient()
    monkeypatch.setattr(memory, "_dequantized_copies", lambda *a: [0.0] * layout.n_layers)
    working = transient()
    monkeypatch.setattr(memory, "_dequantized_copies", lambda *a: [w + 1.0 for w in working])
    assert all(c > 0 for c in copies)
    assert list(with_copies) == [max(w, c) for w, c in zip(working, copies)]
    assert list(transient()) == [w + 1.0 for w in working]  # a copy larger than the working set is the transient


def test_the_gemm_benchmark_runs_at_smoke_size(tmp_path):
    """``bench/quant_gemm.py --smoke --sweep``: its three cases come back at each row count with the three products
    timed (bf16, fused, transient), the same products (fp32 on the CPU), the rule's choice by rows a matrix, the
    weights smaller quantised, and the fused kernel timed at each launch shape of the sweep with the default launch's
    products."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from model.quantized_base import DEQUANT_ROWS

    out = tmp_path / "quant_gemm.json"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(root / "bench/quant_gemm.py"), "--smoke", "--sweep", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == ["experts w1|w3", "experts w2", "attn wq_b"]
    assert [e["rows_per_matrix"] for e in results[0]["by_rows"]] == [4, 16]
    assert [e["rows"] for e in results[2]["by_rows"]] == [4, 16, 64]
    for r in results:
        assert r["weight_bytes"]["quantised"] < r["weight_bytes"]["bf16"]
        for e in r["by_rows"]:
            assert e["chosen"] == ("transient" if e["rows_per_matrix"] >= DEQUANT_ROWS else "fused")
            assert e["fused_max_rel_diff"] < 1e-5 and e["transient_max_rel_diff"] < 1e-5
            assert all(e[f"{way}_{step}_ms"] > 0 for way in ("bf16", "fused", "transient")
                       for step in ("forward", "backward"))
        assert r["sweep"]["rows"] == r["by_rows"][0]["rows"]
        assert [e["tiles"]["BM"] for e in r["sweep"]["shapes"]] == [16, 32]
        for e in r["sweep"]["shapes"]:
            assert all(e[f"{step}_ms"] > 0 and e[f"{step}_rel_diff"] < 1e-5 for step in ("forward", "backward"))


def test_a_launch_shape_is_the_one_asked_for():
    """``quant_gemm(..., tiles=)`` launches the shape it is given: 16-wide tiles cannot hold an FP8 matrix's 32 x 32
    scale blocks, and say so (``tiles_for``'s choice would have run)."""
    from kernels.triton_quant_gemm import Tiles, quant_gemm

    codes, scale = quantize(torch.randn(64, 64), "fp8", BLOCK_FP8)
    x = torch.randn(8, 64)
    quant_gemm(x, codes, scale, None, False, BLOCK_FP8, (64, 64))
    with pytest.raises(ValueError, match=r"scale blocks \(32, 32\) do not tile 16 x 16"):
        quant_gemm(x, codes, scale, None, False, BLOCK_FP8, (64, 64), tiles=Tiles(16, 16, 16, 4, 1, None))


def _table_lookup(rank, out):
    """Rank ``rank`` of 2 holds half of a 37-row table of grid values (FP8 rows of 32 with their scales), converted;
    it looks up ids of both halves through the process group's exchange."""
    from model.engram import EngramTable
    from model.quant import dequantize, quantize
    from model.quantized_base import TABLE_BLOCK, QuantizedTable
    from parallel.rows import RowExchange

    g = torch.Generator().manual_seed(0)
    whole = dequantize(*quantize(torch.randn(38, 64, generator=g) * 3, "fp8", TABLE_BLOCK), "fp8", TABLE_BLOCK)
    table = EngramTable(37, 64, RowExchange(), rank, 2)
    with torch.no_grad():
        table.weight.copy_(whole[table.start:table.start + table.part_rows])
    table.weight.requires_grad_(False)
    ids = torch.randint(0, 37, (3, 5), generator=torch.Generator().manual_seed(rank))
    torch.save({"got": QuantizedTable.of(table)(ids), "want": whole[ids]}, f"{out}/rank{rank}.pt")


def test_a_table_held_as_released_looks_up_rows_across_ranks(tmp_path):
    """Two gloo ranks: the rows of a converted table's halves, looked up across the ranks (codes and scales moved as
    one byte row), are the fp32 table's values exactly. Planted and caught: the scales' bytes left behind (a row's
    codes only)."""
    from parallel.local import spawn

    spawn(_table_lookup, 2, str(tmp_path))
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert torch.equal(result["got"], result["want"]), rank
