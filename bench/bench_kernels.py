"""GPU correctness and speed of the Triton kernels (run by bench/gpu_kernels.sh on the H200).

``check``: bf16 kernels against the fp32 PyTorch reference at medium shapes, on fresh random inputs, outputs
poisoned with NaN (relative error of outputs and every gradient < 1e-2; top-k compared up to near-ties).
``bench``: times at T = 65,536 against baselines measured in the same process (bf16 matmul rate, cuDNN dense
causal SDPA, chunked torch.matmul + torch.topk), and peak memory at two lengths. The sparse attention also
reports its device time by kernel (torch.profiler), each autotuned kernel's chosen config with every config's
time, and TFLOP/s of forward and backward.
Both print a table last and write JSON to ``--out``; ``--only`` runs some sections (e.g. ``--only
bench_matmul,bench_attention``). ``--smoke`` runs the same code at tiny shapes on the CPU through the Triton
interpreter, to test this script without a GPU.
"""
import argparse
import contextlib
import functools
import itertools
import json
import os
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402

from kernels import reference, triton_attention, triton_hyper, triton_indexer, triton_ops, triton_select  # noqa: E402
from result_meta import result_meta  # noqa: E402
from kernels.triton_testing import packed_geometry, random_topk  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
BF16 = torch.float32 if SMOKE else torch.bfloat16  # the interpreter computes bf16 wrongly
RESULTS = {}


def n(real, smoke):
    """A size: the real one on the GPU, a tiny one under --smoke."""
    return smoke if SMOKE else real


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def section(fn):
    """Run one section; a failure is recorded and printed, and the other sections still run."""
    @functools.wraps(fn)
    def run(*args):
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a broken section must not hide the others' numbers
            traceback.print_exc()
            RESULTS[fn.__name__] = {"error": f"{type(e).__name__}: {e}"[:500]}
        if not SMOKE:
            torch.cuda.empty_cache()
    return run


def ms(fn) -> float:
    """Median time of fn in milliseconds (CUDA events through triton.testing.do_bench); one wall-clock run under
    --smoke."""
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


@contextlib.contextmanager
def overridden(module, name: str, value):
    """``module.name`` set to ``value`` inside the block (a kernel module's tuning constant)."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def each_config(kernel):
    """Yield each of the autotuned ``kernel``'s configs with the kernel forced to it (no autotuning), then restore."""
    configs, cache = kernel.configs, kernel.cache
    try:
        for config in configs:
            kernel.configs, kernel.cache = [config], {}
            yield config
    finally:
        kernel.configs, kernel.cache = configs, cache


def rel_err(got, want) -> float:
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


def leaf(x, dtype):
    """A fresh leaf of x rounded to bf16 first: the reference sees the kernel's inputs, so only the kernels'
    arithmetic is compared (ReLU masks of index_logits would otherwise flip on input rounding alone)."""
    return x.detach().to(BF16).to(dtype).requires_grad_()


# ----------------------------------------------------------------------------------------------- check

