"""The stream kernels (kernels/triton_hyper.py) kernel by kernel against an older commit's, and a sweep of their tiles
(issue 51's experiment, run once on an H100; its file is bench/results/kernels/hyper_sweep_h100.json).

A sublayer's pass (hc_pre, hc_post, forward and backward) at 64K x 4 copies x 5,120 (V4.1) and x 1,024 (small_moe), a
bf16 stream: the older kernels from .baseline_hc/kernels (``git archive <commit> kernels | tar -x -C .baseline_hc``)
against this tree's, each Triton kernel's device time (torch.profiler, 3 passes) and the pass's median time
(triton.testing.do_bench), then each setting of a kernel's module constants in turn, with the largest relative error of
any output or gradient against the older kernels' own. Usage, from the repository root on a GPU:
    CSA2_CODE=<commit> OUT=<dir> PYTHONPATH=. python bench/hyper_sweep.py"""
import importlib.util, json, os, sys, time, itertools
import torch, triton
from torch.profiler import profile, ProfilerActivity
from kernels import triton_hyper as new, reference

spec = importlib.util.spec_from_file_location("old_triton_hyper", ".baseline_hc/kernels/triton_hyper.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
OUT = os.environ.get("OUT", "/tmp")
res = {"machine": torch.cuda.get_device_name(), "code": os.environ.get("CSA2_CODE"), "date": time.strftime("%F %T"),
       "shapes": {}}

def problem(T, dim, hc=4):
    mix = (2 + hc) * hc
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, T, hc, dim, device="cuda", generator=g).bfloat16().requires_grad_()
    pre_in = torch.rand(1, T, hc, device="cuda", generator=g).requires_grad_()
    fn = (torch.randn(mix, hc * dim, device="cuda", generator=g) * 0.02).requires_grad_()
    scale = (torch.rand(3, device="cuda", generator=g) + 0.5).requires_grad_()
    base = torch.randn(mix, device="cuda", generator=g).requires_grad_()
    grads = (torch.randn(1, T, hc, dim, device="cuda", generator=g).bfloat16(),)
    return (x, pre_in, fn, scale, base), grads

def step(mod, inputs, grads):
    x, pre_in, fn, scale, base = inputs
    h, m = mod.hc_pre(x, pre_in, fn, scale, base, 20, 1e-6, 1e-6)
    out = mod.hc_post(h, x, m)
    return (h, out), torch.autograd.grad((out, m.pre), inputs, (grads[0], torch.ones_like(m.pre)))

def kernel_times(mod, inputs, grads, reps=3):
    step(mod, inputs, grads); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step(mod, inputs, grads)
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
            t = getattr(e, "self_device_time_total", 0) / 1e3 / reps
            if t > 0: times[e.key[:60]] = round(t, 4)
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

def sweep(inputs, grads, ref, name, settings):
    rows = {}
    for values in settings["values"]:
        saved = {k: getattr(new, k) for k in settings["names"]}
        for k, v in zip(settings["names"], values): setattr(new, k, v)
        key = "_".join(map(str, values))
        try:
            outs, gr = step(new, inputs, grads)
            err = max([rel(a, b) for a, b in zip(outs, ref[0])] + [rel(a, b) for a, b in zip(gr, ref[1])])
            kt = kernel_times(new, inputs, grads)
            ms = triton.testing.do_bench(lambda: step(new, inputs, grads), warmup=5, rep=40, return_mode="median")
            rows[key] = {"ms": round(ms, 3), "max_rel_err_vs_head": err,
                         "kernels": {k: v for k, v in kt.items() if k.startswith("_")}}
        except Exception as e:
            rows[key] = {"error": f"{type(e).__name__}: {e}"[:200]}
        finally:
            for k, v in saved.items(): setattr(new, k, v)
        print(name, key, rows[key], flush=True)
    return rows

SWEEPS = {
    "expand": {"names": ["EXPAND_TOKENS", "TOKEN_BLOCK_D", "EXPAND_WARPS"],
               "values": [(1, 256, 4), (2, 256, 4), (4, 256, 4), (8, 256, 4), (4, 128, 4), (4, 512, 4), (8, 512, 8),
                          (16, 256, 8), (4, 256, 8), (2, 512, 4), (8, 128, 4), (16, 128, 4)]},
    "pre_fwd": {"names": ["BLOCK_N", "BLOCK_D", "WARPS", "PRE_SPLITS"],
                "values": [(64, 64, 8, 1), (64, 64, 8, 2), (64, 64, 8, 4), (64, 64, 8, 8), (64, 64, 4, 4),
                           (128, 64, 8, 4), (32, 64, 4, 4), (64, 128, 8, 4), (32, 128, 4, 4), (128, 32, 8, 4),
                           (64, 32, 4, 8)]},
    "pre_bwd": {"names": ["BWD_BLOCK_N", "BWD_BLOCK_D", "BWD_WARPS", "BACKWARD_PROGRAMS"],
                "values": [(64, 64, 8, 512), (64, 64, 8, 1024), (64, 64, 8, 2048), (64, 64, 8, 4096),
                           (32, 64, 4, 2048), (64, 128, 8, 2048), (128, 64, 8, 2048), (32, 128, 8, 2048),
                           (64, 32, 4, 2048), (32, 64, 8, 4096)]},
    "link": {"names": ["LINK_OUTPUT_GRAD"], "values": [(False,), (True,)]},
    "sinkhorn": {"names": ["SINKHORN_ROWS"], "values": [(32,), (64,), (128,), (256,)]},
}
for name, T, dim in (("v41_64k", 65536, 5120), ("small_moe_64k", 65536, 1024)):
    inputs, grads = problem(T, dim)
    ref = step(old, inputs, grads)
    shape = {"T": T, "dim": dim, "stream_gb": T * 4 * dim * 2 / 1e9}
    shape["head_ms"] = triton.testing.do_bench(lambda: step(old, inputs, grads), warmup=5, rep=40, return_mode="median")
    shape["head_kernels"] = kernel_times(old, inputs, grads)
    try:
        shape["new_default_ms"] = triton.testing.do_bench(lambda: step(new, inputs, grads), warmup=5, rep=40,
                                                          return_mode="median")
        shape["new_default_kernels"] = kernel_times(new, inputs, grads)
    except Exception as e:
        import traceback; traceback.print_exc()
        shape["new_error"] = f"{type(e).__name__}: {e}"[:2000]
    print(name, shape, flush=True)
    for sname, settings in SWEEPS.items():
        shape[sname] = sweep(inputs, grads, ref, sname, settings)
    res["shapes"][name] = shape
    json.dump(res, open(f"{OUT}/hc_sweep.json", "w"), indent=1)
    del inputs, grads, ref
    torch.cuda.empty_cache()
