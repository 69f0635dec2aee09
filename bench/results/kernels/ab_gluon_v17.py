"""A/B of versions of one Gluon kernel module on the GPU, in one process (2026-12-01 onward). Each variant is a copy
of the module (e.g. `git show f53e55d:kernels/gluon_attention.py > tmp_fwd_old.py`), run in turns through the path
that imports the module at each call, the variants interleaved twice, each also with its stages switched off (its
STAGES) in the first round. Outputs are compared with the first variant's (the fp32 reference is bench_kernels
check's):
- ``kernels.gluon_attention``: the sparse-attention forward at the 64K bench's problem; out and LSE bitwise, the
  selected mass relatively;
- ``kernels.gluon_dkv``: the dKV step alone at T = 8,192 (bench_kernels.dkv_step_inputs; its partial rows take
  5.4 GB, kept once per variant); partial rows, dS rows and dsink bitwise.
From the repository root, with this file copied there:
  PYTHONPATH=$PWD:$PWD/bench python ab_gluon.py OUT.json kernels.gluon_attention old=tmp_fwd_old.py new=...
"""
import importlib.util
import json
import sys

import torch
import triton

import bench_kernels as bk
from kernels import triton_attention

out_path, module, variants = sys.argv[1], sys.argv[2], dict(arg.split("=", 1) for arg in sys.argv[3:])
modules = {}
for name, path in variants.items():
    spec = importlib.util.spec_from_file_location(f"{module}_{name}", path)
    modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modules[name])
torch.manual_seed(0)
if module == "kernels.gluon_attention":
    T, H, D, W, K = 65536, 64, 512, 128, 512
    q, kv_window, win_lo, kv_comp, topk, sink, scale, window, rotation = bk.attention_problem(T, H, D, W, K)
    q, kv_window, kv_comp, sink = (x.detach() for x in (q, kv_window, kv_comp, sink))
    rotation = torch.view_as_real(rotation.contiguous())  # the op takes (cos, sin) pairs

    def run():
        """(out, LSE, selected mass)."""
        with torch.no_grad():
            return triton_attention._sparse_attention_fwd(q, kv_window, win_lo, kv_comp, topk, sink, rotation, scale,
                                                          window, True)

    outputs = run

    def compare(outs, first):
        (out, lse, mass), (out_0, lse_0, mass_0) = outs, first
        return {"out_lse_bitwise": torch.equal(out, out_0) and torch.equal(lse, lse_0),
                "mass_rel_err": ((mass - mass_0).norm() / mass_0.norm()).item(),
                "mass_finite": bool(torch.isfinite(mass).all())}
    flops = 4 * T * H * (W + K) * D
else:
    T, H, D, W, K = 8192, 64, 512, 128, 512
    step, _ = bk.dkv_step_inputs(T, H, D, W, K)

    def run():
        step("gluon")

    def outputs():
        """(partial rows, dS rows, dsink), copied: the step writes the same buffers each call."""
        return [x.clone() for x in step("gluon")]

    def compare(outs, first):
        return {"outputs_bitwise": all(torch.equal(a, b) for a, b in zip(outs, first)),
                "finite": all(bool(torch.isfinite(x).all()) for x in outs)}
    flops = 6 * T * H * (W + K) * D  # S, dP and the partial rows' two products


def timed(fn, reps=300):
    return triton.testing.do_bench(fn, warmup=50, rep=reps, return_mode="median")


result = {**bk.result_meta(), "module": module, "T": T, "H": H, "D": D, "W": W, "K": K, "flops": flops,
          "variants": variants}
outs, repeatable = {}, {}
first = next(iter(modules))
for round_ in ("", "_again"):
    for name, mod in modules.items():
        sys.modules[module] = mod  # what `from kernels import gluon_...` finds: the module and the package's attribute
        setattr(importlib.import_module(module.rpartition(".")[0]), module.rpartition(".")[2], mod)
        if round_:
            repeatable[name] = compare(outputs(), outs[name])
        else:
            outs[name] = outputs()
        result[f"{name}{round_}_ms"] = timed(run)
        for stage in mod.STAGES if not round_ else ():
            with bk.overridden(mod, "ABLATE", {stage}):
                result[f"{name}_ms_without_{stage}"] = timed(run, reps=100)
        print(name + round_, result[f"{name}{round_}_ms"], flush=True)
        json.dump(result, open(out_path, "w"), indent=1)  # so far: a variant that hangs leaves the others' times
for name in modules:
    best = min(result[name + "_ms"], result[name + "_again_ms"])
    result[name] = {"best_ms": best, "tflops": flops / best / 1e9, "as_" + first: compare(outs[name], outs[first]),
                    "repeatable": repeatable[name]}
print(json.dumps(result, indent=1))
json.dump(result, open(out_path, "w"), indent=1)