def attention_inputs(doc_lens, m, H, D, W, K, with_selected):
    win_lo, vis_lo, vis_hi = packed_geometry(doc_lens, m, W, DEV)
    B, T = win_lo.shape
    data = dict(q=torch.randn(B, T, H, D, device=DEV), kv_window=torch.randn(B, T, D, device=DEV),
                kv_comp=torch.randn(B, T // m, D, device=DEV) if with_selected else None,
                sink=torch.randn(H, device=DEV))
    topk = random_topk(vis_lo, vis_hi, K, empty_frac=0.05, duplicate=True) if with_selected else None
    return data, win_lo, topk, rope_rotation(B, T, n(64, 8))


def rope_rotation(B, T, rope_dim):
    """The layer's RoPE rotation [B,T,rope_dim/2] complex64 (the attention kernels rotate q and the output): angles
    up to T radians."""
    angle = torch.rand(B, T, rope_dim // 2, device=DEV, dtype=torch.float64) * T
    return torch.polar(torch.ones_like(angle), angle).to(torch.complex64)


def check_attention_case(name, doc_lens, m, H, D, W, K, with_selected):
    """Kernel vs reference on one geometry; the backward runs in chunks of ~T/3 tokens (rows receiving from two
    chunks) and twice, to check that dkv is bitwise reproducible (fixed-order reduction, no atomics); and the
    forward without the selected mass (a recomputed layer's) gives bitwise the same output and LSE."""
    data, win_lo, topk, rotation = attention_inputs(doc_lens, m, H, D, W, K, with_selected)
    B, T = win_lo.shape
    triton_attention.PARTIAL_CHUNK_BYTES = (T // 3 + 5) * (W + K) * D * torch.tensor([], dtype=BF16).element_size()
    errs = {}
    outs = {}
    for impl, dtype in (("triton", BF16), ("reference", torch.float32)):
        leaves = {k: leaf(v, dtype) for k, v in data.items() if v is not None}
        fn = triton_ops.sparse_attention if impl == "triton" else reference.sparse_attention
        out, mass = fn(leaves["q"], leaves["kv_window"], win_lo, leaves.get("kv_comp"), topk, leaves["sink"],
                       D ** -0.5, W, rotation)
        grad = torch.randn_like(out, dtype=torch.float32) if impl == "triton" else outs["triton"][2]
        grads = torch.autograd.grad(out, list(leaves.values()), grad.to(out.dtype), retain_graph=impl == "triton")
        if impl == "triton":
            again = torch.autograd.grad(out, list(leaves.values()), grad.to(out.dtype))
            reproducible = all(torch.equal(g, h) for g, h in zip(grads, again))
        outs[impl] = (out, mass, grad, dict(zip(leaves, grads)))
    (out, mass, _, grads), (ref_out, ref_mass, _, ref_grads) = outs["triton"], outs["reference"]
    errs["out"] = rel_err(out, ref_out)
    if with_selected:
        errs["selected_mass"] = rel_err(mass, ref_mass)
    for k in grads:
        errs["d" + k] = rel_err(grads[k], ref_grads[k])
    same_without_mass = same_output_without_mass(data, win_lo, topk, rotation, D ** -0.5, W)
    RESULTS[name] = {"forward": forward_impl(data["q"].to(BF16)), "dkv": dkv_impl(data["q"].to(BF16), W, K),
                     "dq": dq_impl(data["q"].to(BF16), W, K),
                     "rel_err": errs, "backward_bitwise_reproducible": reproducible,
                     "out_and_lse_bitwise_without_mass": same_without_mass,
                     "pass": all(e < 1e-2 for e in errs.values()) and reproducible and same_without_mass}


def dkv_step_inputs(T, H, D, W, K):
    """The backward's dKV step on its own: the inputs of ``_sparse_attention_bwd``'s first chunk (all T tokens) at
    one geometry: a function running the Gluon or the Triton kernel, and the buffers it writes (PART, DS and
    dsink, NaN-filled at first; the same buffers every call)."""
    q, kv_window, win_lo, kv_comp, topk, sink, scale, window, rotation = attention_problem(T, H, D, W, K)
    q, kv_window, kv_comp, sink = (x.detach() for x in (q, kv_window, kv_comp, sink))
    if K == 0:
        kv_comp, topk = None, None
    pairs = torch.view_as_real(rotation.contiguous())
    with torch.no_grad():
        out, lse, _ = triton_attention._sparse_attention_fwd(q, kv_window, win_lo, kv_comp, topk, sink, pairs, scale,
                                                             window, False)
    dout = torch.randn_like(out)
    idx = topk if topk is not None else win_lo
    rot, rope = triton_attention._rope_args(pairs, q)
    outputs = [torch.full(shape, float("nan"), dtype=dtype, device=DEV)
               for shape, dtype in (((T, W + K, D), q.dtype), ((T, H, W + K), q.dtype), ((1, T, H), torch.float32))]

    scratch = torch.empty((T, 2 * triton_attention._block_h(H), rope), dtype=q.dtype, device=DEV)

    def run(impl: str):
        # The kernels reach kv_comp through its offset from kv_window: made here, so that the closure keeps kv_comp
        # alive (2026-12-01: freed after this function returned, its rows were read from reused memory).
        S, comp_offset = triton_attention._compressed_rows(kv_window, kv_comp)
        triton_attention.dkv_step(impl == "gluon", *outputs, 0, kv_window, q, dout, out, win_lo, idx, sink, rot, lse,
                                  scratch, comp_offset, S, scale, W, rope)
        return outputs
    return run, outputs


@section
def check_dkv_step():
    """The Gluon dKV step against the Triton kernel on identical inputs: the partial rows, dS rows and dsink each
    writes (NaN-filled first), at 64 and 48 heads, without selection, and at 64 heads again last (a failure that
    depends on what ran before shows as the two 64-head cases differing). The end-to-end check goes through the
    reductions; this one names the output that differs."""
    if SMOKE:
        RESULTS["dkv_step"] = {"skipped": "the Gluon kernel runs only on a Hopper GPU"}
        return
    res = {}
    for name, shape in (("h64", (1000, 64, 512, 128, 512)), ("h48", (1000, 48, 512, 128, 512)),
                        ("window_only", (700, 64, 512, 128, 0)), ("h64_again", (1000, 64, 512, 128, 512))):
        run, outputs = dkv_step_inputs(*shape)
        want = [x.clone() for x in run("triton")]
        for x in outputs:  # poisoned again: an element the Gluon kernel misses stays NaN
            x.fill_(float("nan"))
        got = run("gluon")
        res[name] = {out: {"rel_err": rel_err(g.float(), w.float()), "nan": int(torch.isnan(g).sum()),
                           "nan_triton": int(torch.isnan(w).sum())}
                     for out, g, w in zip(("part", "ds", "dsink"), got, want)}
    RESULTS["dkv_step"] = {**res, "pass": all(r["rel_err"] < 1e-3 and r["nan"] == r["nan_triton"] == 0
                                              for case in res.values() for r in case.values())}


def same_output_without_mass(data, win_lo, topk, rotation, scale, window) -> bool:
    """Whether the bf16 forward op gives bitwise the same (out, LSE) with and without its selected-mass pass."""
    args = [data["q"].to(BF16), data["kv_window"].to(BF16), win_lo,
            data["kv_comp"].to(BF16) if data.get("kv_comp") is not None else None, topk, data["sink"],
            torch.view_as_real(rotation.contiguous()) if rotation is not None else None, scale, window]
    with torch.no_grad():
        (out, lse, _), (out_nm, lse_nm, _) = (triton_attention._sparse_attention_fwd(*args, m) for m in (True, False))
    return torch.equal(out, out_nm) and torch.equal(lse, lse_nm)


def forward_impl(q) -> str:
    """Which forward kernel ``sparse_attention`` runs for q: the Gluon one where it applies, else Triton's."""
    return "gluon" if triton_attention.gluon_forward_applies(q) else "triton"


def score_impl(q, k, group) -> str:
    """Which kernel the indexer's dense scoring runs for q: the Gluon one where it applies, else Triton's."""
    return "gluon" if triton_indexer.gluon_score_applies(q, k, group) else "triton"


def dkv_impl(q, window, k) -> str:
    """Which kernel the backward's dKV step runs for q: the Gluon one where it applies, else Triton's."""
    return "gluon" if triton_attention.gluon_dkv_applies(q, window, k) else "triton"


def dq_impl(q, window, k) -> str:
    """Which kernel the backward's dq runs for q: the Gluon one where it applies, else Triton's."""
    return "gluon" if triton_attention.gluon_dq_applies(q, window, k) else "triton"


@section
def check_attention():
    H, D, W, K = n(64, 4), n(512, 32), n(128, 8), n(512, 16)
    check_attention_case("attention_m1", n([[700, 1348]], [[10, 27]]), 1, H, D, W, K, True)
    check_attention_case("attention_m2", n([[500, 1037]], [[9, 26]]), 2, H, D, W, K, True)
    check_attention_case("attention_window_only", n([[300, 724]], [[5, 20]]), 1, H, D, W, 0, False)
    check_attention_case("attention_m1_48_heads", n([[400, 621]], [[10, 27]]), 1, n(48, 3), D, W, K, True)
    with overridden(triton_attention, "FORWARD_IMPL", "triton"):  # the fallback kernels stay checked too
        check_attention_case("attention_m1_triton_forward", n([[700, 1348]], [[10, 27]]), 1, H, D, W, K, True)
    with overridden(triton_attention, "DKV_IMPL", "triton"):
        check_attention_case("attention_m1_triton_dkv", n([[700, 1348]], [[10, 27]]), 1, H, D, W, K, True)
    with overridden(triton_attention, "DQ_IMPL", "triton"):
        check_attention_case("attention_m1_triton_dq", n([[700, 1348]], [[10, 27]]), 1, H, D, W, K, True)


def pick_quality(picks, ref_picks, table):
    """Compare top-k picks under bf16 scoring: empty-slot counts, validity, distinctness, score gap, recall."""
    filled = picks >= 0
    values = table.gather(-1, picks.clamp(min=0)).masked_fill(~filled, float("-inf"))
    ref_values = table.gather(-1, ref_picks.clamp(min=0)).masked_fill(ref_picks < 0, float("-inf"))
    got = values.sort(-1, descending=True).values
    want = ref_values.sort(-1, descending=True).values
    finite = torch.isfinite(want)
    ordered = picks.sort(-1).values
    repeated = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any().item()
    scale = want[finite].abs().max().item()
    same = (picks.unsqueeze(-1) == ref_picks.unsqueeze(-2)) & filled.unsqueeze(-1)
    return {"same_empty_count": torch.equal(filled.sum(-1), (ref_picks >= 0).sum(-1)),
            "all_allowed": bool(torch.isfinite(values[filled]).all()), "repeated": repeated,
            "max_score_gap_rel": ((got[finite] - want[finite]).abs().max().item() / scale) if finite.any() else 0.0,
            "best_first": bool((values[..., :-1] >= values[..., 1:]).all()),
            "recall": (same.any(-1).sum() / filled.sum().clamp(min=1)).item()}


def masked_table(q, w, k, vis_lo, vis_hi, block_size, cand=None):
    s = torch.arange(k.shape[1], device=DEV)
    allowed = (s >= vis_lo.unsqueeze(-1)) & (s < vis_hi.unsqueeze(-1))
    if cand is not None:
        block = torch.div(s - vis_lo.unsqueeze(-1), block_size, rounding_mode="floor")
        allowed &= (block.unsqueeze(-1) == cand.unsqueeze(-2)).any(-1)
    return reference.index_scores(q, w, k).masked_fill(~allowed, float("-inf"))


INDEXER_DOCS = n([[1500, 2596]], [[20, 44]])  # two packed documents


@section
def check_indexer():
    """Random bf16 inputs: picks against the fp32 reference on the same (bf16-rounded) inputs, up to near-ties."""
    _, vis_lo, vis_hi = packed_geometry(INDEXER_DOCS, 1, 1, DEV)
    T, NH, DI, topk, bs, keep = n(4096, 64), n(32, 2), n(128, 16), n(512, 8), 8, n(128, 3)
    q, w, k = torch.randn(1, T, NH, DI, device=DEV), torch.randn(1, T, NH, device=DEV), torch.randn(1, T, DI, device=DEV)
    qb, wb, kb = q.to(BF16), w.to(BF16), k.to(BF16)
    # The reference scores the bf16-rounded inputs in fp32, so only the kernels' accumulation differs.
    qr, wr, kr = qb.float(), wb.float(), kb.float()
    picks, blocks = triton_ops.indexer_select(qb, wb, kb, vis_lo, vis_hi, topk, block_size=bs, keep_blocks=keep)
    ref_picks, ref_blocks = reference.indexer_select(qr, wr, kr, vis_lo, vis_hi, topk, block_size=bs, keep_blocks=keep)
    table = masked_table(qr, wr, kr, vis_lo, vis_hi, bs)
    RESULTS["indexer_full_topk"] = pick_quality(picks, ref_picks, table)
    cand = ref_blocks
    picks, _ = triton_ops.indexer_select(qb, wb, kb, vis_lo, vis_hi, topk, cand, bs)
    ref_picks, _ = reference.indexer_select(qr, wr, kr, vis_lo, vis_hi, topk, cand, bs)
    RESULTS["indexer_cand_topk"] = pick_quality(picks, ref_picks, masked_table(qr, wr, kr, vis_lo, vis_hi, bs, cand))
    RESULTS["indexer_blocks_recall"] = ((blocks.unsqueeze(-1) == ref_blocks.unsqueeze(-2)) & (blocks >= 0).unsqueeze(-1)
                                        ).any(-1).sum().item() / max(1, (ref_blocks >= 0).sum().item())


@section
def check_indexer_ties():
    """Integer-valued bf16 inputs (exact in bf16 and in any fp32 summation order, with many tied scores): picks must
    equal the reference bit for bit, order and ties included (the autotuned GPU configs, not the interpreter's, and
    then each selection and scoring config forced), and a prefix of the sequence must select what the whole
    sequence selects for its tokens."""
    _, vis_lo, vis_hi = packed_geometry(INDEXER_DOCS, 1, 1, DEV)
    T, NH, DI, topk, bs, keep = n(4096, 64), n(32, 2), n(128, 16), n(512, 8), 8, n(128, 3)
    q = torch.randint(-2, 3, (1, T, NH, DI), device=DEV).float()
    q[..., n(24, 1):] = 0  # dots in a narrow integer range: ties on every value
    w = torch.randint(-2, 3, (1, T, NH), device=DEV).float()
    k = torch.randint(-2, 3, (1, T, DI), device=DEV).float()
    k[..., n(16, 4):] = 0
    ref_picks, ref_blocks = reference.indexer_select(q, w, k, vis_lo, vis_hi, topk, block_size=bs, keep_blocks=keep)
    ref_cand, _ = reference.indexer_select(q, w, k, vis_lo, vis_hi, topk, ref_blocks, bs)
    res = {"score_impl": score_impl(q.to(BF16), k.to(BF16), bs)}
    with overridden(triton_indexer, "SCORE_SPLIT", n(1024, 16)):  # several column splits per query at this T
        for impl, t in itertools.product(("gluon", "triton"), (T, T - n(700, 9))):  # the Triton kernel forced too
            qt, wt, lo, hi = q[:, :t].to(BF16), w[:, :t].to(BF16), vis_lo[:, :t], vis_hi[:, :t]
            with overridden(triton_indexer, "SCORE_IMPL", impl):
                picks, blocks = triton_ops.indexer_select(qt, wt, k.to(BF16), lo, hi, topk, block_size=bs,
                                                          keep_blocks=keep)
                case = res[f"{impl} T{t}"] = {"full_equal": torch.equal(picks, ref_picks[:, :t]),
                                              "blocks_equal": torch.equal(blocks, ref_blocks[:, :t])}
                for path, dense in (("gathered", 0.0), ("dense", float("inf"))):
                    with overridden(triton_indexer, "DENSE_CANDIDATES", dense):
                        cand, _ = triton_ops.indexer_select(qt, wt, k.to(BF16), lo, hi, topk, ref_blocks[:, :t], bs)
                    case[f"cand_{path}_equal"] = torch.equal(cand, ref_cand[:, :t])
        # every launch shape of the selection kernel (the autotuner runs one of them), and of the scoring kernel
        res["configs"] = {}
        qt, wt = q.to(BF16), w.to(BF16)
        with overridden(triton_indexer, "SCORE_IMPL", "triton"):
            for kernel in (triton_select._select_kernel, triton_indexer._score_kernel):
                for config in each_config(kernel):
                    picks, _ = triton_ops.indexer_select(qt, wt, k.to(BF16), vis_lo, vis_hi, topk)
                    res["configs"][f"{kernel.fn.__name__} {config_name(config)}"] = torch.equal(picks, ref_picks)
    RESULTS["indexer_ties_exact"] = {**res, "pass": all(v for r in res.values() if isinstance(r, dict)
                                                        for v in r.values())}


@section
def check_index_logits():
    _, vis_lo, vis_hi = packed_geometry(n([[700, 1348]], [[10, 27]]), 1, 1, DEV)
    T, NH, DI, K = n(2048, 37), n(32, 2), n(128, 16), n(512, 8)
    data = dict(q=torch.randn(1, T, NH, DI, device=DEV), w=torch.randn(1, T, NH, device=DEV),
                k=torch.randn(1, T, DI, device=DEV))
    idx = random_topk(vis_lo, vis_hi, K, empty_frac=0.05, duplicate=True)
    grad = torch.randn(1, T, K, device=DEV)
    res = {}
    for impl, dtype in (("triton", BF16), ("reference", torch.float32)):
        leaves = {n: leaf(v, dtype) for n, v in data.items()}
        fn = triton_ops.index_logits if impl == "triton" else reference.index_logits
        logits = fn(leaves["q"], leaves["w"], leaves["k"], idx)
        res[impl] = (logits, torch.autograd.grad(logits, list(leaves.values()), grad.masked_fill(idx < 0, 0)))
    valid = idx >= 0
    errs = {"logits": rel_err(res["triton"][0][valid], res["reference"][0][valid])}
    errs.update({"d" + n: rel_err(g, r) for n, g, r in zip(data, res["triton"][1], res["reference"][1])})
    RESULTS["index_logits"] = {"rel_err": errs, "pass": all(e < 1e-2 for e in errs.values()) and
                               torch.equal(res["triton"][0] == float("-inf"), ~valid)}


@section
def check_rope():
    """q-shaped (64 heads x 512, RoPE on the last 64) and KV-shaped (512, no heads) rotations, bf16, and back."""
    T = n(4096, 37)
    res = {}
    for name, shape in (("q", (1, T, n(64, 2), n(512, 24))), ("kv", (1, T, n(512, 24)))):
        dim = n(64, 16)
        angle = torch.rand(1, T, dim // 2, device=DEV, dtype=torch.float64) * T
        rotation = torch.polar(torch.ones_like(angle), angle)
        x = leaf(torch.randn(shape, device=DEV), BF16)
        grad = torch.randn(shape, device=DEV)
        out = triton_ops.rope(x, rotation.to(torch.complex64), dim)
        want = reference.rope(x.double(), rotation, dim)
        (dx,) = torch.autograd.grad(out, x, grad.to(BF16))
        (want_dx,) = torch.autograd.grad(want, x, grad.double())
        res[name] = {"out": rel_err(out, want), "dx": rel_err(dx, want_dx)}
    RESULTS["rope"] = {"rel_err": res, "pass": all(e < 1e-2 for r in res.values() for e in r.values())}


@section
def check_norm_and_cast():
    """The layer-side kernels in bf16: RMSNorm alone (q_norm-shaped rows) and with RoPE (KV-shaped rows, 64 of 512
    features rotated), output and gradients against the fp32 reference on the same inputs; the one-launch cast of a
    layer's weights bit-exact."""
    T, D, Q, R = n(4096, 37), n(512, 32), n(768, 48), n(64, 16)
    res = {}
    for name, shape, rope_dim in (("q_norm", (1, T, Q), 0), ("kv_norm_rope", (1, T, D), R)):
        x = leaf(torch.randn(shape, device=DEV) * 3, BF16)
        weight = (torch.rand(shape[-1], device=DEV) + 0.5).requires_grad_()
        angle = torch.rand(1, T, max(rope_dim, 2) // 2, device=DEV, dtype=torch.float64) * T
        rotation = torch.polar(torch.ones_like(angle), angle).to(torch.complex64) if rope_dim else None
        grad = torch.randn(shape, device=DEV)
        out = triton_ops.rms_norm(x, weight, 1e-20, rotation, rope_dim)
        got = torch.autograd.grad(out, (x, weight), grad.to(BF16))
        x32 = x.detach().float().requires_grad_()
        want = reference.rms_norm(x32, weight, 1e-20, rotation, rope_dim)
        ref = torch.autograd.grad(want, (x32, weight), grad)
        res[name] = {"out": rel_err(out, want), "dx": rel_err(got[0], ref[0]), "dweight": rel_err(got[1], ref[1])}
    weights = [torch.randn(shape, device=DEV) for shape in ((n(768, 5), n(2048, 7)), (n(32768, 9), n(768, 5)),
                                                            (n(512, 3), n(2048, 7)))]
    exact = all(torch.equal(c, w.to(BF16)) for c, w in zip(triton_ops.cast([[w] for w in weights], BF16), weights))
    RESULTS["norm_and_cast"] = {"rel_err": res, "cast_exact": exact,
                                "pass": exact and all(e < 1e-2 for r in res.values() for e in r.values())}


# ------------------------------------------------------------------------------------------------------ the MoE

def moe_slots(N, k, E, device=DEV, empty=(1, 5)):
    """slot [N, k] (each token's slots in expert order) and the token of every slot, of random picks of E experts
    with the experts ``empty`` never picked, sorted by expert as model/moe.py does."""
    from model.moe import inverse_permutation, sort_by_expert
    indices = torch.randint(0, E, (N, k), device=device)
    for e in empty:
        indices[indices == e] = 0
    order, _ = sort_by_expert(indices, E)
    return inverse_permutation(order).view(N, k), order // k


@section
def check_moe_swiglu():
    """The routed experts' clamped, weighted SwiGLU in bf16 at V4.1's width (2,304) and small_moe's (448), 4,099 rows
    (not a whole number of programs), values spread so both clamps act (limit 10): output, dh and the routing
    weights' gradient against the fp32 reference on the same inputs."""
    res = {}
    for name, I in (("v41", n(2304, 37)), ("small_moe", n(448, 40))):
        rows = n(4099, 13)
        h = leaf(torch.randn(rows, 2 * I, device=DEV) * 8, BF16)
        w = (torch.rand(rows, device=DEV) + 0.5).requires_grad_()
        grad = torch.randn(rows, I, device=DEV)
        out = triton_ops.swiglu(h, 10.0, w)
        got = torch.autograd.grad(out, (h, w), grad.to(BF16))
        h32, w32 = h.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
        want = reference.swiglu(h32, 10.0, w32)
        ref = torch.autograd.grad(want, (h32, w32), grad)
        res[name] = {"out": rel_err(out, want), "dh": rel_err(got[0], ref[0]), "dweights": rel_err(got[1], ref[1])}
    RESULTS["moe_swiglu"] = {"rel_err": res, "pass": all(e < 1e-2 for r in res.values() for e in r.values())}


@section
def check_moe_permute():
    """The dispatch and combine permutations (kernels/triton_moe.py) at V4.1's dim and top-6 and small_moe's (1,024,
    top-4), 4,099 tokens, two experts empty: the spread of fp32 x into bf16 slots and the bf16 copy bit-exact, the
    combine of bf16 rows plus a bf16 shared output into fp32 and both backward passes against the fp32 reference,
    the combine's backward (a gather) bit-exact; every output and gradient bitwise equal on a second run."""
    res, exact, same = {}, True, True
    for name, D, k in (("v41", n(5120, 37), 6), ("small_moe", n(1024, 40), 4)):
        N = n(4099, 13)
        slot, token = moe_slots(N, k, 24)
        x = torch.randn(N, D, device=DEV, requires_grad=True)
        g_rows, g_copy = torch.randn(N * k, D, device=DEV).to(BF16), torch.randn(N, D, device=DEV).to(BF16)
        rows = leaf(torch.randn(N * k, D, device=DEV), BF16)
        shared = leaf(torch.randn(N, D, device=DEV), BF16)
        dy = torch.randn(N, D, device=DEV)

        def run(ops):
            spread, copy = ops.permute_rows(x, slot, BF16, copy=True)
            y = ops.unpermute_rows(rows, slot, shared, torch.float32)
            return [spread, copy, y, *torch.autograd.grad((spread, copy), x, (g_rows, g_copy)),
                    *torch.autograd.grad(y, (rows, shared), dy)]

        got, again, want = run(triton_ops), run(triton_ops), run(reference)
        exact &= torch.equal(got[0], x.detach().to(BF16)[token]) and torch.equal(got[1], x.detach().to(BF16))
        exact &= torch.equal(got[4], dy.to(BF16)[token]) and torch.equal(got[5], dy.to(BF16))
        same &= all(torch.equal(a, b) for a, b in zip(got, again))
        res[name] = {"combine": rel_err(got[2], want[2]), "dx": rel_err(got[3], want[3])}
    RESULTS["moe_permute"] = {"rel_err": res, "exact": exact, "deterministic": same,
                              "pass": exact and same and all(e < 1e-5 for r in res.values() for e in r.values())}


@section
def check_moe_cast():
    """The routed experts' w1 and w3 stacks (24 experts of V4.1's shape) cast to bf16 and stacked expert by expert,
    with w2, in one launch: bit-exact against ``torch.cat(dim=-2)``; the backward's fp32 gradients bit-exact."""
    E, I, D = n(24, 3), n(2304, 37), n(5120, 41)
    w1, w3 = (torch.randn(E, I, D, device=DEV, requires_grad=True) for _ in range(2))
    w2 = torch.randn(E, D, I, device=DEV, requires_grad=True)
    got = triton_ops.cast([[w1, w3], [w2]], BF16)
    want = [torch.cat([w1, w3], dim=-2).to(BF16), w2.to(BF16)]
    grads = [torch.randn(g.shape, device=DEV).to(BF16) for g in got]
    back, ref = (torch.autograd.grad(outs, (w1, w3, w2), grads) for outs in (got, want))
    exact = all(torch.equal(g, w) for g, w in zip(got, want)) and all(torch.equal(g, w) for g, w in zip(back, ref))
    RESULTS["moe_cast"] = {"exact": exact, "pass": exact}


@section
def check_moe_gate():
    """The gate's split bf16 GEMMs (model/split_gemm.py) at V4.1's shape (16,384 tokens, dim 5,120, 384 experts,
    weights at the init's scale) against the fp32 GEMM with TF32 off, x in fp32 and in bf16: the scores' relative
    error (< 2e-5: 2^-16 per split part) and the share of tokens whose top-6 set of sqrt-softplus scores is the
    fp32 one (>= 0.999); the backward against bf16 GEMMs of the rounded operands."""
    from model.split_gemm import split_linear
    N, D, E = n(16384, 256), n(5120, 64), n(384, 48)
    x = torch.randn(N, D, device=DEV)
    w = (torch.randn(E, D, device=DEV) * D ** -0.5).requires_grad_()
    grad = torch.randn(N, E, device=DEV)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {}
    try:
        for name, dtype in (("x_fp32", torch.float32), ("x_bf16", torch.bfloat16)):
            xs = x.to(dtype).requires_grad_()
            scores = split_linear(xs, w)
            want = xs.detach().float() @ w.detach().t()
            picks, want_picks = (torch.nn.functional.softplus(s).sqrt().topk(6, dim=-1).indices.sort(-1).values
                                 for s in (scores.detach(), want))
            dx, dw = torch.autograd.grad(scores, (xs, w), grad)
            g16 = grad.to(torch.bfloat16).float()
            res[name] = {"scores": rel_err(scores, want),
                         "same_top6_share": (picks == want_picks).all(-1).float().mean().item(),
                         "dx": rel_err(dx, g16 @ w.detach().to(torch.bfloat16).float()),
                         "dw": rel_err(dw, g16.t() @ xs.detach().to(torch.bfloat16).float())}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    RESULTS["moe_gate"] = {"results": res, "pass": all(r["scores"] < 2e-5 and r["same_top6_share"] >= 0.999
                                                       and r["dx"] < 1e-2 and r["dw"] < 1e-2 for r in res.values())}


def moe_problem(kernel_backend: str, seed: int = 0):
    """small_moe's MoE layer (dim 1,024, 32 experts top-4, width 448, one shared expert, clamp 10) with weights
    drawn from ``seed`` and experts 3 and 17 never picked (their bias), and 4,099 fp32 tokens."""
    from model.config import MoEArgs
    from model.moe import MoE
    args = MoEArgs(n_routed_experts=32, n_activated_experts=4, inter_dim=n(448, 16), n_shared_experts=1,
                   swiglu_limit=10.0)
    dim = n(1024, 32)
    torch.manual_seed(seed)
    moe = MoE(dim, args, kernel_backend).to(DEV)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=dim ** -0.5)
        moe.gate.bias[[3, 17]] = -100.0
    x = torch.randn(n(4099, 13), dim, device=DEV, generator=torch.Generator(DEV).manual_seed(seed + 1))
    return moe, x


def moe_step(moe, x, grad):
    """Forward and backward of the layer under bf16 autocast: [y, dx, every parameter's gradient]."""
    x = x.detach().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=not SMOKE):
        y = moe(x)
    return [y, *torch.autograd.grad(y, [x, *moe.parameters()], grad)]


@section
def check_moe_layer():
    """The whole MoE layer (small_moe's, two experts empty) under bf16 autocast with the Triton kernels against the
    same layer with the PyTorch reference kernels (the same split-GEMM gate and grouped GEMMs, so the same
    routing): output and every gradient (< 1e-2); and the Triton step makes no host sync
    (``torch.cuda.set_sync_debug_mode``: a synchronizing call there would print a warning)."""
    import warnings
    moe, x = moe_problem("triton")
    ref, _ = moe_problem("torch")
    grad = torch.randn(x.shape, device=DEV)
    got, want = moe_step(moe, x, grad), moe_step(ref, x, grad)
    names = ["y", "dx", *(name for name, _ in moe.named_parameters())]
    err = {name: rel_err(g.float(), w.float()) for name, g, w in zip(names, got, want)}
    syncs = []
    if not SMOKE:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                moe_step(moe, x, grad)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message)[:200] for w in caught if "prototype feature" not in str(w.message)]  # its own notice
    RESULTS["moe_layer"] = {"rel_err": err, "empty_experts_load": moe.take_load()[[3, 17]].tolist(),
                            "host_syncs": syncs, "pass": not syncs and all(e < 1e-2 for e in err.values())}


@section
def check_swiglu():
    """The FFN's SwiGLU in bf16 (the small model's [T, 2 x 4,096] projection): output and gradient against the fp32
    reference on the same inputs."""
    h = leaf(torch.randn(1, n(4096, 37), 2 * n(4096, 1029), device=DEV) * 3, BF16)
    grad = torch.randn(*h.shape[:-1], h.shape[-1] // 2, device=DEV)
    out = triton_ops.swiglu(h)
    (dh,) = torch.autograd.grad(out, h, grad.to(BF16))
    h32 = h.detach().float().requires_grad_()
    want = reference.swiglu(h32)
    (want_dh,) = torch.autograd.grad(want, h32, grad)
    err = {"out": rel_err(out, want), "dh": rel_err(dh, want_dh)}
    RESULTS["swiglu"] = {"rel_err": err, "pass": all(e < 1e-2 for e in err.values())}


def hyper_problem(T, hc, dim, dtype=BF16):
    """A hyper-connected stream x [1,T,hc,dim] in the compute dtype (bf16 on the GPU), a pending pre-mix and a
    block's mix parameters at their trained scale (fn std 0.02, scale 0.5-1.5), all leaves."""
    mix = (2 + hc) * hc
    x = leaf(torch.randn(1, T, hc, dim, device=DEV), dtype)
    pre_in = torch.rand(1, T, hc, device=DEV, requires_grad=True)
    fn = (torch.randn(mix, hc * dim, device=DEV) * 0.02).requires_grad_()
    scale = (torch.rand(3, device=DEV) + 0.5).requires_grad_()
    base = torch.randn(mix, device=DEV).requires_grad_()
    return x, pre_in, fn, scale, base


def hyper_step(ops, x, pre_in, fn, scale, base):
    """One sublayer's pass over the stream, forward and backward: hc_pre, an identity sublayer, hc_post."""
    h, m = ops.hc_pre(x, pre_in, fn, scale, base, 20, 1e-20, 1e-6)
    outs = (m.pre, ops.hc_post(h, x, m))
    return outs, torch.autograd.grad(outs, (x, pre_in, fn, scale, base), [torch.ones_like(o) for o in outs])


@section
def check_hyper():
    """A sublayer's pass over the stream (kernels/triton_hyper.py: hc_pre's mixes, Sinkhorn and collapse, hc_post's
    expand, the stream gradient linked between them) at small_moe's width, hc 4, a bf16 stream: outputs and every
    gradient against the reference in fp32 on the same inputs."""
    problem = hyper_problem(n(4096, 37), 4, n(1024, 75))
    got = hyper_step(triton_ops, *problem)
    want = hyper_step(reference, *(leaf(t, torch.float32) for t in problem))
    names = ("pre", "post_out", "dx", "dpre_in", "dfn", "dscale", "dbase")
    err = {k: rel_err(g.float(), w.float()) for k, g, w in zip(names, [*got[0], *got[1]], [*want[0], *want[1]])}
    RESULTS["hyper"] = {"rel_err": err, "pass": all(e < 1e-2 for e in err.values())}


# ----------------------------------------------------------------------------------------------- bench

@section
def bench_matmul():
    """The bf16 matmul rate the other sections compare against: the fastest of three timings (one timing varied from
    686 to 793 TFLOP/s between calls on 2026-12-01, the 686 in a call whose other processes measured 777-782), so a
    slow measurement cannot flatter a "x its GEMM" ratio."""
    size = n(8192, 64)
    a, b = torch.randn(size, size, device=DEV, dtype=BF16), torch.randn(size, size, device=DEV, dtype=BF16)
    times = [ms(lambda: a @ b) for _ in range(3)]
    t = min(times)
    RESULTS["matmul_8192_bf16"] = {"ms": t, "tflops": 2 * size ** 3 / t / 1e9, "ms_each": times}


def atomic_dispatch_combine(x, token, shared_out, dtype):
    """The dispatch and combine before kernels/triton_moe.py (fcbdd0b's model/moe.py): x cast, gathered by
    ``index_select`` (its backward an atomic ``index_add``), the rows added into their tokens by ``index_add_``."""
    xc = x.to(dtype)
    rows = xc.index_select(0, token)
    y = rows.new_zeros(x.shape[0], x.shape[1], dtype=torch.float32).index_add_(0, token, rows.float())
    return rows, xc, (y + shared_out).to(x.dtype)


@section
def bench_moe():
    """The MoE's fused ops against what they replace, forward + backward, at small_moe's 64K-token layer (dim 1,024,
    top-4 of 32, width 448) and V4.1's rank at 16K tokens (dim 5,120, top-6 of 24 held, width 2,304, the gate over
    384): the permutations (spread with the shared expert's copy, combine with its output) against index_select /
    index_add; the clamped, weighted SwiGLU against the reference's fp32 passes; the gate's split bf16 GEMMs
    against the fp32 GEMM (TF32 off) and a plain bf16 one; the experts' weights cast and stacked in one launch
    against per-tensor casts and a cat. Bytes moved over time for the permutations (the HBM's ~4.8 TB/s bounds
    them)."""
    from model.split_gemm import split_linear
    res = {}
    for name, N, D, k, E, gate_E, I in (("small_moe_64k", n(65536, 64), n(1024, 40), 4, 32, 32, n(448, 40)),
                                        ("v41_16k", n(16384, 64), n(5120, 40), 6, 24, 384, n(2304, 40))):
        r = res[name] = {"tokens": N, "dim": D, "topk": k, "inter": I}
        slot, token = moe_slots(N, k, E, empty=())
        x = torch.randn(N, D, device=DEV, requires_grad=True)
        shared = torch.randn(N, D, device=DEV, dtype=BF16, requires_grad=True)
        g_rows = torch.randn(N * k, D, device=DEV, dtype=BF16)

        def fused():
            rows, xc = triton_ops.permute_rows(x, slot, BF16, copy=True)
            routed = rows.detach().requires_grad_()
            y = triton_ops.unpermute_rows(routed, slot, shared, x.dtype)
            return torch.autograd.grad([y, rows, xc], [x, routed, shared], [y, g_rows, xc])

        def atomic():
            rows, xc, y = atomic_dispatch_combine(x, token, shared, BF16)
            return torch.autograd.grad([y, rows, xc], [x, shared], [y, g_rows, xc])

        r["permute_ms"] = {"triton": ms(fused), "index_add": ms(atomic)}
        # fwd: x read, copy and k slots written, k slots and shared read, y written; bwd: the same bytes back
        moved = N * D * (4 + 2 + 2 * k + 2 * k + 2 + 4) * 2
        r["permute_tb_per_s"] = moved / r["permute_ms"]["triton"] / 1e9
        h = torch.randn(N * k, 2 * I, device=DEV, dtype=BF16).mul(8).requires_grad_()
        w = torch.rand(N * k, device=DEV, requires_grad=True)
        g_h = torch.randn(N * k, I, device=DEV, dtype=BF16)
        r["swiglu_ms"] = {impl: ms(lambda: torch.autograd.grad(ops.swiglu(h, 10.0, w), (h, w), g_h))
                          for impl, ops in (("triton", triton_ops), ("torch", reference))}
        gw = torch.randn(gate_E, D, device=DEV, requires_grad=True)
        g_s = torch.randn(N, gate_E, device=DEV)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            r["gate_ms"] = {impl: ms(lambda: torch.autograd.grad(gate(), (x, gw), g_s)) for impl, gate in (
                ("split_bf16", lambda: split_linear(x, gw)), ("fp32", lambda: x @ gw.t()),
                ("bf16", lambda: (x.to(BF16) @ gw.to(BF16).t()).float()))}
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        del h, g_h
        w1, w3 = (torch.randn(E, I, D, device=DEV, requires_grad=True) for _ in range(2))
        w2 = torch.randn(E, D, I, device=DEV, requires_grad=True)
        g13, g2 = torch.randn(E, 2 * I, D, device=DEV, dtype=BF16), torch.randn(E, D, I, device=DEV, dtype=BF16)
        r["cast_ms"] = {"triton": ms(lambda: torch.autograd.grad(triton_ops.cast([[w1, w3], [w2]], BF16),
                                                                 (w1, w3, w2), (g13, g2))),
                        "torch": ms(lambda: torch.autograd.grad(reference.cast([[w1, w3], [w2]], BF16),
                                                                (w1, w3, w2), (g13, g2)))}
        del w1, w2, w3, g13, g2
        for part in ("permute_ms", "swiglu_ms", "cast_ms"):  # the replaced path's time over the kernels'
            (before,) = (t for impl, t in r[part].items() if impl != "triton")
            r[part]["speedup"] = before / r[part]["triton"]
        r["gate_ms"]["speedup_over_fp32"] = r["gate_ms"]["fp32"] / r["gate_ms"]["split_bf16"]
        if not SMOKE:
            torch.cuda.empty_cache()
    RESULTS["moe"] = res


def attention_problem(T, H, D, W, K):
    win_lo, vis_lo, vis_hi = packed_geometry([[T]], 1, W, DEV)
    q = torch.randn(1, T, H, D, device=DEV, dtype=BF16, requires_grad=True)
    kv_window = torch.randn(1, T, D, device=DEV, dtype=BF16, requires_grad=True)
    kv_comp = torch.randn(1, T, D, device=DEV, dtype=BF16, requires_grad=True)
    sink = torch.randn(H, device=DEV, requires_grad=True)
    topk = random_topk(vis_lo, vis_hi, K)
    return (q, kv_window, win_lo, kv_comp, topk, sink, D ** -0.5, W, rope_rotation(1, T, n(64, 8)))


def peak_mib(fn) -> float:
    """Peak memory fn allocates beyond what is allocated before it, in MiB."""
    if SMOKE:
        fn()
        return 0.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


# The Triton kernels of one sparse-attention call, by stage; any other device work (the inverse index's sort and
# searchsorted, zero fills, casts, dsink's sum) is "other".
ATTENTION_KERNELS = {"_fwd_kernel": "fwd", "_bwd_dkv_kernel": "bwd_dkv", "_bwd_dq_kernel": "bwd_dq",
                     "_window_reduce_kernel": "bwd_window_reduce", "_entry_reduce_kernel": "bwd_entry_reduce"}
ATTENTION_AUTOTUNED = ("_fwd_kernel", "_bwd_dkv_kernel", "_bwd_dq_kernel")


# The Triton kernels of one indexer_select call, by stage; "other" is torch work (fills, the -inf masks).
INDEXER_KERNELS = {"_score_kernel": "score", "_cand_score_kernel": "cand_score", "_group_max_kernel": "group_max",
                   "_select_kernel": "select"}


def device_ms_by_stage(fn, reps: int, kernels: dict = ATTENTION_KERNELS) -> dict:
    """Device time of fn per call by stage (torch.profiler, summed over ``kernels``' name -> stage, the rest as
    "other", divided by reps); the wall time of one call under --smoke (no device kernels to attribute)."""
    if SMOKE:
        return {"wall_ms": ms(fn)}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    stages = {}
    for event in prof.key_averages():
        stage = next((s for k, s in kernels.items() if k in event.key), "other")
        stages[stage] = stages.get(stage, 0.0) + event.self_device_time_total / 1e3 / reps
    return stages


def autotune_choices() -> dict:
    """Each autotuned attention kernel's chosen config and every config's time (ms) on its first call."""
    kernels = {name: getattr(triton_attention, name) for name in ATTENTION_AUTOTUNED}
    if not SMOKE:
        from kernels import gluon_attention, gluon_dkv
        kernels["gluon_fwd_kernel"] = gluon_attention._fwd_kernel
        kernels["gluon_bwd_dkv_kernel"] = gluon_dkv._bwd_dkv_kernel
    choices = {}
    for name, kernel in kernels.items():
        timings = getattr(kernel, "configs_timings", None) or {}
        choices[name] = {"best": str(getattr(kernel, "best_config", None)),
                         "timings_ms": {str(c): t if isinstance(t, float) else list(t) for c, t in timings.items()}}
    return choices


@section
def bench_attention():
    T, H, D, W, K = n(65536, 64), n(64, 4), n(512, 32), n(128, 8), n(512, 16)
    args = attention_problem(T, H, D, W, K)
    out, _ = triton_ops.sparse_attention(*args)
    grad = torch.randn_like(out)
    leaves = [args[0], args[1], args[3], args[5]]

    def backward():
        return torch.autograd.grad(out, leaves, grad, retain_graph=True)

    first = backward()  # autotunes every kernel of the backward
    reproducible = all(torch.equal(a, b) for a, b in zip(first, backward()))
    del first
    fwd = ms(lambda: triton_ops.sparse_attention(*args))
    with overridden(triton_attention, "FORWARD_IMPL", "triton"):
        fwd_triton = ms(lambda: triton_ops.sparse_attention(*args))
    bwd = ms(backward)
    flops = 4 * T * H * (W + K) * D
    res = {"fwd_impl": forward_impl(args[0]), "dkv_impl": dkv_impl(args[0], W, K), "fwd_ms": fwd, "bwd_ms": bwd,
           "fwd_tflops": flops / fwd / 1e9,
           "bwd_tflops": 2.5 * flops / bwd / 1e9, "fwd_ms_triton_kernel": fwd_triton,
           "fwd_tflops_triton_kernel": flops / fwd_triton / 1e9, "flops_fwd": flops, "flops_bwd": 2.5 * flops,
           "bwd_bitwise_reproducible": reproducible, "autotune": autotune_choices()}
    # Where the backward's time goes, by kernel; "without dkv reduce" as the v5 stage timing reported it.
    res["bwd_device_ms_by_stage"] = device_ms_by_stage(backward, reps=3)
    stages = res["bwd_device_ms_by_stage"]
    if "bwd_dkv" in stages:
        res["bwd_ms_without_dkv_reduce"] = stages["bwd_dkv"] + stages.get("bwd_dq", 0.0)
        res["bwd_reduce_and_other_ms"] = sum(stages.get(k, 0.0) for k in ("bwd_window_reduce", "bwd_entry_reduce",
                                                                           "other"))
    if dq_impl(args[0], W, K) == "gluon":  # the backward with the Triton dq kernel, in the same call
        with overridden(triton_attention, "DQ_IMPL", "triton"):
            backward()  # autotunes it
            res["bwd_ms_triton_dq"] = ms(backward)
    if res["dkv_impl"] == "gluon":  # the backward with the Triton dKV kernel, in the same call
        with overridden(triton_attention, "DKV_IMPL", "triton"):
            backward()  # autotunes it
            res["bwd_ms_triton_dkv"] = ms(backward)
            res["bwd_device_ms_by_stage_triton_dkv"] = device_ms_by_stage(backward, reps=3)
    # Stage ablation: the forward without the selected-mass epilogue and its in-loop p stores (mass then wrong).
    triton_attention.ABLATE.add("mass_pass")
    try:
        res["fwd_ms_without_mass_pass"] = ms(lambda: triton_ops.sparse_attention(*args))
    finally:
        triton_attention.ABLATE.clear()
    if res["fwd_impl"] == "gluon":  # the Gluon forward with each of its stages switched off (gluon_attention.STAGES)
        from kernels import gluon_attention
        for stage in gluon_attention.STAGES:
            with overridden(gluon_attention, "ABLATE", {stage}):
                res[f"fwd_ms_without_{stage}"] = ms(lambda: triton_ops.sparse_attention(*args))
    # The backward with 1 GiB chunks of partial rows instead of 4 GiB: the memory / time trade of the chunk size.
    chunk_bytes = triton_attention.PARTIAL_CHUNK_BYTES
    triton_attention.PARTIAL_CHUNK_BYTES = chunk_bytes // 4
    try:
        res["bwd_ms_chunk_1gib"] = ms(backward)
    finally:
        triton_attention.PARTIAL_CHUNK_BYTES = chunk_bytes
    RESULTS["attention_64k"] = res
    del out, grad, args
    mem = {}
    for t in (T // 2, T):
        args = attention_problem(t, H, D, W, K)
        grad = torch.randn_like(args[0])

        def step():
            o, _ = triton_ops.sparse_attention(*args)
            torch.autograd.grad(o, [args[0], args[1], args[3], args[5]], grad)
        mem[t] = peak_mib(step)
        del args, grad
    RESULTS["attention_peak_mib"] = mem


@section
def bench_dkv_step():
    """The backward's dKV step alone at T = 16,384 (every token in one launch): the Gluon kernel, the Triton one,
    and the Gluon kernel with each of its stages switched off (``gluon_dkv.ABLATE``: the stage's cost is the time
    it saves; the outputs are then wrong)."""
    if SMOKE:
        RESULTS["dkv_step_16k"] = {"skipped": "the Gluon kernel runs only on a Hopper GPU"}
        return
    from kernels import gluon_dkv
    run, _ = dkv_step_inputs(16384, 64, 512, 128, 512)
    res = {"tokens": 16384, "gluon_ms": ms(lambda: run("gluon")), "triton_ms": ms(lambda: run("triton"))}
    for stage in gluon_dkv.STAGES:
        with overridden(gluon_dkv, "ABLATE", {stage}):
            res[f"gluon_ms_without_{stage}"] = ms(lambda: run("gluon"))
    RESULTS["dkv_step_16k"] = res


@section
def bench_sdpa_cudnn():
    """Dense causal SDPA at T = 65,536, 64 heads x 128, bf16, through cuDNN (the dense baseline)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    T, H, d = n(65536, 64), n(64, 2), n(128, 16)
    q, k, v = (torch.randn(1, H, T, d, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3))
    attend = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.MATH if SMOKE else SDPBackend.CUDNN_ATTENTION):
        out = attend(q, k, v, is_causal=True)
        grad = torch.randn_like(out)
        fwd = ms(lambda: attend(q, k, v, is_causal=True))
        bwd = ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    flops = 4 * T * T // 2 * H * d
    RESULTS["sdpa_cudnn_attention_causal_64k"] = {"fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": flops / fwd / 1e9,
                                                  "bwd_tflops": 2.5 * flops / bwd / 1e9}


def indexer_problem(T, NH=32, DI=128):
    _, vis_lo, vis_hi = packed_geometry([[T]], 1, 1, DEV)
    q = torch.randn(1, T, NH, DI, device=DEV, dtype=BF16)
    w = torch.rand(1, T, NH, device=DEV, dtype=BF16)
    k = torch.randn(1, T, DI, device=DEV, dtype=BF16)
    return q, w, k, vis_lo, vis_hi


def torch_select(q, w, k, vis_hi, topk, chunk):
    """Baseline: chunked torch.matmul + ReLU-weighted head sum + torch.topk (causal, one document)."""
    T, NH = q.shape[1], q.shape[2]
    out = torch.empty(1, T, topk, dtype=torch.long, device=DEV)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        hi = int(t1)
        dots = torch.matmul(q[0, t0:t1], k[0, :hi].T)  # [n, NH, hi]
        scores = (dots.relu() * w[0, t0:t1, :, None]).sum(1, dtype=torch.float32)
        visible = torch.arange(hi, device=DEV) < vis_hi[0, t0:t1, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        n = min(topk, hi)
        out[0, t0:t1, :n] = scores.topk(n, -1).indices
    return out


def indexer_stages(q, w, k, vis_lo, vis_hi, topk, bs, cand=None):
    """(score, select): indexer_select's two stages over every chunk of batch row 0, each chunk in its own buffer
    (so selection can be timed on scored buffers; T^2/2 floats at most: 8.6 GB at 64K)."""
    lo, hi = vis_lo[0].contiguous(), vis_hi[0].contiguous()
    plan = triton_indexer.chunk_plan((hi - lo).clamp(min=0).cpu().numpy(), topk, bs, cand is not None)
    buffers = [torch.empty(t1 - t0, p.row, device=DEV) for t0, t1, p in plan]
    out = torch.empty(q.shape[1], topk, dtype=torch.long, device=DEV)

    def score():
        for (t0, t1, p), levels in zip(plan, buffers):
            triton_indexer.score_chunk(levels, p, q[0, t0:t1], w[0, t0:t1], k[0], lo[t0:t1], hi[t0:t1],
                                       None if cand is None else cand[0, t0:t1].contiguous())

    def select():
        for (t0, t1, p), levels in zip(plan, buffers):
            triton_select.build_upper_levels(levels, p, lo[t0:t1], hi[t0:t1])
            triton_select.select_entries(levels, p, lo[t0:t1], hi[t0:t1], topk, out=out[t0:t1])
    return score, select, len(plan)


def config_name(config) -> str:
    return f"{config.kwargs} warps={config.num_warps} stages={config.num_stages}" + (
        f" maxnreg={config.maxnreg}" if config.maxnreg else "")


def autotuned_by_key(kernel) -> dict:
    """The autotuner's chosen config for each key it has tuned (e.g. each width class of the scoring kernel)."""
    return {str(key): config_name(config) for key, config in getattr(kernel, "cache", {}).items()}


def per_config_ms(kernel, fn) -> dict:
    """fn's time with each of the autotuned ``kernel``'s configs forced, and the autotuner's own choice."""
    chosen = getattr(kernel, "best_config", None)
    times = {"autotuned": config_name(chosen) if chosen is not None else None}
    for config in each_config(kernel):
        times[config_name(config)] = ms(fn)
    return times


@section
def bench_indexer():
    """Selection at T = 65,536 (m = 1, one document, 32 x 128 index heads, top-512, blocks of 8) against its scoring
    GEMM at the matmul rate measured in this run: full causal (goal <= 2x), with candidate blocks (keep 2,048; goal
    <= 2x its GEMM; also each candidate scoring path alone, to place DENSE_CANDIDATES), the scoring and selection
    stages apart (and each call's device time by kernel: the rest is host work with the GPU idle), each scoring and
    selection config forced, the configs the autotuner kept, and the torch baseline."""
    T, NH, DI, topk, bs, keep = n(65536, 128), n(32, 2), n(128, 16), n(512, 8), 8, n(2048, 4)
    q, w, k, vis_lo, vis_hi = indexer_problem(T, NH, DI)
    rate = RESULTS["matmul_8192_bf16"]["tflops"]
    full_flops = T * (T + 1) // 2 * NH * DI * 2
    cand_flops = T * keep * bs * NH * DI * 2  # upper bound: every candidate block full
    res = {"gemm_ms_full": full_flops / rate / 1e9, "gemm_ms_cand": cand_flops / rate / 1e9}
    res["score_impl"] = score_impl(q, k, bs)
    select_full = functools.partial(triton_ops.indexer_select, q, w, k, vis_lo, vis_hi, topk)
    res["select_ms"] = ms(select_full)
    res["select_vs_gemm"] = res["select_ms"] / res["gemm_ms_full"]
    with overridden(triton_indexer, "SCORE_IMPL", "triton"):
        res["select_ms_triton_scoring"] = ms(select_full)
    res["select_ms_by_chunk_and_split"] = {}  # fewer, larger chunks: fewer launches and kernel tails, more memory
    for chunk_mib, split in itertools.product((256, 512, 1024), (4096, 8192)):
        with overridden(triton_indexer, "SCORE_CHUNK_BYTES", chunk_mib << 20), \
                overridden(triton_indexer, "SCORE_SPLIT", split):
            res["select_ms_by_chunk_and_split"][f"{chunk_mib} MiB, split {split}"] = {
                "ms": ms(select_full), "peak_mib": peak_mib(select_full)}
    res["select_device_ms_by_kernel"] = device_ms_by_stage(select_full, 3, INDEXER_KERNELS)
    res["select_blocks_ms"] = ms(lambda: triton_ops.indexer_select(q, w, k, vis_lo, vis_hi, topk, block_size=bs,
                                                                   keep_blocks=keep))
    _, cand = triton_ops.indexer_select(q, w, k, vis_lo, vis_hi, topk, block_size=bs, keep_blocks=keep)
    res["cand_select_ms"] = ms(lambda: triton_ops.indexer_select(q, w, k, vis_lo, vis_hi, topk, cand, bs))
    res["cand_select_vs_gemm"] = res["cand_select_ms"] / res["gemm_ms_cand"]
    select_cand = functools.partial(triton_ops.indexer_select, q, w, k, vis_lo, vis_hi, topk, cand, bs)
    res["cand_select_device_ms_by_kernel"] = device_ms_by_stage(select_cand, 3, INDEXER_KERNELS)
    res["cand_dense_switch"] = triton_indexer.DENSE_CANDIDATES
    for path, dense in (("gathered", 0.0), ("dense", float("inf"))):  # each candidate scoring path alone
        with overridden(triton_indexer, "DENSE_CANDIDATES", dense):
            res[f"cand_select_{path}_ms"] = ms(lambda: triton_ops.indexer_select(q, w, k, vis_lo, vis_hi, topk, cand, bs))
    for name, candidates, kernel, flops in (("full", None, triton_indexer._score_kernel, full_flops),
                                            ("cand_gathered", cand, triton_indexer._cand_score_kernel, cand_flops)):
        with overridden(triton_indexer, "DENSE_CANDIDATES", 0.0):
            score, select, chunks = indexer_stages(q, w, k, vis_lo, vis_hi, topk, bs, candidates)
            res[f"{name}_chunks"] = chunks
            res[f"{name}_score_ms"] = ms(score)
            res[f"{name}_score_tflops"] = flops / res[f"{name}_score_ms"] / 1e9
            res[f"{name}_pyramid_select_ms"] = ms(select)
            with overridden(triton_indexer, "SCORE_IMPL", "triton"):  # the Triton kernels' configs (Gluon: one)
                res[f"{name}_score_ms_by_config"] = per_config_ms(kernel, score)
            res[f"{name}_score_autotuned"] = autotuned_by_key(kernel)
            if name == "full":  # selection does not depend on how the rows were scored
                with overridden(triton_indexer, "SCORE_IMPL", "triton"):  # only dense scoring has a Gluon kernel
                    res["full_score_ms_triton"] = ms(score)
                res["pyramid_select_ms_by_config"] = per_config_ms(triton_select._select_kernel, select)
                res["select_autotuned"] = autotuned_by_key(triton_select._select_kernel)
        del score, select
        if not SMOKE:
            torch.cuda.empty_cache()
    res["torch_chunked_ms"] = ms(lambda: torch_select(q, w, k, vis_hi, topk, n(512, 32)))
    del cand
    res["peak_mib"] = {}
    for t in (T // 2, T):
        problem = indexer_problem(t, NH, DI)
        res["peak_mib"][t] = peak_mib(lambda: triton_ops.indexer_select(*problem, topk, block_size=bs, keep_blocks=keep))
    RESULTS["indexer_64k"] = res


@section
def bench_index_logits():
    T, NH, DI, K = n(65536, 64), n(32, 2), n(128, 16), n(512, 8)
    res = {}
    for t in (T // 2, T):
        q, w, k, vis_lo, vis_hi = indexer_problem(t, NH, DI)
        q, w, k = (x.requires_grad_() for x in (q, w, k))
        idx = random_topk(vis_lo, vis_hi, K)
        logits = triton_ops.index_logits(q, w, k, idx)
        grad = torch.randn_like(logits)
        if t == T:
            res["fwd_ms"] = ms(lambda: triton_ops.index_logits(q, w, k, idx))
            res["bwd_ms"] = ms(lambda: torch.autograd.grad(logits, (q, w, k), grad, retain_graph=True))
        res[f"peak_mib_{t}"] = peak_mib(lambda: torch.autograd.grad(triton_ops.index_logits(q, w, k, idx), (q, w, k),
                                                                    grad))
        del logits, grad
    for t in (T // 16, T // 8):
        q, w, k, vis_lo, vis_hi = indexer_problem(t, NH, DI)
        q, w, k = (x.requires_grad_() for x in (q, w, k))
        idx = random_topk(vis_lo, vis_hi, K)
        res[f"reference_peak_mib_{t}"] = peak_mib(
            lambda: torch.autograd.grad(reference.index_logits(q, w, k, idx).sum(), (q, w, k)))
    RESULTS["index_logits_64k"] = res


# The Triton kernels of a sublayer's pass over the stream (kernels/triton_hyper.py), by name; "other" is torch work
# (the partial sums' reductions, fn's split, zero fills).
HYPER_KERNELS = {name: name.strip("_") for name in ("_pre_fwd", "_sinkhorn_fwd", "_expand_fwd", "_expand_bwd",
                                                    "_sinkhorn_bwd", "_pre_bwd")}


@section
def bench_hyper():
    """A sublayer's pass over the stream forward + backward at 64K, hc 4, dims 1,024 (small_moe) and 5,120 (V4.1-Flash),
    a bf16 stream: Triton against the PyTorch reference (the mixes' fp32 projection and ~300 Sinkhorn launches,
    per-token matmuls), each Triton kernel's device time, and the stream's bytes over the time (the ceiling is HBM's
    ~3.3 TB/s on an H100, ~4.8 on an H200). Bytes counted, S the stream's and R a row's [T, dim]: forward X read by
    hc_pre and by hc_post, the new stream written, h written and y read (3 S + 2 R); backward the expand's X and G
    read, its dX written and read again by hc_pre's, which reads X and writes the sum (6 S), y and dh read, dy written
    (3 R)."""
    res = {}
    for name, T, dim in (("small_moe_64k", n(65536, 64), n(1024, 75)), ("v41_64k", n(65536, 64), n(5120, 75))):
        problem = hyper_problem(T, 4, dim)
        times = {impl: ms(lambda: hyper_step(ops, *problem)) for impl, ops in (("triton", triton_ops),
                                                                            ("torch", reference))}
        stream, row = T * 4 * dim * problem[0].element_size(), T * dim * problem[0].element_size()
        moved = 9 * stream + 5 * row
        res[name] = {"T": T, "dim": dim, "hc": 4, **{f"{k}_ms": v for k, v in times.items()},
                     "speedup": times["torch"] / times["triton"], "triton_tb_per_s": moved / times["triton"] / 1e9,
                     "triton_kernel_ms": device_ms_by_stage(lambda: hyper_step(triton_ops, *problem), 5,
                                                            HYPER_KERNELS)}
        res[name]["triton_ms_by_tiles"] = hyper_tiles(problem)
        del problem
    RESULTS["hyper"] = res


# Other settings of kernels/triton_hyper.py's tiles than its defaults, one kernel's at a time: the data for choosing
# the defaults.
HYPER_TILES = {
    "pre_fwd": ("BLOCK_N", "BLOCK_D", "WARPS", "PRE_SPLITS"),
    "pre_bwd": ("BWD_BLOCK_N", "BWD_BLOCK_D", "BWD_WARPS", "BACKWARD_PROGRAMS"),
    "expand": ("EXPAND_TOKENS", "TOKEN_BLOCK_D", "EXPAND_WARPS"),
}
HYPER_TILE_VALUES = {
    "pre_fwd": [(128, 64, 8, 2), (128, 64, 8, 8), (64, 64, 4, 4), (128, 32, 8, 4)],
    "pre_bwd": [(64, 64, 8, 4096), (32, 64, 4, 2048), (32, 64, 8, 4096), (32, 32, 4, 4096)],
    "expand": [(2, 256, 4), (8, 256, 4), (4, 512, 4), (8, 128, 4)],
}


def hyper_tiles(problem) -> dict:
    """The Triton pass's time with each of HYPER_TILE_VALUES in place of its kernel's defaults (one kernel's
    settings changed at a time); a tile too large for the SM is recorded, not raised."""
    times = {}
    for kernel, names in HYPER_TILES.items():
        for values in n(HYPER_TILE_VALUES[kernel], HYPER_TILE_VALUES[kernel][:1]):
            key = f"{kernel}:" + ",".join(f"{k}={v}" for k, v in zip(names, values))
            with contextlib.ExitStack() as stack:
                for k, v in zip(names, values):
                    stack.enter_context(overridden(triton_hyper, k, v))
                try:
                    times[key] = ms(lambda: hyper_step(triton_ops, *problem))
                except triton.runtime.errors.OutOfResources as e:
                    times[key] = f"{type(e).__name__}: {e}"[:200]
    return times


def table() -> str:
    lines = []
    for name, value in RESULTS.items():
        lines.append(f"{name}: {json.dumps(value, default=float)}")
    return "\n".join(lines)


def run_steps(steps, out: str, title: str) -> None:
    """Run the sections in order, printing each one's line and rewriting the JSON after each (a later timeout
    keeps the earlier numbers), then the whole table."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    print("cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for step in steps:
        step()
        print(table().splitlines()[-1] if RESULTS else "", flush=True)
        with open(out, "w") as f:
            json.dump({**result_meta(), **RESULTS}, f, indent=1, default=float)
    print("\n==== " + title + " ====\n" + table())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["check", "bench"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    parser.add_argument("--only", default=None, help="comma-separated section names of the mode to run, in their "
                                                    "usual order (bench_indexer needs bench_matmul's rate)")
    args = parser.parse_args()
    # The newest kernels first: a cut run keeps their results.
    sections = {"check": [check_hyper, check_moe_swiglu, check_moe_permute, check_moe_cast, check_moe_gate,
                          check_moe_layer, check_swiglu, check_indexer, check_indexer_ties, check_index_logits,
                          check_rope, check_norm_and_cast, check_attention, check_dkv_step],
                "bench": [bench_hyper, bench_moe, bench_matmul, bench_attention, bench_dkv_step, bench_sdpa_cudnn,
                          bench_indexer, bench_index_logits]}
    by_name = {fn.__name__: fn for fn in sections[args.mode]}
    chosen = args.only.split(",") if args.only else list(by_name)
    unknown = [name for name in chosen if name not in by_name]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: {args.mode} has the sections {', '.join(by_name)}")
    os.environ["CSA2_KERNEL_POISON"] = "1" if args.mode == "check" else "0"
    run_steps([fn for fn in sections[args.mode] if fn.__name__ in chosen], args.out, args.mode)
    failed = [name for name, r in RESULTS.items() if isinstance(r, dict) and ("error" in r or r.get("pass") is False)]
    if failed:  # the JSON keeps every section; the exit status says whether the run can be trusted
        print(f"error: {len(failed)} section(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
